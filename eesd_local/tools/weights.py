"""Weights that verify cheaply: batch costs B(k), requantisation, and its quality cost.

On a CPU, llama.cpp decodes one row with ggml's vec_dot and two or more rows with
llamafile's tinyBLAS for F32/F16/BF16/Q8_0/Q4_0/Q5_0/IQ4_NL weights; K-quants fall back to
vec_dot row by row below 8 rows. So B(k) = t(k) / t(1), the cost of verifying a draft of
k - 1 tokens in units of one plain token, depends on the weight types: a flatter B(k)
makes longer drafts pay. :func:`batch_costs` measures it, :func:`requantize` rewrites a
GGUF as Q8_0, Q5_0 or Q4_0 through llama.cpp's own ``llama_model_quantize`` (the LM head kept
at Q8_0, never a K-quant), and :func:`quality` says what that costs: teacher-forced top-1
agreement with the source model and greedy answers side by side.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import llama_cpp as lc
import numpy as np

from eesd_local.base import cachefile
from eesd_local.base.atomic import atomic_path, in_cache
from eesd_local.base.errors import EesdError
from eesd_local.base.interrupts import terminate_as_interrupt
from eesd_local.base.params import check_int
from eesd_local.gguf.check import check_gguf
from eesd_local.gguf.reader import read_header
from eesd_local.llama.catalog import check_variant
from eesd_local.llama.costs import calm, time_batches
from eesd_local.llama.ggmlapi import init_backend
from eesd_local.llama.runtime import Context, ContextParams, Model, default_threads
from eesd_local.speculative import chat
from eesd_local.speculative.lossless import first_divergence

COST_KS = (*range(1, 9), 16)  # batch sizes eesd bench measures: the draft lengths up to 8, and 16
MAX_COST_K = 256  # the largest batch measured: its logits alone take k x n_vocab floats (155 MB for Qwen at 256)
PREFIX_TOKENS = 64

# progress(done, total, what)
Progress = Callable[[int, int, str], None]


# --- B(k) ----------------------------------------------------------------------------------


@dataclass
class CostTable:
    """Median decode time of a batch of k tokens after a fixed prefix, per k."""

    model: str
    n_threads: int
    repeats: int
    prefix: int
    ms: dict[int, float] = field(default_factory=dict)  # k -> median milliseconds
    steady: bool = True  # the timings of batches of 1 and 2 agreed as on a quiet machine (costs.calm)

    @property
    def ratios(self) -> dict[int, float]:
        """B(k) = t(k) / t(1)."""
        return {k: v / self.ms[1] for k, v in self.ms.items()}

    def to_json(self) -> dict:
        return {"model": self.model, "threads": self.n_threads, "repeats": self.repeats, "prefix_tokens": self.prefix,
                "t1_ms": round(self.ms[1], 3), "ms": {str(k): round(v, 3) for k, v in self.ms.items()},
                "B": {str(k): round(v, 3) for k, v in self.ratios.items()}}


def _filler_tokens(model, n: int) -> list[int]:
    """``n`` tokens of real Python source (this module), repeated if short."""
    toks = model.tokenize(Path(__file__).read_text(encoding="utf-8"), add_special=False)
    while len(toks) < n:
        toks = toks + toks
    return toks[:n]


def batch_costs(paths: Sequence[str | os.PathLike[str]], ks: Sequence[int] = tuple(range(1, 17)), *, repeats: int = 12,
                prefix: int = PREFIX_TOKENS, n_threads: int | None = None, progress: Progress | None = None,
                n_gpu_layers: int = 0, rpc: Sequence[str] = ()) -> list[CostTable]:
    """B(k) of each model: after a ``prefix``-token prefill, decode k tokens with logits for every row
    (as a verify does), trim the KV back to the prefix, ``repeats`` times; report the medians.
    Several models are measured interleaved (repeat by repeat), so their figures share the
    machine's noise and compare side by side. ``n_gpu_layers`` and ``rpc`` place the layers as the
    engine does (B(k) over an RPC server includes its round trips)."""
    check_int("repeats", repeats, 1, hint="decodes per batch size, e.g. --repeats 12")
    ks = sorted(set(ks) | {1})
    for k in ks:
        check_int("the batch size", k, 1, MAX_COST_K, hint="measure batches up to the longest draft, e.g. --max-k 16")
    threads = n_threads or default_threads()
    opened = []
    try:
        for p in paths:
            model = Model(p, n_gpu_layers=n_gpu_layers, rpc=rpc)
            ctx = Context(model, ContextParams(n_ctx=prefix + max(ks) + 16, n_batch=max(prefix, max(ks)), n_threads=threads))
            opened.append((model, ctx))
        times: list[dict[int, list[float]]] = [{k: [] for k in ks} for _ in opened]
        fills = [_filler_tokens(m, prefix + max(ks)) for m, _ in opened]
        total = (repeats + 1) * len(opened) * len(ks)
        done = 0
        for rep in range(repeats + 1):  # round 0 warms up and is not counted
            for (model, ctx), fill, t in zip(opened, fills, times, strict=True):
                if ctx.n_past != prefix:
                    ctx.clear()
                    ctx.decode(fill[:prefix])
                for k, dt in time_batches(ctx, fill, prefix, ks, rep):
                    if rep:
                        t[k].append(dt)
                    done += 1
                    if progress:
                        progress(done, total, f"{model.path.name} k={k}")
        return [CostTable(str(m.path), threads, repeats, prefix, {k: 1e3 * statistics.median(v) for k, v in t.items()},
                          calm(t))
                for (m, _), t in zip(opened, times, strict=True)]
    finally:
        for model, ctx in reversed(opened):
            ctx.close()
            model.close()


# --- requantisation ----------------------------------------------------------------------


def requantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], kind: str, *, force: bool = False,
               n_threads: int | None = None) -> Path:
    """Write ``src`` requantised to ``kind`` (every weight matrix, the LM head at Q8_0) at ``dst``.

    llama.cpp writes a temporary file beside ``dst`` in a child process; it is renamed onto
    ``dst`` only when complete. Ctrl-C or SIGTERM ends the child and removes the file; after
    a SIGKILL the child dies with this process and the next run removes its file."""
    kind = check_variant(kind)
    src_path = check_gguf(Path(src))
    dst_path = Path(dst)
    if dst_path.resolve() == src_path.resolve():
        raise EesdError(f"the output {dst_path} is the source file", hint="write the variant to another path")
    cachefile.forget(dst_path)
    threads = n_threads or os.cpu_count() or 1
    with atomic_path(dst_path, force=force) as tmp, terminate_as_interrupt():
        cmd = [sys.executable, "-m", "eesd_local.tools.weights", str(src_path), str(tmp), kind, str(threads), str(os.getpid())]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _, err = proc.communicate()
        except BaseException:  # Ctrl-C or SIGTERM: end the child; atomic_path removes its file
            proc.kill()
            proc.wait()
            raise
        if proc.returncode != 0 or not tmp.is_file():
            msg = err.decode("utf-8", "replace").strip().splitlines()
            raise EesdError(f"llama.cpp could not requantise {src_path.name} to {kind}: {msg[-1] if msg else proc.returncode}",
                            hint="check that the file loads (eesd generate --model ...) and that the disk has room")
    if in_cache(dst_path.parent):  # a variant in the cache is read as the model itself: it gets a content check
        cachefile.record(dst_path)
    return dst_path


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this process when its parent dies (even by SIGKILL)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _quantize_child(src: str, dst: str, kind: str, threads: int) -> int:
    """The child's work: one llama_model_quantize call."""

    init_backend()  # silences llama.cpp's per-tensor log unless EESD_LLAMA_LOG is set
    params = lc.llama_model_quantize_default_params()
    # a tensor already of the target type is copied as is: q5_0 of a mostly-Q5_0 file changes only its K-quants
    params.ftype = {"q8_0": lc.LLAMA_FTYPE_MOSTLY_Q8_0, "q5_0": lc.LLAMA_FTYPE_MOSTLY_Q5_0, "q4_0": lc.LLAMA_FTYPE_MOSTLY_Q4_0}[kind]
    params.allow_requantize = True
    # llama.cpp's default head for Q4_0 is Q6_K, a K-quant that verifies row by row; Q8_0 batches
    params.output_tensor_type = lc.GGML_TYPE_Q8_0
    params.nthread = threads
    rc = lc.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        print(f"llama_model_quantize returned {rc}", file=sys.stderr)
    return int(rc)


