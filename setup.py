"""Builds eesd_local._native (native/) against the installed llama-cpp-python.

Everything else about the package is in pyproject.toml. The extension includes the
llama.h that llama-cpp-python installs (<site-packages>/include) and links its
libllama (<site-packages>/llama_cpp/lib), with an RPATH to that directory so that
the extension and llama_cpp's ctypes share ONE loaded libllama. So llama-cpp-python is
installed first; then ``pip install -e .`` builds this against it (with or without build
isolation: see find_llama_cpp).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sysconfig

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup


def find_llama_cpp() -> tuple[str, str]:
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
    raise SystemExit("llama-cpp-python must be installed first (pip install llama-cpp-python==0.3.36); then: pip install -e .")


LLAMA_CPP_DIR, LLAMA_CPP_VERSION = find_llama_cpp()
LLAMA_LIB_DIR = os.path.join(LLAMA_CPP_DIR, "lib")
LLAMA_INCLUDE_DIR = os.path.join(os.path.dirname(LLAMA_CPP_DIR), "include")

native = Pybind11Extension(
    "eesd_local._native",
    ["native/rounds.cpp", "native/module.cpp"],  # and the headers they include: native/*.hpp
    include_dirs=[LLAMA_INCLUDE_DIR],
    library_dirs=[LLAMA_LIB_DIR],
    libraries=["llama"],
    # llama_cpp's copy of libllama: beside the installed package, else where it was at build time
    extra_link_args=["-Wl,-rpath,$ORIGIN/../llama_cpp/lib", f"-Wl,-rpath,{LLAMA_LIB_DIR}"],
    define_macros=[("EESD_LLAMA_CPP_VERSION", f'"{LLAMA_CPP_VERSION}"')],
    # -O3 -fopenmp-simd: the vocabulary-wide loops (exp, sums, max) are written to vectorise and
    # carry `omp simd` reductions; -march=native: the extension is built where it runs, as
    # llama.cpp's own CPU backend is, so those loops get the machine's widest vectors (AVX-512)
    extra_compile_args=["-O3", "-march=native", "-fopenmp-simd"],
    cxx_std=17,
)

setup(ext_modules=[native])
