"""A thin runtime over llama-cpp-python's low-level API: models, contexts, batches, logits.

Everything the engine needs from llama.cpp and nothing more: load a model, tokenize
and detokenize, decode a batch at given positions with logits for chosen rows, read
those rows as NumPy arrays, and trim the KV cache. One :class:`Context` holds one
sequence (seq 0) unless asked for more; it tracks which tokens seq 0's KV cache holds so
callers can reuse a common prefix and roll back past rejected drafts. A context of several
sequences (``n_seq_max``: the heads tools' teacher and corpus) decodes batches whose rows
name their own position and sequence (:meth:`Context.decode_rows`), and frees a finished
sequence's cells (:meth:`Context.clear_seq`).
"""

from __future__ import annotations

import atexit
import codecs
import ctypes
import functools
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as lc
import llama_cpp.llama_cpp as raw
import numpy as np

from eesd_local.base.errors import ContextFullError, EesdError
from eesd_local.gguf.check import check_gguf
from eesd_local.llama import memtune
from eesd_local.llama.ggmlapi import EXACT_ALL, exact_rows, ggml_symbol, init_backend, offload_devices, rpc_failures
from eesd_local.llama.machine import kernel_choice_path
from eesd_local.llama.rpc import RpcError, add_servers


@functools.cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """Whether this CPU advertises AMX (Intel Sapphire Rapids and later)."""
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        if line.startswith("flags"):
            return "amx_int8" in line.split(":", 1)[-1].split()
    return False


def extra_bufts_allowed(cpuinfo: str | None = None) -> bool:
    """Whether llama.cpp may repack weights into its extra CPU buffer types.

    On CPUs with AMX a native build of llama.cpp puts the weights in its AMX buffer, and the
    vendored llama.cpp's AMX matmul crashes the process (SIGSEGV on the first decode) on some
    virtual machines (ggml-org/llama.cpp#20824): there the extra buffer types stay off and the
    ordinary AVX-512 kernels run. EESD_EXTRA_BUFTS=1 (or 0) overrides the choice.
    """
    env = os.environ.get("EESD_EXTRA_BUFTS")
    if env in ("0", "1"):
        return env == "1"
    return not cpu_has_amx(cpuinfo)


def guard_model_defaults() -> None:
    """Make llama.cpp's default model parameters safe on this CPU, for every loader in the
    process (ours and llama-cpp-python's ``Llama``, which the bench and tests use too)."""
    orig = raw.llama_model_default_params
    if getattr(orig, "_eesd_guarded", False):
        return

    def llama_model_default_params():  # noqa: ANN202 - same signature as llama.cpp's
        params = orig()
        if not extra_bufts_allowed():
            params.use_extra_bufts = False
        return params

    llama_model_default_params._eesd_guarded = True  # type: ignore[attr-defined]
    raw.llama_model_default_params = llama_model_default_params
    lc.llama_model_default_params = llama_model_default_params


def setup_process() -> None:
    """The process-wide settings eesd-local runs with, made once (later calls do nothing):
    glibc's malloc thresholds raised so vocabulary-sized arrays reuse heap pages
    (:func:`memtune.tune`), llama.cpp's default model parameters made safe on this CPU for
    every loader in the process (:func:`guard_model_defaults`), and the file where the patched
    kernels keep their per-CPU choices (:func:`keep_kernel_choices`). Importing this module changes
    nothing; every :class:`Model` calls this before it loads, and code that loads models through
    ``llama_cpp.Llama`` in the same process calls it first."""
    memtune.tune()
    guard_model_defaults()
    keep_kernel_choices()


def keep_kernel_choices() -> None:
    """Point the patched kernels at this CPU's file of kept kernel choices (``GGML_CPU_EXACT_CHOICE_FILE``), unless
    the environment names one already (an empty value keeps none: every process times its shapes again)."""
    if "GGML_CPU_EXACT_CHOICE_FILE" in os.environ:
        return
    try:
        os.environ["GGML_CPU_EXACT_CHOICE_FILE"] = str(kernel_choice_path())
    except EesdError:
        pass  # no writable cache: each process times its shapes


