"""This machine's cost profile for a model: what a verify batch of k tokens costs, measured once, kept.

B(k) = t(k) / t(1): the time of one decode of k tokens (logits for every row, as a verify does)
over one token's. It depends on the CPU (its vector units select the kernels), the threads, the
llama.cpp build, the model file and where its layers run (with layers offloaded: which devices); the profile is kept under the cache's
``costs/`` keyed by all of them, so a profile from another CPU, build or model is never used, and
a damaged one is measured again (with a note).

The engine reads it to decide, before it maps or builds anything, whether the exit head could
ever pay on this machine (:func:`head_verdict`); ``eesd models costs`` shows and refreshes it, and
the set-up command measures it for the demo model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eesd_local.base.atomic import write_text_atomic
from eesd_local.llama.ggmlapi import offload_device_names
from eesd_local.llama.machine import build as _build
from eesd_local.llama.machine import costs_dir
from eesd_local.llama.machine import cpu as _cpu
from eesd_local.llama.runtime import Context, ContextParams

FORMAT = 1
# a verify batch holds draft_max + 1 tokens: 9 by default, up to 65 for drafts of 64; above 9, B(k) is on
# the line through its measured neighbours (a CPU's cost per row is near constant there: measured here beside a test run,
# B(33) 12.82 against 12.73 on the line from B(17) to B(65), 0.5B; each size costs seconds at load)
KS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 65)
PREFIX = 64  # tokens in the cache before each timed decode
REPEATS = 5
STEADY = 1.35  # the spread of one batch size's timings a quiet machine stays within (steady())
BUDGET_S = 8.0  # most seconds a measurement at load time takes (0.5B here: ~2 s, 1.5B: ~5 s)


@dataclass
class CostProfile:
    t1_ms: float  # one token's decode
    bk: dict[int, float]  # B(k) = t(k) / t(1)
    fingerprint: dict[str, Any]
    measured_at: float = 0.0
    repeats: int = REPEATS
    note: str = ""  # why it was measured now (missing, stale, damaged), or "" when read from the cache
    plausible: bool = True  # False: measured under other work; not kept, not to decide from

    def b(self, k: int) -> float:
        """B(k); between two measured sizes on the line through them, beyond the largest extrapolated
        linearly from the last two."""
        if k in self.bk:
            return self.bk[k]
        ks = sorted(self.bk)
        if k < ks[0]:
            return 1.0
        above = [x for x in ks if x > k]
        a, b = (max(x for x in ks if x < k), above[0]) if above else (ks[-2], ks[-1])
        line = self.bk[a] + (k - a) * (self.bk[b] - self.bk[a]) / (b - a)
        # beyond the largest size, never below it (a profile whose last two sizes fell would go negative)
        return line if above else max(line, self.bk[ks[-1]])

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("note")
        d.pop("plausible")
        d["bk"] = {str(k): v for k, v in self.bk.items()}
        out = {"format": FORMAT, **d}
        out["sha256"] = _digest(out)  # an edited or damaged file is measured again, not used
        return out

    def summary(self) -> str:
        return f"t(1) {self.t1_ms:.1f} ms, " + ", ".join(f"B({k}) {v:.2f}" for k, v in sorted(self.bk.items()) if k > 1)


def fingerprint(model_path: str | os.PathLike[str], *, n_threads: int, n_gpu_layers: int = 0,
                rpc: Sequence[str] = ()) -> dict[str, Any]:
    p = Path(model_path).resolve()
    st = p.stat()
    fp = {**_cpu(), "threads": int(n_threads), "build": _build(),
          "model": {"name": p.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns},
          "n_gpu_layers": int(n_gpu_layers), "rpc": list(rpc)}
    if n_gpu_layers != 0 and not rpc:
        # which device the layers run on: one build (Vulkan, say) drives many, each with its own B(k)
        # (lavapipe's and a real GPU's differ by orders of magnitude); CPU-only keys stay as they were
        devices = offload_device_names()
        if devices:
            fp["devices"] = devices
    return fp


def profile_path(fp: dict[str, Any]) -> Path:
    key = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return costs_dir() / f"{Path(fp['model']['name']).stem}-{key}.json"


def _digest(d: dict[str, Any]) -> str:
    """The sha256 of a kept profile's figures (every field but the checksum itself)."""
    return hashlib.sha256(json.dumps({k: v for k, v in d.items() if k != "sha256"}, sort_keys=True).encode()).hexdigest()


