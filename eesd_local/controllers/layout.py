"""Where each number lives in a controller's float64 state array.

Header (every controller): kind, limits, RNG words, running statistics. Then the
kind's own block. Thompson-sampling controllers append blocks sized by max_draft K:
confidence bins, per-position Beta posteriors, verify-time estimates per batch size
b = 1..K+1, and the per-position acceptance chances sampled at the start of a round.
"""

from __future__ import annotations

from numba import njit

# controller kinds
FIXED = 1
PMIN = 2
HEURISTIC = 3
THOMPSON = 4

# header, shared by all kinds
KIND = 0
MAX_DRAFT = 1
RNG = 2  # four words: 2..5
ROUNDS = 6  # rounds seen by end_round
EMA_DRAFTED = 7  # drafted tokens per round
EMA_ACCEPTED = 8  # accepted drafts per round
EMA_T_DRAFT = 9  # seconds per drafted token
EMA_T_VERIFY = 10  # seconds per verify call, any batch size
N_T_DRAFT = 11  # rounds with at least one draft (timing sample count)
ALL_A = 12  # pooled Beta posterior of "a draft token is accepted", all positions
ALL_B = 13
N_T_VERIFY = 14  # rounds with a usable verify time
NO_BONUS = 15  # this round verifies its drafts without the bonus token (a probe: see thompson.py); set by begin
HEADER = 16

# baselines: one parameter
PARAM = 16  # fixed: K; pmin: p_min; heuristic: the current K (a float that moves by +2/-1)
BASELINE_SIZE = 17

# Thompson-sampling block
RULE = 16  # 0: act optimally under the sampled model; 1: the EESD paper's Bernoulli(theta) rule
USE_BINS = 17  # condition on the drafter's confidence (calibration)
BATCH_COSTS = 18  # verify time per batch size (cost-aware); else one verify time for all sizes
EPS = 19  # exploration budget: the share of time a closed gate may spend on one-token probes
FORGET = 20  # per-observation discount of past evidence toward the prior
LAMBDA = 21  # this round's target rate: tokens per second of the best fixed k under the sample
PREFIX = 22  # sampled chance that every token drafted so far in this round is accepted
PROBE = 23  # this round may probe (1) or not (0)
OPEN = 24  # drafting pays under the posterior means (1) or not (0): when not, only probes draft
BIN0 = 25  # N_BINS triples (alpha, beta, predicted) over confidence bins, see thompson.py
N_BINS = 10
BIN_WIDTH = 3
POS0 = BIN0 + BIN_WIDTH * N_BINS  # K triples (alpha, beta, predicted), one per draft position
POS_WIDTH = 3


@njit(cache=True)
def vc0(k):
    """K+1 pairs (mean seconds, sample count) of the verify time for batch sizes 1..K+1."""
    return POS0 + POS_WIDTH * k


@njit(cache=True)
def ve0(k):
    """K+1 verify-time estimates used by the plan (observed, interpolated or assumed)."""
    return vc0(k) + 2 * (k + 1)


@njit(cache=True)
def th0(k):
    """K sampled per-position acceptance chances for the current round, then K posterior means."""
    return ve0(k) + (k + 1)


@njit(cache=True)
def thompson_size(k):
    return th0(k) + 2 * k
