"""Thompson-sampling draft-length control: Beta-TS, Calibration-TS and cost-aware TS.

Model. Draft token i (1-based) is accepted, given that tokens 1..i-1 were, with chance
p_i. Each position has a Beta posterior: accepted positions add to its alpha, the first
rejected one to its beta, later positions are unobserved. Position 1, seen in every
round that drafts, carries the level and forgets fast (FORGET, ~100 observations); a
deeper position carries only its odds ratio to the position before it, learned slowly:
    odds(p_i) = odds(p_{i-1}) * odds(theta_i) / odds(r_i),
where r_i is the mean chance p_{i-1} the model predicted for the tokens position i saw.
A change of regime moves theta_1 within tens of rounds and every deeper position with
it; a position never observed is assumed as good as the one before it (ratio prior 1).
Calibration does the same for the drafter's confidence c: one Beta per confidence bin
and the mean r_bin the position model predicted for its tokens, so
    odds(p_i | c) = odds(p_i) * odds(theta_bin(c)) / odds(r_bin(c)),
which is 1 for an uninformative confidence and > 1 for a bin that does better than
its positions suggest.

Decision (Thompson sampling). At the start of a round sample theta_1 from its posterior
(deeper positions follow it through their mean odds ratios), sample the bin of each
drafted token's confidence when the token arrives, and act optimally for the sample. A round that drafts k tokens yields
E[N_k] = sum_{i=0..k} prod_{m<=i} p_m tokens in C_k = k d + V(k+1) seconds (d: one
draft step, V(b): one target decode of b tokens). Throughput E[N]/E[C] is a ratio, so
the best policy maximises E[N] - lambda E[C] at lambda = the best rate, here the best
fixed k under the sample. At step j (P_j = sampled chance that drafts 1..j are all
accepted) draft another token iff some k > j has
    P_j sum_{i=j+1..k} prod_{m=j+1..i} p_m  >  lambda (d (k - j) + V(k+1) - V(j+1)),
i.e. the tokens it adds are worth more than the time it costs. Looking to every k > j,
not only j+1, lets the plan cross a batch size whose marginal cost is high.

Costs. d and V(b) are measured online. Beta-TS and Calibration-TS take one verify time
for every batch size (the flat GPU case EESD was made for); cost-aware TS keeps a mean
per batch size, smoothed toward a fitted line (see refresh_verify_estimates).

Margin (cost-ts, the margin field, DRAFT_MARGIN). A round drafts only where its plan beats plain
decoding's rate by 5% under the round's own sample (in hindsight: under the posterior means),
and a probe with its bonus token is priced against that hurdle; the gate keeps its break-even,
so probes reopen it as fast as before. C_k leaves out what a drafting round does to the rounds
around it (the draft's weights evict the target's from the caches): on a CPU where a batch of two
costs little more than one token, plans at break-even drafted on chat with the exit head and lost
up to 8% to plain decoding (BENCHMARKS.md). Where the target runs on the CPU the engine raises the
margin to CPU_DRAFT_MARGIN (Controller.raise_margin): the draft's work shares the target's cores and
caches there, and with 5% the 1.5B's exit head on the shared trunk still drafted on chat at 36-49%
accepted and ran 0.97-0.99 of plain decoding on four of seven chat kinds; with 10% 0.99-1.13 on all
seven, the 0.5B's rounds unchanged (its free offers clear either hurdle). On a GPU (the simulator's
profiles) 10% starved a draft model worth 15-20% (prose, 0.1 of a token: 1.00 on one seed).
``cost-ts:no-margin`` drafts at break-even, for comparison.

Catching up (a draft model that did not draft for a while: copy-mode EESD, a draft model, auto's
model source). Its catch-up is paid once and serves the whole stretch of rounds it then drafts, so
a round that resumes it is charged the catch-up spread over the stretches it drafted before
(resume_cost), not all of it: else, while another source drafts, the catch-up grows every round
and locks the model out however much more it would pay. And no probe may waste more than
PROBE_WASTE_MAX target tokens: probing a model a thousand tokens behind is cheap on average
(rationed by EPS) but a lottery whose one draw costs a user 5-15% of a request.

Exploration where drafting does not pay. TS samples from the tail of the posterior
would keep buying long drafts that cost several target tokens each. So when no k pays
even at a mildly optimistic theta_1 (posterior mean + GATE_Z sd), the gate closes: a
round then drafts nothing, or with a small chance one token, a *probe*. Where a batch
of two costs more than the bonus token is worth (V(2) - V(1) > theta_1 V(1), as on small CPUs),
the probe is verified WITHOUT its bonus: the target decodes only [last], exactly what
plain decoding does, and its one token is the draft if accepted, else the correction.
Such a probe costs just one draft step over plain decoding, so probes can be frequent
(their chance is set so they take about EPS of the time: every round for a free lookup
drafter, ~3% of rounds for a drafter at 0.35 of a target token). theta_1's evidence
ages by the round, observed or not, so after a long closed spell a few probes move it:
the gate reopens within ~170 rounds of a switch to an easy regime on the cpu profiles
(simulator) while costing ~1% where nothing pays.

Free offers, learned in hindsight (the hindsight field; the engine turns it on for prompt lookup, alone
or as `auto`'s lookup source). A lookup draft is a point proposal, accepted with the chance that
the target emits it, so the tokens the target goes on to emit tell how far every offer would
have run, drafted or not: the loop reports each offer once its outcome is known (ts_hindsight),
and acceptance is learned from all of them at no cost. With full information nothing is gained
by exploring: the plan takes posterior means, no probes. The model changes too: what predicts
whether the next offered token is right is how long the context already matches the offer's
source (L0 tokens before the round, L0 + i after i accepted drafts), so the classes field holds
one Beta per match-length class (1..9 each, then 10-15, 16-23, 24-31, 32-47, 48-63, 64+: lookup
measures matches up to 64 tokens), forgotten per request like theta_1. A class spanning w lengths
keeps w times the evidence (a copy passes each of its lengths once), and from 10 tokens on a class
backs off to the class below (its prior is that class's mean), so a 64-token draft is planned from
what long matches did, not from a hopeful prior; and an offer drafts no more tokens than its match is
long (REACH_FLOOR at least: SuffixDecoding's rule), since the classes pool requests and a chat request
that happens to match 15 tokens does not copy as an agent's does. A request's prediction is exempt
(offer_reach): the client said the answer goes on as it does, so right after a realignment its offer is
planned as far as the classes' chances say pays (BENCHMARKS.md, "Predicted outputs"). On recorded answers of
the built-in sets (scripts/lookup_replay.py) this is within 1-2% of the best fixed rule per
category in hindsight, where the position model above lost up to 8% to plain decoding on prose
(its odds ratios, learned on copy-heavy requests, carried long drafts into prose). Two refinements
(issue 31): prompt lookup reports an ambiguous n-gram (its earlier occurrences went on differently)
as a one-token match, and offers at matches of REQUEST_MATCH tokens or more share the request's odds
ratio against their classes (the first position's triple, which the position model does not use in hindsight):
a long match runs on in a rewrite and in code, less often in chat, and the classes pool every request.
With B(b) fixed from the kept cost profile (PROFILE_COSTS) the plan is then a function of the tokens.

rule = 1 is the EESD paper's rule, kept for comparison: at each step sample theta (the
pooled posterior, or the confidence bin's) and go on with probability theta. Its draft
length is geometric, which loses 6-21% to the best fixed k on the simulator's GPU
profiles whatever the posterior, so it is not the default behaviour.
"""

