#!/usr/bin/env bash
# One check on a machine with an NVIDIA GPU, CUDA and no network (issue 44, part 2), or its dry form here:
#
#   bash scripts/gpu_check.sh [--backend cuda|vulkan] [options]
#
# 1. what scripts/gpu_carry.py carried (.gpu-carry/cNN: the patched llama-cpp-python source, trimmed; the wheels the
#    device's image lacks; the bench prompts; the models in parts) is checked and put in place: the models in
#    build/gpu-check/home, the EESD_HOME of everything below (without .gpu-carry: your own EESD_HOME);
# 2. scripts/gpu_path.sh --backend B --build-only builds llama-cpp-python for that backend into its own environment
#    (cuda: -DGGML_CUDA=on for this card's architecture, offline, all cores, ccache where ggml finds one; into
#    build/gpu-cuda. vulkan: build/gpu-path, the gpu-path tier's kept build, on lavapipe) and the extension against it;
# 3. the model tier's GPU tests there: tests/test_gpu_path.py, every layer offloaded (--tests);
# 4. a short eesd bench there: methods none, auto, lookup, eesd (the exit head forced on), draft-model; kinds code,
#    chat, rewrite; on the 1.5B with the 0.5B as draft model where the 1.5B is in place, else on the 0.5B (drafting
#    for itself in draft-model: that method's path runs, its speedup means nothing);
# 5. gpu_check.json and gpu_check.md (and the logs) into $OUT when set, else build/gpu-check/out-BACKEND; written
#    after each stage, so a run cut short still leaves what it did.
#
# On CUDA the whole check keeps within --deadline (default 570 s, a device call's 10 minutes less a margin): tests
# and bench get what the build leaves. `--build-only --background` (device call 1) unpacks the source and wheels and
# starts the build in a session of its own, which goes on while later calls carry the model's parts
# (`--carry-only`: unpack, and show the build's progress); the final call waits for it. README's GPU section lists
# the calls. --backend vulkan is the dry form for this machine: lavapipe, few tokens, one prompt a kind, a quick
# subset of the tests.
#
# Options: --tests all|quick|none|'PYTEST ARGS' (cuda: all, vulkan: quick), --prompts FILE|SETS (cuda: the carried
# ones, vulkan: three short ones of its own), --model M, --draft-model D,
# --max-tokens N, --n-prompts N (a kind), --warmup-tokens N, --cost-repeats N, --deadline S (0: none), --out DIR,
# --home DIR (EESD_HOME of the check), --build-only [--background], --carry-only.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
T0=$(date +%s)
die() { echo "gpu_check: $*" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

BACKEND=cuda TESTS="" PROMPTS="" MODEL="" DRAFT="" MAXTOK="" NPROMPTS="" WARMUP="" COSTREP="" DEADLINE="" OUTDIR=${OUT:-} HOME_DIR=""
BUILD_ONLY="" BACKGROUND="" CARRY_ONLY=""
while [ $# -gt 0 ]; do
  opt=$1
  case "$opt" in
    -h|--help) usage; exit 0 ;;
    --build-only) BUILD_ONLY=1; shift; continue ;;
    --background) BACKGROUND=1; shift; continue ;;
    --carry-only) CARRY_ONLY=1; shift; continue ;;
  esac
  case "$opt" in
    --backend|--tests|--prompts|--model|--draft-model|--max-tokens|--n-prompts|--warmup-tokens|--cost-repeats|--deadline|--out|--home)
      [ $# -ge 2 ] || die "$opt takes a value (see --help)" ;;
    *) die "unknown option $opt (see --help)" ;;
  esac
  case "$opt" in
    --backend) BACKEND=$2 ;;
    --tests) TESTS=$2 ;;
    --prompts) PROMPTS=$2 ;;
    --model) MODEL=$2 ;;
    --draft-model) DRAFT=$2 ;;
    --max-tokens) MAXTOK=$2 ;;
    --n-prompts) NPROMPTS=$2 ;;
    --warmup-tokens) WARMUP=$2 ;;
    --cost-repeats) COSTREP=$2 ;;
    --deadline) DEADLINE=$2 ;;
    --out) OUTDIR=$2 ;;
    --home) HOME_DIR=$2 ;;
  esac
  shift 2
done
for n in "$MAXTOK" "$NPROMPTS" "$WARMUP" "$COSTREP" "$DEADLINE"; do
  [ -z "$n" ] || [[ "$n" =~ ^[0-9]+$ ]] || die "$n is not a whole number"
