"""Builds eesd_local._native (native/) against the installed llama-cpp-python.

Everything else about the package is in pyproject.toml, but the package list: every package
under eesd_local/ is found here (find_packages; eesd_chat lives in tui/), plus the shipped models/ data
as eesd_local.models (pyproject's package-dir). The extension includes the
llama.h that llama-cpp-python installs (<site-packages>/include) and links its
libllama (<site-packages>/llama_cpp/lib), with an RPATH to that directory so that
the extension and llama_cpp's ctypes share ONE loaded libllama. So llama-cpp-python is
installed first; then ``pip install -e .`` builds this against it (with or without build
isolation: see find_llama_cpp).

The extension is optional: where it cannot be built (no llama-cpp-python yet, no C++17
compiler) the install goes on without it, says so in one line, and the engine runs its
Python round loop, which gives the same tokens.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
import sysconfig

from pybind11.setup_helpers import Pybind11Extension, build_ext, has_flag
from setuptools import find_packages, setup
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

SOURCES = ["native/rounds.cpp", "native/split.cpp", "native/module.cpp"]  # and the headers they include: native/*.hpp


def find_llama_cpp() -> tuple[str, str] | None:
    """(package directory, version) of the llama-cpp-python the extension is for: importable, or
    (under pip's build isolation, which hides the environment's packages) in the site-packages of
    the environment being installed into, which this interpreter's sysconfig still names."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.origin is not None:
        return os.path.dirname(spec.origin), importlib.metadata.version("llama-cpp-python")
    for site in dict.fromkeys(sysconfig.get_paths()[k] for k in ("platlib", "purelib")):
        if os.path.isfile(os.path.join(site, "llama_cpp", "__init__.py")):
            for dist in importlib.metadata.distributions(path=[site]):
                if dist.metadata["Name"].lower().replace("_", "-") == "llama-cpp-python":
                    return os.path.join(site, "llama_cpp"), dist.version
    return None


def arch_flags(compiler) -> list[str]:
    """The code-generation flag for the build machine's own vector units: the extension is built
    where it runs, as llama.cpp's CPU backend is, so the vocabulary-wide loops get the widest
    vectors there (AVX-512 or AVX2 on x86-64, NEON/SVE on arm64). Each candidate is tried on a
    tiny file; none (the compiler's default target) if the compiler takes none of them."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        candidates = ["-march=native"]
    elif machine in ("arm64", "aarch64"):
        # Apple clang has taken -mcpu=native only in recent releases; apple-m1 is the oldest Apple core
        candidates = ["-mcpu=native", "-mcpu=apple-m1"] if sys.platform == "darwin" else ["-mcpu=native"]
    else:
        candidates = ["-march=native", "-mcpu=native"]
    return next(([flag] for flag in candidates if has_flag(compiler, flag)), [])


class BuildNative(build_ext):
    """build_ext with flags chosen for this compiler and machine, and a build failure reported in
    one line rather than ending the install."""

    def build_extensions(self) -> None:
        flags = arch_flags(self.compiler)
        # -fopenmp-simd: the loops carry `omp simd` reductions (no OpenMP runtime is linked)
        flags += [f for f in ("-fopenmp-simd",) if has_flag(self.compiler, f)]
        for ext in self.extensions:
            ext.extra_compile_args += flags
        super().build_extensions()

    def build_extension(self, ext) -> None:
        try:
            if LLAMA is None:
                raise PlatformError("llama-cpp-python is not installed here (install it first, then "
                                    "`pip install --no-build-isolation -e .`)")
            super().build_extension(ext)
        except (CCompilerError, ExecError, PlatformError, OSError) as exc:
            if isinstance(exc, CompileError):
                reason = "the C++17 compile failed (the compiler's messages are above)"
            elif isinstance(exc, LinkError):
                reason = "linking against llama-cpp-python's libllama failed (the linker's messages are above)"
            else:
                reason = " ".join(str(exc).split())
            print(f"eesd-local: the native round loop could not be built: {reason}", file=sys.stderr)
            raise


LLAMA = find_llama_cpp()
LLAMA_CPP_DIR, LLAMA_CPP_VERSION = LLAMA or ("llama_cpp", "none")
LLAMA_LIB_DIR = os.path.join(LLAMA_CPP_DIR, "lib")
LLAMA_INCLUDE_DIR = os.path.join(os.path.dirname(LLAMA_CPP_DIR), "include")
# llama_cpp's copy of libllama: beside the installed package, else where it was at build time
ORIGIN = "@loader_path" if sys.platform == "darwin" else "$ORIGIN"

def _lib_files() -> list[str]:
    return os.listdir(LLAMA_LIB_DIR) if os.path.isdir(LLAMA_LIB_DIR) else []


native = Pybind11Extension(
    "eesd_local._native",
    SOURCES,
    depends=[os.path.join("native", f) for f in ("simd.hpp", "probs.hpp", "kv.hpp", "rounds.hpp", "capture.hpp", "verify.hpp", "store.hpp")],
    include_dirs=[LLAMA_INCLUDE_DIR],
    library_dirs=[LLAMA_LIB_DIR],
    # ggml-base: the shared-trunk capture (capture.hpp) reads a graph tensor through ggml's backend API
    libraries=["llama"] + (["ggml-base"] if any(f.startswith("libggml-base.") for f in _lib_files()) else []),
    extra_link_args=[f"-Wl,-rpath,{ORIGIN}/../llama_cpp/lib", f"-Wl,-rpath,{LLAMA_LIB_DIR}"],
    define_macros=[("EESD_LLAMA_CPP_VERSION", f'"{LLAMA_CPP_VERSION}"')],
    # -O3: the vocabulary-wide loops (exp, sums, max) are written to vectorise; BuildNative adds
    # the target flags this compiler takes
    extra_compile_args=["-O3"],
    cxx_std=17,
    optional=True,
)

PACKAGES = find_packages(include=["eesd_local", "eesd_local.*"]) + ["eesd_chat", "eesd_local.models"]

setup(packages=PACKAGES, ext_modules=[native], cmdclass={"build_ext": BuildNative})