def cached(fp: dict[str, Any]) -> tuple[CostProfile | None, str]:
    """The kept profile for ``fp``, or (None, why not: "" when none was kept)."""
    path = profile_path(fp)
    if not path.exists():
        return None, ""
    try:
        d = json.loads(path.read_text())
        if d.get("format") != FORMAT or not isinstance(d.get("fingerprint"), dict):
            raise ValueError("not a cost profile of this version")
        if d["fingerprint"] != fp:
            return None, f"the kept cost profile {path.name} is for another machine or build: measured again"
        # profiles kept before the checksum have none; one that has it must match
        if "sha256" in d and d["sha256"] != _digest(d):
            return None, (f"the kept cost profile {path.name} is damaged or was edited (its checksum does not match "
                          "its figures): measured again")
        bk = {int(k): float(v) for k, v in d["bk"].items()}
        if max(bk, default=0) < max(KS):
            return None, (f"the kept cost profile {path.name} stops at batches of {max(bk, default=0)} tokens: "
                          f"measured again up to {max(KS)}")
        t1 = float(d["t1_ms"])
        if not (t1 > 0 and bk.get(1) == 1.0 and all(math.isfinite(v) and v > 0 for v in bk.values()) and len(bk) >= 2
                and plausible(bk)):
            raise ValueError("figures out of range")
        return CostProfile(t1, bk, fp, float(d.get("measured_at", 0.0)), int(d.get("repeats", REPEATS))), ""
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        return None, f"the kept cost profile {path.name} is damaged ({str(exc)[:200]}): measured again"


Progress = Callable[[int, int], None]


def time_batches(ctx: Any, fill: Sequence[int], prefix: int, ks: Sequence[int], rep: int) -> Iterator[tuple[int, float]]:
    """One round of a B(k) measurement on a context holding ``fill[:prefix]``: for each k, in an order
    rotated by ``rep`` (so no size always follows the same one), decode the next k tokens with logits
    for every row, as a verify does, and trim back to the prefix; yields (k, seconds)."""
    for k in list(ks[rep % len(ks):]) + list(ks[: rep % len(ks)]):
        t0 = time.perf_counter()
        ctx.decode(fill[prefix:prefix + k], n_logits=k)
        dt = time.perf_counter() - t0
        ctx.trim(prefix)
        yield k, dt


def plausible(bk: dict[int, float]) -> bool:
    """Whether B(k) looks like one machine's batch costs rather than other work's noise: no batch
    cheaper than 0.9 of one token, none much cheaper than the batch one token smaller. Measured
    while the tests ran beside it on 2 cores, B(2) came out 0.20 and B(8) 2.8 > B(9) 2.0."""
    ks = sorted(bk)
    return all(bk[k] >= 0.9 for k in ks if k > 1) and all(bk[b] >= 0.85 * bk[a] for a, b in zip(ks, ks[1:]))


def steady(samples: Sequence[float]) -> bool:
    """Whether repeated timings of one batch size agree as on a quiet machine: the second slowest
    within STEADY of the fastest (one outlier is forgiven). Other work beside a measurement makes
    every size slower alike and B(k) look flat: a profile the test suite's load measured had t(1)
    74.6 ms against 22.0 quiet and B(2) 1.23 against 1.77, which plausible() took for a real one,
    but its timings were not steady."""
    s = sorted(samples)
    if len(s) < 3:
        return True
    return s[-2] <= STEADY * s[0]


