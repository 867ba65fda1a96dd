"""Synthetic rounds of a drafter with several sources (prompt lookup and a model drafter), to test
the controller's choice between them without a model (``eesd simulate --sources``).

A *stretch* is a run of rounds in which each source behaves alike: lookup has a match in a share
of rounds (a continuation of 8 tokens, its matched n-gram length known before the round: the
offer), each of its tokens accepted with some chance given the ones before; the model drafter's
tokens are accepted with their own chance, and it costs ``draft_cost`` target tokens per drafted
token plus, when it resumes after rounds it did not draft, ``catchup_cost`` per token it missed.
A *process* is a list of stretches (a copy-heavy rewrite, then prose; a new request may start at a
stretch). Verifying b tokens costs the simulator's CPU or GPU curve (:mod:`.simulator`).

Policies compared on the same process, cost profile and seed: ``auto`` (the multi-source
controller picks the source each round), ``lookup`` and ``model`` (one source, the same
controller sizing its drafts), ``none`` (plain decoding). Tokens are counted by their expectation
given the round's draft, as in :mod:`.simulator`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eesd_local.base.defaults import MODEL_DRAFT_MAX as DRAFT_MAX  # the simulator's drafters are models
from eesd_local.speculative.controllers import layout as L
from eesd_local.speculative.controllers import make_controller
from eesd_local.tools.simulator import PROFILES, T_TOKEN, TIMING_NOISE, CostProfile

LOOKUP_CONTINUATION = 8  # tokens a lookup match offers
NGRAM_MAX = 4  # lookup's longest n-gram: a match of n tokens has confidence n / (NGRAM_MAX + 1)


@dataclass(frozen=True)
class Stretch:
    rounds: int
    lookup_offer: float  # share of rounds where lookup has a match
    lookup_p: float  # acceptance chance of each lookup token, given the ones before
    lookup_match: int  # matched n-gram length (1..NGRAM_MAX)
    model_p: float  # acceptance chance of each model token, given the ones before
    new_request: bool = False  # a new request starts here (the engine calls begin_request)


@dataclass(frozen=True)
class SourceProcess:
    name: str
    stretches: tuple[Stretch, ...]
    about: str


SOURCE_PROCESSES = {
    p.name: p
    for p in [
        SourceProcess("copy-then-prose", (Stretch(200, 0.95, 0.92, 4, 0.45), Stretch(200, 0.5, 0.15, 1, 0.35)) * 3,
                      "one request: a copied block (lookup matches 4-grams, 92% kept), then prose (1-gram matches, 15%); x3"),
        SourceProcess("requests", (Stretch(150, 0.95, 0.92, 4, 0.45, True), Stretch(150, 0.5, 0.15, 1, 0.35, True)) * 4,
                      "alternating requests: a rewrite (as above), then an essay (as above); x4"),
        SourceProcess("prose", (Stretch(1200, 0.5, 0.15, 1, 0.35),), "prose only: lookup rarely right, the model at 35%"),
        SourceProcess("model-pays", (Stretch(1200, 0.3, 0.3, 2, 0.8),),
                      "the model's drafts are right 80% of the time, lookup's seldom (where the exit head should draft)"),
    ]
}

POLICIES = ("auto", "lookup", "model", "none")


def run(policy: str, process: SourceProcess, profile: CostProfile, *, seed: int = 0, spec: str = "cost-ts",
        catchup_cost: float = 0.05, max_draft: int = DRAFT_MAX) -> dict[str, float]:
    """One policy over the process: tokens, seconds (in target tokens), and rounds per source."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    rng = np.random.default_rng(seed)
    ctrl = make_controller(spec if policy != "none" else "fixed:0", max_draft=max_draft, seed=seed,
                           sources=2 if policy == "auto" else 1)
    # as the engine does: the controller learns lookup from every offer in hindsight where it can
    hindsight = policy in ("auto", "lookup") and ctrl.learn_in_hindsight(True)
    verify = profile.verify(max_draft)
    tokens = seconds = 0.0
    by_source = {L.SRC_LOOKUP: 0, L.SRC_MODEL: 0}
    behind = 0
    for st in process.stretches:
        if st.new_request:
            ctrl.begin_request()
        for _ in range(st.rounds):
            offer = LOOKUP_CONTINUATION if policy in ("auto", "lookup") and rng.random() < st.lookup_offer else 0
            conf = st.lookup_match / (NGRAM_MAX + 1.0)
            uses_model = policy in ("auto", "model")
            ctrl.begin_round(offer, conf if offer else 0.0, behind if uses_model and behind > 1 else 0,
                             st.lookup_match if offer else 0)
            src = ctrl.source()
            if src == L.SRC_ANY:
                src = {"lookup": L.SRC_LOOKUP, "model": L.SRC_MODEL}.get(policy, L.SRC_NONE)
            limit = offer if src == L.SRC_LOOKUP else max_draft if src == L.SRC_MODEL else 0
            p = st.lookup_p if src == L.SRC_LOOKUP else st.model_p
            confs: list[float] = []
            c = 1.0
            while len(confs) < limit and ctrl.draft_more(len(confs), c):
                c = conf if src == L.SRC_LOOKUP else float(rng.uniform(0.2, 0.95))
                confs.append(c)
            k = len(confs)
            m = 0
            if offer and hindsight:  # how far the whole offer would have gone: its drafts' fate is part of it
                reach = 0
                while reach < offer and rng.random() < st.lookup_p:
                    reach += 1
                m = min(reach, k) if src == L.SRC_LOOKUP else 0
                ctrl.hindsight(st.lookup_match, offer, reach)  # (the engine learns it once the tokens are emitted)
            if src != L.SRC_LOOKUP or not hindsight:
                m = 0
                while m < k and rng.random() < p:
                    m += 1
            b = k if ctrl.no_bonus() and k else k + 1
            tokens += sum(p**i for i in range(b))  # the expected tokens of a batch of b
            t_catchup = catchup_cost * behind if src == L.SRC_MODEL and k and behind > 1 else 0.0
            t_draft = (profile.draft_cost * k if src == L.SRC_MODEL else 0.0) + t_catchup
            t_verify = float(verify[b - 1])
            seconds += t_draft + t_verify
            noise = 1.0 + TIMING_NOISE * float(rng.standard_normal())
            ctrl.end_round(np.array(confs), m, T_TOKEN * t_draft * noise, T_TOKEN * t_verify * noise, T_TOKEN * t_catchup * noise)
            if k:
                by_source[src] += 1
            emitted = m if (k and b == k and m == k) else m + 1  # a probe that kept all its drafts has no next token
            behind = 0 if src == L.SRC_MODEL and k else behind + emitted
    return {"tokens_per_token_time": tokens / seconds, "lookup_rounds": by_source[L.SRC_LOOKUP],
            "model_rounds": by_source[L.SRC_MODEL], "rounds": sum(s.rounds for s in process.stretches)}


def table(processes: list[str], profiles: list[str], *, seed: int = 0, spec: str = "cost-ts") -> str:
    """Throughput of each policy (target tokens per target-token time: plain decoding is 1.00) and
    auto's share of the best single source."""
    lines = [f"{'process':16s} {'profile':10s} " + " ".join(f"{p:>7s}" for p in POLICIES)
             + "  auto/best  auto rounds by lookup | model"]
    for pname in processes:
        for prof in profiles:
            res = {pol: run(pol, SOURCE_PROCESSES[pname], PROFILES[prof], seed=seed, spec=spec) for pol in POLICIES}
            rate = {pol: r["tokens_per_token_time"] for pol, r in res.items()}
            best = max(rate[p] for p in POLICIES if p != "auto")
            a = res["auto"]
            lines.append(f"{pname:16s} {prof:10s} " + " ".join(f"{rate[p]:7.2f}" for p in POLICIES)
                         + f"  {rate['auto'] / best:9.2f}  {a['lookup_rounds'] / a['rounds']:.0%} | {a['model_rounds'] / a['rounds']:.0%}")
    return "\n".join(lines)