from __future__ import annotations

import math

from eesd_local.speculative.controllers.common import discount, ema, observe
from eesd_local.speculative.controllers.jitcache import kernel
from eesd_local.speculative.controllers.layout import BP, MATCH_EDGES, N_BINS, N_MATCH, TR, TS, VP, at
from eesd_local.speculative.controllers.rng import beta, uniform

BIN_PRIOR = 2.0  # prior strength of a confidence bin, centred on the bin's confidence
POS_PRIOR = 2.0  # prior strength of a deeper position's odds ratio, centred on 1 ("as good as the one before")
RATIO_FORGET = 0.995  # odds ratios (deeper positions, bins) keep ~200 observations: they are stable, and noisy with few
LINE_PRIOR = 3.0  # pseudo-samples of the fitted verify-time line behind each batch size's own mean
PROBE_WASTE_MAX = 4.0  # no probe wastes more than this many target tokens (a draft model far behind)
GATE_Z = 0.5  # how optimistic the "does any k pay?" gate is, in posterior sds of theta_1
THETA_CLAMP = 1e-9  # keeps odds finite when a sampled theta rounds to 0 or 1
REQUEST_EVIDENCE = 4.0  # observations of theta_1 a new request starts with (ts_new_request)
REQUEST_RATIO_EVIDENCE = 16.0  # observations each deeper position's odds ratio keeps at a new request
REQUEST_PROBES = 2  # a new request's gate stays closed until this many of its rounds were verified
MATCH_PRIOR = 2.0  # prior strength of a match-length class (in hindsight)
MATCH_REQUEST_EVIDENCE = 16.0  # observations each match-length class keeps at a new request (in hindsight)
MATCH_FORGET = 0.99  # a match-length class keeps ~100 observations (in hindsight)
BACKOFF_CLASS = 9  # in hindsight: match-length classes from this one (10 tokens and more) back off to the class below
REACH_FLOOR = 8  # in hindsight: a free offer may draft as many tokens as its match is long, and at least this many
REQUEST_MATCH = 4  # in hindsight: offers at matches of this many tokens and more share a per-request odds ratio
REQUEST_MATCH_PRIOR = 4.0  # its prior strength in observations ("as the classes predict")
PROFILE_COSTS = 2.0  # batch_costs: per size, B(b) fixed from the kept cost profile (Controller.prime_costs)
DRAFT_MARGIN = 0.05  # cost-ts: a round drafts only if its plan beats plain decoding's rate by this share (the margin field)
CPU_DRAFT_MARGIN = 0.10  # ... and this where the target runs on the CPU (the engine: Controller.raise_margin)