def tensor_types(path: str | os.PathLike[str]) -> dict[str, int]:
    """Weight type name -> number of tensors of that type (read from the header alone)."""

    out: dict[str, int] = {}
    for t in read_header(Path(path)).tensors.values():
        name = gguf.GGMLQuantizationType(t.type).name
        out[name] = out.get(name, 0) + 1
    return out


# --- quality ------------------------------------------------------------------------------


@dataclass
class Quality:
    source: str
    variant: str
    n_tokens: int  # teacher-forced positions compared
    agreement: float  # share of positions where both models' top-1 token is the same
    answers: list[dict] = field(default_factory=list)  # per prompt: id, n tokens, identical, first divergence

    @property
    def identical_answers(self) -> int:
        return sum(a["identical"] for a in self.answers)

    def to_json(self) -> dict:
        return {"source": self.source, "variant": self.variant, "teacher_forced_tokens": self.n_tokens,
                "top1_agreement": round(self.agreement, 4), "greedy_answers": self.answers,
                "identical_answers": self.identical_answers}


def _chat_tokens(model, text: str) -> list[int]:
    """A one-turn chat request, tokenized as Engine.apply_chat_template + tokenize do."""
    bos = model.token_to_piece(model.bos, special=True).decode("utf-8", "replace") if model.add_bos else ""
    rendered = chat.render(model.chat_template(), [{"role": "user", "content": text}], add_generation_prompt=True,
                           bos_token=bos, eos_token="")
    if bos and rendered.startswith(bos):
        rendered = rendered[len(bos):]
    return model.tokenize(rendered, add_special=True, parse_special=True)


