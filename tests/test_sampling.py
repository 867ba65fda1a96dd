"""Speculative sampling keeps the target's distribution exactly (chi-square tests on the
demo model's real logits), with temperature, top-k, top-p, reduced draft vocabularies
and deterministic (lookup) proposals. The verification tested is the round loop's own
(native/verify.hpp, through the extension's ``verify``); the distributions it is held to are
the NumPy references of tests/reference.py."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from eesd_local.llama import native
from eesd_local.llama.runtime import Context, ContextParams, Model
from eesd_local.speculative.sampling import SamplingParams
from tests.reference import probs, sample

N_TRIALS = 6000
V = 3000  # the maths does not depend on the vocabulary size: use the top tokens of a real row


@pytest.fixture(scope="module")
def rows(qwen05_path):
    """Two real next-token logit rows of the demo model (positions t and t+1 of a prompt)."""
    model = Model(qwen05_path)
    ctx = Context(model, ContextParams(n_ctx=256))
    toks = model.tokenize("The three most useful Python built-in functions are")
    ctx.decode(toks, n_logits=2)
    l1, l2 = ctx.logits(0).astype(np.float64), ctx.logits(1).astype(np.float64)
    ctx.close()
    model.close()
    keep = np.argsort(-(l1 + l2))[:V]
    return l1[keep], l2[keep]


def chi2_critical(df: int, alpha: float = 1e-3) -> float:
    """Upper alpha quantile of chi-square (Wilson-Hilferty); z for alpha=1e-3 is 3.09."""
    z = {1e-3: 3.090, 1e-4: 3.719}[alpha]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    """Chi-square of counts against p, tokens with expected count < 5 merged into one bin."""
    n = counts.sum()
    exp = p * n
    big = exp >= 5
    obs_b = np.append(counts[big], counts[~big].sum())
    exp_b = np.append(exp[big], exp[~big].sum())
    if exp_b[-1] < 5:  # fold a tiny tail bin into the last big one
        obs_b[-2] += obs_b[-1]
        exp_b[-2] += exp_b[-1]
        obs_b, exp_b = obs_b[:-1], exp_b[:-1]
    stat = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    return stat, len(obs_b) - 1


class Verify:
    """The round loop's verification, with its random stream carried from call to call."""

    def __init__(self, seed: int) -> None:
        self.state = seed

    def sampled(self, target, drafts, qs, params, bonus=True):
        m, tok, self.state = native.require().verify(np.asarray(target, dtype=np.float32), drafts, qs, params.temperature,
                                                     params.top_k, params.top_p, self.state, bonus)
        return m, tok


def loop_probs(x, params):
    """The round loop's processed distribution of one row."""
    return native.require().probs(np.asarray(x, dtype=np.float32), params.temperature, params.top_k, params.top_p)


def verify_greedy(target, drafts, bonus=True):
    m, tok, _ = native.require().verify(np.asarray(target, dtype=np.float32), drafts, None, 0.0, 0, 1.0, 0, bonus)
    return m, tok


def run_spec(l1, l2, q_logits, params, *, point_mass=False, seed=0):
    """First and (when drafted tokens are all accepted) second emitted token over many trials."""
    rng = np.random.default_rng(seed)
    ver = Verify(seed)
    q = probs(q_logits, params)
    first = np.zeros(len(l1), dtype=np.int64)
    second = np.zeros(len(l1), dtype=np.int64)
    target = np.stack([l1, l2])
    accepted = 0
    for _ in range(N_TRIALS):
        d = int(np.argmax(q)) if point_mass else sample(q, rng)
        m, tok = ver.sampled(target, [d], [None if point_mass else q], params)
        if m == 1:
            accepted += 1
            first[d] += 1
            second[tok] += 1  # the bonus token, drawn from p2
        else:
            first[tok] += 1
    return first, second, accepted / N_TRIALS