@kernel
def conf_bin(confidence):
    """Bins equal in sqrt(1 - c), finer near c = 1 where drafters put most tokens."""
    c = min(max(confidence, 0.0), 1.0)
    return min(int(N_BINS * (1.0 - math.sqrt(1.0 - c))), N_BINS - 1)


@kernel
def bin_prior_mean(i):
    u = 1.0 - (i + 0.5) / N_BINS
    return 1.0 - u * u


@kernel
def _size_mean(state, vc, b):
    """Mean seconds of a verify of b + 1 tokens (vc: the verify field): a batch of one is kept in seconds,
    a larger one as its ratio to a batch of one at the time (record_verify), so a machine that gets busier
    or quieter moves every size at once, not only the sizes that happen to run."""
    return state[vc + VP.mean] if b == 0 else state[vc + VP.size * b + VP.mean] * state[vc + VP.mean]


@kernel
def record_verify(state, b, t_verify):
    """One verify of b + 1 tokens that took t_verify seconds into the per-size means (cost-aware TS)."""
    k = int(state[TS.max_draft])
    one = at(TS.verify, k)  # a batch of one
    vc = one + VP.size * min(b, k)
    if b == 0:
        state[vc + VP.count] += 1.0
        state[vc + VP.mean] = ema(state[vc + VP.mean], t_verify, state[vc + VP.count])
    elif state[TS.batch_costs] == PROFILE_COSTS:
        return  # the ratios are the kept cost profile's
    elif state[one + VP.count] > 0.0 and state[one + VP.mean] > 0.0:  # a ratio needs a batch of one timed first
        state[vc + VP.count] += 1.0
        state[vc + VP.mean] = ema(state[vc + VP.mean], t_verify / state[one + VP.mean], state[vc + VP.count])


@kernel
def refresh_verify_estimates(state):
    """V(b) for b = 1..K+1 into the estimate field.

    Flat (Beta-TS, Calibration-TS): the mean verify time over all rounds, for every b.
    Per size (cost-aware TS): a line a + s (b - 1) fitted by least squares to the per-size
    means weighted by their sample counts (s >= 0), and each size's own mean shrunk toward
    it: V(b) = (n_b mean_b + LINE_PRIOR line(b)) / (n_b + LINE_PRIOR). One noisy sample
    of a rarely used size cannot then hide it or make it look cheap; a size never seen
    takes the line, flat while only one size is known (optimistic, so it gets tried).
    """
    k = int(state[TS.max_draft])
    vc = at(TS.verify, k)
    ve = at(TS.estimate, k)
    if state[TS.batch_costs] == 0.0:
        for b in range(k + 1):
            state[ve + b] = state[TS.ema_t_verify]
        return
    if state[TS.batch_costs] == PROFILE_COSTS:  # t(1) as timed here, B(b) as the kept cost profile has it
        for b in range(k + 1):
            state[ve + b] = _size_mean(state, vc, b)
        return
    sw = 0.0
    sx = 0.0
    sy = 0.0
    sxx = 0.0
    sxy = 0.0
    for b in range(k + 1):
        n = state[vc + VP.size * b + VP.count]
        y = _size_mean(state, vc, b)
        sw += n
        sx += n * b
        sy += n * y
        sxx += n * b * b
        sxy += n * b * y
    if sw == 0.0:
        for b in range(k + 1):
            state[ve + b] = 0.0
        return
    den = sw * sxx - sx * sx
    slope = max((sw * sxy - sx * sy) / den, 0.0) if den > 0.0 else 0.0
    icpt = (sy - slope * sx) / sw
    top = 0  # the largest batch size timed so far
    for b in range(k + 1):
        n = state[vc + VP.size * b + VP.count]
        state[ve + b] = (n * _size_mean(state, vc, b) + LINE_PRIOR * (icpt + slope * b)) / (n + LINE_PRIOR)
        if n > 0.0:
            top = b
    # sizes beyond the largest timed one cost no more than it (optimistic, so they get tried): a line
    # through a batch of one and a batch of two only would price a batch of nine far above what it
    # costs (batching amortises the weight reads), and a closed gate would never time it to learn better
    for b in range(top + 1, k + 1):
        state[ve + b] = state[ve + top]