def calm(times: dict[int, list[float]]) -> bool:
    """Whether a measurement's timings by batch size were steady() where the plan leans on them most:
    batches of 1 and 2 tokens."""
    return all(steady(v) for k, v in times.items() if k <= 2)


def measure(model: Any, *, n_threads: int, ks: Sequence[int] = KS, repeats: int = REPEATS,
            progress: Progress | None = None, budget_s: float = BUDGET_S) -> tuple[float, dict[int, float], bool]:
    """(t(1) in ms, B(k), whether its timings were calm()) of a loaded :class:`~eesd_local.llama.runtime.Model`:
    after a PREFIX-token prefill, decode k tokens with logits for every row and trim back, ``repeats`` times per k
    (rotating the order, after one warm-up round); medians. Past ``budget_s`` seconds (a slow
    or busy machine) it stops after the first counted round."""
    ks = sorted(set(ks) | {1})
    ctx = Context(model, ContextParams(n_ctx=PREFIX + max(ks) + 16, n_batch=max(PREFIX, max(ks)), n_threads=n_threads))
    try:
        text = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n" * 8
        fill = (model.tokenize(text) * 4)[: PREFIX + max(ks)]
        ctx.decode(fill[:PREFIX])
        times: dict[int, list[float]] = {k: [] for k in ks}
        total, done = (repeats + 1) * len(ks), 0
        t_start = time.perf_counter()
        for rep in range(repeats + 1):  # round 0 warms up and is not counted
            if rep >= 2 and time.perf_counter() - t_start > budget_s:
                break
            for k, dt in time_batches(ctx, fill, PREFIX, ks, rep):
                if rep:
                    times[k].append(dt)
                done += 1
                if progress:
                    progress(done, total)
    finally:
        ctx.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return 1e3 * med[1], {k: round(med[k] / med[1], 4) for k in ks}, calm(times)


# a profile measured under other work is not kept; this process uses it this long (one engine's load asks
# twice: for the shared-trunk plan, then for the drafter), then measures again
UNKEPT_REUSE_S = 120.0
_unkept: dict[str, tuple[float, CostProfile]] = {}


def profile(model: Any, *, n_threads: int, n_gpu_layers: int = 0, rpc: Sequence[str] = (), refresh: bool = False,
            progress: Progress | None = None) -> CostProfile:
    """The kept profile of ``model`` here, measured now (and kept) where none matches."""
    fp = fingerprint(model.path, n_threads=n_threads, n_gpu_layers=n_gpu_layers, rpc=rpc)
    key = str(profile_path(fp))
    why = "refreshed"
    if not refresh:
        got, why = cached(fp)
        if got is not None:
            return got
        recent = _unkept.get(key)
        if recent is not None and time.monotonic() - recent[0] < UNKEPT_REUSE_S:
            return recent[1]
        why = why or "no cost profile was kept for this model on this machine: measured once (a few seconds)"
    t1, bk, calm = measure(model, n_threads=n_threads, progress=progress)
    prof = CostProfile(t1, bk, fp, time.time(), REPEATS, why)
    if not plausible(bk) or not calm:
        prof.note = ("this machine's batch costs could not be measured (other work ran beside: B(2) "
                     f"{bk.get(2, 0.0):.2f}{'' if calm else ', timings unsteady'}); nothing kept, "
                     "`eesd models costs` measures them again")
        prof.plausible = False
        _unkept[key] = (time.monotonic(), prof)
        return prof
    _unkept.pop(key, None)
    try:
        write_text_atomic(profile_path(fp), json.dumps(prof.to_json(), indent=1) + "\n")
    except OSError:
        pass  # a read-only cache: measured again next time
    return prof


