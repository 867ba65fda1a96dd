"""native/ compiles for the targets users build on: x86-64 with and without AVX-512, and arm64
(with the aarch64 cross compiler, when it is installed). Compile checks only, so they run
whether or not the extension is built here; test_native.py checks what the built one does."""

from __future__ import annotations

import importlib.util
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[1] / "native"
SOURCES = sorted(NATIVE.glob("*.cpp"))
X86 = platform.machine().lower() in ("x86_64", "amd64")
ARM64 = platform.machine().lower() in ("aarch64", "arm64")

# (name, compiler, flags, full compile?). -fsyntax-only does not see an AVX-512 intrinsic used
# outside `#if defined(__AVX512F__)`: GCC reports the target mismatch only when it inlines the
# intrinsic, so the x86 build without AVX-512 is compiled for real (-O0: quick, same check).
TARGETS = [
    ("x86-64 SSE2 (the compiler's default)", "g++", [], False),
    ("x86-64 AVX2 without AVX-512", "g++", ["-mavx2", "-mfma", "-mno-avx512f"], True),
    ("x86-64 AVX-512", "g++", ["-march=x86-64-v4"], False),
    ("arm64 NEON", "aarch64-linux-gnu-g++", ["-march=armv8-a"], False),
    ("arm64 without NEON (the portable paths)", "aarch64-linux-gnu-g++", ["-march=armv8-a+nosimd"], False),
]


def _includes() -> list[str]:
    """llama.h from llama-cpp-python (<site-packages>/include), pybind11's and Python's headers."""
    pybind11 = pytest.importorskip("pybind11", reason="pybind11 is not installed: no headers to compile against")
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        pytest.skip("llama-cpp-python is not installed: no llama.h to compile against")
    llama = Path(spec.origin).parent.parent / "include"
    if not (llama / "llama.h").is_file():
        pytest.skip(f"llama-cpp-python installed no llama.h in {llama}")
    return [f"-I{llama}", f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]


def _compiler(name: str, cxx: str) -> str:
    if cxx == "g++":
        if not X86:
            pytest.skip(f"{name}: g++ here does not target x86-64")
    elif ARM64 and shutil.which(cxx) is None:
        cxx = "g++"  # on an arm64 machine its own g++ is the arm64 compiler
    path = shutil.which(cxx)
    if path is None:
        pytest.skip(f"{name}: {cxx} is not on PATH (Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu)")
    return path


@pytest.mark.parametrize(("name", "cxx", "flags", "full"), TARGETS, ids=[t[0] for t in TARGETS])
def test_native_sources_compile(name, cxx, flags, full, tmp_path):
    assert SOURCES, f"no C++ sources in {NATIVE}"
    cxx = _compiler(name, cxx)
    base = [cxx, "-std=c++17", "-Wall", "-Wextra", "-fopenmp-simd", '-DEESD_LLAMA_CPP_VERSION="0.0.0"', *flags, *_includes()]
    procs = []  # the sources compile side by side (one compiler each)
    for src in SOURCES:
        mode = ["-c", "-O0", "-o", str(tmp_path / f"{src.stem}.o")] if full else ["-fsyntax-only"]
        procs.append((src, subprocess.Popen([*base, *mode, str(src)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    for src, proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: {src.name} does not compile:\n{err[-4000:]}"
        ours = [line for line in err.splitlines() if f"{NATIVE.name}/" in line and "warning:" in line]
        assert not ours, f"{name}: warnings in {src.name}:\n" + "\n".join(ours)
