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
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
GP=${EESD_GPU_PATH_DIR:-$ROOT/build/gpu-path}
VENV=$GP/venv
PY=$VENV/bin/python
step() { printf '\n==> %s\n' "$*"; }
die() { echo "gpu-path: $*" >&2; exit 2; }

[ -x .venv/bin/python ] || die ".venv is missing: run bash scripts/setup.sh first"
BUILD_ONLY=""; [ "${1:-}" = --build-only ] && { BUILD_ONLY=1; shift; }
mkdir -p "$GP"

# --- 1. system packages ----------------------------------------------------------------------------
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

# --- 2. the environment and its llama-cpp-python -----------------------------------------------------
if [ ! -x "$PY" ]; then
  step "creating $VENV"
  .venv/bin/python -m venv "$VENV"
  # .venv's setuptools builds the extension below (the venv's bundled one is older than pyproject.toml needs)
  "$PY" -m pip uninstall -q -y setuptools
fi
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
MAIN_SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
NATIVE_DIR=$GP/native
# .venv's packages after this environment's own (so its llama_cpp, the Vulkan build, wins), and
# eesd_local._native from build/gpu-path/native, the extension linked against that llama_cpp
cat > "$SITE/_eesd_gpu_path.py" <<EOF
"""Written by scripts/gpu_path.sh: this environment is .venv with llama.cpp's Vulkan build."""
import importlib.util
import os
import site
import sys

if not os.environ.get("EESD_GPU_PATH_BARE"):  # set while pip installs here: it then sees this environment alone
    site.addsitedir(${MAIN_SITE@Q})
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

export CMAKE_ARGS="-DGGML_VULKAN=on"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)
# and one patch of its own beside native/patches: Debian 12's Vulkan headers predate an extension the backend uses
LB=(scripts/llama_build.py --python "$PY" --patch scripts/patches/ggml-vulkan-old-headers.patch)
if ! why=$("$PY" "${LB[0]}" check "${LB[@]:1}" 2>&1); then
  step "building llama-cpp-python with llama.cpp's Vulkan backend ($why)"
  # pip sees this environment alone (never .venv's llama-cpp-python) and installs the package alone
  EESD_GPU_PATH_BARE=1 "$PY" "${LB[0]}" install "${LB[@]:1}" --into "$GP" --no-deps
fi
KEY=$("$PY" -c "import json, os, llama_cpp; print(json.load(open(os.path.join(os.path.dirname(llama_cpp.__file__), 'lib', 'eesd-build.json')))['key'])")

# --- 3. the extension against that libllama ----------------------------------------------------------
STAMP=$NATIVE_DIR/llama-key
force=""; [ "$(cat "$STAMP" 2>/dev/null)" = "$KEY" ] || force="-f"
step "building eesd_local._native against the Vulkan build's libllama${force:+ (rebuilt: another llama build)}"
"$PY" setup.py -q build_ext $force --build-lib "$NATIVE_DIR" --build-temp "$GP/native-temp" >"$GP/native.log" 2>&1 \
  || { tail -n 30 "$GP/native.log"; die "the extension did not build against the Vulkan libllama (its log: $GP/native.log)"; }
echo "$KEY" > "$STAMP"
ls "$NATIVE_DIR"/eesd_local/_native.*.so >/dev/null 2>&1 || die "the extension was not built (its log: $GP/native.log)"
echo "  built in $(( $(date +%s) - t0 )) s"
[ -n "$BUILD_ONLY" ] && exit 0

# --- 4. the tier --------------------------------------------------------------------------------------
if [ -z "${GGML_VK_VISIBLE_DEVICES:-}" ]; then
  # ggml uses a CPU-type Vulkan device only when named; without vulkaninfo, device 0
  idx=$(vulkaninfo --summary 2>/dev/null | awk '/^GPU[0-9]+:/{g=substr($1,4)+0} /deviceType/ && /CPU/{print g; exit}')
  export GGML_VK_VISIBLE_DEVICES=${idx:-0}
fi
"$PY" -c "
from eesd_local.llama import ggmlapi, native
devs = ggmlapi.offload_device_names()
mod, why = native.load()
assert mod is not None, why
print('  devices:', ', '.join(devs) or 'none')
raise SystemExit(0 if devs else 1)" || die "llama.cpp's Vulkan build sees no device (GGML_VK_VISIBLE_DEVICES=$GGML_VK_VISIBLE_DEVICES)"
step "gpu-path tier: pytest -m gpu_path, every layer on $(vulkaninfo --summary 2>/dev/null | awk -F'= ' '/deviceName/{print $2; exit}' || echo 'the Vulkan device')"
t1=$(date +%s)
EESD_GPU_PATH=1 "$PY" -m pytest -q -m gpu_path tests/test_gpu_path.py "$@"
echo "  the tier ran in $(( $(date +%s) - t1 )) s"
