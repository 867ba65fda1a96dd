#!/usr/bin/env bash
# Set-up command 1: install everything into .venv and run the main job on the default
# demo model. Safe to rerun: finished steps are skipped.
#   bash scripts/setup.sh
# Environment: PYTHON (default python3), EESD_TORCH (default torch==2.13.0, the CPU
# build), CMAKE_ARGS (e.g. -DGGML_CUDA=on for a CUDA build of llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EESD_TORCH=${EESD_TORCH:-torch==2.13.0}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export PIP_DISABLE_PIP_VERSION_CHECK=1

step() { printf '\n==> %s\n' "$*"; }

# the tests' system tools: tmux (the real-terminal check of eesd-chat) and the arm64 cross-compiler
# (the arm64 compile check of native/); scripts/test.sh installs nothing, and skips those two without them
if ! command -v tmux >/dev/null 2>&1 || ! command -v aarch64-linux-gnu-g++ >/dev/null 2>&1; then
  step "installing tmux and g++-aarch64-linux-gnu for the tests (apt-get)"
  (apt-get update -qq && apt-get install -y -qq tmux g++-aarch64-linux-gnu) >/dev/null 2>&1 \
    || echo "note: could not install tmux / g++-aarch64-linux-gnu: two tests will be skipped"
fi

if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"

if ! why=$(.venv/bin/python scripts/llama_build.py check 2>&1); then
  step "building llama-cpp-python 0.3.36 from its vendored llama.cpp with eesd-local's patch ($why)"
  # native/patches: decode batches are batch-invariant on the CPU (greedy speculation is exact);
  # a patch that does not apply stops the set-up here, with one line
  .venv/bin/python scripts/llama_build.py install
fi

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  step "installing $EESD_TORCH (for head training and conversion)"
  $PIP install --progress-bar on "$EESD_TORCH"
fi

step "installing eesd-local with its train and dev extras (compiles the native round loop)"
# the extension links against the llama-cpp-python in .venv: no build isolation, so the
# build tools go into .venv first
$PIP install --progress-bar on "setuptools>=68" wheel "pybind11>=2.12"
$PIP install --progress-bar on --no-build-isolation -e '.[train,dev]'
.venv/bin/python -c "import eesd_local.speculative.engine, eesd_chat.app" || { echo "install failed"; exit 1; }
# the round loop is the extension: without it nothing generates
if ! why=$(.venv/bin/python -c "import eesd_local._native" 2>&1); then
  echo "the native round loop does not load: $(printf '%s\n' "$why" | tail -n 1)"; exit 1
fi

step "fetching the default demo model"
.venv/bin/eesd models pull qwen2.5-coder-0.5b-instruct

step "the main job: a coding question, answered with speculative decoding"
.venv/bin/eesd generate --chat --max-tokens 160 \
  --prompt "Write a Python function that reverses a string."

printf '\nDone. Try:  .venv/bin/eesd-chat      or   .venv/bin/eesd --help\n'