@kernel
def _odds(p):
    p = min(max(p, THETA_CLAMP), 1.0 - THETA_CLAMP)
    return p / (1.0 - p)


@kernel
def _prob(odds):
    return odds / (1.0 + odds)


@kernel
def _mean_ratio(state, t):
    """odds(posterior mean) / odds(predicted mean) of the triple (layout.TRIPLE) at state[t]."""
    n = state[t + TR.alpha] + state[t + TR.beta]
    return _odds(state[t + TR.alpha] / n) / _odds(state[t + TR.predicted] / n)


@kernel
def _observe_ratio(state, t, strength, prior_mean, accepted, predicted):
    """One outcome into the triple at state[t]; the prior says 'as predicted' (ratio 1) with this strength."""
    a0 = strength * prior_mean
    state[t + TR.predicted] = a0 + RATIO_FORGET * (state[t + TR.predicted] - a0) + predicted
    observe(state, t, a0, strength - a0, RATIO_FORGET, accepted)


@kernel
def plan_limit(state):
    """Most tokens this round's plan counts on: max_draft, or fewer when the drafter's free
    proposals (offer_n, prompt lookup's continuation) are all it has; a drafting model (no free
    offer) at most model_max."""
    k = int(state[TS.max_draft])
    n = int(state[TS.offer_n])
    if n <= 0:
        return min(k, int(state[TS.model_max])) if state[TS.model_max] > 0.0 else k
    if state[TS.hindsight] != 0.0 and state[TS.offer_match] > 0.0:
        # a free offer reaches no further than its match is long (and REACH_FLOOR tokens): what the classes
        # pool over requests says little about how far this request's copy runs beyond what it has shown
        # (a request's prediction reaches as far as it goes: offer_reach)
        k = min(k, max(REACH_FLOOR, int(state[TS.offer_match]), int(state[TS.offer_reach])))
    return min(k, n)


@kernel
def offer_ratio(state, sampled):
    """Odds ratio of position 1 given the offer's confidence (the calibration bin of offer_conf):
    a lookup that matched a long n-gram is a safer bet than one that matched a single token.
    1 when no confidence is known (offer_conf outside (0, 1)) or bins are off."""
    c = state[TS.offer_conf]
    if state[TS.use_bins] == 0.0 or c <= 0.0 or c >= 1.0:
        return 1.0
    b = TS.bins + TR.size * conf_bin(c)
    n = state[b + TR.alpha] + state[b + TR.beta]
    theta = beta(state, TS.rng, state[b + TR.alpha], state[b + TR.beta]) if sampled else state[b + TR.alpha] / n
    return _odds(theta) / _odds(state[b + TR.predicted] / n)


@kernel
def resume_cost(state):
    """Seconds of a draft model's catching up on ``behind`` tokens charged to the round that resumes it:
    paid once, before its first draft, and then good for the whole stretch of rounds it drafts before
    it falls behind again. So the catch-up is spread over the stretches the model drafted, their
    harmonic mean (stretch_mean holds the mean of 1/stretch: short stretches weigh most, so a model
    that drafts a round and stops is charged nearly all of it; the current stretch until one has
    ended; 1 while it never drafted). Charging it all to one round locks the model out: while another
    source drafts, the model falls further behind, its catch-up grows with every round, and it never
    resumes, however much more it would pay."""
    behind = state[TS.behind]
    if behind <= 1.0:
        return 0.0
    per_round = state[TS.stretch_mean] if state[TS.n_resume] > 0.0 else 1.0 / max(1.0, state[TS.stretch])
    return behind * state[TS.resume] * per_round