def keep(model_path: str | os.PathLike[str], t1_ms: float, bk: dict[int, float], *, n_threads: int, repeats: int,
         n_gpu_layers: int = 0, rpc: Sequence[str] = ()) -> Path:
    """Keep figures measured elsewhere (``eesd models costs``) as this machine's profile of the model."""
    fp = fingerprint(model_path, n_threads=n_threads, n_gpu_layers=n_gpu_layers, rpc=rpc)
    prof = CostProfile(float(t1_ms), {int(k): round(float(v), 4) for k, v in bk.items()}, fp, time.time(), repeats)
    return write_text_atomic(profile_path(fp), json.dumps(prof.to_json(), indent=1) + "\n")


# --- can a model drafter pay here? -----------------------------------------------------------


def tokens_per_round(alpha: float, k: int) -> float:
    """Expected tokens a round of k drafts emits when each draft is accepted with probability
    ``alpha`` (independently, until the first rejection), the bonus or correction included."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_gain(prof: CostProfile, alpha: float, draft_cost: float, k_max: int) -> tuple[float, int]:
    """(speed over plain decoding, k) of the best fixed draft length: tokens per round over the
    round's cost in plain tokens (k drafts at ``draft_cost`` each, then a verify of k + 1 rows)."""
    best = (1.0, 0)
    for k in range(1, k_max + 1):
        g = tokens_per_round(alpha, k) / (k * draft_cost + prof.b(k + 1))
        if g > best[0]:
            best = (g, k)
    return best


def needed_acceptance(prof: CostProfile, draft_cost: float, k_max: int, margin: float = 0.0) -> float:
    """The least per-token acceptance at which some draft length beats plain decoding by ``margin``
    (above 1: none can, even if every draft were accepted)."""
    if best_gain(prof, 1.0, draft_cost, k_max)[0] <= 1.0 + margin:
        # even every draft accepted loses: what one draft a round would need, (1 + a) / (c + B(2)) > 1 + margin
        return max((1.0 + margin) * (draft_cost + prof.b(2)) - 1.0, 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if best_gain(prof, mid, draft_cost, k_max)[0] > 1.0 + margin:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass
class Verdict:
    pays: bool
    needed: float  # the acceptance it would need
    agreement: float  # what the head reached against the target when it was trained
    draft_cost: float  # a draft token's cost in plain tokens (a lower bound: the trunk's share)
    note: str


def head_verdict(prof: CostProfile, *, agreement: float, exit_layer: int, n_layer: int, k_max: int,
                 margin: float = 0.0) -> Verdict:
    """Whether an exit head could ever beat plain decoding here by ``margin`` (the share by which the
    controller wants a round's plan to beat plain decoding before it drafts: a head that cannot clear
    it never drafts, and holding it costs every round). Deliberately generous to the head otherwise:
    its draft token is costed at the trunk's share of the layers (no output layer), and its
    acceptance taken as its top-1 agreement with the target at training, so "off" means it cannot
    pay; "on" means it may, and the controller then decides round by round."""
    cost = (exit_layer + 1) / max(1, n_layer)
    if not prof.plausible:
        return Verdict(False, float("nan"), agreement, cost, f"exit head: off for now: {prof.note}")
    need = needed_acceptance(prof, cost, k_max, margin)
    pays = agreement > need
    b2 = f"B(2)={prof.b(2):.2f}"
    if pays:
        note = f"exit head: on ({b2}, needs acceptance > {need:.2f}, its agreement {agreement:.2f})"
    elif need >= 1.0:  # no acceptance is enough: a round costs more than it yields even with every draft accepted
        note = (f"exit head: off, never pays on this machine: {b2}, a round costs more than it yields even with every "
                f"draft accepted (its agreement {agreement:.2f})")
    else:
        note = f"exit head: off, cannot pay on this machine: {b2}, needs acceptance > {need:.2f} (its agreement {agreement:.2f})"
    return Verdict(pays, need, agreement, cost, note)
