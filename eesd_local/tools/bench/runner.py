"""The interleaved benchmark loop.

Every method is loaded into this one process and warmed up; then each prompt goes
through method A, B, C... before the next prompt starts, so machine noise hits all
methods alike. ``none`` (plain decoding) is always one of them: its output is the
reference every other method's greedy output is compared with, token for token. Where a
method claims exactness (runtime.exactness) any difference is a failure; elsewhere each one
is measured as the gap of the target's two best logits there (a near tie or not). The order of the
methods rotates from prompt to prompt. Ctrl-C ends the loop; the prompts that every
method finished stay in the results.
"""

from __future__ import annotations

import datetime
import os
import platform
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import TypeVar

import numpy as np

from eesd_local.base.defaults import BENCH_MAX_TOKENS, BENCH_SEED, DRAFT_MAX, TEMPERATURE, TOP_K, TOP_P
from eesd_local.base.errors import EesdError
from eesd_local.llama.ggmlapi import offload_device_names
from eesd_local.llama.runtime import Context, ContextParams, Model, default_threads
from eesd_local.speculative import lossless
from eesd_local.speculative.drafters import resolve_head
from eesd_local.speculative.engine import Engine, EngineConfig
from eesd_local.tools import heads
from eesd_local.tools.bench.methods import (
    EngineMethod,
    Method,
    MethodSpec,
    PeerMethod,
    Sampling,
    Turn,
    default_draft_model,
    parse_methods,
)
from eesd_local.tools.bench.prompts import PromptItem, load_prompts, prediction_for
from eesd_local.tools.bench.servers import HttpPeer, LlamaServerPeer, PeerFailed, check_servers, stop_all
from eesd_local.tools.prepare import prepare
from eesd_local.tools.registry import resolve_model
from eesd_local.tools.weights import COST_KS, batch_costs

# progress(done, total, what): done == 0 while methods load and warm up
_M = TypeVar("_M")
Progress = Callable[[int, int, str], None]
WARMUP_MESSAGE = "Write a Python function that returns the n-th Fibonacci number."


@dataclass
class BenchConfig:
    model: str
    prompts: str
    methods: str = "none,eesd,lookup"
    categories: list[str] | None = None
    n_prompts: int = 20  # per category, evenly spaced over the set; 0: all
    max_tokens: int = BENCH_MAX_TOKENS
    temperature: float = TEMPERATURE
    top_k: int = TOP_K
    top_p: float = TOP_P
    seed: int = BENCH_SEED
    repeats: int = 1
    warmup_tokens: int = 16  # one generation per method before measuring; 0: none
    head: str | None = None
    draft_model: str | None = None
    controller: str | None = None
    draft_max: int = DRAFT_MAX
    n_ctx: int = 4096
    n_gpu_layers: int = 0
    n_threads: int | None = None
    cost_repeats: int = 5  # decodes per batch size for the model's B(k) (weights.COST_KS); 0: skip
    rpc: tuple[str, ...] = ()  # llama.cpp RPC servers holding the offloaded layers of every method


@dataclass
class Mismatch:
    item: str
    repeat: int
    turn: int
    index: int  # first generated position (within the turn) where the output differs from none
    plain_token: int
    other_token: int
    gap: float  # none's logit of its token minus that of the other's token
    near_tie: bool


@dataclass
class Run:
    """One prompt through one method (every turn of a multi-turn item)."""

    method: str
    item: str
    category: str
    repeat: int
    prompts: list[list[int]]  # prompt tokens of each turn
    turns: list[Turn]
    mismatch: Mismatch | None = None
    same_as_plain: bool | None = None  # a peer's output equals its own plain reference's (llama-server's, say)


@dataclass
class MethodInfo:
    name: str
    drafter: str
    controller: str
    model_bytes: int
    rss_growth_bytes: int | None  # process RSS added by loading and warming this method
    # per model source: bytes its draft step reads over a target step's (the memory-bound projection)
    draft_share: dict[str, float] = field(default_factory=dict)
    trunk_share: float | None = None  # shared trunk: a trunk step without logits over a target step (timed)
    exact: bool = False  # claims greedy output byte-identical to plain decoding
    peer: bool = False  # another program (compared with ours, never claimed exact)