@kernel
def ts_begin(state):
    k = int(state[TS.max_draft])
    state[TS.prefix] = 1.0
    state[TS.no_bonus] = 0.0
    if state[TS.rule] != 0.0:
        state[TS.probe] = 1.0 if uniform(state, TS.rng) < state[TS.eps] else 0.0
        return
    if state[TS.hindsight] != 0.0:
        _hindsight_begin(state)
        return
    kk = plan_limit(state)
    th = at(TS.chance, k)
    ve = at(TS.estimate, k)
    d = state[TS.ema_t_draft]
    a1 = state[TS.pos + TR.alpha]
    b1 = state[TS.pos + TR.beta]
    resume = resume_cost(state)
    odds_1 = _odds(beta(state, TS.rng, a1, b1)) * offer_ratio(state, True)
    state[TS.lam] = _best_rate(state, odds_1, th, ve, d, kk, resume)
    n1 = a1 + b1
    mean1 = a1 / n1
    v1 = state[ve]
    # where no k pays at theta_1's posterior mean, the gate closes: the round drafts nothing, or with a
    # small chance one token, a probe that keeps theta_1 current (its evidence ages by the round). Sampling
    # from the tail of a posterior that only probes feed would buy costly long drafts instead.
    rate_0 = 1.0 / v1 if v1 > 0.0 else 0.0
    optimistic = mean1 + GATE_Z * math.sqrt(a1 * b1 / (n1 * n1 * (n1 + 1.0)))
    ratio = offer_ratio(state, False)
    state[TS.open] = 1.0 if _best_rate(state, _odds(optimistic) * ratio, at(TS.gate_chance, k), ve, d, kk, resume) > rate_0 else 0.0
    # an open gate drafts only where the round's own sample beats plain decoding's rate by margin: what a
    # plan leaves out (the draft's weights evicting the target's from the caches) costs a few percent, so a
    # plan at break-even loses. (The gate itself keeps its break-even, so probes reopen it as fast.)
    if state[TS.open] != 0.0 and state[TS.lam] <= (1.0 + state[TS.margin]) * rate_0:
        state[TS.open] = 0.0  # this round drafts nothing, or probes
    warm_up = state[TS.open] != 0.0 and state[TS.req_seen] < REQUEST_PROBES
    if warm_up:
        state[TS.open] = 0.0  # a new request probes before it drafts more (its acceptance is its own): see below
    chance = state[TS.eps]
    if state[TS.open] == 0.0 and state[TS.batch_costs] != 0.0:
        # a one-token round verified without its bonus costs d + V(1) for exactly one token (it wastes d),
        # with the bonus d + V(2) for 1 + theta_1, a token worth V(1) / (1 + margin) at the hurdle a drafting
        # round must clear: the probe takes whichever wastes less, and probes take about EPS of the time
        p1 = _prob(_odds(mean1) * ratio)
        waste = d + state[ve + 1] - (1.0 + p1) * v1 / (1.0 + state[TS.margin])
        if d < waste:
            state[TS.no_bonus] = 1.0
            waste = d
        waste += resume
        chance = min(1.0, state[TS.eps] * v1 / waste) if waste > 0.0 else 1.0
        if waste > PROBE_WASTE_MAX * v1:
            chance = 0.0  # a lottery ticket: cheap on average, but one draw costs a user many tokens
    state[TS.probe] = 1.0 if uniform(state, TS.rng) < chance else 0.0
    if warm_up:
        state[TS.probe] = 1.0


@kernel
def _best_rate(state, odds_1, out, ve, d, k, resume):
    """Write p_1..p_k for position-1 odds odds_1 to state[out:out+k]; return max_n E[N_n] / C_n
    over n = 0..k (C_n: n draft steps, the verify of n + 1 tokens, and resuming when n > 0).

    lambda is the rate a round must beat per second spent; 0 while no cost is known.
    """
    odds = odds_1
    for i in range(k):
        if i > 0:
            odds *= _mean_ratio(state, TS.pos + TR.size * i)
        state[out + i] = _prob(odds)
    return _rate_of(state, out, ve, d, k, resume)


@kernel
def _rate_of(state, out, ve, d, k, resume):
    """max_n E[N_n] / C_n over n = 0..k for the chances p_1..p_k at state[out:out+k]."""
    lam = 0.0
    gain = 1.0
    p_all = 1.0
    for n in range(k + 1):
        if n > 0:
            p_all *= state[out + n - 1]
            gain += p_all
        cost = d * n + state[ve + n] + (resume if n > 0 else 0.0)
        if cost > 0.0:
            lam = max(lam, gain / cost)
    return lam


