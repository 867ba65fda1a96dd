#!/usr/bin/env bash
# Set-up command 2: lint, import contracts, the fast tier, the model tier, the wheel check.
#   bash scripts/test.sh            everything (the model tier loads the real demo models)
#   bash scripts/test.sh fast       lint, contracts and the fast tier only (about 5 minutes on 2 cores)
#   bash scripts/test.sh gpu-path   not part of the above: every layer offloaded to llama.cpp's Vulkan backend on
#                                   lavapipe, in an environment of its own (scripts/gpu_path.sh; installs its apt packages)
# Nothing is installed here: scripts/setup.sh installs (tmux and the arm64 cross-compiler, which
# two tests use, are skipped with a reason where missing).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/lint-imports ] || { echo "test.sh: .venv lacks the dev tools: run bash scripts/setup.sh" >&2; exit 2; }
step() { printf '\n==> %s\n' "$*"; }
if [ "${1:-}" = gpu-path ]; then shift; exec bash scripts/gpu_path.sh "$@"; fi
step "ruff"
.venv/bin/ruff check eesd_local tui tests scripts setup.py
step "import contracts (lint-imports)"
.venv/bin/lint-imports
step "mypy"
.venv/bin/python -m mypy
step "fast tier: pytest -m 'not model'"
.venv/bin/python -m pytest -q -m "not model"
[ "${1:-}" = fast ] && exit 0
step "model tier: pytest -m model"
.venv/bin/python -m pytest -q -m model --durations=15
step "wheel check"
bash scripts/wheel_check.sh