done
[ -z "$BACKGROUND" ] || [ -n "$BUILD_ONLY" ] || die "--background goes with --build-only"
# the quick subset: the engine's exactness note, no-offload CPU kernels, the KV check after rejected drafts, one drafter
QUICK='not_exact or no_layer_offloaded or stale_cell or (every_drafter and lookup)'
case "$BACKEND" in
  cuda) : "${TESTS:=all}" "${MAXTOK:=128}" "${NPROMPTS:=4}" "${WARMUP:=16}" "${COSTREP:=5}" "${DEADLINE:=570}" ;;
  vulkan) : "${TESTS:=quick}" "${MAXTOK:=8}" "${NPROMPTS:=1}" "${WARMUP:=0}" "${COSTREP:=1}" "${DEADLINE:=0}" ;;
  *) die "--backend takes cuda or vulkan, not $BACKEND" ;;
esac
GP=$ROOT/build/$([ "$BACKEND" = cuda ] && echo gpu-cuda || echo gpu-path)
PY=$GP/venv/bin/python
WORK=$ROOT/build/gpu-check/$BACKEND
OUTDIR=${OUTDIR:-$ROOT/build/gpu-check/out-$BACKEND}
mkdir -p "$WORK" "$OUTDIR"
CARRY=$ROOT/.gpu-carry
CARRIED=$ROOT/build/gpu-carry
if [ -z "$HOME_DIR" ]; then
  if [ -d "$CARRY" ]; then HOME_DIR=$ROOT/build/gpu-check/home; else HOME_DIR=${EESD_HOME:-$HOME/.cache/eesd-local}; fi
fi
export EESD_HOME=$HOME_DIR PYTHONUNBUFFERED=1
[ -d "$CARRIED/wheels" ] && export EESD_GPU_WHEELS=$CARRIED/wheels
SYS_PY=$(command -v python3 || echo .venv/bin/python)
left() { [ "$DEADLINE" -gt 0 ] && echo $(( DEADLINE - ($(date +%s) - T0) )) || echo 86400; }
progress() { grep -a -E "compiling|building|built in|error|Error" "$1" 2>/dev/null | tail -n 1 || true; }
build_running() {
  local pid; pid=$(cat "$WORK/build.pid" 2>/dev/null || true)
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -a -q gpu_path "/proc/$pid/cmdline" 2>/dev/null
}

# --- 1. what was carried ------------------------------------------------------------------------------
need=source,wheel,prompts,model
[ -n "$BUILD_ONLY" ] && need=source,wheel
[ -n "$CARRY_ONLY" ] && need=""
if [ -d "$CARRY" ]; then
  echo "==> carried files (.gpu-carry -> $CARRIED, models -> $EESD_HOME/models)"
  # the dry form keeps the carried source apart (build/llama-src holds the set-up's tree of the same name)
  src=(); [ "$BACKEND" = vulkan ] && src=(--src-root "$ROOT/build/gpu-check/llama-src")
  rc=0; "$SYS_PY" scripts/gpu_carry.py unpack --home "$EESD_HOME" --need "$need" "${src[@]}" || rc=$?
  if [ "$rc" = 3 ]; then
    die "not everything this step needs has been carried yet: carry the calls named above (README, GPU section)"
  fi
  [ "$rc" = 0 ] || die "the carried files did not unpack (exit $rc)"
elif [ "$BACKEND" = cuda ]; then
  echo "gpu_check: no .gpu-carry here: building from build/llama-src and running on the models in $EESD_HOME" >&2
fi
if [ -n "$CARRY_ONLY" ]; then
  if build_running; then echo "  background build: running: $(progress "$WORK/build.log")"
  elif [ -f "$WORK/build.log" ]; then echo "  background build: ended: $(progress "$WORK/build.log")"; fi
  exit 0
fi

# --- 2. the build -------------------------------------------------------------------------------------
if [ -n "$BUILD_ONLY" ]; then  # what the machine has, in a few lines (what a later session would want to know)
  echo "==> the machine: $(nproc) cores; $("$SYS_PY" --version 2>&1); $(cmake --version 2>/dev/null | head -n 1 || echo no cmake);" \
    "$(gcc --version 2>/dev/null | head -n 1 || echo no gcc); ccache: $(command -v ccache || echo none)"
  [ "$BACKEND" = cuda ] && echo "  $(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>&1 | head -n 1);" \
    "$( (command -v nvcc >/dev/null && nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>&1 | tail -n 1)"