@dataclass
class Results:
    config: BenchConfig
    model_path: str
    started: str
    n_threads: int
    methods: dict[str, MethodInfo] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    n_planned: int = 0
    complete: bool = False
    exit_code: int = 0  # an interrupted run's: 130 for Ctrl-C, 143 for SIGTERM (base.interrupts.Terminated)
    peak_rss_bytes: int | None = None
    categories: list[str] = field(default_factory=list)
    batch_costs: dict | None = None  # weights.CostTable.to_json() of the model, measured before the prompts
    failures: dict[str, str] = field(default_factory=dict)  # method -> why it stopped (or never started): one line


# --- memory ---------------------------------------------------------------------------


def _proc_status(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes() -> int | None:
    return _proc_status("VmRSS")


def peak_rss_bytes() -> int | None:
    """The process's resident-memory high-water mark."""
    peak = _proc_status("VmHWM")
    if peak is None:
        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = ru if sys.platform == "darwin" else ru * 1024  # bytes on macOS, KiB on Linux
    return peak


# --- the loop ---------------------------------------------------------------------------


def plan_methods(cfg: BenchConfig, model_path: Path) -> tuple[list[MethodSpec], str | None, str | None]:
    """The method specs, the exit head and the draft model they need; fails before anything loads."""
    specs = parse_methods(cfg.methods, cfg.controller)
    check_servers(specs)
    head: str | None = None
    draft_model = cfg.draft_model
    if any(s.server_spec == "draft-simple" for s in specs) and not draft_model:
        draft_model = default_draft_model(model_path)  # none: that peer's row says it needs one
    if any(s.drafter == "draft-model" for s in specs) and not draft_model:
        draft_model = default_draft_model(model_path)
        if draft_model is None:
            raise EesdError(f"the draft-model method needs a draft model for {model_path.name}",
                            hint="pass --draft-model M (a smaller model of the same vocabulary)")
    if any(s.needs_head for s in specs):
        found = resolve_head(cfg.head) if cfg.head else heads.find_head(model_path)
        head = str(found) if found else None
        if head is None and (any(s.drafter == "eesd" for s in specs) or not draft_model):
            raise EesdError(f"no exit head is known for {model_path.name}: the eesd methods need one",
                            hint="pass --head HEAD.gguf, or drop eesd and hierarchical from --methods")
    return specs, head, draft_model


# the text a shared trunk's step is timed after (measure_trunk_share)
_TRUNK_TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 3


def open_method(spec: MethodSpec, cfg: BenchConfig, model_path: Path, head: str | None, draft_model: str | None,
                ref: EngineMethod | None) -> Method:
    threads = cfg.n_threads or default_threads()
    if spec.drafter in ("server", "http"):
        dm = resolve_model(draft_model) if draft_model else None
        if spec.drafter == "server":
            return LlamaServerPeer(spec, model_path, n_ctx=cfg.n_ctx, n_threads=threads, n_gpu_layers=cfg.n_gpu_layers,
                                   draft_model=dm, rpc=cfg.rpc)
        return HttpPeer(spec, model_path, n_ctx=cfg.n_ctx, n_threads=threads, n_gpu_layers=cfg.n_gpu_layers,
                        draft_model=dm, draft_max=cfg.draft_max, rpc=cfg.rpc)
    if spec.is_peer:
        assert ref is not None
        return PeerMethod(spec, model_path, n_ctx=cfg.n_ctx, n_threads=threads, n_gpu_layers=cfg.n_gpu_layers,
                          is_eog=ref.engine.model.is_eog)
    kw: dict = dict(drafter=spec.drafter, controller=spec.controller, draft_max=cfg.draft_max, n_ctx=cfg.n_ctx,
                    n_gpu_layers=cfg.n_gpu_layers, n_threads=cfg.n_threads, shared_trunk=spec.shared_trunk, rpc=cfg.rpc)
    if spec.drafter in ("eesd", "hierarchical"):
        kw["head"] = head
    if spec.drafter == "auto" and cfg.head:  # else auto finds the model's shipped head itself, if any
        kw["head"] = cfg.head
    if spec.drafter == "draft-model" or (spec.drafter == "hierarchical" and head is None):
        kw["draft_model"] = draft_model
    config = EngineConfig(model=str(model_path), **kw)
    prepare(config)
    return EngineMethod(spec, Engine(config))


def _messages(pairs: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in pairs]


def run_item(method: Method, item: PromptItem, ref: EngineMethod, s: Sampling, n_ctx: int, repeat: int) -> Run:
    """Generate ``item`` with ``method``; a multi-turn item keeps the method's own answers between turns."""
    eng = ref.engine
    run = Run(method.spec.name, item.id, item.category, repeat, [], [])
    history: list[tuple[str, str]] = []
    for turn_no in range(item.n_turns):
        if item.prompt is not None:
            prompt = eng.tokenize(item.prompt)
        elif item.messages:
            prompt = eng.tokenize(eng.apply_chat_template(_messages(item.messages)))
        else:
            history.append(("user", item.turns[turn_no]))
            prompt = eng.tokenize(eng.apply_chat_template(_messages(history)))
        need = len(prompt) + s.max_tokens + 2 * eng.config.draft_max + 2
        if need > n_ctx:
            raise EesdError(f"prompt {item.id!r} (turn {turn_no + 1}) has {len(prompt)} tokens: with --max-tokens "
                            f"{s.max_tokens} it does not fit into the context of {n_ctx}", hint="pass a larger --n-ctx")
        # plain baselines (in process and over HTTP) decode without the prediction: the speedup is over plain decoding
        # (a later turn predicts the method's own previous answer: the turn before this user turn)
        previous = next((c for r, c in reversed(history) if r == "assistant"), "")
        predicted = prediction_for(item, turn_no, previous)
        turn = method.generate(prompt, s, prediction=None if method.spec.plain else predicted)
        run.prompts.append(prompt)
        run.turns.append(turn)
        if item.turns:
            history.append(("assistant", turn.text))
    return run


def certify(ref: EngineMethod, plain: Run, other: Run, s: Sampling, n_ctx: int) -> Mismatch | None:
    """The first divergence of ``other`` from plain decoding, with the gap of the target's logits there."""
    model = ref.engine.model
    for t, (pa, pb, ta, tb) in enumerate(zip(plain.prompts, other.prompts, plain.turns, other.turns, strict=False)):
        if pa != pb or ta.tokens == tb.tokens:
            continue  # (prompts differ only after an earlier turn diverged, which was returned)
        div = lossless.compare(model, pa, ta.tokens, tb.tokens, n_ctx=n_ctx)
        if div is None:
            div = _stop_divergence(model, pa, ta.tokens, tb.tokens, s.max_tokens, n_ctx)
        if div is not None:
            return Mismatch(other.item, other.repeat, t, div.index, div.plain_token, div.other_token, div.gap, div.near_tie)
    return None


def _stop_divergence(model: Model, prompt: list[int], plain: list[int], other: list[int], max_tokens: int,
                     n_ctx: int) -> lossless.Divergence | None:
    """One output is a prefix of the other because it stopped at an end-of-generation token:
    the divergence is that stop, measured on the plain path's logits like any other."""
    i = min(len(plain), len(other))
    if max(len(plain), len(other)) <= i or i >= max_tokens:
        return None
    ctx = Context(model, ContextParams(n_ctx=max(n_ctx, len(prompt) + i + 8)))
    try:
        ctx.decode(prompt)
        for tok in plain[:i]:
            ctx.decode([tok])
        row = ctx.logits().astype(np.float64)
    finally:
        ctx.close()
    eog = _eog_tokens(model)
    stop = int(eog[int(np.argmax(row[eog]))])  # the end-of-generation token the model likes best here
    a, b = (stop, other[i]) if len(plain) == i else (plain[i], stop)
    gap = float(row[a] - row[b])
    return lossless.Divergence(i, a, b, gap, abs(gap) < lossless.NEAR_TIE)


def same_output(run: Run, plain: Run) -> bool:
    """A run's answers equal another's (a peer's plain reference's, say): by tokens where both have them, else by text."""
    for a, b in zip(run.turns, plain.turns, strict=False):
        if (a.tokens or b.tokens) and a.count is None and b.count is None:
            if a.tokens != b.tokens:
                return False
        elif a.text != b.text:
            return False
    return len(run.turns) == len(plain.turns)


_EOG: dict[str, np.ndarray] = {}


def _eog_tokens(model: Model) -> np.ndarray:
    key = str(model.path)
    if key not in _EOG:
        _EOG[key] = np.array([t for t in range(model.n_vocab) if model.is_eog(t)] or [model.eos], dtype=np.int64)
    return _EOG[key]


def _warm_up(method: Method, ref: EngineMethod, tokens: int) -> None:
    eng = ref.engine
    try:
        prompt = eng.tokenize(eng.apply_chat_template([{"role": "user", "content": WARMUP_MESSAGE}]))
    except EesdError:
        prompt = eng.tokenize("def fibonacci(n):")
    method.generate(prompt, Sampling(max_tokens=tokens))


def _drop(res: Results, methods: list[Method], m: Method, exc: PeerFailed) -> None:
    """A peer that failed (to warm up, to restart, to answer): its row says why; the rest of the run goes on."""
    res.failures[m.spec.name] = str(exc)
    methods.remove(m)
    m.close()


def run_order(methods: list[_M], rep: int, k: int) -> list[_M]:
    """The order the methods run prompt ``k`` in, in pass ``rep``: rotated from prompt to prompt and from pass to
    pass, and backwards every other pass, so that no method always runs first, last or right after the same other
    one (each prompt's median pass is then not one place's; a rotation by the prompt's number over the whole run
    gave every prompt the same order in every pass when the prompts were a multiple of the methods)."""
    shift = (rep + k) % len(methods)
    order = methods[shift:] + methods[:shift]
    return order[::-1] if rep % 2 else order


def run_bench(cfg: BenchConfig, progress: Progress | None = None) -> Results:
    """Load every method, warm it up, then run prompts x methods interleaved. Ctrl-C ends
    the loop early; the results then hold what was measured (``complete`` is False)."""
    if cfg.repeats < 1:
        raise EesdError(f"--repeats must be at least 1, got {cfg.repeats}")
    if cfg.max_tokens < 1:
        raise EesdError(f"--max-tokens must be at least 1, got {cfg.max_tokens}")
    items = load_prompts(cfg.prompts, categories=cfg.categories, n_per_category=cfg.n_prompts)
    model_path = resolve_model(cfg.model)
    specs, head, draft_model = plan_methods(cfg, model_path)
    report = progress or (lambda done, total, what: None)
    res = Results(cfg, str(model_path), datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                  cfg.n_threads or default_threads())
    res.categories = list(dict.fromkeys(it.category for it in items))
    res.n_planned = cfg.repeats * len(items) * len(specs)
    methods: list[Method] = []
    try:
        ref: EngineMethod | None = None
        for spec in specs:
            report(0, res.n_planned, f"loading {spec.name}")
            rss0 = rss_bytes()
            try:
                m = open_method(spec, cfg, model_path, head, draft_model, ref)
            except PeerFailed as exc:  # that peer's row says why; the rest of the run goes on
                res.failures[spec.name] = str(exc)
                continue
            methods.append(m)
            if ref is None:
                assert isinstance(m, EngineMethod)
                ref = m
            if cfg.warmup_tokens > 0:
                report(0, res.n_planned, f"warming up {spec.name}")
                try:
                    _warm_up(m, ref, cfg.warmup_tokens)
                except PeerFailed as exc:
                    _drop(res, methods, m, exc)
                    continue
            rss1 = rss_bytes()
            growth = rss1 - rss0 if rss0 is not None and rss1 is not None else None
            if isinstance(m, EngineMethod) and items:
                m.measure_trunk(ref.engine.tokenize(_TRUNK_TEXT))
            res.methods[spec.name] = MethodInfo(spec.name, m.drafter, m.controller, m.model_bytes, growth,
                                                dict(getattr(m, "draft_share", {})), getattr(m, "trunk_share", None),
                                                m.exact, spec.is_peer)
        assert ref is not None
        if cfg.cost_repeats > 0:
            report(0, res.n_planned, "measuring B(k)")
            table = batch_costs([model_path], COST_KS, repeats=cfg.cost_repeats, n_threads=res.n_threads,
                                n_gpu_layers=cfg.n_gpu_layers, rpc=cfg.rpc)[0]
            res.batch_costs = table.to_json()
        done = 0
        for rep in range(cfg.repeats):
            # a repeat measures the same requests again, not answers or prompts recalled from the pass before: our
            # engines forget them, a server is started anew (its caches and n-gram pools go with the old process)
            for m in list(methods):
                if isinstance(m, EngineMethod):
                    m.fresh()
                elif rep and hasattr(m, "fresh"):
                    report(done, res.n_planned, f"restarting {m.spec.name}")
                    try:
                        m.fresh()
                        if cfg.warmup_tokens > 0:
                            _warm_up(m, ref, cfg.warmup_tokens)
                    except PeerFailed as exc:
                        _drop(res, methods, m, exc)
            for k, item in enumerate(items):
                seed = None if cfg.temperature == 0 else cfg.seed + 100_003 * rep + k
                s = Sampling(cfg.max_tokens, cfg.temperature, cfg.top_k, cfg.top_p, seed)
                runs: dict[str, Run] = {}
                for m in run_order(methods, rep, k):
                    report(done, res.n_planned, f"{m.spec.name} · {item.category}/{item.id}")
                    try:
                        runs[m.spec.name] = run_item(m, item, ref, s, cfg.n_ctx, rep)
                    except PeerFailed as exc:  # a peer that died or answered an error: its row ends here
                        _drop(res, methods, m, exc)
                    done += 1
                plain = runs["none"]
                for m in methods:  # a prompt counts once every method has run it
                    run = runs[m.spec.name]
                    fam = runs.get(m.spec.family)
                    if run is not plain and cfg.temperature == 0 and not m.spec.is_peer:
                        run.mismatch = certify(ref, plain, run, s, cfg.n_ctx)
                    elif fam is not None and cfg.temperature == 0:
                        run.same_as_plain = same_output(run, fam)
                    res.runs.append(run)
                report(done, res.n_planned, f"{item.category}/{item.id} done")
        res.complete = True
    except KeyboardInterrupt as exc:
        res.complete = False
        res.exit_code = getattr(exc, "exit_code", 130)
    finally:
        res.peak_rss_bytes = peak_rss_bytes()
        for m in reversed(methods):
            m.close()
        stop_all()  # whatever server a failed start or Ctrl-C left behind
    return res


def machine_info(cfg: BenchConfig, n_threads: int) -> dict:
    """Cores, CPU, GPU (when layers are offloaded) and the library versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    if cfg.n_gpu_layers:
        gpu = _gpu_name()
    try:
        lcp = version("llama-cpp-python")
    except Exception:
        lcp = None
    return {"cores": os.cpu_count(), "cpu": cpu, "gpu": gpu, "n_gpu_layers": cfg.n_gpu_layers, "threads": n_threads,
            "system": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "llama_cpp_python": lcp}


def _gpu_name() -> str | None:
    # the devices llama.cpp offloads to, as it names them (Vulkan0 (llvmpipe ...), CUDA0 (NVIDIA H200), Metal ...)
    names = offload_device_names()
    if names:
        return ", ".join(names)
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=10)
            return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            return None
    return "Metal" if sys.platform == "darwin" else "GPU offload (name unknown)"
