"""Several draft sources under one controller: each round, which source drafts and how much.

A multi-source state is an outer header (pooled statistics for ``belief()``, the loop's
offer, the round's source) followed by one whole cost-aware Thompson state per source
(:mod:`.thompson`), so each source keeps its own belief: acceptance by position and by
confidence, draft seconds per token, and (a draft model) seconds per token of catching up.
What a target decode of b tokens costs is the machine's, not a source's: every source's
verify table learns from every round.

Choice. At the start of a round every source that can draft plans its round under its own
posterior sample (``ts_begin``): a source whose gate is open offers the rate (tokens per
second) its best round would give; the highest offer drafts. Thompson sampling over (source,
length): the sample decides both. When no gate is open, a source may probe: the draft model's
probes (rationed by their cost, see ``ts_begin``) go first, then prompt lookup's (free: its
one-token probe is verified by plain decoding's own call), else nothing is drafted. Sources
not chosen age their theta_1 as a single-source controller does in a round without drafts.

Prompt lookup (source 0) can only draft what it found: with no offer (offer_n = 0) it is not a
candidate, and its plan is capped at the offer's length and conditioned on the offer's
confidence. A draft model (source 1) is charged its catch-up (``behind`` tokens) once, to the round
that resumes it.
"""

from __future__ import annotations

from eesd_local.speculative.controllers.common import discount, update_header
from eesd_local.speculative.controllers.jitcache import kernel
from eesd_local.speculative.controllers.layout import MS, SRC_LOOKUP, SRC_MODEL, SRC_NONE, TS, at
from eesd_local.speculative.controllers.thompson import (
    REQUEST_PROBES,
    record_verify,
    refresh_verify_estimates,
    ts_begin,
    ts_decide,
    ts_hindsight,
    ts_new_request,
    ts_update,
)


@kernel
def source_state(state, s):
    """Source s's Thompson state (a view into the multi-source state)."""
    size = at(TS.size, int(state[MS.max_draft]))
    begin = MS.src + s * size
    return state[begin : begin + size]


@kernel
def multi_begin(state):
    n_src = int(state[MS.n_src])
    best = SRC_NONE
    best_rate = 0.0
    probe = SRC_NONE
    for s in range(n_src):
        sub = source_state(state, s)
        if s == SRC_LOOKUP:
            sub[TS.offer_n] = state[MS.offer_n]
            sub[TS.offer_conf] = state[MS.offer_conf]
            sub[TS.offer_match] = state[MS.offer_match]
            sub[TS.offer_reach] = state[MS.offer_reach]
            sub[TS.behind] = 0.0
        else:
            sub[TS.offer_n] = 0.0
            sub[TS.offer_conf] = 0.0
            sub[TS.behind] = state[MS.behind]
        ts_begin(sub)
        if s == SRC_LOOKUP and state[MS.offer_n] <= 0.0:
            continue  # nothing to propose this round
        if sub[TS.open] != 0.0:
            if sub[TS.lam] > best_rate:
                best = s
                best_rate = sub[TS.lam]
        elif sub[TS.probe] != 0.0 and (probe == SRC_NONE or s == SRC_MODEL):
            probe = s  # a costly source's probes are rationed by their chance: they go first
    src = best if best != SRC_NONE else probe
    lookup = source_state(state, SRC_LOOKUP)
    if state[MS.offer_n] > 0.0 and lookup[TS.req_seen] < REQUEST_PROBES:
        src = SRC_LOOKUP  # a new request looks at its free source first: else an open model gate would starve it
    state[MS.source] = src
    state[MS.no_bonus] = source_state(state, src)[TS.no_bonus] if src != SRC_NONE else 0.0


@kernel
def multi_decide(state, step, confidence):
    src = int(state[MS.source])
    if src < 0:
        return 0
    return ts_decide(source_state(state, src), step, confidence)


@kernel
def multi_update(state, confidences, n_accepted, t_draft, t_verify):
    """The outer header was updated by the caller (controller_update)."""
    n_src = int(state[MS.n_src])
    src = int(state[MS.source])
    n = confidences.shape[0]
    no_bonus = state[MS.no_bonus] != 0.0 and n > 0
    b = n - 1 if no_bonus else n  # the verify batch held b + 1 tokens
    for s in range(n_src):
        sub = source_state(state, s)
        if s == src:
            sub[TS.t_catchup] = state[MS.t_catchup]
            update_header(sub, confidences, n_accepted, t_draft, t_verify)
            ts_update(sub, confidences, n_accepted, t_verify)
            continue
        # not chosen: theta_1 ages as in a round without drafts (unless it learns from offers in hindsight),
        # and the verify time is the machine's
        if sub[TS.hindsight] == 0.0:
            discount(sub, TS.pos, 1.0, 1.0, sub[TS.forget])
        if t_verify > 0.0 and t_verify < 1e30:
            record_verify(sub, b, t_verify)
            refresh_verify_estimates(sub)


@kernel
def multi_new_request(state):
    for s in range(int(state[MS.n_src])):
        ts_new_request(source_state(state, s))


@kernel
def multi_hindsight(state, match, n_offered, n_matched):
    """Prompt lookup's offer seen in hindsight: its source learns from it (thompson.ts_hindsight)."""
    ts_hindsight(source_state(state, SRC_LOOKUP), match, n_offered, n_matched)
