"""Shared-trunk EESD: the target runs as two llama.cpp contexts, and the draft is the first one.

The exit head's draft is the target's own first N layers plus one exit block. Rather than a
second model holding its own copy of those layers (and catching up on every token it did not
see), the target is split where the draft leaves it:

- **trunk+exit** (the draft GGUF of :func:`heads.build_draft`): base blocks 0..N-1 byte for
  byte, then the exit block, its norm and the draft LM head;
- **tail** (:func:`build_tail`): base blocks N..L-1 renumbered 0..L-N-1, ``output_norm``,
  ``output`` (or the tied ``token_embd``), byte for byte.

Every token, history and drafts alike, is decoded once by the trunk+exit context. A graph
callback (native/capture.hpp) copies the residual stream entering the exit block, the tensor
``l_out-{N-1}``, for every row of the batch; :class:`SplitTarget` feeds those rows to the tail
context as embeddings (``llama_batch.embd``), which gives the target's logits. A row that the
draft already computed is not computed again, so drafting costs only the exit block and the
draft head beyond what verifying needs anyway, and a round that drafts nothing costs one
target token. Layer N-1 is not the trunk model's last layer, so its output has every row even
when the batch asks for no logits (llama.cpp then skips only the exit block's FFN and head).

Devices: the trunk and the tail are ordinary contexts, each offloaded as ``--n-gpu-layers``
says. The callback copies h_N to host memory with ``ggml_backend_tensor_get`` (n_embd floats
per token: 3.5 KB for the 0.5B, a few microseconds over PCIe) and the tail's embeddings input
uploads it again; llama.cpp has no API that hands a tensor from one context to another on
the device, so a round copies (k+1) rows down and up: tiny next to a target step.

Both round loops run the split: :class:`SplitTarget` and :class:`TrunkContext` are the reference,
the native loop's ``Rounds::set_split`` (native/split.cpp) its C++ twin, and tests/test_native.py
checks that they give the same events (greedy and seeded sampling, probe rounds).

Architectures: the ones whose graph names ``l_out-{il}`` and feeds embeddings into layer 0
unscaled (qwen2, llama); others raise a clear error.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import struct
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from eesd_local.base import cachefile
from eesd_local.base.errors import EesdError
from eesd_local.base.paths import cache_dir
from eesd_local.gguf.check import check_gguf
from eesd_local.gguf.headfile import (
    check_exit_layer,
    check_head_for,
    draft_key,
    exit_tensors,
    fingerprint,
    head_draft_vocab,
    model_info,
    read_head_info,
    read_head_pair,
)
from eesd_local.gguf.reader import GGUFHeader, read_header
from eesd_local.gguf.writer import write_derived
from eesd_local.llama import native
from eesd_local.llama.draftvocab import DRAFT_VOCAB, read_draft_vocab
from eesd_local.llama.runtime import Context, ContextParams, Model

TAIL_FORMAT = 2
TRUNK_FORMAT = 1
# architectures whose graph builder names each layer's output l_out-{il} and feeds batch
# embeddings to layer 0 as they are (no scaling): checked in the vendored llama.cpp
SPLIT_ARCHS = ("qwen2", "llama")


def check_split_arch(arch: str, what: str) -> None:
    if arch not in SPLIT_ARCHS:
        raise EesdError(
            f"{what} is a {arch} model; the shared trunk runs {' and '.join(SPLIT_ARCHS)} models only",
            hint="use --no-shared-trunk (the exit head then runs as a separate draft model)",
        )


def build_tail(base_path: Path, n: int, *, force: bool = False, out_path: Path | None = None) -> Path:
    """base GGUF -> its blocks N..L-1 as a model of their own (cache_dir('drafts')), built once.

    The tensors are the base's bytes; the metadata is the base's with ``block_count`` = L - N.
    ``token_embd`` stays (llama.cpp requires it; with untied embeddings it is never read on the
    embeddings path, and under mmap it stays on disk)."""
    base_path = check_gguf(Path(base_path))
    base = model_info(base_path)
    arch, n_layer = base["arch"], base["n_layer"]
    check_split_arch(arch, base_path.name)
    check_exit_layer(n, n_layer, str(base_path))
    fp = fingerprint(base_path)
    if out_path is None:
        key = hashlib.sha256(f"{TAIL_FORMAT}|{fp}|{n}".encode()).hexdigest()[:24]
        out_path = cache_dir("drafts") / f"{base_path.stem}.tail{n}.{key}.gguf"
    out_path = Path(out_path)
    if not force and cachefile.intact(out_path):  # damaged, truncated or foreign: built again below
        return out_path
    reader = read_header(base_path)
    set_kv, drop = _split_kv(reader, arch, n_layer, n_layer - n, base_path, int(base["n_vocab"]))
    set_kv |= {"eesd.tail.base_fingerprint": fp, "eesd.tail.first_layer": n}
    tensors: list = []
    for name, t in reader.tensors.items():
        if name.startswith("blk."):
            layer = int(name.split(".")[1])
            if layer < n:
                continue
            new = f"blk.{layer - n}." + name.split(".", 2)[2]
        else:
            new = name
        tensors.append((new, t.dims, t.type, lambda name=name: reader.tensor_bytes(name)))
    write_derived(out_path, reader, tensors=tensors, set_kv=set_kv, drop=drop)
    return out_path


def _split_kv(reader: GGUFHeader, arch: str, n_layer: int, blocks: int, base_path: Path,
              n_vocab: int) -> tuple[dict, Callable[[str], bool]]:
    """(keys to set, keys to drop) making the base's metadata that of a part of it with ``blocks``
    blocks, fed embeddings: no tokenizer (llama.cpp's "none" vocabulary of ``n_vocab`` dummy
    tokens: nothing to load, and the rows' count sizes the LM head)."""
    for k, v in reader.kv.items():
        if k.startswith(f"{arch}.") and isinstance(v, list) and len(v) == n_layer and k != f"{arch}.block_count":
            raise EesdError(f"{base_path} has per-layer metadata ({k}) that the shared trunk does not support yet",
                            hint="use --no-shared-trunk")
    set_kv = {f"{arch}.block_count": blocks, "tokenizer.ggml.model": "none", f"{arch}.vocab_size": n_vocab}
    return set_kv, lambda k: k.startswith("tokenizer.")


def build_trunk(base_path: Path, head_path: Path, vocab: np.ndarray, *, lm_head_type: str = "Q4_0", force: bool = False,
                out_path: Path | None = None) -> Path:
    """base GGUF + exit head + V' -> the trunk+exit model (cache_dir('drafts')), built once.

    Base blocks 0..N-1 byte for byte, the head's exit block N and norm, and as LM head the V'
    rows of the head's (or the base's) LM head, requantized to ``lm_head_type``, stored as a tied
    ``token_embd`` of V' dummy tokens. The model is fed embeddings (the base's token_embd rows,
    :class:`EmbedTable`), so its own token_embd is only ever read as the LM head."""

    base_path = check_gguf(Path(base_path))
    head_path = Path(head_path)
    info, base_fp = check_head_for(base_path, head_path)
    n = int(info["exit_layer"])
    check_split_arch(info["arch"], base_path.name)
    vocab = np.asarray(vocab, dtype=np.int32)
    if out_path is None:
        digest = hashlib.sha256(f"{TRUNK_FORMAT}|{draft_key(base_fp, head_path, lm_head_type)}|".encode() + vocab.tobytes())
        out_path = cache_dir("drafts") / f"{base_path.stem}.trunk{n}.v{len(vocab)}.{digest.hexdigest()[:24]}.gguf"
    out_path = Path(out_path)
    if not force and cachefile.intact(out_path):  # damaged, truncated or foreign: built again below
        return out_path
    base, breader, hreader = read_head_pair(base_path, head_path, info)
    arch = base["arch"]
    n_vocab = int(base["n_vocab"])
    if len(vocab) == 0 or vocab.min() < 0 or vocab.max() >= n_vocab or len(np.unique(vocab)) != len(vocab):
        raise EesdError(f"the draft vocabulary must be distinct token ids below {n_vocab}")
    set_kv, drop = _split_kv(breader, arch, base["n_layer"], n + 1, base_path, len(vocab))
    set_kv |= {"eesd.trunk.base_fingerprint": base_fp, "eesd.trunk.exit_layer": n}
    tensors: list = []
    for name, t in breader.tensors.items():  # blocks 0..N-1, byte for byte
        if any(name.startswith(f"blk.{i}.") for i in range(n)):
            tensors.append((name, t.dims, t.type, lambda name=name: breader.tensor_bytes(name)))
    tensors += [e for e in exit_tensors(breader, hreader, info, base_path, head_path) if e[0] != "output.weight"]
    if "output.weight" in hreader.tensors:
        src_reader, src = hreader, "output.weight"
    else:
        src_reader, src = breader, ("output.weight" if "output.weight" in breader.tensors else "token_embd.weight")
    st = src_reader.tensors[src]
    qt = gguf.GGMLQuantizationType[lm_head_type]

    def head_rows() -> np.ndarray:
        raw = np.asarray(src_reader.tensor_bytes(src)).reshape(st.dims[1], -1)[vocab]  # whole rows: whole quant blocks
        if st.type == qt:
            return np.ascontiguousarray(raw)
        rows = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(st.type)).astype(np.float32)
        return gguf.quants.quantize(rows, qt)

    tensors.append(("token_embd.weight", (st.dims[0], len(vocab)), int(qt), head_rows))
    write_derived(out_path, breader, tensors=tensors, set_kv=set_kv, drop=drop)
    return out_path


