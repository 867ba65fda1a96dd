"""Draft-length controllers: how many tokens to draft in each speculative round.

The engine asks ``draft_more(step, confidence)`` before every draft step and reports
each round's outcome to ``end_round``. Every controller is one float64 state array plus
three Numba kernels (:mod:`.kernels`): a compiled decision costs 0.05-0.3 us (about 1 us
with the call from Python), and the native loop calls the same compiled code as cfuncs. Same spec
and seed, same decisions, compiled or not.

Specs: ``beta-ts``, ``calibration-ts``, ``cost-ts`` (Thompson sampling, see
:mod:`.thompson`), ``beta-ts:paper`` and ``calibration-ts:paper`` (the EESD paper's
Bernoulli rule, for comparison), ``fixed:K``, ``pmin:P`` (llama.cpp's p_min, default
0.75) and ``heuristic`` (+2 when all drafts were accepted, -1 otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib import recfunctions

from eesd_local.base.defaults import MODEL_DRAFT_MAX
from eesd_local.base.errors import EesdError
from eesd_local.speculative.controllers import layout as L
from eesd_local.speculative.controllers.baselines import HEURISTIC_START
from eesd_local.speculative.controllers.kernels import (
    controller_begin,
    controller_decide,
    controller_hindsight,
    controller_new_request,
    controller_update,
)
from eesd_local.speculative.controllers.rng import seed_words
from eesd_local.speculative.controllers.thompson import (
    BIN_PRIOR,
    CPU_DRAFT_MARGIN,
    DRAFT_MARGIN,
    POS_PRIOR,
    PROFILE_COSTS,
    bin_prior_mean,
    refresh_verify_estimates,
    ts_use_hindsight,
)

CONTROLLER_CHOICES = ["cost-ts", "beta-ts", "calibration-ts", "fixed:K", "pmin:P", "heuristic"]
# cost-ts: >= 0.98 of the best fixed k in hindsight on every process and cost profile of `eesd simulate`
# (beta-ts and calibration-ts match it on the flat GPU profiles but fall to 0.56-0.89 on the CPU profiles: BENCHMARKS.md)
DEFAULT_CONTROLLER = "cost-ts"
DEFAULT_PMIN = 0.75  # llama.cpp's default p_min for greedy speculative decoding
TS_EPS = 0.01  # exploration budget: a closed gate spends about this share of the time on one-token probes
PRIME_WEIGHT = 6.0  # timings a kept cost profile's B(b) is worth in the verify-time means (Controller.prime_costs)
TS_FORGET = 0.99  # theta_1 keeps ~100 rounds of evidence: it follows a change of regime in ~40-170 rounds (simulator)

_THOMPSON = {
    # name: (rule, use_bins, batch_costs, margin)
    "beta-ts": (0, 0, 0, 0.0),
    "calibration-ts": (0, 1, 0, 0.0),
    "cost-ts": (0, 1, 1, DRAFT_MARGIN),
    "cost-ts:no-hindsight": (0, 1, 1, DRAFT_MARGIN),  # prompt lookup learned from its drafts only (before issue 16's hindsight)
    "cost-ts:no-margin": (0, 1, 1, 0.0),  # a model source drafts at break-even (before issue 15's margin; lookup's too)
    "beta-ts:paper": (1, 0, 0, 0.0),
    "calibration-ts:paper": (1, 1, 0, 0.0),
}


class Controller:
    """A draft-length controller: a spec name and the state its kernels update in place."""

    def __init__(self, name: str, state: np.ndarray) -> None:
        self.name = name
        self.max_draft = int(state[L.HD.max_draft])
        self.state = state
        self.hindsight_allowed = not name.endswith(":no-hindsight")

    @property
    def fields(self) -> Any:
        """The state's fields by name (layout.fields: a view, writing a field writes the state)."""
        return L.fields(self.state)

    def _thompson_states(self) -> list[np.ndarray]:
        """The Thompson states in this controller: its own, a multi-source state's one per source, or none."""
        s = self.state
        kind = s[L.HD.kind]
        if kind == L.MULTI:
            return [L.source_state(s, i) for i in range(int(s[L.MS.n_src]))]
        return [s] if kind == L.THOMPSON else []

    def begin_request(self) -> None:
        """A new request: acceptance evidence from earlier ones is thinned (thompson.ts_new_request)."""
        controller_new_request(self.state)

    def prime_resume(self, seconds_per_token: float) -> None:
        """A first guess of what catching a draft model up costs per token, until it has been
        measured (the engine takes the target's prefill time per token times the draft's share of
        the weights): so the first probe of a model far behind is not taken as free."""
        for st in self._thompson_states():
            f = L.fields(st)
            if f["n_resume"] == 0.0 and seconds_per_token > 0.0:
                f["resume"] = seconds_per_token

    def prime_costs(self, t1_s: float, ratios: Sequence[float], weight: float = PRIME_WEIGHT) -> bool:
        """Take what a verify batch costs from this machine's kept cost profile: t(1) in seconds and
        ``ratios``, B(b) for batch sizes b = 1, 2, .. max_draft + 1 (costs.CostProfile.b). The first
        rounds of a process then already know it, where a size never timed would otherwise be priced as
        the largest one timed (optimistic: a first request's long drafts cost several tokens each). t(1)
        starts at the profile's, worth ``weight`` timings, and follows the rounds' plain decodes; the
        ratios B(b) stay the profile's (thompson.PROFILE_COSTS), so the plan of a lookup round is a
        function of the tokens alone: the same prompt drafts the same rounds in every run and under every
        drafter that looks up (``auto`` with its model source off and ``lookup``), whatever the timing
        noise. ``eesd models costs`` measures the profile again. Only a state that has timed nothing is
        primed; returns whether any was."""
        if not (t1_s > 0.0 and math.isfinite(t1_s)) or len(ratios) < self.max_draft + 1:
            return False
        primed = False
        for st in self._thompson_states():
            f = L.fields(st)
            if f["batch_costs"] == 0.0:
                continue
            k = int(f["max_draft"])
            verify = f["verify"]  # per batch size 1..k+1
            if (verify["count"] > 0.0).any():
                continue
            verify["mean"] = [t1_s, *ratios[1 : k + 1]]
            verify["count"] = weight
            f["batch_costs"] = PROFILE_COSTS
            refresh_verify_estimates(st)
            primed = True
        return primed

    def raise_margin(self, margin: float) -> bool:
        """Draft only where a plan beats plain decoding by at least ``margin`` (the engine's CPU_DRAFT_MARGIN
        where the target runs on the CPU); a controller without a margin (``cost-ts:no-margin``, Beta-TS,
        the baselines) keeps none. Returns whether any state took it."""
        raised = False
        for st in self._thompson_states():
            f = L.fields(st)
            if 0.0 < f["margin"] < margin:
                f["margin"] = margin
                raised = True
        return raised

    def begin_round(self, offer: int = 0, confidence: float = 0.0, behind: int = 0, match: int = 0,
                    reach: int = 0) -> None:
        """A round starts. What the loop knows before it: ``offer`` free proposals (prompt lookup's
        continuation) with this ``confidence`` (0: unknown) after a context that matches their source
        over ``match`` tokens, how many of them it may draft whatever its match (``reach``: a request's
        prediction, all of it; 0: as far as it matches), and ``behind``, the tokens a draft model would
        catch up on before drafting."""
        s = self.state
        s[L.HD.offer_n] = offer
        s[L.HD.offer_conf] = confidence
        s[L.HD.offer_match] = match
        s[L.HD.offer_reach] = reach
        s[L.HD.behind] = behind
        s[L.HD.t_catchup] = 0.0
        controller_begin(s)

    def source(self) -> int:
        """Which source drafts this round (L.SRC_LOOKUP, L.SRC_MODEL, L.SRC_NONE; L.SRC_ANY: the
        controller does not choose, the drafter takes its default)."""
        return int(self.state[L.HD.source])

    def draft_more(self, step: int, confidence: float) -> bool:
        """Draft token number step+1? step = tokens drafted so far this round; confidence = the
        drafter's probability of the token it just drafted (1.0 at step 0)."""
        return controller_decide(self.state, step, confidence) != 0

    def no_bonus(self) -> bool:
        """Verify this round's drafts without the bonus token (a probe: the batch is [last, d1..d(k-1)])."""
        return bool(self.state[L.HD.no_bonus] != 0.0)

    def end_round(self, confidences: np.ndarray, n_accepted: int, t_draft: float, t_verify: float,
                  t_catchup: float = 0.0) -> None:
        """After verification: one confidence per drafted token, the accepted prefix length,
        seconds spent drafting this round (``t_catchup`` of them a draft model's catching up on
        tokens it missed), seconds of the target's decode of n_drafted+1 tokens."""
        confidences = np.ascontiguousarray(confidences, dtype=np.float64)
        self.state[L.HD.t_catchup] = t_catchup
        controller_update(self.state, confidences, int(n_accepted), float(t_draft - t_catchup), float(t_verify))

    def learn_in_hindsight(self, on: bool = True) -> bool:
        """Whether the round loop reports every free offer in hindsight (:meth:`hindsight`): prompt
        lookup's acceptance is then learned from all of them, by match length, rather than from its
        drafts (thompson.ts_hindsight). The loop asks at every request with ``on`` = its drafter has
        free offers; returns whether this controller now learns so (a cost-aware Thompson state, or a
        multi-source state's lookup source). Turning it off restores the confidence bins' prior."""
        s = self.state
        if not self.hindsight_allowed:
            return False
        f = L.fields(s)
        if f["kind"] == L.MULTI:
            st = L.source_state(s, L.SRC_LOOKUP)
        elif f["kind"] == L.THOMPSON and f["rule"] == 0.0 and f["batch_costs"] != 0.0:
            st = s
        else:
            return False
        f = L.fields(st)
        if on and f["hindsight"] == 0.0:
            ts_use_hindsight(st)
        elif not on and f["hindsight"] != 0.0:
            f["hindsight"] = 0.0
            _bins_prior(f)
            f["pos"][0] = (1.0, 1.0, 1.0)  # theta_1 at Beta(1, 1) again (in hindsight it held the request's ratio)
        return on

    def hindsight(self, match: int, n_offered: int, n_matched: int) -> None:
        """A free offer of n_offered tokens at match length ``match`` of which the target went on to
        emit the first n_matched."""
        controller_hindsight(self.state, int(match), int(n_offered), int(n_matched))

    def belief(self) -> dict[str, float]:
        """Posterior of the acceptance rate (all positions pooled) and the running draft length."""
        f = self.fields
        a, b = f["pooled"]["alpha"], f["pooled"]["beta"]
        mean = a / (a + b)
        sd = math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1.0)))
        out = {
            "mean": float(mean),
            "lo": float(max(0.0, mean - 1.645 * sd)),  # normal approximation of the 5% / 95% quantiles
            "hi": float(min(1.0, mean + 1.645 * sd)),
            "expected_k": float(f["ema_drafted"]),
            "expected_accepted": float(f["ema_accepted"]),
            "tau": float(f["ema_accepted"] + 1.0),
            "draft_ms": float(1e3 * f["ema_t_draft"]),
            "verify_ms": float(1e3 * f["ema_t_verify"]),
            "rounds": float(f["rounds"]),
        }
        kind = f["kind"]
        if kind == L.MULTI:
            out["source"] = float(f["source"])
            for i, name in enumerate(SOURCE_NAMES[: int(f["n_src"])]):
                sub = f["src"][i]
                a1, b1 = sub["pos"][0]["alpha"], sub["pos"][0]["beta"]
                out[f"{name}_theta_1"] = float(a1 / (a1 + b1))
                out[f"{name}_rounds"] = float(sub["rounds"])
                out[f"{name}_tau"] = float(sub["ema_accepted"] + 1.0)
        if kind == L.HEURISTIC:
            out["k"] = float(f["param"])
        if kind == L.THOMPSON and f["rule"] == 0.0:
            k = self.max_draft
            a1, b1 = f["pos"][0]["alpha"], f["pos"][0]["beta"]
            out["theta_1"] = float(a1 / (a1 + b1))
            out["target_tok_s"] = float(f["lam"])
            if f["batch_costs"] != 0.0:
                ve = f["estimate"]  # per batch size 1..k+1
                if ve[0] > 0.0:
                    out["draft_cost_ratio"] = float(f["ema_t_draft"] / ve[0])
                    out["verify_cost_ratio_max"] = float(ve[k] / ve[0])
        return out

    def state_dict(self) -> dict:
        f = self.fields
        out: dict = {"name": self.name, "kind": int(f["kind"]), "max_draft": self.max_draft, "rounds": int(f["rounds"])}
        out["pooled_alpha_beta"] = (float(f["pooled"]["alpha"]), float(f["pooled"]["beta"]))
        if f["kind"] == L.THOMPSON:
            rows = recfunctions.structured_to_unstructured
            out["positions_alpha_beta_predicted"] = rows(f["pos"]).tolist()
            out["bins_alpha_beta_predicted"] = rows(f["bins"]).tolist()
            # (mean, count) per batch size: seconds for a batch of one, the ratio to it for larger batches
            out["verify_mean_count"] = rows(f["verify"]).tolist()
            out["verify_estimate"] = f["estimate"].tolist()
            out["draft_seconds_per_token"] = float(f["ema_t_draft"])
        elif f["kind"] != L.MULTI:
            out["param"] = float(f["param"])
        return out

    def __repr__(self) -> str:
        return f"Controller({self.name!r}, max_draft={self.max_draft})"