fi
if [ -n "$BACKGROUND" ]; then
  if build_running; then echo "  a build is already running (pid $(cat "$WORK/build.pid"))"; exit 0; fi
  # a session of its own: the device keeps it running after this call returns (until the machine goes back)
  setsid nohup bash scripts/gpu_path.sh --backend "$BACKEND" --build-only >"$WORK/build.log" 2>&1 </dev/null &
  echo $! >"$WORK/build.pid"
  date +%s >"$WORK/build.start"
  sleep 2
  if ! build_running; then  # done already (a kept build), or failed at once
    cat "$WORK/build.log"
    grep -q "built in" "$WORK/build.log" && exit 0
    die "the background build stopped at once"
  fi
  echo "==> building in the background (pid $(cat "$WORK/build.pid"), log $WORK/build.log); its first lines:"
  head -n 8 "$WORK/build.log"
  exit 0
fi
if build_running; then
  echo "==> waiting for the background build (log $WORK/build.log)"
  n=0
  while build_running; do
    [ "$(left)" -gt 60 ] || die "the background build is still running and the deadline is near: $(progress "$WORK/build.log")"
    sleep 5; n=$((n + 1)); [ $((n % 6)) = 0 ] && echo "  $(progress "$WORK/build.log")"
  done
  BG_S=$(( $(stat -c %Y "$WORK/build.log") - $(cat "$WORK/build.start" 2>/dev/null || stat -c %Y "$WORK/build.pid") ))
  echo "  the background build ended after $BG_S s: $(progress "$WORK/build.log")"
fi
rm -f "$WORK/build.pid"

