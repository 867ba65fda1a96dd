"""Synthetic speculative rounds to measure draft-length controllers without a model.

A *process* says, for draft position i of a round, the drafter's confidence c_i and the
chance p_i that the target accepts the token given that tokens before it were. A
*cost profile* says what a round costs: d per drafted token and V(b) for the target's
decode of b = k+1 tokens, in units of one plain target token (t_token seconds).

The controller sees only what the engine gives it (confidences, the accepted count,
noisy draft and verify times). Tokens are counted by their expectation given the
round's draft, sum_{i=0..k} prod_{m<=i} p_m, an unbiased and far less noisy measure
than the sampled count (which the controller still gets). Throughput = tokens / time.

Reported: throughput relative to the best fixed k in hindsight (k = 0..K, k = 0 being
plain decoding), and rounds to adapt after a regime switch: the first round after a
switch from which the throughput of a 20-round window, averaged over all switches and
seeds, stays at or above 95% of the best fixed k's for the new regime.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from eesd_local.base.defaults import MODEL_DRAFT_MAX as DRAFT_MAX  # the simulator's drafters are models
from eesd_local.speculative.controllers import make_controller
from eesd_local.speculative.controllers.jitcache import kernel
from eesd_local.speculative.controllers.kernels import controller_begin, controller_decide, controller_update
from eesd_local.speculative.controllers.layout import HD
from eesd_local.speculative.controllers.rng import beta, normal, seed_words, uniform

IID, DECAY, CONF, SWITCH = 1, 2, 3, 4
T_TOKEN = 0.02  # seconds per plain target token in the simulated timings (~Qwen2.5-0.5B on 2 cores)
TIMING_NOISE = 0.05  # relative sd of the times the controller is told


@dataclass(frozen=True)
class Process:
    name: str
    kind: int
    params: tuple[float, ...]
    about: str

    def array(self) -> np.ndarray:
        out = np.zeros(8)
        out[0] = self.kind
        out[1 : 1 + len(self.params)] = self.params
        return out

    def phases(self) -> tuple[Process, Process] | None:
        """A switching process's two regimes as stationary processes (easy, hard)."""
        if self.kind != SWITCH:
            return None
        easy, hard = self.params[0], self.params[1]
        return iid(easy), iid(hard)


def iid(a: float) -> Process:
    return Process(f"iid-{a:g}", IID, (a,), f"every token accepted with p={a:g}, confidence uninformative")


PROCESSES = {
    p.name: p
    for p in [
        iid(0.9),
        iid(0.7),
        iid(0.4),
        Process("decay", DECAY, (0.95, 0.85), "p_i = 0.95 * 0.85^(i-1) along the draft, confidence uninformative"),
        Process("conf", CONF, (3.0, 0.8, 1.5), "confidence c ~ Beta(3, 0.8), accepted with p = c^1.5 (overconfident drafter)"),
        Process("switch", SWITCH, (0.9, 0.4, 500.0), "iid p=0.9 and p=0.4 alternating every 500 rounds"),
    ]
}

# decode time of a batch of b tokens relative to b = 1 on a 2-core CPU (Qwen2.5-Coder-0.5B, shipped
# weights, 2 threads; the measurement is in BENCHMARKS.md); linear between the measured sizes and beyond 16
_CPU_POINTS = [(1, 1.0), (2, 1.86), (4, 2.7), (5, 3.65), (8, 4.8), (16, 7.9)]


def cpu_verify(b: int) -> float:
    for (b0, v0), (b1, v1) in zip(_CPU_POINTS, _CPU_POINTS[1:], strict=False):
        if b <= b1:
            return v0 + (v1 - v0) * (b - b0) / (b1 - b0)
    (b0, v0), (b1, v1) = _CPU_POINTS[-2], _CPU_POINTS[-1]
    return v1 + (v1 - v0) * (b - b1) / (b1 - b0)


def gpu_verify(b: int) -> float:
    return 1.0 + 0.01 * (b - 1)  # a batch of 9 costs 8% more than one token