def _new_state(kind: int, max_draft: int, seed: int, n_src: int = 0) -> tuple[np.ndarray, Any]:
    """A zeroed state of the kind's record with its header set, and its fields."""
    record = L.RECORDS[kind]
    state = np.zeros(record.size(max_draft, n_src), dtype=np.float64)
    f = state.view(record.dtype(max_draft, n_src))[0]
    f["kind"] = kind
    f["max_draft"] = max_draft
    f["rng"] = seed_words(seed)
    f["pooled"] = (1.0, 1.0)
    f["source"] = L.SRC_ANY
    return state, f


SOURCE_NAMES = ("lookup", "model")  # as L.SRC_LOOKUP, L.SRC_MODEL number them


def _bins_prior(f: Any) -> None:
    """The confidence bins of the Thompson state with fields f at their prior: as the positions predict."""
    bins = f["bins"]
    for j in range(L.N_BINS):
        m = bin_prior_mean(j)
        bins[j] = BIN_PRIOR * m, BIN_PRIOR * (1.0 - m), BIN_PRIOR * m


def _bad_spec(spec: str, why: str) -> EesdError:
    return EesdError(
        f"unknown controller {spec!r}: {why}",
        hint="use one of " + ", ".join(CONTROLLER_CHOICES) + " (e.g. fixed:4, pmin:0.75)",
    )