def release_unread(path: Path, names: tuple[str, ...]) -> int:
    """Drop from this process's resident memory the pages of tensors ``names`` of the GGUF ``path``
    that llama.cpp mapped (and prefetched) but never reads, such as the tail's token_embd of an
    untied model fed embeddings. Linux only (elsewhere nothing happens); the file stays mapped, so
    a page that is read after all comes back from the page cache. Returns the bytes released."""

    if not sys.platform.startswith("linux"):
        return 0
    h = read_header(path)
    real = str(Path(path).resolve())
    maps = []
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() == real:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    maps.append((lo, hi, int(parts[2], 16)))
    except OSError:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    released = 0
    for name in names:
        t = h.tensors.get(name)
        if t is None:
            continue
        start, end = h.data_offset + t.offset, h.data_offset + t.offset + t.nbytes
        for lo, hi, off in maps:
            a = max(start, off) - off + lo
            b = min(end, off + (hi - lo)) - off + lo
            a = (a + page - 1) // page * page
            b = b // page * page
            if b > a and libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), 4) == 0:  # MADV_DONTNEED
                released += b - a
    return released


class EmbedTable:
    """The base model's token embeddings as float32 rows, read from its GGUF through mmap and
    dequantized by ggml's own type traits (what llama.cpp's get_rows computes)."""

    def __init__(self, base_path: Path) -> None:
        h = read_header(Path(base_path))
        t = h.tensors.get("token_embd.weight")
        if t is None:
            raise EesdError(f"{Path(base_path).name} has no token_embd tensor")
        self.n_embd, self.n_rows = int(t.dims[0]), int(t.dims[1])
        self.type = int(t.type)
        self._raw = h.tensor_bytes("token_embd.weight")  # a memmap: only the rows read are paged in
        self.row_bytes = t.nbytes // self.n_rows
        self._native = _native_module()

    def rows(self, ids) -> np.ndarray:
        return self._native.embed_rows(self._raw.ctypes.data, self.row_bytes, self.type, self.n_rows, self.n_embd,
                                       [int(i) for i in ids])