CASES = {
    "temp1": SamplingParams(temperature=1.0),
    "temp0.7-topk40": SamplingParams(temperature=0.7, top_k=40),
    "temp0.9-topp0.9": SamplingParams(temperature=0.9, top_p=0.9),
    "topk50-topp0.8": SamplingParams(temperature=1.0, top_k=50, top_p=0.8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_sampling_matches_target_distribution(rows, name):
    l1, l2 = rows
    params = CASES[name]
    noise = np.random.default_rng(1).normal(0, 1.5, size=l1.shape)
    first, second, acc = run_spec(l1, l2, l1 + noise, params, seed=2)  # a draft close to, not equal to, p
    assert 0.05 < acc < 0.95, "the draft should be neither perfect nor useless for this test to bite"
    for counts, p in ((first, probs(l1, params)), (second, probs(l2, params))):
        stat, df = chi2_stat(counts, p)
        assert stat < chi2_critical(df), f"{name}: chi2 {stat:.1f} over {df} dof"


def test_draft_vocabulary_missing_target_tokens(rows):
    """q is zero where p is not (a reduced draft vocabulary): the residual restores p."""
    l1, l2 = rows
    params = SamplingParams(temperature=1.0)
    q_logits = l1.copy()
    q_logits[::2] = -np.inf  # the drafter cannot propose every other token, the best one included
    first, _, acc = run_spec(l1, l2, q_logits, params, seed=3)
    assert acc > 0.05
    stat, df = chi2_stat(first, probs(l1, params))
    assert stat < chi2_critical(df)


def test_deterministic_proposal_like_lookup(rows):
    l1, l2 = rows
    params = SamplingParams(temperature=0.8, top_p=0.95)
    first, _, acc = run_spec(l1, l2, l1, params, point_mass=True, seed=4)
    stat, df = chi2_stat(first, probs(l1, params))
    assert stat < chi2_critical(df)


def test_a_biased_rule_is_caught(rows):
    """'Sample and match' (keep d only if the target's own sample equals it) is exact too, but
    always accepting the draft is not: the test must see the difference."""
    l1, _ = rows
    params = SamplingParams(temperature=1.0)
    noise = np.random.default_rng(1).normal(0, 1.5, size=l1.shape)
    q = probs(l1 + noise, params)
    rng = np.random.default_rng(5)
    counts = np.zeros(len(l1), dtype=np.int64)
    for _ in range(N_TRIALS):
        counts[sample(q, rng)] += 1  # the draft's distribution, accepted blindly
    stat, df = chi2_stat(counts, probs(l1, params))
    assert stat > chi2_critical(df)


def test_probs_filters():
    x = np.array([3.0, 2.0, 1.0, 0.0, -1.0])
    p = loop_probs(x, SamplingParams(temperature=1.0, top_k=2))
    assert np.count_nonzero(p) == 2 and p[0] > p[1] > 0
    soft = np.exp(x - x.max()) / np.exp(x - x.max()).sum()  # 0.636, 0.234, 0.086, ...
    p = loop_probs(x, SamplingParams(temperature=1.0, top_p=0.8))
    assert np.count_nonzero(p) == 2  # 0.636 < 0.8 <= 0.87
    p = loop_probs(x, SamplingParams(temperature=0.5))
    assert p[0] > soft[0]
    assert loop_probs(x, SamplingParams(temperature=1.0)).sum() == pytest.approx(1.0)


def test_a_probe_without_the_bonus_keeps_the_target_distribution(rows):
    """A probe verifies its draft with the target's row for it only: accepted, the draft is the round's
    token; rejected, the residual's sample is. Either way the token follows p, and no bonus is drawn."""
    l1, _ = rows
    params = SamplingParams(temperature=0.9, top_k=50)
    noise = np.random.default_rng(1).normal(0, 1.5, size=l1.shape)
    q = probs(l1 + noise, params)
    rng = np.random.default_rng(6)
    ver = Verify(6)
    counts = np.zeros(len(l1), dtype=np.int64)
    accepted = 0
    for _ in range(N_TRIALS):
        d = sample(q, rng)
        m, tok = ver.sampled(l1[None, :], [d], [q], params, bonus=False)
        assert (m, tok == -1) in ((1, True), (0, False))
        accepted += m
        counts[d if m else tok] += 1
    assert 0.05 < accepted / N_TRIALS < 0.95
    stat, df = chi2_stat(counts, probs(l1, params))
    assert stat < chi2_critical(df)
    assert verify_greedy(np.stack([l1, l1]), [int(np.argmax(l1)), 5], bonus=False)[0] in (1, 2)
    assert verify_greedy(l1[None, :], [int(np.argmax(l1))], bonus=False) == (1, -1)


def test_malloc_tuning_is_applied_by_setup_not_by_import_and_can_be_turned_off():
    code = ("import eesd_local.llama.runtime as r, eesd_local.llama.memtune as m; before = m._done; "
            "r.setup_process(); print(before, m._done)")
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    env = {**os.environ, "EESD_MALLOC_TUNE": "0"}
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout.strip()
    assert (on, off) == ("False True", "False False")


def test_top_p_after_top_k_stays_within_the_top_k(rows):
    """llama.cpp's order: top-p works on the top-k survivors' own softmax, so it can only shrink them."""
    l1, _ = rows
    for k, p in [(5, 0.99), (40, 0.95), (40, 0.5)]:
        both = loop_probs(l1, SamplingParams(temperature=1.0, top_k=k, top_p=p))
        only_k = loop_probs(l1, SamplingParams(temperature=1.0, top_k=k))
        assert set(np.flatnonzero(both)) <= set(np.flatnonzero(only_k))
        w = np.sort(only_k)[::-1]
        want = int(np.searchsorted(np.cumsum(w), p * w.sum())) + 1
        assert np.count_nonzero(both) == min(want, k)
