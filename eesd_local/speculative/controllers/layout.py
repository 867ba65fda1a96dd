"""Where each number lives in a controller's float64 state array.

Header (every controller): kind, limits, RNG words, running statistics. Then the
kind's own block. Thompson-sampling controllers append blocks sized by max_draft K:
confidence bins, per-position Beta posteriors, verify-time estimates per batch size
b = 1..K+1, and the per-position acceptance chances sampled at the start of a round.
"""

from __future__ import annotations

from eesd_local.speculative.controllers.jitcache import kernel

# controller kinds
FIXED = 1
PMIN = 2
HEURISTIC = 3
THOMPSON = 4
MULTI = 5  # several sources (lookup, a draft model), each with a Thompson state of its own: see multi.py

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
# what the round loop knows before a round begins, written by the loop before controller_begin:
OFFER_N = 16  # free proposals on offer (prompt lookup's continuation length; 0: none)
OFFER_CONF = 17  # their confidence (the lookup's matched n-gram length over its maximum; 0: unknown)
BEHIND = 18  # tokens a draft model would catch up on before drafting (it did not draft for a while)
SOURCE = 19  # which source drafts this round (set by a multi-source begin: see SRC_*)
T_CATCHUP = 20  # seconds this round's draft model spent catching up (written by the loop before update)
OFFER_MATCH = 21  # how many tokens before the offer match its source (lookup's match length, beyond the n-gram)
HEADER = 22

# the sources of a drafter, as SOURCE numbers them
SRC_ANY = -2  # the controller does not choose (one source, or a baseline rule): the drafter's own default
SRC_NONE = -1  # nothing is drafted this round
SRC_LOOKUP = 0
SRC_MODEL = 1

# baselines: one parameter
PARAM = HEADER  # fixed: K; pmin: p_min; heuristic: the current K (a float that moves by +2/-1)
BASELINE_SIZE = HEADER + 1

# Thompson-sampling block
RULE = HEADER + 0  # 0: act optimally under the sampled model; 1: the EESD paper's Bernoulli(theta) rule
USE_BINS = HEADER + 1  # condition on the drafter's confidence (calibration)
BATCH_COSTS = HEADER + 2  # verify time per batch size (cost-aware); else one verify time for all sizes
EPS = HEADER + 3  # exploration budget: the share of time a closed gate may spend on one-token probes
FORGET = HEADER + 4  # per-observation discount of past evidence toward the prior
LAMBDA = HEADER + 5  # this round's target rate: tokens per second of the best fixed k under the sample
PREFIX = HEADER + 6  # sampled chance that every token drafted so far in this round is accepted
PROBE = HEADER + 7  # this round may probe (1) or not (0)
OPEN = HEADER + 8  # drafting pays under the posterior means (1) or not (0): when not, only probes draft
RESUME = HEADER + 9  # seconds per token a model source spends catching up (charged to resuming, not to drafts)
N_RESUME = HEADER + 10  # catch-up samples behind RESUME
REQ_SEEN = HEADER + 11  # rounds of the current request whose drafts were verified (see thompson.ts_new_request)
# acceptance of free offers is learned from every offer in hindsight (ts_hindsight), not from drafts, by
# match length: the BIN0 triples then hold one Beta (alpha, beta, -) per match-length class (thompson.match_class)
HINDSIGHT = HEADER + 12
# a round drafts only if the rate its plan gives (tokens per second, under the round's sample; posterior
# means in hindsight) beats plain decoding's by this share: the costs a round's plan leaves out
MARGIN = HEADER + 13
# a model source's stretches: rounds it drafted since it last resumed (caught up), and the mean of
# 1 / stretch over the stretches that ended: how a resume's catch-up is spread (thompson.resume_cost)
STRETCH = HEADER + 14
STRETCH_MEAN = HEADER + 15
BIN0 = HEADER + 16  # N_BINS triples (alpha, beta, predicted) over confidence bins, see thompson.py
N_BINS = 10
BIN_WIDTH = 3
POS0 = BIN0 + BIN_WIDTH * N_BINS  # K triples (alpha, beta, predicted), one per draft position
POS_WIDTH = 3


@kernel
def vc0(k):
    """K+1 pairs (mean seconds, sample count) of the verify time for batch sizes 1..K+1."""
    return POS0 + POS_WIDTH * k


@kernel
def ve0(k):
    """K+1 verify-time estimates used by the plan (observed, interpolated or assumed)."""
    return vc0(k) + 2 * (k + 1)


@kernel
def th0(k):
    """K sampled per-position acceptance chances for the current round, then K posterior means."""
    return ve0(k) + (k + 1)


@kernel
def thompson_size(k):
    return th0(k) + 2 * k


# multi-source block: the number of sources, then each source's whole Thompson state (header
# included) at its offset; the outer header keeps the pooled statistics and the round's SOURCE
N_SRC = HEADER
SRC_OFS = HEADER + 1  # MAX_SRC offsets
MAX_SRC = 2
MULTI_HEAD = HEADER + 1 + MAX_SRC


def loop_slots() -> dict[str, int]:
    """Where the native round loop reads and writes the state, by field: what it knows before a round
    (offer_n, offer_conf, offer_match, behind), what begin decided (source, no_bonus) and the catch-up
    seconds it writes before update."""
    return {"offer_n": OFFER_N, "offer_conf": OFFER_CONF, "behind": BEHIND, "source": SOURCE,
            "t_catchup": T_CATCHUP, "offer_match": OFFER_MATCH, "no_bonus": NO_BONUS}