def _native_module():
    module, why = native.load()
    if module is None:
        raise EesdError(f"the shared trunk needs the native extension (eesd_local._native): {why}",
                        hint="rebuild it with `pip install --no-build-isolation -e .`, or use --no-shared-trunk")
    return module


def _native_capture(name: str, n_embd: int):
    return _native_module().Capture(name, n_embd)


class TrunkContext(Context):
    """The trunk+exit context: a Context whose every decode also keeps h_N (the rows entering
    the exit block) for the positions the tail has not taken yet."""

    def __init__(self, model: Model, params: ContextParams, exit_layer: int, table: EmbedTable, vocab: np.ndarray,
                 target_model: Model) -> None:
        n_vocab = target_model.n_vocab
        self.target_model = target_model  # its vocabulary: end-of-generation tokens for the native loop
        self.capture = _native_capture(f"l_out-{exit_layer - 1}", model.n_embd)
        super().__init__(model, params, cb_eval=(self.capture.callback, self.capture.user_data), embd=table.n_embd)
        self.table, self.vocab, self.n_vocab = table, np.asarray(vocab, dtype=np.int64), n_vocab
        self.h = np.zeros((0, model.n_embd), np.float32)  # h_N of positions [h_base, n_past)
        self.h_base = 0

    def decode(self, tokens, *, n_logits: int = 1, embd: np.ndarray | None = None, stop=None) -> int:
        """Decode target token ids (fed as the base's embedding rows); logits over V'."""
        pos0 = self.n_past
        self.capture.reset()
        try:
            return super().decode(tokens, n_logits=n_logits, embd=self.table.rows(tokens) if len(tokens) else None, stop=stop)
        finally:
            rows = self.capture.take()
            if self.capture.n_bad:
                raise RuntimeError(f"the trunk's capture of {self.capture.name} had an unexpected shape")
            got = self.n_past - pos0  # a failed decode keeps what llama.cpp kept (Context resynchronised it)
            if len(rows) < got:
                raise RuntimeError(f"the trunk captured {len(rows)} rows for {got} tokens")
            self._keep(pos0)
            if self.h_base + len(self.h) != pos0:  # not contiguous (the native loop held the rows meanwhile)
                self.h, self.h_base = self.h[:0], pos0
            self.h = np.concatenate([self.h, rows[:got]]) if len(self.h) else rows[:got].copy()

    def logits(self, row: int = -1) -> np.ndarray:
        """A draft logit row over the target's vocabulary: V' as computed, -inf elsewhere (q = 0 there)."""
        out = np.full(self.n_vocab, -np.inf, dtype=np.float32)
        out[self.vocab] = super().logits(row)
        return out

    def draft_logits(self, row: int = -1) -> np.ndarray:
        """A draft logit row over V' (index i is target token ``vocab[i]``): a view, valid until the next decode."""
        return super().logits(row)

    def _keep(self, end: int) -> None:
        """Drop the rows of positions >= end."""
        if end <= self.h_base:
            self.h, self.h_base = self.h[:0], end
        else:
            self.h = self.h[: end - self.h_base]

    def trim(self, n_keep: int) -> None:
        super().trim(n_keep)
        self._keep(self.n_past)

    def clear(self) -> None:
        super().clear()
        self.h = self.h[:0]
        self.h_base = 0

    def rows(self, start: int, end: int) -> np.ndarray:
        """h_N of positions [start, end) (all decoded and not yet forgotten)."""
        if start < self.h_base or end > self.h_base + len(self.h):
            raise RuntimeError(f"h_N of positions {start}..{end} is not held (held: {self.h_base}..{self.h_base + len(self.h)})")
        return self.h[start - self.h_base : end - self.h_base]

    def forget_before(self, pos: int) -> None:
        """The tail has taken every position before ``pos``: their rows are not needed again."""
        cut = min(max(0, pos - self.h_base), len(self.h))
        if cut:
            self.h = self.h[cut:].copy()
            self.h_base += cut


