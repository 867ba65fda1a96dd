"""What this machine and its llama.cpp build are, for the files kept per machine: the cost profiles
(:mod:`eesd_local.llama.costs`) and the batch-invariant kernels' choices (:func:`kernel_choice_path`).
Apart from costs so that :mod:`eesd_local.llama.runtime` can name the kernels' file without importing it."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as raw

from eesd_local.base.paths import cache_dir

# flags that select ggml's CPU kernels (and so B(k)); other flags do not matter here
_KERNEL_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                 "avx_vnni", "amx_int8", "amx_bf16", "asimd", "sve", "i8mm")


def cpu() -> dict[str, Any]:
    name, flags = "", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model", "CPU part") and not name:
                name = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    if not name:
        name = platform.processor() or platform.machine()
    return {"cpu": name, "flags": sorted(f for f in _KERNEL_FLAGS if f in flags), "cores": os.cpu_count()}


def build() -> str:
    """The llama.cpp build: scripts/llama_build.py's record of it, else its CPU library's size and time."""
    lib = Path(raw._base_path)
    info = lib / "eesd-build.json"
    if info.is_file():
        try:
            d = json.loads(info.read_text())
            return f"{d.get('version')}:{d.get('key')}:{d.get('patch', '')[:16]}"
        except (OSError, ValueError):
            pass
    sig = []
    for p in sorted(lib.glob("libggml-cpu*")) + sorted(lib.glob("libllama*")):
        st = p.stat()
        sig.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(sig)


def costs_dir() -> Path:
    """Where profiles are kept: the cache's ``costs/``, or ``EESD_COSTS_DIR`` where set (the test suite sets
    its own: batch costs timed while tests run beside other work must never become the user's profile)."""
    override = os.environ.get("EESD_COSTS_DIR")
    if override:
        path = Path(override)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return cache_dir("costs")


def kernel_choice_path() -> Path:
    """Where the batch-invariant kernels keep their choices for this CPU and build (GGML_CPU_EXACT_CHOICE_FILE:
    the patch times two exact kernels per product shape and appends the faster to it, so a later process runs
    each known shape's faster kernel from its first batch); beside the cost profiles, so the test suite's are its own."""
    key = hashlib.sha256(json.dumps({**cpu(), "build": build()}, sort_keys=True).encode()).hexdigest()[:16]
    return costs_dir() / f"kernels-{key}.txt"
