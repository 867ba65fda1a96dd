"""The entry points every controller state goes through, dispatched on its kind.

C-friendly signatures, so the native round loop takes the same code as Numba ``cfunc``s
(:mod:`.cfuncs` wraps each over the state as (double*, length)):

    controller_begin(state: float64[:]) -> None
    controller_decide(state: float64[:], step: int64, confidence: float64) -> int64 (1: draft one more)
    controller_update(state: float64[:], confidences: float64[:], n_accepted: int64,
                      t_draft: float64, t_verify: float64) -> None
    controller_hindsight(state: float64[:], match: int64, n_offered: int64, n_matched: int64) -> None
"""

from __future__ import annotations

from eesd_local.speculative.controllers.baselines import fixed_decide, heuristic_decide, heuristic_update, pmin_decide
from eesd_local.speculative.controllers.common import update_header
from eesd_local.speculative.controllers.jitcache import kernel
from eesd_local.speculative.controllers.layout import FIXED, HD, HEURISTIC, MULTI, PMIN, THOMPSON, TS
from eesd_local.speculative.controllers.multi import multi_begin, multi_decide, multi_hindsight, multi_new_request, multi_update
from eesd_local.speculative.controllers.thompson import ts_begin, ts_decide, ts_hindsight, ts_new_request, ts_update


@kernel
def controller_begin(state):
    if state[HD.kind] == THOMPSON:
        ts_begin(state)
    elif state[HD.kind] == MULTI:
        multi_begin(state)


@kernel
def controller_decide(state, step, confidence):
    kind = state[HD.kind]
    if kind == THOMPSON:
        return ts_decide(state, step, confidence)
    if kind == MULTI:
        return multi_decide(state, step, confidence)
    if kind == FIXED:
        return fixed_decide(state, step, confidence)
    if kind == PMIN:
        return pmin_decide(state, step, confidence)
    if kind == HEURISTIC:
        return heuristic_decide(state, step, confidence)
    return 0


@kernel
def controller_update(state, confidences, n_accepted, t_draft, t_verify):
    update_header(state, confidences, n_accepted, t_draft, t_verify)
    kind = state[HD.kind]
    if kind == THOMPSON:
        ts_update(state, confidences, n_accepted, t_verify)
    elif kind == MULTI:
        multi_update(state, confidences, n_accepted, t_draft, t_verify)
    elif kind == HEURISTIC:
        heuristic_update(state, confidences, n_accepted)


@kernel
def controller_hindsight(state, match, n_offered, n_matched):
    """A free offer (prompt lookup's n_offered tokens at match length ``match``) whose first n_matched
    tokens the target went on to emit: a no-op but for controllers that learn in hindsight
    (the Thompson state's hindsight, thompson.ts_hindsight)."""
    kind = state[HD.kind]
    if kind == THOMPSON:
        ts_hindsight(state, match, n_offered, n_matched)
    elif kind == MULTI:
        multi_hindsight(state, match, n_offered, n_matched)


@kernel
def controller_new_request(state):
    """A new request begins (called from Python, between generations)."""
    if state[HD.kind] == THOMPSON and state[TS.rule] == 0.0:
        ts_new_request(state)
    elif state[HD.kind] == MULTI:
        multi_new_request(state)