STAGES=$WORK/stages.jsonl
: >"$STAGES"
stage() { local note=${4//[\"\\]/ }; printf '{"stage": "%s", "status": "%s", "seconds": %s, "note": "%s"}\n' "$1" "$2" "$3" "${note//[$'\t\r\n']/ }" >>"$STAGES"; }
# timeout sends SIGINT first (pytest and the bench then write what they have): 124 after it, 137 after the kill
status_of() { case "$1" in 0) echo ok ;; 124|137) echo "timed out" ;; *) echo "failed (exit $1)" ;; esac; }
report() {
  EESD_CHECK_BACKEND=$BACKEND EESD_CHECK_WORK=$WORK EESD_CHECK_OUT=$OUTDIR EESD_CHECK_T0=$T0 EESD_CHECK_PY=$PY \
  EESD_CHECK_MODEL=${MODEL:-} EESD_CHECK_DRAFT=${DRAFT:-} EESD_CHECK_ARGS="$ARGS_LINE" "$SYS_PY" - <<'PYEOF' || echo "gpu_check: the report could not be written" >&2
import json, os, platform, re, shutil, subprocess, time
import xml.etree.ElementTree as ET
from pathlib import Path

E = os.environ
work, out = Path(E["EESD_CHECK_WORK"]), Path(E["EESD_CHECK_OUT"])
backend = E["EESD_CHECK_BACKEND"]


def sh(*cmd):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return r.stdout.strip() if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def tail(p, n=40):
    try:
        return "".join(Path(p).read_text(errors="replace").splitlines(True)[-n:])
    except OSError:
        return None


stages = [json.loads(line) for line in (work / "stages.jsonl").read_text().splitlines() if line.strip()]
gpu = sh("nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader")
if backend == "vulkan":
    gpu = (sh("sh", "-c", "vulkaninfo --summary 2>/dev/null | awk -F'= ' '/deviceName/{print $2}'") or "").replace("\n", ", ") or None
cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else platform.processor()
build_info = sh(E["EESD_CHECK_PY"], "-c", "import importlib.util as u, os; print(open(os.path.join(os.path.dirname("
                "u.find_spec('llama_cpp').origin), 'lib', 'eesd-build.json')).read())")
res = {
    "backend": backend, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": round(time.time() - int(E["EESD_CHECK_T0"])),
    "args": E["EESD_CHECK_ARGS"],
    "machine": {"gpu": gpu, "nvcc": ((sh("nvcc", "--version") or "").splitlines()[-1:] or None) if backend == "cuda" else None, "cpu": cpu, "cores": os.cpu_count(),
                "python": sh(E["EESD_CHECK_PY"], "-c", "import sys; print(sys.version.split()[0])"), "system": platform.platform()},
    "commit": sh("git", "rev-parse", "--short", "HEAD"), "dirty_files": len((sh("git", "status", "--porcelain") or "").splitlines()) or None,
    "build": json.loads(build_info) if build_info else None,
    "model": E.get("EESD_CHECK_MODEL") or None, "draft_model": E.get("EESD_CHECK_DRAFT") or None,
    "stages": stages, "tests": None, "bench": None,
}
xml = work / "tests.xml"
if xml.is_file():
    cases = []
    for tc in ET.parse(xml).getroot().iter("testcase"):
        outcome, msg = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome, msg = {"failure": "failed"}.get(tag, tag), (el.get("message") or "")[:600]
        cases.append({"name": tc.get("name"), "outcome": outcome, "seconds": round(float(tc.get("time") or 0), 1), "message": msg})
    counts = {}
    for c in cases:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    res["tests"] = {"counts": counts, "cases": cases}
vj = work / "verdict.json"
res["auto_verdict"] = json.loads(vj.read_text()) if vj.is_file() and vj.stat().st_size else None
bj = work / "bench.json"
if bj.is_file():
    res["bench"] = json.loads(bj.read_text())
(out / "gpu_check.json").write_text(json.dumps(res, indent=1) + "\n")

md = [f"# GPU check ({backend}): {gpu or 'no device named'}, {res['date'][:10]}", ""]
md.append(f"commit {res['commit'] or '?'}{' (+%d changed files)' % res['dirty_files'] if res['dirty_files'] else ''}; "
          f"{res['machine']['cpu']}, {res['machine']['cores']} cores; Python {res['machine']['python']}; "
          f"llama.cpp flags {' '.join((res['build'] or {}).get('cmake_args', [])) or '?'}"
          + (f"; {res['machine']['nvcc'][0]}" if res["machine"]["nvcc"] else ""))
md.append(f"model {res['model']}, draft model {res['draft_model']}; `{res['args']}`")
md += ["", "| stage | status | seconds | note |", "| --- | --- | ---: | --- |"]
md += [f"| {s['stage']} | {s['status']} | {s['seconds']} | {s['note']} |" for s in stages]
if res["tests"]:
    md += ["", "## Tests (tests/test_gpu_path.py, every layer offloaded)", "",
           ", ".join(f"{v} {k}" for k, v in res["tests"]["counts"].items()), "", "| test | outcome | s |", "| --- | --- | ---: |"]
    md += [f"| {c['name']} | {c['outcome']} | {c['seconds']} |" for c in res["tests"]["cases"]]
    for c in res["tests"]["cases"]:
        if c["message"] and c["outcome"] != "passed":
            md += ["", f"{c['name']}: {c['outcome']}", "```", c["message"], "```"]
b = res["bench"]
if b:
    run = b.get("run", {})
    md += ["", f"## Bench ({run.get('max_tokens')} tokens, {run.get('n_prompts_per_category')} prompt(s) a kind, greedy, "
           f"n_gpu_layers {b.get('machine', {}).get('n_gpu_layers')}{'' if run.get('complete', True) else '; INCOMPLETE'})", "",
           "| method | kind | tok/s | speedup | projected mem-bound speedup | tau | acceptance | identical to none |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]

    def f(v, p=2):
        return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))
    for meth, cats in b.get("methods", {}).items():
        for cat, r in cats.items():
            md.append(f"| {meth} | {cat} | {f(r.get('tokens_per_s'), 1)} | {f(r.get('speedup'))} | "
                      f"{f(r.get('projected_memory_bound_speedup'))} | {f(r.get('tau'))} | {f(r.get('acceptance_rate'))} | "
                      f"{r.get('identical')}/{r.get('n_runs')}{'' if r.get('lossless', True) else ' (differs)'} |")
    bc = b.get("batch_costs") or {}
    if bc.get("B"):
        md += ["", "B(k), a batch of k tokens over one token: " + ", ".join(f"B({k})={v}" for k, v in bc["B"].items())
               + f"; t(1) = {bc.get('t1_ms')} ms"]
    v = res["auto_verdict"]
    if v:
        prof = v.get("profile") or {}
        md += ["", "auto's exit head: " + (v.get("verdict") or "no verdict: no cost profile is kept for this placement "
               "(auto measures one at its first load and keeps it only when B(k) looks like one machine's)")
               + (f"; the kept profile: t(1) {prof.get('t1_ms', 0):.2f} ms, " + ", ".join(
                   f"B({k})={x}" for k, x in prof.get("bk", {}).items() if k != "1") if prof else "")]
    if b.get("failures"):
        md += ["", "failures: " + json.dumps(b["failures"])[:2000]]
    if res["draft_model"] and res["draft_model"] == res["model"]:
        md += ["", "draft-model: the model drafts for itself (the 1.5B was not carried): its path runs, its speedup means nothing."]