# llama.cpp attends over the KV cells up to the highest one used, rounded up to a multiple of 256 (llama_kv_cache::
# get_n_kv): a chunk of a long input that ends past such a multiple makes every one of its rows attend to up to 255 cells
# more. So a chunk that is not the last ends on a multiple of KV_PAD positions. A 600-token prompt after a cached prefix
# of one token (its chunks ending at 513 and 600) took 3.7% longer to decode than from an empty cache (512, 600): 0.5B
# demo model, 2-core EPYC without AVX-512 (BENCHMARKS.md, "AVX2 EPYC")
KV_PAD = 256

# what the engine says when greedy output is not exact, by cause
NOT_EXACT = {
    "build": "this llama.cpp lacks eesd-local's batch-invariant patch (install with scripts/setup.sh)",
    "gpu": "layers run on a GPU backend, whose kernels change with the batch size",
    "rpc": "layers run on RPC servers, whose kernels eesd-local cannot check",
    "amx": "llama.cpp's AMX weight buffers are on (EESD_EXTRA_BUFTS=1), and they batch differently",
}


def exactness(*, draft_max: int, n_gpu_layers: int = 0, rpc: bool = False) -> tuple[bool, str]:
    """Whether greedy speculative output is byte-identical to plain decoding here, and why (not).

    It is when every verify batch (at most ``draft_max`` + 1 rows) runs the CPU backend's
    batch-invariant kernels: the patched build, no layer on another backend, and no weight buffer
    type the patch does not cover."""
    rows = exact_rows()
    if rows == 0:
        off = ggml_symbol("ggml_cpu_exact_rows") is not None  # patched, but GGML_CPU_EXACT_ROWS=0
        return False, "GGML_CPU_EXACT_ROWS=0 turned the batch-invariant kernels off" if off else NOT_EXACT["build"]
    if rpc:
        return False, NOT_EXACT["rpc"]
    if n_gpu_layers != 0 and offload_devices():
        return False, NOT_EXACT["gpu"]
    if draft_max + 1 > rows:
        return False, (f"a verify batch of {draft_max + 1} tokens is more than the {rows} rows the CPU kernels keep "
                       f"batch-invariant (pass --draft-max {rows - 1} or less)")
    if extra_bufts_allowed() and cpu_has_amx():
        return False, NOT_EXACT["amx"]
    if rows >= EXACT_ALL:
        return True, "batch-invariant CPU kernels at every batch size"
    return True, f"batch-invariant CPU kernels for batches of up to {rows} tokens"


def default_threads() -> int:
    """``EESD_THREADS`` or the number of cores (llama.cpp's results do not depend on it)."""
    env = os.environ.get("EESD_THREADS")
    if env:
        return max(1, int(env))
    return max(1, os.cpu_count() or 1)