class SplitTarget:
    """The target as trunk+exit then tail, with the face of a :class:`Context` (decode, logits,
    trim and the record of what the cache holds): the round loops and the engine use it as
    the target context. Its logits are the full model's."""

    def __init__(self, model: Model, trunk: TrunkContext, tail: Context) -> None:
        self.model = model  # the target's vocabulary (a vocab-only load: the weights are the trunk's and the tail's)
        self.trunk, self.tail = trunk, tail
        self.n_ctx = min(trunk.n_ctx, tail.n_ctx)
        self.n_batch = min(trunk.n_batch, tail.n_batch)
        # the weights the split holds: both files' tensors but those it never reads (open_split)
        self.weight_bytes = trunk.model.size_bytes + tail.model.size_bytes

    @property
    def ptr(self):  # the engine checks it is open
        return self.tail.ptr if self.trunk.ptr else None

    @property
    def tokens(self) -> list[int]:
        return self.tail.tokens

    @property
    def n_past(self) -> int:
        return self.tail.n_past

    def room(self) -> int:
        return self.n_ctx - self.n_past

    def trim(self, n_keep: int) -> None:
        self.tail.trim(n_keep)
        self.trunk.trim(n_keep)  # drafts past the accepted ones go too

    def clear(self) -> None:
        self.tail.clear()
        self.trunk.clear()

    def state_size(self) -> int:
        """Bytes of :meth:`save_state_into`'s state (the drafts past the tail's positions dropped first)."""
        self.trunk.trim(self.tail.n_past)  # drafts past the tail's positions are not part of the prompt
        if self.trunk.tokens != self.tail.tokens:
            raise RuntimeError("the trunk context is out of step with the tail")
        return 8 + self.trunk.state_size() + self.tail.state_size()

    def save_state_into(self, out: Any) -> None:
        """Both contexts' KV states into ``out`` (exactly :meth:`state_size` bytes, after it): the trunk's
        first, its length ahead of it, then the tail's; one buffer, each state written in place."""
        view = memoryview(out).cast("B")
        try:
            n = self.trunk.state_size()
            struct.pack_into("<Q", view, 0, n)
            self.trunk.save_state_into(view[8 : 8 + n])
            self.tail.save_state_into(view[8 + n :])
        finally:
            view.release()

    def save_state(self) -> bytearray:
        """Both contexts' KV states in one bytearray, for :meth:`restore_state`: the prompt
        cache keeps a split target's idle prompts as it keeps a whole target's."""
        out = bytearray(self.state_size())
        self.save_state_into(out)
        return out

    def restore_state(self, state: bytes | bytearray | memoryview, tokens: Sequence[int]) -> None:
        """Put back a state :meth:`save_state` gave, which holds ``tokens``; the caches held before are dropped.
        The trunk's h_N rows are not part of it: the next decode computes the rows it feeds the tail."""
        (n,) = struct.unpack_from("<Q", state)
        if n + 8 > len(state):
            raise EesdError("a saved split-target state is damaged")
        view = memoryview(state)
        try:
            self.trunk.restore_state(view[8 : 8 + n], tokens)
            self.tail.restore_state(view[8 + n :], tokens)
        except BaseException:
            self.clear()
            raise
        finally:
            view.release()

    def decode(self, tokens, *, n_logits: int = 1, stop=None) -> int:
        """The trunk's rows, then the tail's; ``stop`` is not asked (a split target decodes a prompt whole)."""
        n = len(tokens)
        if n == 0:
            return 0
        base = self.tail.n_past
        trunk = self.trunk
        if trunk.n_past < base:  # (as the native loop checks: comparing the records would copy the history each round)
            raise RuntimeError("the trunk context is out of step with the tail")
        # the rows the draft already computed for these tokens are reused; the rest are decoded now
        have = trunk.tokens[base : trunk.h_base + len(trunk.h)] if trunk.h_base <= base else []  # with their rows held
        k = 0
        while k < min(len(have), n) and have[k] == tokens[k]:
            k += 1
        trunk.trim(base + k)
        if k < n:
            trunk.decode(list(tokens[k:]), n_logits=0)
        rows = trunk.rows(base, base + n)
        got = self.tail.decode(tokens, n_logits=n_logits, embd=np.ascontiguousarray(rows))
        trunk.forget_before(self.tail.n_past - 1)
        return got

    def logits(self, row: int = -1) -> np.ndarray:
        return self.tail.logits(row)

    def logits_rows(self) -> np.ndarray:
        return self.tail.logits_rows()

    def close(self) -> None:
        self.tail.close()
        self.trunk.close()
        for m in getattr(self, "_models", ()):
            m.close()


