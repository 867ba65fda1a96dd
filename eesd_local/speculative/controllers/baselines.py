"""Baseline draft-length rules: fixed k, llama.cpp's p_min, and the +2/-1 heuristic."""

from __future__ import annotations

from eesd_local.speculative.controllers.jitcache import kernel
from eesd_local.speculative.controllers.layout import BS

HEURISTIC_START = 5.0  # transformers' assistant starts at num_assistant_tokens = 5


@kernel
def fixed_decide(state, step, confidence):
    return 1 if step < min(state[BS.param], state[BS.max_draft]) else 0


@kernel
def pmin_decide(state, step, confidence):
    """llama.cpp's speculative p_min: stop once the drafter's probability of its last token < p_min.

    llama.cpp checks the candidate before keeping it; here the doubtful token is already
    drafted and goes to verification, and drafting stops after it.
    """
    if step >= state[BS.max_draft]:
        return 0
    return 1 if step == 0 or confidence >= state[BS.param] else 0


@kernel
def heuristic_decide(state, step, confidence):
    return 1 if step < min(int(state[BS.param]), state[BS.max_draft]) else 0


@kernel
def heuristic_update(state, confidences, n_accepted):
    """transformers' heuristic schedule: K += 2 when the whole draft was accepted, else K -= 1 (K >= 1)."""
    n = confidences.shape[0]
    k = state[BS.param]
    if n > 0 and n_accepted >= n and n >= int(k):
        k += 2.0
    else:
        k -= 1.0
    state[BS.param] = min(max(k, 1.0), state[BS.max_draft])