bmd = work / "bench.md"
if bmd.is_file():
    md += ["", "## The bench's own tables", "", bmd.read_text()]
(out / "gpu_check.md").write_text("\n".join(md) + "\n")
for name in ("build.log", "tests.log", "bench.log"):
    if (work / name).is_file() and out.resolve() != work.resolve():
        shutil.copyfile(work / name, out / name)
PYEOF
}
ARGS_LINE="gpu_check.sh --backend $BACKEND --tests '$TESTS' --max-tokens $MAXTOK --n-prompts $NPROMPTS --warmup-tokens $WARMUP --cost-repeats $COSTREP --deadline $DEADLINE"

echo "==> build: scripts/gpu_path.sh --backend $BACKEND --build-only"
[ -n "${BG_S:-}" ] || : >"$WORK/build.log"  # after a background build, its log goes on
tb=$(date +%s); rc=0
bash scripts/gpu_path.sh --backend "$BACKEND" --build-only >>"$WORK/build.log" 2>&1 || rc=$?
tail -n 3 "$WORK/build.log"
stage build "$([ $rc = 0 ] && echo ok || echo "failed (exit $rc)")" $(( $(date +%s) - tb )) "${BG_S:+background build $BG_S s; }$(progress "$WORK/build.log" | xargs)"
if [ $rc != 0 ]; then report; die "the build failed (its log: $WORK/build.log)"; fi
if [ "$BACKEND" = vulkan ] && [ -d "$ROOT/build/gpu-check/llama-src" ]; then
  # the dry form builds nothing from the carried source (the gpu-path tier's kept wheel is of the full one): it
  # configures it, so a file the trim dropped and a CMakeLists still reads shows here, not on the GPU machine
  tree=$(ls -d "$ROOT"/build/gpu-check/llama-src/*/ | head -n 1)
  echo "==> the carried source: cmake configure of ${tree#"$ROOT"/}"
  tc=$(date +%s); rc=0; rm -rf "$WORK/configure"
  cmake -S "$tree" -B "$WORK/configure" -G Ninja -DGGML_VULKAN=on -DGGML_RPC=ON -DLLAVA_BUILD=OFF -DGGML_NATIVE=ON \
    >"$WORK/configure.log" 2>&1 || rc=$?
  [ $rc = 0 ] || tail -n 20 "$WORK/configure.log"
  stage "carried source" "$(status_of $rc)" $(( $(date +%s) - tc )) "cmake configure of the trimmed tree (no compile)"
fi
[ -n "$BUILD_ONLY" ] && { report; exit 0; }

# the model: the 1.5B with the 0.5B as draft model where the 1.5B is in place, else the 0.5B
if [ -z "$MODEL" ]; then
  if "$PY" -c "from eesd_local.llama import catalog as c; raise SystemExit(0 if c.is_present(c.get_spec('qwen2.5-coder-1.5b-instruct')) else 1)" 2>/dev/null; then
    MODEL=qwen2.5-coder-1.5b-instruct
  else
    MODEL=qwen2.5-coder-0.5b-instruct
  fi
fi
DRAFT=${DRAFT:-qwen2.5-coder-0.5b-instruct}
echo "  model $MODEL, draft model $DRAFT, EESD_HOME=$EESD_HOME"

# --- 3. the tests -------------------------------------------------------------------------------------
BENCH_MIN=$([ "$BACKEND" = cuda ] && echo 200 || echo 0)
if [ "$TESTS" = none ]; then
  stage tests skipped 0 "--tests none"
else
  case "$TESTS" in all) targs=() ;; quick) targs=(-k "$QUICK") ;; *) read -r -a targs <<<"$TESTS" ;; esac
  budget=$(( $(left) - BENCH_MIN - 30 ))
  if [ "$budget" -lt 30 ]; then
    stage tests skipped 0 "no time left before the bench"
  else
    echo "==> tests: tests/test_gpu_path.py ${targs[*]} (at most $budget s; log $WORK/tests.log)"
    tt=$(date +%s); rc=0
    rm -f "$WORK/tests.xml"
    timeout -s INT -k 30 "$budget" bash scripts/gpu_path.sh --backend "$BACKEND" -p no:cacheprovider -rA --durations=0 \
      --junitxml="$WORK/tests.xml" "${targs[@]}" >"$WORK/tests.log" 2>&1 || rc=$?
    tail -n 4 "$WORK/tests.log"
    note=$(grep -a -E "(passed|failed|error|deselected).* in [0-9.]+s" "$WORK/tests.log" | tail -n 1 | tr -d '=' | xargs || true)
    stage tests "$(status_of $rc)" $(( $(date +%s) - tt )) "$note"
  fi
fi
report

# --- 4. the bench -------------------------------------------------------------------------------------
if [ -z "$PROMPTS" ] && [ "$BACKEND" = vulkan ]; then
  # lavapipe prefills about two tokens a second on 2 cores: the real prompts (200-500 tokens) would take an hour, so
  # the dry form asks one short request of each kind (the path runs the same; the numbers mean nothing there)
  PROMPTS=$WORK/short-prompts.jsonl
  cat >"$PROMPTS" <<'EOF'
{"id": "short-code", "category": "code", "messages": [{"role": "user", "content": "Complete this Python function:\n```python\ndef add(a, b):\n```"}]}
{"id": "short-chat", "category": "chat", "messages": [{"role": "user", "content": "What is a Python list?"}]}
{"id": "short-rewrite", "category": "rewrite", "messages": [{"role": "user", "content": "Rename x to y:\n```python\ndef f(x):\n    return x + 1\n```"}]}
EOF
fi
[ -n "$PROMPTS" ] || PROMPTS=$CARRIED/bench-prompts.jsonl
[ -f "$PROMPTS" ] || PROMPTS=code,chat,rewrite  # the built-in sets (they need the dev extras' data packages)
budget=$(( $(left) - 25 ))
if [ "$budget" -lt 30 ]; then
  stage bench skipped 0 "no time left"
else
  echo "==> bench: none, auto, lookup, eesd, draft-model on $MODEL (at most $budget s; log $WORK/bench.log)"
  tt=$(date +%s); rc=0
  rm -f "$WORK/bench.json" "$WORK/bench.md"
  timeout -s INT -k 30 "$budget" "$PY" -m eesd_local.cli bench --model "$MODEL" --draft-model "$DRAFT" --prompts "$PROMPTS" \
    --methods none,auto,lookup,eesd,draft-model --n-prompts "$NPROMPTS" --max-tokens "$MAXTOK" --warmup-tokens "$WARMUP" \
    --cost-repeats "$COSTREP" --n-gpu-layers -1 --json "$WORK/bench.json" --markdown "$WORK/bench.md" --force \
    >"$WORK/bench.log" 2>&1 || rc=$?
  tail -n 5 "$WORK/bench.log"
  stage bench "$(status_of $rc)" $(( $(date +%s) - tt )) "$NPROMPTS prompt(s) a kind of ${PROMPTS#"$ROOT"/}, $MAXTOK tokens"
fi
# auto's verdict on the exit head, read from the cost profile kept for this placement (the bench's auto measured it)
"$PY" - "$MODEL" >"$WORK/verdict.json" 2>"$WORK/verdict.log" <<'PYEOF' || echo "  (auto's verdict could not be read: $WORK/verdict.log)"
import json
import sys

from eesd_local.llama import costs
from eesd_local.llama.catalog import resolve_model
from eesd_local.speculative.drafters import auto_head, placement
from eesd_local.speculative.engine import EngineConfig

cfg = EngineConfig(model=sys.argv[1], drafter="auto", n_gpu_layers=-1)
path = resolve_model(sys.argv[1])
prof, why = costs.cached(costs.fingerprint(path, **placement(cfg)))
head, verdict = auto_head(cfg, path)
print(json.dumps({"profile": prof.to_json() if prof else None, "why_none": why or None, "head": str(head) if head else None,
                  "verdict": verdict.note if verdict else None, "pays": verdict.pays if verdict else None}))
PYEOF
report
echo "==> gpu_check: $(( $(date +%s) - T0 )) s; $OUTDIR/gpu_check.json and gpu_check.md"
sed -n '1,/^## The bench/p' "$OUTDIR/gpu_check.md" | head -n 60
grep -q '"status": "ok"' "$STAGES" && ! grep -q -E '"status": "(failed|timed out)' "$STAGES"
