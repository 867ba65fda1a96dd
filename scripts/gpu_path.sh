#!/usr/bin/env bash
# The GPU path before a GPU is at hand (issue 44, part 1), run by `bash scripts/test.sh gpu-path`:
#   1. the system packages of llama.cpp's Vulkan backend and of lavapipe (Mesa's Vulkan device on the CPU),
#      installed with apt-get where missing;
#   2. an environment of its own, build/gpu-path/venv: llama-cpp-python built by scripts/llama_build.py
#      from the same patched source with -DGGML_VULKAN=on (the wheel and a resumable CMake tree kept in
#      build/gpu-path, rebuilt only when the source, the patches or the flags change), and everything else
#      (eesd_local itself, numpy, pytest...) taken from .venv, which stays as the set-up made it;
#   3. this project's extension built against that libllama into build/gpu-path/native (the source tree's
#      eesd_local/_native*.so is .venv's, against the CPU build) and loaded from there in that environment;
#   4. pytest -m gpu_path (tests/test_gpu_path.py) there, every layer offloaded to lavapipe.
# About 12 min the first time on 2 busy cores (the Vulkan shaders and ggml-vulkan), seconds after; the tier
# about 25 min there (lavapipe: about a second a token of the 0.5B). Environment: CMAKE_BUILD_PARALLEL_LEVEL (default: all cores), GGML_VK_VISIBLE_DEVICES (default:
# the first CPU-type Vulkan device, lavapipe, which ggml leaves out unless named), EESD_GPU_PATH_DIR.
#
# --backend cuda (scripts/gpu_check.sh on a machine with an NVIDIA GPU and no network): the same steps with
# -DGGML_CUDA=on for that card's architecture (nvidia-smi's compute capability; EESD_CUDA_ARCH overrides) into
# build/gpu-cuda, no apt-get, built offline (no pip index, no build isolation: scikit-build-core, cmake and
# ninja come from the base interpreter). The base is .venv's interpreter where there is one, else python3 (or
# EESD_GPU_BASE_PYTHON): its packages are seen after the environment's own, and eesd_local is read from this
# checkout. EESD_GPU_WHEELS names a folder of wheels installed into the environment first (what the base lacks).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BACKEND=${EESD_GPU_BACKEND:-vulkan}
BUILD_ONLY="" PRINT_ARGS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build-only) BUILD_ONLY=1; shift ;;
    --print-cmake-args) PRINT_ARGS=1; shift ;;  # the flags it would build with (what it found here), and stop
    --backend) BACKEND=${2:?--backend takes vulkan or cuda}; shift 2 ;;
    --backend=*) BACKEND=${1#--backend=}; shift ;;
    *) break ;;
  esac
done
case "$BACKEND" in
  vulkan) GP=${EESD_GPU_PATH_DIR:-$ROOT/build/gpu-path} ;;
  cuda) GP=${EESD_GPU_PATH_DIR:-$ROOT/build/gpu-cuda} ;;
  *) echo "gpu-path: --backend takes vulkan or cuda, not $BACKEND" >&2; exit 2 ;;
esac
VENV=$GP/venv
PY=$VENV/bin/python
step() { printf '\n==> %s\n' "$*"; }
die() { echo "gpu-path: $*" >&2; exit 2; }

if [ -n "${EESD_GPU_BASE_PYTHON:-}" ]; then BASE_PY=$EESD_GPU_BASE_PYTHON
elif [ -x .venv/bin/python ]; then BASE_PY=.venv/bin/python
elif [ "$BACKEND" = cuda ]; then BASE_PY=$(command -v python3 || true)
else die ".venv is missing: run bash scripts/setup.sh first"
fi
[ -n "$BASE_PY" ] && "$BASE_PY" -c "import sys; assert sys.version_info >= (3, 11)" 2>/dev/null \
  || die "no Python 3.11+ to build on (${BASE_PY:-python3 is not on PATH}); set EESD_GPU_BASE_PYTHON"