@dataclass(frozen=True)
class CostProfile:
    name: str
    verify_kind: str  # "gpu" or "cpu"
    draft_cost: float  # seconds per drafted token / seconds per plain target token
    about: str

    def verify(self, max_draft: int) -> np.ndarray:
        f = gpu_verify if self.verify_kind == "gpu" else cpu_verify
        return np.array([f(b) for b in range(1, max_draft + 2)])


PROFILES = {
    p.name: p
    for p in [
        CostProfile("gpu-d0.1", "gpu", 0.10, "flat verify (+1% per token), draft 0.10 of a target token"),
        CostProfile("gpu-d0.35", "gpu", 0.35, "flat verify (+1% per token), draft 0.35 of a target token"),
        CostProfile("cpu-d0.1", "cpu", 0.10, "the 2-core CPU verify curve, draft 0.10 of a target token"),
        CostProfile("cpu-d0.35", "cpu", 0.35, "the 2-core CPU verify curve, draft 0.35 of a target token"),
    ]
}

TABLE_CONTROLLERS = ["cost-ts", "beta-ts", "calibration-ts", "beta-ts:paper", "calibration-ts:paper", "pmin:0.75", "heuristic"]


@kernel
def _token(proc, rng, round_no, pos):
    """(confidence, acceptance chance) of draft token number pos+1 in round round_no."""
    kind = proc[0]
    if kind == CONF:
        c = beta(rng, 0, proc[1], proc[2])
        return c, math.pow(c, proc[3])
    c = uniform(rng, 0)
    if kind == IID:
        return c, proc[1]
    if kind == DECAY:
        return c, proc[1] * math.pow(proc[2], pos)
    phase = int(round_no // proc[3]) % 2
    return c, proc[1] if phase == 0 else proc[2]


@kernel
def _noisy(t, noise, rng):
    return t * max(0.2, 1.0 + noise * normal(rng, 0))


@kernel
def run_rounds(ctrl, proc, verify, draft_cost, t_token, noise, n_rounds, rng, out):
    """Run n_rounds; out[r] = (expected tokens, seconds, drafted tokens) of round r."""
    k_max = int(ctrl[HD.max_draft])
    confs = np.empty(k_max)
    probs = np.empty(k_max)
    for r in range(n_rounds):
        controller_begin(ctrl)
        k = 0
        conf = 1.0
        while k < k_max and controller_decide(ctrl, k, conf) != 0:
            conf, p = _token(proc, rng, r, k)
            confs[k] = conf
            probs[k] = p
            k += 1
        n_acc = 0
        while n_acc < k and uniform(rng, 0) < probs[n_acc]:
            n_acc += 1
        # a probe (no bonus) verifies d1..dk with the batch [last, d1..d(k-1)]: at most k tokens
        n_verify = k if ctrl[HD.no_bonus] != 0.0 and k > 0 else k + 1
        expected = 1.0
        prefix = 1.0
        for i in range(n_verify - 1):
            prefix *= probs[i]
            expected += prefix
        t_draft = k * draft_cost * t_token
        t_verify = verify[n_verify - 1] * t_token
        controller_update(ctrl, confs[:k], n_acc, _noisy(t_draft, noise, rng), _noisy(t_verify, noise, rng))
        out[r, 0] = expected
        out[r, 1] = t_draft + t_verify
        out[r, 2] = k


def _rng(seed: int) -> np.ndarray:
    return np.array(seed_words(seed ^ 0x5EED5EED), dtype=np.float64)


def simulate(
    spec: str,
    process: Process,
    profile: CostProfile,
    *,
    rounds: int = 4000,
    seed: int = 0,
    max_draft: int = DRAFT_MAX,
    options: dict | None = None,
) -> np.ndarray:
    """Per-round (expected tokens, seconds, drafted) for one controller on one process and profile.

    options: extra keyword arguments for make_controller (eps, forget)."""
    ctrl = make_controller(spec, max_draft=max_draft, seed=seed, model_max=max_draft, **(options or {}))
    out = np.zeros((rounds, 3))
    run_rounds(ctrl.state, process.array(), profile.verify(max_draft), profile.draft_cost, T_TOKEN, TIMING_NOISE, rounds, _rng(seed), out)
    return out


def throughput(out: np.ndarray) -> float:
    """Tokens per second."""
    return float(out[:, 0].sum() / out[:, 1].sum())


def best_fixed(process: Process, profile: CostProfile, *, rounds: int = 4000, seed: int = 0, max_draft: int = DRAFT_MAX) -> tuple[int, float]:
    """The fixed k in 0..max_draft with the highest throughput on this run, and that throughput."""
    rates = [throughput(simulate(f"fixed:{k}", process, profile, rounds=rounds, seed=seed, max_draft=max_draft)) for k in range(max_draft + 1)]
    k = int(np.argmax(rates))
    return k, rates[k]


def relative_throughput(spec: str, process: Process, profile: CostProfile, *, rounds: int = 4000, seed: int = 0, max_draft: int = DRAFT_MAX) -> float:
    """Throughput of the controller / throughput of the best fixed k in hindsight."""
    _, best = best_fixed(process, profile, rounds=rounds, seed=seed, max_draft=max_draft)
    return throughput(simulate(spec, process, profile, rounds=rounds, seed=seed, max_draft=max_draft)) / best


@dataclass
class Adaptation:
    to_easy: int  # rounds after a switch to the easy regime until the window stays >= level (-1: not within the phase)
    to_hard: int
    curve_easy: np.ndarray  # windowed throughput / best fixed for the regime, by round after the switch
    curve_hard: np.ndarray


def adaptation(
    spec: str,
    process: Process,
    profile: CostProfile,
    *,
    phases: int = 8,
    seeds: int = 4,
    window: int = 20,
    level: float = 0.95,
    max_draft: int = DRAFT_MAX,
) -> Adaptation:
    """Rounds to get back to `level` of the new regime's best fixed k after each switch."""
    regimes = process.phases()
    if regimes is None:
        raise ValueError(f"{process.name} does not switch regimes")
    period = int(process.params[2])
    best = [best_fixed(p, profile, rounds=2000, max_draft=max_draft)[1] for p in regimes]
    sums = np.zeros((2, period, 2))  # regime entered, round after the switch, (tokens, seconds)
    for seed in range(seeds):
        out = simulate(spec, process, profile, rounds=period * phases, seed=seed, max_draft=max_draft)
        for ph in range(1, phases):
            sums[ph % 2] += out[ph * period : (ph + 1) * period, :2]
    curves = []
    firsts = []
    for regime in range(2):
        tok = np.convolve(sums[regime, :, 0], np.ones(window), mode="valid")
        sec = np.convolve(sums[regime, :, 1], np.ones(window), mode="valid")
        curve = tok / sec / best[regime]
        curves.append(curve)
        below = np.nonzero(curve < level)[0]
        if below.size == 0:
            firsts.append(0)
        elif below[-1] + 1 < curve.size:
            firsts.append(int(below[-1]) + 1)  # from here on the window stays at or above the level
        else:
            firsts.append(-1)
    return Adaptation(firsts[0], firsts[1], curves[0], curves[1])


def table(
    controllers: list[str],
    processes: list[str],
    profiles: list[str],
    *,
    rounds: int = 4000,
    seed: int = 0,
    max_draft: int = DRAFT_MAX,
    adapt: bool = True,
) -> str:
    """The controller x process x profile table of relative throughput, as text."""
    lines = [
        f"throughput relative to the best fixed k in hindsight ({rounds} rounds, seed {seed}, max_draft {max_draft}); "
        "'best k' row: that k and its speed-up over plain decoding"
    ]
    width = max(len(c) for c in controllers + ["best k (speed-up)"]) + 2
    for prof_name in profiles:
        prof = PROFILES[prof_name]
        lines.append("")
        lines.append(f"[{prof.name}] {prof.about}")
        lines.append("controller".ljust(width) + "".join(p.rjust(11) for p in processes))
        bests = []
        row = "best k (speed-up)".ljust(width)
        plain = {}
        for p in processes:
            k, rate = best_fixed(PROCESSES[p], PROFILES[prof_name], rounds=rounds, seed=seed, max_draft=max_draft)
            plain[p] = throughput(simulate("fixed:0", PROCESSES[p], prof, rounds=rounds, seed=seed, max_draft=max_draft))
            bests.append(rate)
            row += f"{k} ({rate / plain[p]:.2f}x)".rjust(11)
        lines.append(row)
        for spec in controllers:
            row = spec.ljust(width)
            for p, best in zip(processes, bests, strict=True):
                rate = throughput(simulate(spec, PROCESSES[p], prof, rounds=rounds, seed=seed, max_draft=max_draft))
                row += f"{rate / best:.3f}".rjust(11)
            lines.append(row)
    switching = [p for p in processes if PROCESSES[p].kind == SWITCH]
    if adapt and switching:
        lines.append("")
        period = int(PROCESSES[switching[0]].params[2])
        lines.append(
            f"rounds after a switch until a 20-round window stays >= 95% of the new regime's best fixed k "
            f"({switching[0]}; to easy / to hard; -1: not within the {period}-round phase)"
        )
        lines.append("controller".ljust(width) + "".join(p.rjust(14) for p in profiles))
        for spec in controllers:
            row = spec.ljust(width)
            for prof_name in profiles:
                a = adaptation(spec, PROCESSES[switching[0]], PROFILES[prof_name], max_draft=max_draft)
                row += f"{a.to_easy} / {a.to_hard}".rjust(14)
            lines.append(row)
    return "\n".join(lines)


@kernel
def _decide_loop(state, n, k):
    total = 0
    for i in range(n):
        total += controller_decide(state, i % k, 0.8)
    return total


@kernel
def _round_loop(state, n, confidences):
    k_max = confidences.shape[0]
    decisions = 0
    for r in range(n):
        controller_begin(state)
        k = 0
        while True:
            decisions += 1
            if k >= k_max or controller_decide(state, k, confidences[k]) == 0:
                break
            k += 1
        controller_update(state, confidences[:k], min(k, r % 6), 0.002 * k, 0.02 + 0.0002 * k)  # ~4 of 5 accepted
    return decisions


def decision_cost(spec: str, *, max_draft: int = DRAFT_MAX, n: int = 200_000) -> dict[str, float]:
    """Nanoseconds per draft_more (compiled loop), per whole round, and per draft_more from Python.

    The controller first learns 2000 rounds of iid-0.7 on gpu-d0.1, so its state is mature.
    """
    ctrl = make_controller(spec, max_draft=max_draft, seed=1, model_max=max_draft)
    warm = np.zeros((2000, 3))
    prof = PROFILES["gpu-d0.1"]
    run_rounds(ctrl.state, PROCESSES["iid-0.7"].array(), prof.verify(max_draft), prof.draft_cost, T_TOKEN, TIMING_NOISE, 2000, _rng(1), warm)
    confidences = np.full(max_draft, 0.8)
    _decide_loop(ctrl.state.copy(), 10, max_draft)
    _round_loop(ctrl.state.copy(), 10, confidences)
    state = ctrl.state.copy()
    t0 = time.perf_counter()
    _decide_loop(state, n, max_draft)
    decide_ns = (time.perf_counter() - t0) / n * 1e9
    state = ctrl.state.copy()
    rounds = n // 4
    t0 = time.perf_counter()
    decisions = _round_loop(state, rounds, confidences)
    round_ns = (time.perf_counter() - t0) / rounds * 1e9
    calls = n // 10
    t0 = time.perf_counter()
    for i in range(calls):
        ctrl.draft_more(i % max_draft, 0.8)
    python_ns = (time.perf_counter() - t0) / calls * 1e9
    return {"decide_ns": decide_ns, "round_ns": round_ns, "decisions_per_round": decisions / rounds, "python_call_ns": python_ns}


def decision_trace(spec: str, process: str, profile: str, *, rounds: int = 300, seed: int = 0, max_draft: int = DRAFT_MAX) -> tuple[np.ndarray, np.ndarray]:
    """(per-round results, final controller state) of one short run: what the JIT / no-JIT check compares."""
    ctrl = make_controller(spec, max_draft=max_draft, seed=seed, model_max=max_draft)
    out = np.zeros((rounds, 3))
    prof = PROFILES[profile]
    run_rounds(ctrl.state, PROCESSES[process].array(), prof.verify(max_draft), prof.draft_cost, T_TOKEN, TIMING_NOISE, rounds, _rng(seed), out)
    return out, ctrl.state
