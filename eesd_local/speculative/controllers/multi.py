"""Several draft sources under one controller: each round, which source drafts and how much.

A multi-source state is an outer header (pooled statistics for ``belief()``, the loop's
offer, the round's SOURCE) followed by one whole cost-aware Thompson state per source
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

Prompt lookup (source 0) can only draft what it found: with no offer (OFFER_N = 0) it is not a
candidate, and its plan is capped at the offer's length and conditioned on the offer's
confidence. A draft model (source 1) is charged its catch-up (BEHIND tokens) once, to the round
that resumes it.
"""

from __future__ import annotations

from eesd_local.speculative.controllers.common import discount, update_header
from eesd_local.speculative.controllers.jitcache import kernel
from eesd_local.speculative.controllers.layout import (
    BEHIND,
    FORGET,
    HINDSIGHT,
    LAMBDA,
    MAX_DRAFT,
    MULTI_HEAD,
    N_SRC,
    NO_BONUS,
    OFFER_CONF,
    OFFER_MATCH,
    OFFER_N,
    OPEN,
    POS0,
    PROBE,
    REQ_SEEN,
    SOURCE,
    SRC_LOOKUP,
    SRC_MODEL,
    SRC_NONE,
    T_CATCHUP,
    thompson_size,
)
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
    size = thompson_size(int(state[MAX_DRAFT]))
    at = MULTI_HEAD + s * size
    return state[at : at + size]


@kernel
def multi_begin(state):
    n_src = int(state[N_SRC])
    best = SRC_NONE
    best_rate = 0.0
    probe = SRC_NONE
    for s in range(n_src):
        sub = source_state(state, s)
        if s == SRC_LOOKUP:
            sub[OFFER_N] = state[OFFER_N]
            sub[OFFER_CONF] = state[OFFER_CONF]
            sub[OFFER_MATCH] = state[OFFER_MATCH]
            sub[BEHIND] = 0.0
        else:
            sub[OFFER_N] = 0.0
            sub[OFFER_CONF] = 0.0
            sub[BEHIND] = state[BEHIND]
        ts_begin(sub)
        if s == SRC_LOOKUP and state[OFFER_N] <= 0.0:
            continue  # nothing to propose this round
        if sub[OPEN] != 0.0:
            if sub[LAMBDA] > best_rate:
                best = s
                best_rate = sub[LAMBDA]
        elif sub[PROBE] != 0.0 and (probe == SRC_NONE or s == SRC_MODEL):
            probe = s  # a costly source's probes are rationed by their chance: they go first
    src = best if best != SRC_NONE else probe
    lookup = source_state(state, SRC_LOOKUP)
    if state[OFFER_N] > 0.0 and lookup[REQ_SEEN] < REQUEST_PROBES:
        src = SRC_LOOKUP  # a new request looks at its free source first: else an open model gate would starve it
    state[SOURCE] = src
    state[NO_BONUS] = source_state(state, src)[NO_BONUS] if src != SRC_NONE else 0.0


@kernel
def multi_decide(state, step, confidence):
    src = int(state[SOURCE])
    if src < 0:
        return 0
    return ts_decide(source_state(state, src), step, confidence)


@kernel
def multi_update(state, confidences, n_accepted, t_draft, t_verify):
    """The outer header was updated by the caller (controller_update)."""
    n_src = int(state[N_SRC])
    src = int(state[SOURCE])
    n = confidences.shape[0]
    no_bonus = state[NO_BONUS] != 0.0 and n > 0
    b = n - 1 if no_bonus else n  # the verify batch held b + 1 tokens
    for s in range(n_src):
        sub = source_state(state, s)
        if s == src:
            sub[T_CATCHUP] = state[T_CATCHUP]
            update_header(sub, confidences, n_accepted, t_draft, t_verify)
            ts_update(sub, confidences, n_accepted, t_verify)
            continue
        # not chosen: theta_1 ages as in a round without drafts (unless it learns from offers in hindsight),
        # and the verify time is the machine's
        if sub[HINDSIGHT] == 0.0:
            discount(sub, POS0, 1.0, 1.0, sub[FORGET])
        if t_verify > 0.0 and t_verify < 1e30:
            record_verify(sub, b, t_verify)
            refresh_verify_estimates(sub)


@kernel
def multi_new_request(state):
    for s in range(int(state[N_SRC])):
        ts_new_request(source_state(state, s))


@kernel
def multi_hindsight(state, match, n_offered, n_matched):
    """Prompt lookup's offer seen in hindsight: its source learns from it (thompson.ts_hindsight)."""
    ts_hindsight(source_state(state, SRC_LOOKUP), match, n_offered, n_matched)