BASE_SITE=$("$BASE_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$GP"

# --- 1. system packages ----------------------------------------------------------------------------
if [ "$BACKEND" = vulkan ]; then
  # glslc compiles the shaders, libvulkan-dev and spirv-headers are the headers and loader the backend builds
  # against, mesa-vulkan-drivers is lavapipe; vulkan-tools (vulkaninfo) only names the device
  PKGS="glslc libvulkan-dev spirv-headers mesa-vulkan-drivers vulkan-tools"
  missing=$(for p in $PKGS; do dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"; done)
  if [ -n "$missing" ]; then
    step "installing $(echo $missing) (apt-get)"
    command -v apt-get >/dev/null 2>&1 || die "cannot install $(echo $missing): no apt-get here; install them (or your system's Vulkan SDK, glslc and lavapipe) and run again"
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
    if ! ($sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing) >"$GP/apt.log" 2>&1; then
      die "could not install $(echo $missing) with apt-get (root and Debian's packages are needed; its output: $GP/apt.log)"
    fi
  fi
  command -v glslc >/dev/null 2>&1 || die "glslc is not on PATH after installing glslc"
  ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || die "lavapipe's ICD (mesa-vulkan-drivers) is not installed"
  CMAKE_ARGS="-DGGML_VULKAN=on"
  # and one patch of its own beside native/patches: Debian 12's Vulkan headers predate an extension the backend uses
  EXTRA_PATCH=(--patch scripts/patches/ggml-vulkan-old-headers.patch)
  # ggml uses a CPU-type Vulkan device only when named; without vulkaninfo, device 0
  idx=$(vulkaninfo --summary 2>/dev/null | awk '/^GPU[0-9]+:/{g=substr($1,4)+0} /deviceType/ && /CPU/{print g; exit}')
  VK_DEVICE=${GGML_VK_VISIBLE_DEVICES:-${idx:-0}}
else
  # CUDA: nvcc (on PATH or in /usr/local/cuda) and the card's compute capability, for one architecture only
  NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
  [ -n "$NVCC" ] || die "no nvcc: CUDA's compiler is neither on PATH nor in /usr/local/cuda/bin"
  export PATH="$(dirname "$NVCC"):$PATH" CUDACXX=$NVCC
  ARCH=${EESD_CUDA_ARCH:-$( (nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null || true) | head -n 1 | tr -d ' .')}
  ARCH=${ARCH:-native}
  CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$ARCH"
  # ggml-cuda links cuBLAS and the driver's libcuda. A toolkit assembled from pip packages (as on this project's own
  # machines) may lack cuBLAS: then the one of the base's nvidia-cublas package (PyTorch's) is named to CMake, and the
  # libraries' RUNPATH finds it at run time; no libcuda stub: the driver's own, else no VMM pool (GGML_CUDA_NO_VMM)
  CUDA_ROOT=""
  for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" "$(dirname "$(readlink -f "$NVCC")")/.." /usr/local/cuda; do
    [ -n "$d" ] && [ -f "$d/include/cuda_runtime.h" ] && { CUDA_ROOT=$(cd "$d" && pwd); break; }
  done
  in_toolkit() { for d in lib64 targets/x86_64-linux/lib lib; do ls "$CUDA_ROOT/$d/"$1 2>/dev/null || true; done | head -n 1; }
  in_base() { { find "$BASE_SITE/nvidia" -name "$1" 2>/dev/null || true; } | sort | head -n 1; }
  if [ -n "$(in_toolkit 'libcublas.so*')" ]; then
    CUBLAS="in the toolkit ($CUDA_ROOT)"
  else
    lib=$(in_base 'libcublas.so*'); lt=$(in_base 'libcublasLt.so*'); hdr=$(in_base cublas_v2.h)
    [ -n "$lib" ] && [ -n "$lt" ] && [ -n "$hdr" ] \
      || die "no cuBLAS: neither the CUDA toolkit (${CUDA_ROOT:-not found}) nor $BASE_SITE/nvidia holds libcublas and cublas_v2.h"
    CMAKE_ARGS+=" -DCUDA_cublas_LIBRARY=$lib -DCUDA_cublasLt_LIBRARY=$lt -DCMAKE_CUDA_FLAGS=-I$(dirname "$hdr")"
    CUBLAS="from $(dirname "$lib") (a pip package)"
  fi
  stub=$(in_toolkit 'stubs/libcuda.so')
  drv=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
  [ -n "$drv" ] || drv=$(ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null | head -n 1 || true)
  if [ -n "$stub" ]; then LIBCUDA="the toolkit's stub"
  elif [ -n "$drv" ]; then CMAKE_ARGS+=" -DCUDA_cuda_driver_LIBRARY=$drv"; LIBCUDA=$drv
  else CMAKE_ARGS+=" -DGGML_CUDA_NO_VMM=ON"; LIBCUDA="none (GGML_CUDA_NO_VMM)"
  fi
  echo "  CUDA: $("$NVCC" --version | grep -o "release [0-9.]*" || true), architecture $ARCH, cuBLAS $CUBLAS, libcuda $LIBCUDA"
  EXTRA_PATCH=()
  VK_DEVICE=""
fi
[ -n "$PRINT_ARGS" ] && { echo "$CMAKE_ARGS"; exit 0; }

# --- 2. the environment and its llama-cpp-python -----------------------------------------------------
if [ ! -x "$PY" ]; then
  step "creating $VENV (on $BASE_PY)"
  if ! "$BASE_PY" -m venv "$VENV" >"$GP/venv.log" 2>&1; then
    # an interpreter without ensurepip (a distribution's python3): a venv without pip, and the base's pip linked in
    rm -rf "$VENV"
    "$BASE_PY" -m venv --without-pip "$VENV" || die "could not create $VENV with $BASE_PY (its log: $GP/venv.log)"
    VSITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    ln -s "$BASE_SITE/pip" "$VSITE/pip"
  fi
  # the base's setuptools builds the extension below (a venv's bundled one is older than pyproject.toml needs)
  "$PY" -m pip uninstall -q -y setuptools >/dev/null 2>&1 || true
fi
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
NATIVE_DIR=$GP/native
# the base's packages after this environment's own (so its llama_cpp, the GPU build, wins), this checkout
# last (eesd_local where the base does not install it), eesd_local._native from $GP/native (the extension
# linked against that llama_cpp), and the Vulkan device to use unless one is named
cat > "$SITE/_eesd_gpu_path.py" <<EOF
"""Written by scripts/gpu_path.sh: llama.cpp's ${BACKEND} build over the packages of ${BASE_SITE}."""
import importlib.util
import os
import site
import sys

if not os.environ.get("EESD_GPU_PATH_BARE"):  # set while pip installs here: it then sees this environment alone
    site.addsitedir(${BASE_SITE@Q})
    if ${ROOT@Q} not in sys.path:
        sys.path.append(${ROOT@Q})
if ${VK_DEVICE@Q}:
    os.environ.setdefault("GGML_VK_VISIBLE_DEVICES", ${VK_DEVICE@Q})
NATIVE = ${NATIVE_DIR@Q}


class _NativeFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "eesd_local._native":
            return None
        where = os.path.join(NATIVE, "eesd_local")
        found = sorted(f for f in os.listdir(where) if f.startswith("_native.") and f.endswith(".so")) if os.path.isdir(where) else []
        return importlib.util.spec_from_file_location(name, os.path.join(where, found[0])) if found else None


sys.meta_path.insert(0, _NativeFinder)
EOF
echo "import _eesd_gpu_path" > "$SITE/_eesd_gpu_path.pth"
if [ -n "${EESD_GPU_WHEELS:-}" ] && ls "$EESD_GPU_WHEELS"/*.whl >/dev/null 2>&1; then
  # what the base lacks, carried as wheels (scripts/gpu_carry.py): installed alone, from those files
  EESD_GPU_PATH_BARE=1 "$PY" -m pip install -q --no-index --no-deps --no-compile "$EESD_GPU_WHEELS"/*.whl \
    || die "could not install the wheels in $EESD_GPU_WHEELS"
fi

export CMAKE_ARGS
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)
LB=(scripts/llama_build.py --python "$PY" "${EXTRA_PATCH[@]}")
if ! why=$("$PY" "${LB[0]}" check "${LB[@]:1}" 2>&1); then
  step "building llama-cpp-python with llama.cpp's $BACKEND backend ($why)"
  # Vulkan: pip sees this environment alone (never .venv's llama-cpp-python) and installs the package alone, its
  # build tools in an isolated environment from the index. CUDA, offline: no index, no isolation, so the build's
  # tools (scikit-build-core, cmake, ninja) come from the base, which this environment must then see
  how=(EESD_GPU_PATH_BARE=1); [ "$BACKEND" = cuda ] && how=(PIP_NO_INDEX=1 PIP_NO_BUILD_ISOLATION=0)
  env "${how[@]}" "$PY" "${LB[0]}" install "${LB[@]:1}" --into "$GP" --no-deps
fi
KEY=$("$PY" -c "import json, os, llama_cpp; print(json.load(open(os.path.join(os.path.dirname(llama_cpp.__file__), 'lib', 'eesd-build.json')))['key'])")

# --- 3. the extension against that libllama ----------------------------------------------------------
STAMP=$NATIVE_DIR/llama-key
force=""; [ "$(cat "$STAMP" 2>/dev/null)" = "$KEY" ] || force="-f"
step "building eesd_local._native against the $BACKEND build's libllama${force:+ (rebuilt: another llama build)}"
"$PY" setup.py -q build_ext $force --build-lib "$NATIVE_DIR" --build-temp "$GP/native-temp" >"$GP/native.log" 2>&1 \
  || { tail -n 30 "$GP/native.log"; die "the extension did not build against the $BACKEND libllama (its log: $GP/native.log)"; }
echo "$KEY" > "$STAMP"
ls "$NATIVE_DIR"/eesd_local/_native.*.so >/dev/null 2>&1 || die "the extension was not built (its log: $GP/native.log)"
echo "  built in $(( $(date +%s) - t0 )) s"

# --- 4. the tier --------------------------------------------------------------------------------------
# the build sees its device (with --build-only too: a background build on a GPU machine says so in its log)
[ -n "$VK_DEVICE" ] && export GGML_VK_VISIBLE_DEVICES=$VK_DEVICE
"$PY" -c "
from eesd_local.llama import ggmlapi, native
devs = ggmlapi.offload_device_names()
mod, why = native.load()
assert mod is not None, why
print('  devices:', ', '.join(devs) or 'none')
raise SystemExit(0 if devs else 1)" || die "llama.cpp's $BACKEND build sees no device${VK_DEVICE:+ (GGML_VK_VISIBLE_DEVICES=$VK_DEVICE)}"
[ -n "$BUILD_ONLY" ] && exit 0
if [ "$BACKEND" = vulkan ]; then
  where=$(vulkaninfo --summary 2>/dev/null | awk -F'= ' '/deviceName/{print $2; exit}' || true)
else
  where=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || true)
fi
step "gpu-path tier: pytest -m gpu_path, every layer on ${where:-the $BACKEND device}"
t1=$(date +%s)
EESD_GPU_PATH=1 "$PY" -m pytest -q -m gpu_path tests/test_gpu_path.py "$@"
echo "  the tier ran in $(( $(date +%s) - t1 )) s"