# --- learning in hindsight (free offers: prompt lookup) -------------------------------------
#
# A point proposal d is accepted with the chance p(d) that the target emits d (greedy or sampled),
# so the tokens the target goes on to emit say, for every offer, how far the draft it would have
# been runs, whatever the round drafted. With every offer seen, nothing is learned by exploring
# (full information): the plan takes posterior means, and a closed gate drafts nothing (no probes).
# What predicts acceptance is how long the context already matches the offer's source: a token
# drafted after i accepted ones extends a match of L0 tokens to L0 + i. So one Beta per match-length
# class (layout.MATCH_EDGES: 1, 2, .., 9, then 10-15 up to 64 or more), learned per request (a rewrite copies long
# runs, an essay matches short phrases that its answer does not continue), forgetting by MATCH_FORGET.


@kernel
def match_class(length):
    """The class of a match of this many tokens: 1..9 each its own, then 10-15, 16-23, 24-31, 32-47,
    48-63, 64 and more (layout.MATCH_EDGES)."""
    n = max(int(length), 1)
    c = 0
    while c + 1 < N_MATCH and MATCH_EDGES[c + 1] <= n:
        c += 1
    return c


@kernel
def class_width(c):
    """How many match lengths class c spans (the last, open one: as many as the one before it). A run
    of copied tokens passes through every length of a class, so a class keeps its evidence in runs:
    width times the tokens of a one-length class (MATCH_FORGET, MATCH_REQUEST_EVIDENCE)."""
    if c + 1 < N_MATCH:
        return MATCH_EDGES[c + 1] - MATCH_EDGES[c]
    return MATCH_EDGES[c] - MATCH_EDGES[c - 1]


@kernel
def match_prior_mean(c):
    """Before any evidence: a longer match is a safer bet (1 token 0.25, 4 tokens 0.62, 10-15 0.9, 64 or
    more 0.97: the hazard of a miss shrinks by 0.8 a class)."""
    return 1.0 - 0.75 * 0.8 ** c


@kernel
def _match_prior(c):
    """(alpha, beta) of match-length class c before any evidence."""
    m = match_prior_mean(c)
    return MATCH_PRIOR * m, MATCH_PRIOR * (1.0 - m)


@kernel
def _request_ratio_prior(state):
    """The request's odds ratio for long matches (the first position's triple, unused by the position
    model in hindsight) at 1."""
    half = REQUEST_MATCH_PRIOR / 2.0
    state[TS.pos + TR.alpha] = half
    state[TS.pos + TR.beta] = half
    state[TS.pos + TR.predicted] = half


@kernel
def ts_use_hindsight(state):
    """Turn hindsight on: the confidence bins become match-length classes at their prior, and the
    first position's triple holds the request's odds ratio for long matches (_match_planned)."""
    state[TS.hindsight] = 1.0
    _request_ratio_prior(state)
    for c in range(N_MATCH):
        t = TS.classes + TR.size * c
        state[t + TR.alpha], state[t + TR.beta] = _match_prior(c)
        state[t + TR.predicted] = 0.0


@kernel
def _match_mean(state, length):
    """The posterior mean of the length's class. From 10 tokens on (BACKOFF_CLASS) a class's prior is
    not its own but the class below's posterior mean: a longer match is as good a bet as a shorter one
    until its own offers say otherwise. Long classes see few offers per request, so a fixed prior would
    decide them: one far more hopeful than the evidence below drafts 64 tokens on nothing."""
    c = match_class(length)
    t = TS.classes + TR.size * min(c, BACKOFF_CLASS - 1)
    m = state[t + TR.alpha] / (state[t + TR.alpha] + state[t + TR.beta])
    for j in range(BACKOFF_CLASS, c + 1):
        t = TS.classes + TR.size * j
        a0, b0 = _match_prior(j)
        seen = state[t + TR.alpha] + state[t + TR.beta] - a0 - b0
        m = (state[t + TR.alpha] - a0 + MATCH_PRIOR * m) / (seen + MATCH_PRIOR)
    return m


@kernel
def _match_planned(state, length):
    """What the plan counts on for a token offered at this match length: its class's mean, and from
    REQUEST_MATCH tokens on times this request's odds ratio (the first position's triple: observed against what the
    classes predicted for its offers at such matches). Long matches run on in a rewrite and in code
    (0.97-0.99 of first tokens after a 4-9 token match on the built-in sets) and less in chat (0.80):
    the classes pool every request, the ratio says which kind this one is within a few offers."""
    m = _match_mean(state, length)
    if length < REQUEST_MATCH:
        return m
    return _prob(_odds(m) * _mean_ratio(state, TS.pos))


