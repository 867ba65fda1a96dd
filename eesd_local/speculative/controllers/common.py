"""Pieces every controller kernel shares: running means, discounted Beta evidence,
and the header statistics (acceptance, timings) that ``belief()`` reports."""

from __future__ import annotations

from eesd_local.speculative.controllers.jitcache import kernel
from eesd_local.speculative.controllers.layout import (
    ALL_A,
    EMA_ACCEPTED,
    EMA_DRAFTED,
    EMA_T_DRAFT,
    EMA_T_VERIFY,
    N_T_DRAFT,
    N_T_VERIFY,
    ROUNDS,
)

W_MIN = 0.05  # running mean over the first 20 samples, then an EMA with a ~20-sample memory
POOLED_FORGET = 0.98  # the pooled acceptance posterior keeps ~1/(1-0.98) = 50 observations


@kernel
def ema(old, new, n):
    """Running mean while n <= 1/W_MIN, exponential moving average after."""
    w = max(1.0 / n, W_MIN)
    return old + w * (new - old)


@kernel
def discount(state, at, prior_a, prior_b, forget):
    """Age the Beta(alpha, beta) at state[at:at+2] toward its prior: alpha <- a0 + g (alpha - a0)."""
    state[at] = prior_a + forget * (state[at] - prior_a)
    state[at + 1] = prior_b + forget * (state[at + 1] - prior_b)


@kernel
def observe(state, at, prior_a, prior_b, forget, accepted):
    """One Bernoulli outcome into the Beta(alpha, beta) at state[at:at+2].

    Old evidence is discounted toward the prior first, so the posterior holds about 1/(1-g)
    observations and follows a change of regime.
    """
    discount(state, at, prior_a, prior_b, forget)
    state[at] += accepted
    state[at + 1] += 1.0 - accepted


@kernel
def update_header(state, confidences, n_accepted, t_draft, t_verify):
    n = confidences.shape[0]
    a = min(max(n_accepted, 0), n)
    state[ROUNDS] += 1.0
    rounds = state[ROUNDS]
    state[EMA_DRAFTED] = ema(state[EMA_DRAFTED], n, rounds)
    state[EMA_ACCEPTED] = ema(state[EMA_ACCEPTED], a, rounds)
    if t_verify > 0.0 and t_verify < 1e30:  # a missing or NaN timing must not poison the means
        state[N_T_VERIFY] += 1.0
        state[EMA_T_VERIFY] = ema(state[EMA_T_VERIFY], t_verify, state[N_T_VERIFY])
    if n > 0 and t_draft >= 0.0 and t_draft < 1e30:
        state[N_T_DRAFT] += 1.0
        state[EMA_T_DRAFT] = ema(state[EMA_T_DRAFT], t_draft / n, state[N_T_DRAFT])
    # accepted positions are successes, the first rejected one a failure, later ones unobserved
    for _ in range(a):
        observe(state, ALL_A, 1.0, 1.0, POOLED_FORGET, 1.0)
    if a < n:
        observe(state, ALL_A, 1.0, 1.0, POOLED_FORGET, 0.0)
