#!/usr/bin/env bash
# Set-up command 2: lint and run the test suite (real demo models, pulled if missing).
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v tmux >/dev/null 2>&1; then  # the real-terminal check of eesd-chat drives tmux
  (apt-get update -qq && apt-get install -y -qq tmux) >/dev/null 2>&1 || echo "note: could not install tmux"
fi
if ! command -v aarch64-linux-gnu-g++ >/dev/null 2>&1; then  # the arm64 compile check of native/ (test_native_build.py)
  (apt-get update -qq && apt-get install -y -qq g++-aarch64-linux-gnu) >/dev/null 2>&1 || echo "note: could not install g++-aarch64-linux-gnu"
fi
.venv/bin/ruff check eesd_local tui tests scripts
.venv/bin/python -m mypy
.venv/bin/python -m pytest -q "$@"
