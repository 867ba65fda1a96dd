"""Pieces every controller kernel shares: running means, discounted Beta evidence,
and the header statistics (acceptance, timings) that ``belief()`` reports."""

from __future__ import annotations

from eesd_local.speculative.controllers.jitcache import kernel
from eesd_local.speculative.controllers.layout import BP, HD

W_MIN = 0.05  # running mean over the first 20 samples, then an EMA with a ~20-sample memory
POOLED_FORGET = 0.98  # the pooled acceptance posterior keeps ~1/(1-0.98) = 50 observations


@kernel
def ema(old, new, n):
    """Running mean while n <= 1/W_MIN, exponential moving average after."""
    w = max(1.0 / n, W_MIN)
    return old + w * (new - old)


@kernel
def discount(state, at, prior_a, prior_b, forget):
    """Age the Beta(alpha, beta) at state[at] (a layout.BETA_PAIR, or a TRIPLE's first two) toward its
    prior: alpha <- a0 + g (alpha - a0)."""
    state[at + BP.alpha] = prior_a + forget * (state[at + BP.alpha] - prior_a)
    state[at + BP.beta] = prior_b + forget * (state[at + BP.beta] - prior_b)


@kernel
def observe(state, at, prior_a, prior_b, forget, accepted):
    """One Bernoulli outcome into the Beta(alpha, beta) at state[at] (as :func:`discount`).

    Old evidence is discounted toward the prior first, so the posterior holds about 1/(1-g)
    observations and follows a change of regime.
    """
    discount(state, at, prior_a, prior_b, forget)
    state[at + BP.alpha] += accepted
    state[at + BP.beta] += 1.0 - accepted


@kernel
def update_header(state, confidences, n_accepted, t_draft, t_verify):
    n = confidences.shape[0]
    a = min(max(n_accepted, 0), n)
    state[HD.rounds] += 1.0
    rounds = state[HD.rounds]
    state[HD.ema_drafted] = ema(state[HD.ema_drafted], n, rounds)
    state[HD.ema_accepted] = ema(state[HD.ema_accepted], a, rounds)
    if t_verify > 0.0 and t_verify < 1e30:  # a missing or NaN timing must not poison the means
        state[HD.n_t_verify] += 1.0
        state[HD.ema_t_verify] = ema(state[HD.ema_t_verify], t_verify, state[HD.n_t_verify])
    if n > 0 and t_draft >= 0.0 and t_draft < 1e30:
        state[HD.n_t_draft] += 1.0
        state[HD.ema_t_draft] = ema(state[HD.ema_t_draft], t_draft / n, state[HD.n_t_draft])
    # accepted positions are successes, the first rejected one a failure, later ones unobserved
    for _ in range(a):
        observe(state, HD.pooled, 1.0, 1.0, POOLED_FORGET, 1.0)
    if a < n:
        observe(state, HD.pooled, 1.0, 1.0, POOLED_FORGET, 0.0)
