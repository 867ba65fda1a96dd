"""ggml and llama.cpp calls that llama-cpp-python does not bind: backend start-up, and ggml's own
functions (device list, the batch-invariance mode of the patched CPU backend, RPC failures) looked up in
the libraries llama-cpp-python loaded."""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Any

import llama_cpp as lc
import llama_cpp.llama_cpp as raw

_backend_lock = threading.Lock()
_backend_ready = False
_log_cb: Any = None


def init_backend() -> None:
    """Initialise llama.cpp once per process and silence its logging."""
    global _backend_ready, _log_cb
    with _backend_lock:
        if _backend_ready:
            return
        if not os.environ.get("EESD_LLAMA_LOG"):

            @lc.llama_log_callback
            def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
                return None

            _log_cb = _quiet  # keep a reference: llama.cpp holds the pointer
            lc.llama_log_set(_log_cb, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _backend_ready = True


def ggml_symbol(name: str) -> Any:
    """A C function of the ggml libraries llama-cpp-python loaded (None if none exports it).

    Looked up through llama-cpp-python's own handle of libllama, whose dependencies are the ggml
    libraries in use: loading ``libggml-cpu.so`` again by its file name would map a second copy
    beside the ``libggml-cpu.so.0`` that libllama loaded (pip installs them as separate files), and a
    setting made in that copy would change nothing."""
    fn = getattr(raw._lib, name, None)
    return fn if fn is not None else None


EXACT_ALL = 1 << 30  # GGML_CPU_EXACT_ALL: every batch size is batch-invariant


@functools.cache
def exact_rows() -> int:
    """How many rows a decode batch may hold and stay batch-invariant on the CPU: every row's logits
    bit-identical to the same token decoded alone (``ggml_cpu_exact_rows()``, exported by the llama.cpp
    that scripts/llama_build.py builds with native/patches/ggml-batch-invariant.patch):
    :data:`EXACT_ALL` (every batch size), or 0 for a build without the patch or with
    ``GGML_CPU_EXACT_ROWS=0`` (llama.cpp's stock kernels)."""
    fn = ggml_symbol("ggml_cpu_exact_rows")
    if fn is None:
        return 0
    fn.restype = ctypes.c_int
    return max(0, int(fn()))


def offload_devices() -> list[str]:
    """The GPU and accelerator devices llama.cpp can offload layers to (RPC servers included once added)."""
    count, get, kind, name = (ggml_symbol(f) for f in ("ggml_backend_dev_count", "ggml_backend_dev_get",
                                                        "ggml_backend_dev_type", "ggml_backend_dev_name"))
    if None in (count, get, kind, name):
        return []
    count.restype = ctypes.c_size_t
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    kind.restype, kind.argtypes = ctypes.c_int, [ctypes.c_void_p]
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    init_backend()
    out = []
    for i in range(int(count())):
        dev = get(i)
        if kind(dev) != 0:  # GGML_BACKEND_DEVICE_TYPE_CPU
            out.append((name(dev) or b"?").decode("utf-8", "replace"))
    return out


def offload_device_names() -> list[str]:
    """Each local GPU or accelerator device as ``NAME (DESCRIPTION)`` (``Vulkan0 (llvmpipe (LLVM 15.0.6, 256
    bits))``, ``CUDA0 (NVIDIA H200)``): what a cost profile measured with offloaded layers is for. RPC
    servers are left out (named by their addresses, and added only when a model loads)."""
    syms = [ggml_symbol(f) for f in ("ggml_backend_dev_count", "ggml_backend_dev_get", "ggml_backend_dev_type",
                                     "ggml_backend_dev_name", "ggml_backend_dev_description")]
    if None in syms:
        return []
    count, get, kind, name, desc = syms
    count.restype = ctypes.c_size_t
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    kind.restype, kind.argtypes = ctypes.c_int, [ctypes.c_void_p]
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    desc.restype, desc.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    init_backend()
    out = []
    for i in range(int(count())):
        dev = get(i)
        label = (name(dev) or b"?").decode("utf-8", "replace")
        if kind(dev) == 0 or label.upper().startswith("RPC"):  # GGML_BACKEND_DEVICE_TYPE_CPU; RPC servers
            continue
        out.append(f"{label} ({(desc(dev) or b'?').decode('utf-8', 'replace')})")
    return out


def rpc_failures() -> int:
    """RPC connections that failed in this process (ggml-rpc-no-abort.patch); 0 where none was made."""
    fn = ggml_symbol("ggml_backend_rpc_failures")
    if fn is None:
        return 0
    fn.restype = ctypes.c_int
    return int(fn())