def make_controller(spec: str, *, max_draft: int = MODEL_DRAFT_MAX, seed: int = 0, eps: float = TS_EPS, forget: float = TS_FORGET,
                    sources: int = 1, model_max: int = MODEL_DRAFT_MAX) -> Controller:
    """A fresh controller from its spec; raises EesdError on a bad spec. ``sources`` > 1: a
    Thompson spec becomes a multi-source controller (one state per source, see multi.py) that
    chooses each round which source drafts; baseline rules leave the choice to the drafter.
    ``model_max``: a Thompson plan without a free offer (a drafting model's) counts on at most this
    many tokens (and max_draft); the round loop cuts a model's draft there for every controller."""
    if not isinstance(max_draft, int) or max_draft < 1:
        raise EesdError(f"max_draft must be a positive integer, got {max_draft!r}", hint="e.g. --draft-max 8")
    if sources not in range(1, L.MAX_SRC + 1):
        raise EesdError(f"a controller takes 1 to {L.MAX_SRC} sources, not {sources!r}")
    name, _, arg = spec.strip().lower().partition(":")
    if name in ("beta-ts", "calibration-ts", "cost-ts") and sources > 1:
        # one whole Thompson state per source, behind a header of its own (multi.py)
        subs = [make_controller(spec, max_draft=max_draft, seed=seed + 7919 * (i + 1), eps=eps, forget=forget, model_max=model_max)
                for i in range(sources)]
        state, f = _new_state(L.MULTI, max_draft, seed, n_src=sources)
        f["n_src"] = sources
        for i, sub in enumerate(subs):
            f["src_ofs"][i] = L.source_offset(max_draft, i)
            L.source_state(state, i)[:] = sub.state
        return Controller(subs[0].name, state)
    if name in ("beta-ts", "calibration-ts", "cost-ts"):
        key = name if not arg else f"{name}:{arg}"
        if key not in _THOMPSON:
            raise _bad_spec(spec, f"{name} takes no argument other than 'paper'" + (", 'no-hindsight' or 'no-margin'" if name == "cost-ts" else ""))
        rule, bins, batch, margin = _THOMPSON[key]
        state, f = _new_state(L.THOMPSON, max_draft, seed)
        f["rule"] = rule
        f["use_bins"] = bins
        f["batch_costs"] = batch
        f["margin"] = margin
        f["model_max"] = min(max_draft, max(1, int(model_max)))
        f["eps"] = eps
        f["forget"] = forget
        half = POS_PRIOR / 2.0
        f["pos"][0] = (1.0, 1.0, 1.0)  # Beta(1, 1) at position 1
        f["pos"][1:] = (half, half, half)  # odds ratio 1 (r = alpha) deeper
        f["req_seen"] = 1e9  # no request warm-up until a request begins (begin_request)
        _bins_prior(f)
        return Controller(key, state)
    if name == "fixed":
        try:
            k = int(arg)
        except ValueError:
            raise _bad_spec(spec, "fixed needs a draft length, as in fixed:4") from None
        if not 0 <= k <= max_draft:
            raise _bad_spec(spec, f"the draft length must be within 0..max_draft={max_draft}")
        state, f = _new_state(L.FIXED, max_draft, seed)
        f["param"] = k
        return Controller(f"fixed:{k}", state)
    if name == "pmin":
        try:
            p = float(arg) if arg else DEFAULT_PMIN
        except ValueError:
            raise _bad_spec(spec, "pmin needs a probability, as in pmin:0.75") from None
        if not 0.0 <= p <= 1.0:
            raise _bad_spec(spec, "p_min must be within 0..1")
        state, f = _new_state(L.PMIN, max_draft, seed)
        f["param"] = p
        return Controller(f"pmin:{p:g}", state)
    if name == "heuristic" and not arg:
        state, f = _new_state(L.HEURISTIC, max_draft, seed)
        f["param"] = min(HEURISTIC_START, max_draft)
        return Controller("heuristic", state)
    raise _bad_spec(spec, "not a known controller")


__all__ = [
    "CONTROLLER_CHOICES",
    "CPU_DRAFT_MARGIN",
    "DEFAULT_CONTROLLER",
    "Controller",
    "make_controller",
]