@kernel
def _hindsight_begin(state):
    """Plan the round from the match-length classes' means (offer_match: the offer's match length)."""
    k = int(state[TS.max_draft])
    kk = plan_limit(state)
    th = at(TS.chance, k)
    ve = at(TS.estimate, k)
    state[TS.prefix] = 1.0
    state[TS.no_bonus] = 0.0
    state[TS.probe] = 0.0
    if state[TS.offer_n] <= 0.0:
        state[TS.open] = 0.0
        state[TS.lam] = 0.0
        return
    match = state[TS.offer_match]
    for i in range(kk):
        state[th + i] = _match_planned(state, match + i)
    lam = _rate_of(state, th, ve, state[TS.ema_t_draft], kk, 0.0)
    state[TS.lam] = lam
    v1 = state[ve]
    state[TS.open] = 1.0 if v1 > 0.0 and lam > (1.0 + state[TS.margin]) / v1 else 0.0


@kernel
def ts_hindsight(state, match, n_offered, n_matched):
    """An offer of n_offered tokens at match length ``match``, of which the target went on to emit
    the first n_matched: one observation per token up to the first miss (hindsight on)."""
    if state[TS.hindsight] == 0.0:
        return
    n = min(int(n_offered), int(state[TS.max_draft]))
    a = min(max(int(n_matched), 0), n)
    for i in range(min(a + 1, n)):
        c = match_class(match + i)
        accepted = 1.0 if i < a else 0.0
        if match + i >= REQUEST_MATCH:  # the request's ratio: what happened against what its class predicted
            state[TS.pos + TR.alpha] += accepted
            state[TS.pos + TR.beta] += 1.0 - accepted
            state[TS.pos + TR.predicted] += _match_mean(state, match + i)
        a0, b0 = _match_prior(c)
        observe(state, TS.classes + TR.size * c, a0, b0, MATCH_FORGET ** (1.0 / class_width(c)), accepted)
    state[TS.req_seen] += 1.0


@kernel
def ts_decide(state, step, confidence):
    k = int(state[TS.max_draft])
    if step >= k:
        return 0
    if state[TS.rule] != 0.0:
        return _paper_decide(state, step, confidence)
    kk = plan_limit(state)
    if step >= kk:
        return 0
    if state[TS.batch_costs] != 0.0 and state[at(TS.verify, k) + VP.count] == 0.0:
        return 0  # one plain decode first, to learn what a target token costs
    if state[TS.open] == 0.0:
        if step > 0:
            return 0  # gate closed: at most one token, the cheapest look at theta_1
        return 1 if state[TS.probe] != 0.0 else 0
    th = at(TS.chance, k)
    if step > 0:
        p = state[th + step - 1]
        # a token's own confidence, unless the offer's confidence already conditioned the whole plan
        if state[TS.use_bins] != 0.0 and state[TS.hindsight] == 0.0 and not 0.0 < state[TS.offer_conf] < 1.0:
            b = TS.bins + TR.size * conf_bin(confidence)
            theta = beta(state, TS.rng, state[b + TR.alpha], state[b + TR.beta])
            p = _prob(_odds(p) * _odds(theta) / _odds(state[b + TR.predicted] / (state[b + TR.alpha] + state[b + TR.beta])))
        state[TS.prefix] *= p
    ve = at(TS.estimate, k)
    lam = state[TS.lam]
    d = state[TS.ema_t_draft]
    base = state[ve + step]
    resume = resume_cost(state) if step == 0 else 0.0  # later steps: already paid this round
    gain = 0.0
    term = state[TS.prefix]
    for n in range(step + 1, kk + 1):
        term *= state[th + n - 1]
        gain += term
        if gain > lam * (d * (n - step) + state[ve + n] - base + resume):
            return 1
    return 0


@kernel
def _paper_decide(state, step, confidence):
    if step > 0 and state[TS.use_bins] != 0.0:
        b = TS.bins + TR.size * conf_bin(confidence)
        theta = beta(state, TS.rng, state[b + TR.alpha], state[b + TR.beta])
    else:
        theta = beta(state, TS.rng, state[TS.pooled + BP.alpha], state[TS.pooled + BP.beta])
    return 1 if uniform(state, TS.rng) < theta else 0