def _greedy(ctx, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding: the prompt, then one token at a time."""
    ctx.clear()
    ctx.decode(prompt)
    out: list[int] = []
    for _ in range(n):
        tok = int(np.argmax(ctx.logits()))
        out.append(tok)
        if ctx.model.is_eog(tok) or ctx.room() < 1:
            break
        ctx.decode([tok])
    return out


def quality(src: str | os.PathLike[str], variant: str | os.PathLike[str], texts: list[str], *, max_tokens: int = 256,
            n_answers: int = 4, answer_tokens: int = 96, n_threads: int | None = None) -> Quality:
    """Top-1 agreement of ``variant`` with ``src`` over held-out ``texts`` (teacher-forced: both models
    read the same tokens, every position compared), and the greedy answers of both to the first few
    (``eesd models requant`` passes the bench's held-out prompts, bench.prompts.heldout_texts)."""
    models = [Model(src), Model(variant)]
    ctxs = [Context(m, ContextParams(n_ctx=2048, n_batch=512, n_threads=n_threads)) for m in models]
    try:
        same = total = 0
        for text in texts:
            toks = models[0].tokenize(text)[:max_tokens]
            tops = []
            for ctx in ctxs:
                ctx.clear()
                ctx.decode(toks, n_logits=len(toks))
                tops.append(np.argmax(ctx.logits_rows(), axis=1))
            same += int(np.sum(tops[0] == tops[1]))
            total += len(toks)
        answers = []
        for i, text in enumerate(texts[:n_answers]):
            prompt = _chat_tokens(models[0], text)
            a, b = (_greedy(ctx, prompt, answer_tokens) for ctx in ctxs)
            div = first_divergence(a, b)
            answers.append({"prompt": i, "tokens": len(a), "identical": div is None, "first_divergence": div,
                            "source_text": models[0].detokenize(a), "variant_text": models[1].detokenize(b)})
        return Quality(str(src), str(variant), total, same / max(total, 1), answers)
    finally:
        for ctx in ctxs:
            ctx.close()
        for m in models:
            m.close()


def main(argv: list[str]) -> int:
    """``python -m eesd_local.tools.weights SRC DST KIND THREADS PARENT``: the requantisation child."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C goes to the parent, which ends this child
    src, dst, kind, threads, parent = argv
    if sys.platform.startswith("linux"):
        _die_with_parent(int(parent))
    return _quantize_child(src, dst, kind, int(threads))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