class Model:
    """A loaded GGUF: weights, vocabulary and metadata."""

    ptr: Any = None  # llama_model*; None once freed (or before it was loaded)
    _contexts = 0  # contexts made from it and not freed yet: the model is freed after the last of them
    _close_asked = False  # close() came while contexts were alive: the last one's close frees the model

    def __init__(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, vocab_only: bool = False,
                 rpc: Sequence[str] = ()) -> None:
        """``rpc``: HOST:PORT of RPC servers to offload layers to (with ``n_gpu_layers``, as to a GPU).
        The first model loaded makes the process-wide settings of :func:`setup_process`."""
        setup_process()
        init_backend()
        self.path = check_gguf(Path(path))  # llama.cpp aborts the process on some damaged files: refuse them first
        # RPC: the servers' devices join llama.cpp's before the load; every decode then checks that
        # none stopped answering (llama.cpp would go on with zeros: ggml-rpc-no-abort.patch)
        self.rpc = tuple(rpc)
        self.rpc_lost = ""  # why an RPC server no longer answers: the model must be loaded again
        if self.rpc:
            add_servers(list(self.rpc))
        params = lc.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        self.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        ptr = lc.llama_model_load_from_file(os.fsencode(self.path), params)
        if not ptr:
            raise EesdError(f"llama.cpp could not load {self.path}", hint="the file may be truncated or of an unsupported architecture; set EESD_LLAMA_LOG=1 to see why")
        self.ptr = ptr
        _track(self)
        self.vocab_only = vocab_only  # no weights: tokenizer and metadata only (size_bytes still counts the file's tensors)
        self.vocab = lc.llama_model_get_vocab(ptr)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))
        self.n_layer = int(lc.llama_model_n_layer(ptr))
        self.n_embd = int(lc.llama_model_n_embd(ptr))
        self.n_ctx_train = int(lc.llama_model_n_ctx_train(ptr))
        self.size_bytes = int(lc.llama_model_size(ptr))
        self.arch = self.meta("general.architecture") or "unknown"
        self.bos = int(lc.llama_vocab_bos(self.vocab))
        self.eos = int(lc.llama_vocab_eos(self.vocab))
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self.vocab))
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}

    # --- metadata --------------------------------------------------------

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = lc.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            lc.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def chat_template(self) -> str | None:
        return self.meta("tokenizer.chat_template")

    def vocab_signature(self) -> tuple[int, tuple[bytes, ...]]:
        """Size plus a sample of token texts: equal for models that share a vocabulary."""
        step = max(1, self.n_vocab // 997)
        return self.n_vocab, tuple(self.token_to_piece(t, special=True) for t in range(0, self.n_vocab, step))

    # --- tokens ----------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates: undecodable bytes of argv or stdin (surrogateescape)
            raise _not_utf8(text, exc.start) from None
        cap = len(data) + 8
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        if not special and token in self._pieces:
            return self._pieces[token]
        self.check_token(token)
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        piece = buf.raw[:n]
        if not special:
            self._pieces[token] = piece
        return piece

    def check_token(self, token: int, where: str = "") -> None:
        """llama.cpp indexes its vocabulary with .at(): an id outside it throws a C++ exception
        that nothing catches, and the process aborts. Refuse it here instead."""
        if not 0 <= token < self.n_vocab:
            raise EesdError(
                f"token id {token}{where} is not in the vocabulary of {self.path.name}: it lies outside the "
                f"vocabulary's ids 0 to {self.n_vocab - 1}",
                hint="pass token ids made by this model's tokenizer",
            )

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_to_piece(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        eog = self._eog.get(token)
        if eog is None:  # asked once per emitted token: remember the answer rather than call llama.cpp
            self.check_token(token)
            eog = self._eog[token] = bool(lc.llama_vocab_is_eog(self.vocab, token))
        return eog

    def close(self) -> None:
        """Free the model, exactly once whatever signals arrive (see :func:`_take`), and never before a
        context made from it: the garbage collector finalizes a cycle's objects in any order."""
        if self._contexts > 0:
            self._close_asked = True
            return
        ptr = _take(self, "ptr")
        if ptr:
            lc.llama_model_free(ptr)

    def __del__(self) -> None:
        try:
            self.close()
        except BaseException:  # a KeyboardInterrupt here would only be printed as "ignored"
            pass


_live: weakref.WeakSet[Any] = weakref.WeakSet()  # models and contexts not freed yet (their atexit close)
_live_lock = threading.Lock()


def _track(obj: Model | Context) -> None:
    """Free ``obj`` at exit, while the interpreter is whole, if nothing did before: a __del__ during the
    interpreter's teardown could run after the log callback llama.cpp calls was gone."""
    with _live_lock:
        if not _live:
            atexit.register(_close_live)
        _live.add(obj)


def _close_live() -> None:
    with _live_lock:
        left = list(_live)
    for obj in sorted(left, key=lambda o: isinstance(o, Model)):  # contexts first, then their models
        try:
            obj.close()
        except BaseException:  # exiting anyway: the rest still get closed
            pass


def _take(obj: object, name: str) -> Any:
    """Remove the handle ``name`` from ``obj`` and return it (None if it is gone already), before the
    caller frees it. ``dict.pop`` is one C call: neither a signal handler nor another thread runs inside
    it, so of two closes (a KeyboardInterrupt raised right after a free, then ``__del__``; or two threads)
    exactly one gets the handle. An interrupt between the pop and the free leaks the handle, never frees
    it twice. The class attribute (None) answers for the handle from then on."""
    return vars(obj).pop(name, None)


def _not_utf8(text: str, i: int) -> EesdError:
    """The error for a str holding a lone surrogate at index ``i`` (not encodable as UTF-8)."""
    code = ord(text[i])
    # Python decodes argv (and stdin, in a C locale) with surrogateescape: byte b becomes U+DC00+b
    what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
    before = text[max(0, i - 20):i].encode("utf-8", "replace").decode("utf-8")
    return EesdError(
        f"the prompt is not valid UTF-8 text: {what} at character {i} of {len(text)} (after {before!r})",
        hint="pass the prompt as UTF-8 (convert a file first, e.g. iconv -f latin1 -t utf-8 FILE), or remove that byte",
    )


class Detokenizer:
    """Incremental token -> text: holds back bytes of an incomplete UTF-8 character."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._dec.decode(self.model.token_to_piece(token))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


@dataclass
class ContextParams:
    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: int | None = None
    # llama.cpp's default (auto, None here) turns flash attention on where the backend has it; off,
    # the logits match llama-cpp-python's Llama (which disables it unless asked) bit for bit
    flash_attn: bool | None = False
    n_seq_max: int = 1  # sequences the context holds (rows of decode_rows name theirs)
    kv_unified: bool = False  # several sequences: one KV buffer shared by all, or a stream each


class Context:
    """One llama.cpp context with a record of what its KV cache holds for sequence 0 (by default its only one)."""

    ptr: Any = None  # llama_context*; None once freed (or before it was made)
    _batch: Any = None  # its llama_batch

    def __init__(self, model: Model, params: ContextParams | None = None, *, cb_eval: tuple[int, int] | None = None,
                 embd: int = 0) -> None:
        """``cb_eval``: (function, user data) addresses of a graph eval callback (the shared trunk's
        capture); ``embd`` > 0: the context is fed rows of that width (:meth:`decode` with ``embd=``)
        rather than token ids."""
        params = params or ContextParams()
        if params.n_ctx < 1:  # llama.cpp reads 0 as "the model's size" and fails on negatives with a misleading error
            raise EesdError(f"--n-ctx must be a positive number of tokens, got {params.n_ctx}", hint="e.g. --n-ctx 4096")
        if params.n_batch < 1:
            raise EesdError(f"the batch size must be a positive number of tokens, got {params.n_batch}")
        if params.n_seq_max < 1:
            raise EesdError(f"a context holds at least one sequence, got n_seq_max={params.n_seq_max}")
        self.model = model
        cp = lc.llama_context_default_params()
        cp.n_ctx = params.n_ctx
        cp.n_batch = params.n_batch
        cp.n_ubatch = params.n_batch
        cp.n_seq_max = params.n_seq_max
        cp.kv_unified = params.kv_unified
        cp.flash_attn_type = (lc.LLAMA_FLASH_ATTN_TYPE_AUTO if params.flash_attn is None else
                              lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if params.flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        threads = params.n_threads or default_threads()
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.no_perf = True
        # no layer offloaded: every op on the CPU. llama.cpp's default (op_offload) otherwise sends a batch of 32
        # rows or more to a GPU backend of the build (Vulkan, CUDA) even then, whose kernels are not batch-invariant:
        # a long verify or a prefill in other cuts would leave the CPU's exact kernels while exactness() says exact
        cp.op_offload = getattr(model, "n_gpu_layers", 0) != 0
        if cb_eval is not None:
            cp.cb_eval = ctypes.cast(cb_eval[0], lc.ggml_backend_sched_eval_callback)
            cp.cb_eval_user_data = ctypes.c_void_p(cb_eval[1])
        model._contexts += 1  # before llama.cpp holds the model: whatever happens next, the model outlives the context
        ptr = lc.llama_init_from_model(model.ptr, cp)
        if not ptr:
            model._contexts -= 1
            raise EesdError(f"llama.cpp could not create a context of {params.n_ctx} tokens for {model.path.name}", hint="try a smaller --n-ctx")
        self.ptr = ptr
        _track(self)
        # llama.cpp pads the KV size up to a multiple of 256 but caps a batch at the n_ctx asked
        # for: hold both to what was asked, so chunking never exceeds the real batch
        self.n_ctx = min(params.n_ctx, int(lc.llama_n_ctx(ptr)))
        self.n_batch = min(params.n_batch, int(lc.llama_n_batch(ptr)))
        self.mem = lc.llama_get_memory(ptr)
        self.tokens: list[int] = []  # what the KV cache holds, position by position
        self.embd = embd
        self._batch = lc.llama_batch_init(self.n_batch, embd, 1)
        self._n_out = 0
        self._out_base = 0

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def trim(self, n_keep: int) -> None:
        """Drop every cached position >= n_keep (the KV rollback)."""
        if n_keep < len(self.tokens):
            lc.llama_memory_seq_rm(self.mem, 0, n_keep, -1)
            del self.tokens[n_keep:]

    def clear(self) -> None:
        lc.llama_memory_clear(self.mem, True)
        self.tokens.clear()

    def clear_seq(self, seq: int) -> None:
        """Drop every cached position of sequence ``seq`` (its cells are free for the next one); for
        sequence 0 the record of :attr:`tokens` too."""
        lc.llama_memory_seq_rm(self.mem, seq, -1, -1)
        if seq == 0:
            self.tokens.clear()

    def room(self) -> int:
        """How many more tokens fit into the context."""
        return self.n_ctx - self.n_past

    def state_size(self) -> int:
        """Bytes of sequence 0's KV state as :meth:`save_state_into` writes it."""
        return int(lc.llama_state_seq_get_size(self.ptr, 0))

    def save_state_into(self, out: Any) -> None:
        """Write sequence 0's KV state into ``out``, a writable buffer of exactly :meth:`state_size` bytes
        (a bytearray, or a memoryview of one: the prompt cache hands a recycled buffer's, whose pages are
        already mapped; fresh pages cost this VM about 0.5 ms a MB, ten times the copy itself)."""
        size = len(out) if not isinstance(out, memoryview) else out.nbytes
        buf = (ctypes.c_uint8 * size).from_buffer(out)
        got = int(lc.llama_state_seq_get_data(self.ptr, buf, size, 0))
        del buf  # (a live view would pin the buffer's size)
        if got != size:
            raise EesdError(f"llama.cpp saved {got} of {size} bytes of a KV state")

    def save_state(self) -> bytearray:
        """Sequence 0's KV state (what :meth:`restore_state` takes back), as llama.cpp serialises it: written
        straight into the bytearray returned (tens of MB for a long prompt: no second copy)."""
        out = bytearray(self.state_size())
        self.save_state_into(out)
        return out

    def restore_state(self, state: bytes | bytearray | memoryview, tokens: Sequence[int]) -> None:
        """Put back a state :meth:`save_state` gave, which holds ``tokens``; the cache held before is dropped.
        A writable state (what save_state returns) is read in place, anything else copied once."""
        self.clear()
        n = state.nbytes if isinstance(state, memoryview) else len(state)
        try:
            buf = (ctypes.c_uint8 * n).from_buffer(state)  # type: ignore[arg-type]
        except TypeError:  # read-only (bytes): a copy
            buf = (ctypes.c_uint8 * n).from_buffer_copy(state)
        ok = int(lc.llama_state_seq_set_data(self.ptr, buf, n, 0)) == n
        del buf
        if not ok:
            self.clear()
            raise EesdError("llama.cpp could not restore a saved KV state")
        self.tokens[:] = list(tokens)

    def decode(self, tokens: Sequence[int], *, n_logits: int = 1, embd: np.ndarray | None = None,
               stop: Callable[[], bool] | None = None) -> int:
        """Append ``tokens`` to the cache with logits for the last ``n_logits`` of them.

        Long inputs go in n_batch chunks, each but the last ending on a multiple of KV_PAD positions where
        it can; the logit rows must all fall into the last chunk. Returns the number of logit rows available through :meth:`logits`.
        ``stop`` is asked between chunks: when it says so, the decode ends there, the cache holding
        (and :attr:`tokens` recording) the chunks decoded, and no logit row is available (returns -1).
        A context made with ``embd`` is fed ``embd`` (one float32 row per token) instead of
        the token ids, which then only say what its cache holds.
        """
        n = len(tokens)
        if n == 0:
            return 0
        if self.embd:
            if embd is None or embd.shape != (n, self.embd) or embd.dtype != np.float32 or not embd.flags.c_contiguous:
                raise ValueError(f"this context is fed ({n}, {self.embd}) float32 rows, got "
                                 f"{None if embd is None else (embd.shape, embd.dtype)}")
        elif embd is not None:
            raise ValueError("this context is fed token ids, not embeddings")
        n_vocab = self.model.n_vocab
        for i, tok in enumerate(tokens if embd is None else ()):  # llama.cpp rejects the whole batch with code -1 and says nothing more
            if not 0 <= tok < n_vocab:
                self.model.check_token(tok, f" (position {i} of {n})")
        if self.n_past + n > self.n_ctx:
            raise ContextFullError(
                f"the context is full: {self.n_past} + {n} tokens exceed n_ctx={self.n_ctx}",
                hint="start a new conversation or pass a larger --n-ctx",
            )
        n_logits = max(0, min(n_logits, n))
        start = 0
        while start < n:
            if start and stop is not None and stop():
                self._n_out = 0
                return -1
            size = min(self.n_batch, n - start)
            if start + size < n and (self.n_past + size) % KV_PAD < size:  # a chunk before the last ends on a multiple
                size -= (self.n_past + size) % KV_PAD  # of KV_PAD positions (above)
            # the last chunk is cut so that it holds every token that wants logits
            if start + size < n and n - (start + size) < n_logits:
                size = max(1, n - start - n_logits)
            chunk = tokens[start : start + size]
            first_out = n - n_logits - start  # batch index of the first row with logits
            b = self._batch
            pos0 = self.n_past
            if embd is not None:
                rows = embd[start : start + size]
                ctypes.memmove(b.embd, rows.ctypes.data, rows.nbytes)
            for i, tok in enumerate(chunk):
                if embd is None:
                    b.token[i] = tok
                b.pos[i] = pos0 + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = i >= first_out
            b.n_tokens = len(chunk)
            rc = self._llama_decode()
            if rc != 0:
                # llama.cpp keeps processed ubatches on fatal errors: resynchronise our record
                pos_max = int(lc.llama_memory_seq_pos_max(self.mem, 0))
                self.tokens.extend(chunk[: max(0, pos_max + 1 - pos0)])
                self.trim(pos0)
                if rc == 1:
                    raise ContextFullError(f"llama.cpp found no KV slot for {len(chunk)} tokens", hint="pass a larger --n-ctx")
                raise RuntimeError(f"llama_decode failed with code {rc}")
            self.tokens.extend(chunk)
            start += len(chunk)
            self._out_base = first_out
        self._n_out = n_logits
        return n_logits

    def decode_rows(self, rows: Sequence[tuple[int, int, int, bool]]) -> np.ndarray:
        """Decode one batch of (token, position, sequence, wants logits) rows, each placed where its caller
        says (a context of several sequences: the teacher's and the corpus' batches mix them); return the
        logits of the rows that want them, in row order, as an (n, n_vocab) float32 view into llama.cpp's
        buffer, valid until the next decode. The rows must fit one batch (:attr:`n_batch`). The record of
        :attr:`tokens` is left alone: a caller of this method keeps its own, and :meth:`logits` reads the
        rows of :meth:`decode` only."""
        n = len(rows)
        n_vocab = self.model.n_vocab
        self._n_out = 0
        if n == 0:
            return np.zeros((0, n_vocab), np.float32)
        if self.embd:
            raise ValueError("this context is fed embeddings, not token ids")
        if n > self.n_batch:
            raise ValueError(f"{n} rows do not fit one batch of {self.n_batch}")
        b = self._batch
        n_out = 0
        for i, (tok, pos, seq, out) in enumerate(rows):
            if not 0 <= tok < n_vocab:  # llama.cpp would reject the whole batch with code -1 and say nothing more
                self.model.check_token(tok, f" (row {i} of {n})")
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = bool(out)
            n_out += bool(out)
        b.n_tokens = n
        rc = self._llama_decode()
        if rc == 1:
            raise ContextFullError(f"llama.cpp found no KV slot for {n} tokens", hint="pass a larger --n-ctx")
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")
        if n_out == 0:
            return np.zeros((0, n_vocab), np.float32)
        return np.ctypeslib.as_array(lc.llama_get_logits(self.ptr), shape=(n_out, n_vocab))

    def _llama_decode(self) -> int:
        """``llama_decode`` of the batch as filled; on an RPC model, then the check that no server stopped answering."""
        lost = rpc_failures() if self.model.rpc else 0
        rc = int(lc.llama_decode(self.ptr, self._batch))
        if self.model.rpc:
            self._check_rpc(lost)
        return rc

    def _check_rpc(self, before: int) -> None:
        """After a decode on an RPC model: its outputs arrived (llama.cpp copies them lazily), and no
        server stopped answering meanwhile, else this and every later decode raises."""
        if not self.model.rpc_lost:
            lc.llama_synchronize(self.ptr)
        check_rpc(self.model, before)

    def logits(self, row: int = -1) -> np.ndarray:
        """Logit row ``row`` of the last decode (negative counts from the end): a float32 view
        into llama.cpp's buffer, valid until the next decode."""
        if row < 0:
            row += self._n_out
        if not 0 <= row < self._n_out:
            raise IndexError(f"logit row {row} of {self._n_out}")
        ptr = lc.llama_get_logits_ith(self.ptr, self._out_base + row)  # index within the batch
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))

    def logits_rows(self) -> np.ndarray:
        """All logit rows of the last decode as an (n, n_vocab) array (a copy)."""
        return np.stack([self.logits(i) for i in range(self._n_out)])

    def close(self) -> None:
        """Free the context and its batch, each exactly once whatever signals arrive (see :func:`_take`)."""
        ptr = _take(self, "ptr")
        batch = _take(self, "_batch")
        if batch is not None:
            lc.llama_batch_free(batch)
        if ptr:
            lc.llama_free(ptr)
            model = self.model
            model._contexts -= 1
            if model._contexts == 0 and model._close_asked:
                model.close()

    def __del__(self) -> None:
        try:
            self.close()
        except BaseException:  # a KeyboardInterrupt here would only be printed as "ignored"
            pass


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_rpc(model: Model, before: int) -> None:
    """Raise RpcError if an RPC server of ``model`` stopped answering since the failure count was
    ``before`` (:func:`rpc_failures`), or ever did: the decodes since then ran on zeros. The native
    round loop calls it after each batch of rounds, before any of their tokens is taken."""
    if model.rpc and not model.rpc_lost and rpc_failures() > before:
        model.rpc_lost = (f"an RPC server ({', '.join(model.rpc)}) stopped answering during a "
                          "decode: the model's layers there are gone")
    if model.rpc_lost:
        raise RpcError(model.rpc_lost, hint="start the server again and load the model again")