@kernel
def _learn(state, confidences, n, a):
    """Acceptance evidence of n drafts (or offered tokens) of which the first a were accepted:
    positions 1..min(a + 1, n) are observed, each conditional on the ones before it."""
    bins = state[TS.use_bins] != 0.0
    first = TS.pos  # the first position's triple
    odds_prev = _odds(state[first + TR.alpha] / (state[first + TR.alpha] + state[first + TR.beta]))  # predictions use the state before this round
    for i in range(min(a + 1, n)):
        accepted = 1.0 if i < a else 0.0
        t = TS.pos + TR.size * i
        odds_i = odds_prev if i == 0 else odds_prev * _mean_ratio(state, t)
        if bins:
            j = conf_bin(confidences[i])
            _observe_ratio(state, TS.bins + TR.size * j, BIN_PRIOR, bin_prior_mean(j), accepted, _prob(odds_i))
        if i > 0:
            _observe_ratio(state, t, POS_PRIOR, 0.5, accepted, _prob(odds_prev))
        odds_prev = odds_i
    observe(state, first, 1.0, 1.0, state[TS.forget], 1.0 if a > 0 else 0.0)
    state[TS.req_seen] += 1.0


@kernel
def ts_update(state, confidences, n_accepted, t_verify):
    n = confidences.shape[0]
    a = min(max(n_accepted, 0), n)
    if state[TS.hindsight] == 0.0:  # in hindsight the loop reports every offer (ts_hindsight): drafts are in it
        if n > 0:
            _learn(state, confidences, n, a)
        else:  # theta_1's evidence ages by the round, seen or not, so a closed gate's estimate stays current
            discount(state, TS.pos, 1.0, 1.0, state[TS.forget])
    behind = state[TS.behind]
    if n > 0 and behind > 1.0 and state[TS.t_catchup] > 0.0 and state[TS.t_catchup] < 1e30:
        state[TS.n_resume] += 1.0  # a draft model caught up before drafting: seconds per token of catching up
        state[TS.resume] = ema(state[TS.resume], state[TS.t_catchup] / behind, state[TS.n_resume])
        state[TS.stretch_mean] = ema(state[TS.stretch_mean], 1.0 / max(1.0, state[TS.stretch]), state[TS.n_resume])  # the stretch that ended
        state[TS.stretch] = 0.0
    if n > 0:
        state[TS.stretch] += 1.0
    if t_verify > 0.0 and t_verify < 1e30:  # a missing or NaN timing must not poison the means
        b = n - 1 if state[TS.no_bonus] != 0.0 and n > 0 else n  # the verify batch held n + 1 tokens, or n
        record_verify(state, b, t_verify)
    refresh_verify_estimates(state)


@kernel
def ts_new_request(state):
    """A new request: how often theta_1's drafts are accepted depends on the request (a rewrite
    copies its input, an essay does not), so its evidence from earlier requests is thinned to
    REQUEST_EVIDENCE observations around the same mean. The first rounds of the new request then
    move it within a few rounds, where ~100 rounds of old evidence would hold it for tens. What
    the machine costs (verify times, draft times) and how the drafter's confidence relates to
    acceptance are kept: they do not change with the request."""
    state[TS.req_seen] = 0.0
    if state[TS.hindsight] != 0.0:  # the match-length classes are the request's: thinned alike
        for c in range(N_MATCH):
            a0, b0 = _match_prior(c)
            _thin(state, TS.classes + TR.size * c, a0, b0, MATCH_REQUEST_EVIDENCE * class_width(c), False)
        _request_ratio_prior(state)
        return
    _thin(state, TS.pos, 1.0, 1.0, REQUEST_EVIDENCE, False)
    # how far a draft runs on once its first token is right is the request's too (a copied block
    # runs on, prose does not): each deeper position's odds-ratio evidence is thinned alike
    a0 = POS_PRIOR * 0.5
    for i in range(1, int(state[TS.max_draft])):
        _thin(state, TS.pos + TR.size * i, a0, a0, REQUEST_RATIO_EVIDENCE, True)
    # and so, for prompt lookup, is what a match length is worth (a 4-gram match continues a copied block
    # in a rewrite and a common phrase in an essay): the confidence bins are thinned alike
    for j in range(N_BINS):
        b0 = BIN_PRIOR * bin_prior_mean(j)
        _thin(state, TS.bins + TR.size * j, b0, BIN_PRIOR - b0, REQUEST_RATIO_EVIDENCE, True)


@kernel
def _thin(state, t, a0, b0, keep, predicted):
    """Thin the Beta (alpha, beta) of the triple at state[t] to ``keep`` observations beyond its prior
    (a0, b0), around the same mean; ``predicted``: the triple's predicted sum goes alike."""
    n = state[t + TR.alpha] + state[t + TR.beta] - a0 - b0
    if n > keep:
        w = keep / n
        state[t + TR.alpha] = a0 + w * (state[t + TR.alpha] - a0)
        state[t + TR.beta] = b0 + w * (state[t + TR.beta] - b0)
        if predicted:
            state[t + TR.predicted] = a0 + w * (state[t + TR.predicted] - a0)