def open_split(model: Model, head_path: Path, params: ContextParams, *, vocab_size: int = DRAFT_VOCAB,
               n_gpu_layers: int = 0, force: bool = False, rpc: tuple[str, ...] = ()) -> SplitTarget:
    """The split target for ``model`` (a vocab-only load is enough) and the exit head ``head_path``,
    deriving (once) the trunk+exit model and the tail; the draft vocabulary must be computed already
    (``eesd_local.tools.heads.draftvocab``)."""

    base_path = Path(model.path)
    exit_layer = int(read_head_info(Path(head_path))["exit_layer"])
    # the V' the head carries, else the one the app layer computed (tools/heads/draftvocab.py)
    vocab = head_draft_vocab(Path(head_path), vocab_size)
    if vocab is None:
        vocab = read_draft_vocab(base_path, vocab_size)
    elif int(vocab[-1]) >= model.n_vocab:
        raise EesdError(f"{Path(head_path).name}: its draft vocabulary names token {int(vocab[-1])}, beyond "
                        f"{base_path.name}'s {model.n_vocab}", hint="the head is not for this model, or damaged")
    trunk_path = build_trunk(base_path, Path(head_path), vocab, force=force)
    tail_path = build_tail(base_path, exit_layer, force=force)
    table = EmbedTable(base_path)
    trunk_model = Model(trunk_path, n_gpu_layers=n_gpu_layers, rpc=rpc)
    tail_model = Model(tail_path, n_gpu_layers=n_gpu_layers, rpc=rpc)

    tail_h = read_header(tail_path)
    unread = 0  # weight bytes mapped but never read: an untied tail's token_embd (its input is the trunk's rows)
    if "output.weight" in tail_h.tensors:
        unread = tail_h.tensors["token_embd.weight"].nbytes
        release_unread(tail_path, ("token_embd.weight",))
    trunk = tail = None
    try:
        trunk = TrunkContext(trunk_model, params, exit_layer, table, vocab, model)
        tail = Context(tail_model, params, embd=tail_model.n_embd)
        split = SplitTarget(model, trunk, tail)
    except BaseException:
        for c in (trunk, tail):
            if c is not None:
                c.close()
        trunk_model.close()
        tail_model.close()
        raise
    split._models = (trunk_model, tail_model)  # type: ignore[attr-defined]
    split.weight_bytes = trunk_model.size_bytes + tail_model.size_bytes - unread
    return split


def measure_trunk_share(split: SplitTarget, tokens: list[int], *, reps: int = 24) -> float:
    """The trunk's part of a target token, timed: a trunk step that asks for no logits (blocks
    0..N-1 and the exit block's attention) over a whole target step (trunk then tail), single
    tokens after ``tokens``, lower quartiles (the machine is shared). Leaves the cache empty."""
    split.clear()
    split.decode(tokens[:-1], n_logits=0)
    n0 = split.n_past
    last = tokens[-1]
    t_trunk: list[float] = []
    t_full: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        split.trunk.decode([last], n_logits=0)
        t_trunk.append(time.perf_counter() - t0)
        split.trunk.trim(n0)
        t0 = time.perf_counter()
        split.decode([last])
        t_full.append(time.perf_counter() - t0)
        split.trim(n0)
    split.clear()
    return float(np.percentile(t_trunk, 25) / np.percentile(t_full, 25))
