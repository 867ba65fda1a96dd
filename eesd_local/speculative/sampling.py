"""Sampling parameters, the processed distribution p, and exact verification.

The target's distribution p and the drafter's q go through the very same
:func:`probs` (top-k, top-p, temperature, in llama.cpp's order), so speculative
sampling keeps the target's distribution exactly:

    accept draft d with probability min(1, p(d) / q(d))
    on rejection sample from  r = max(0, p - q) / sum(max(0, p - q))
    when all k drafts are accepted sample a bonus token from p_{k+1}

The maths is vectorised over the vocabulary with NumPy; Python loops run only over
the (at most a handful of) draft positions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from eesd_local.base.params import SEED_MAX, SEED_MIN, check_optional_int, check_temperature, check_top_k, check_top_p

# top-p without top-k: the candidates are the logits within SPAN nats of the largest, for
# the first span whose softmax mass reaches top_p; they are grouped into bins 1/32 nat wide,
# the bin where the mass crosses top_p is found from the bin sums, and only that bin is
# sorted. A flat distribution needs tens of thousands of tokens for top_p = 0.95: sorting
# them all cost ~40 ms a row.
_TOP_P_SPANS = (4.0, 8.0, 16.0, 32.0, 64.0)
_TOP_P_BINS = 2048
_TOP_P_BINS_PER_NAT = 32.0


class Uniform(Protocol):
    """A source of U[0, 1) draws: :class:`TokenRNG`, or a NumPy Generator in tests."""

    def random(self) -> float: ...


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    seed: int | None = None

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        check_top_k(self.top_k)
        check_top_p(self.top_p)
        check_optional_int("seed", self.seed, SEED_MIN, SEED_MAX, hint="leave it out for a random seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def rng(self) -> TokenRNG:
        return TokenRNG(self.seed)


_MASK64 = 0xFFFFFFFFFFFFFFFF


class TokenRNG:
    """The token sampler's random stream: splitmix64 (Steele, Lea and Flood 2014).

    One 64-bit word of state; the native round loop runs the same generator in C++ and
    hands the state back, so both loops draw the same numbers. ``random()`` is
    (z >> 11) * 2**-53: a double in [0, 1) on the 2**-53 grid.
    """

    __slots__ = ("state",)

    def __init__(self, seed: int | None = None) -> None:
        self.state = (int.from_bytes(os.urandom(8), "little") if seed is None else seed) & _MASK64

    def random(self) -> float:
        self.state = s = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = ((s ^ (s >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The normalised float64 distribution over the vocabulary after top-k, top-p, temperature."""
    x = np.asarray(logits, dtype=np.float64)
    n = x.shape[-1]
    keep: np.ndarray | None = None  # indices that survive the filters, None = all
    if params.top_k and params.top_k < n:
        keep = _top_indices(x, params.top_k)
    if params.top_p < 1.0:
        keep = _top_p(x, keep, params.top_p)
    t = params.temperature if params.temperature > 0 else 1.0
    out = np.zeros(n, dtype=np.float64)
    if keep is None:
        z = (x - x.max()) / t
        np.exp(z, out=out)
    else:
        z = (x[keep] - x[keep].max()) / t
        out[keep] = np.exp(z)
    out /= out.sum()
    return out


def _top_indices(x: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries; among ties at the k-th value the lowest indices win, so that
    the native loop (which follows the same rule) keeps the very same set."""
    thr = np.partition(x, x.shape[0] - k)[x.shape[0] - k]  # the k-th largest value
    above = np.flatnonzero(x > thr)
    return np.concatenate([above, np.flatnonzero(x == thr)[: k - len(above)]])


def _top_p(x: np.ndarray, keep: np.ndarray | None, top_p: float) -> np.ndarray:
    """The smallest set of tokens, by descending logit (ties: lower index first), whose softmax
    mass (temperature 1) reaches top_p. After top-k (``keep``) the mass is that of the survivors'
    own softmax, as llama.cpp's top-p after top-k, so the set is always within the top k."""
    if keep is not None:
        idx = np.sort(keep)
        order = idx[np.argsort(-x[idx], kind="stable")]
        w = np.exp(x[order] - x[order[0]])
        cut = int(np.searchsorted(np.cumsum(w), top_p * w.sum())) + 1
        return order[: min(cut, len(order))]
    m = x.max()
    w = np.exp(x - m)
    need = top_p * w.sum()
    for span in _TOP_P_SPANS:
        cand = np.flatnonzero(x >= m - span)
        if w[cand].sum() >= need:
            break
    else:
        cand = np.arange(x.shape[0])
    b = np.minimum((m - x[cand]) * _TOP_P_BINS_PER_NAT, _TOP_P_BINS - 1).astype(np.int64)
    mass = np.cumsum(np.bincount(b, weights=w[cand], minlength=_TOP_P_BINS))
    c = min(int(np.searchsorted(mass, need)), _TOP_P_BINS - 1)  # the bin where the mass crosses top_p
    inner = cand[b == c]
    inner = inner[np.argsort(-x[inner], kind="stable")]
    acc = (mass[c - 1] if c > 0 else 0.0) + np.cumsum(w[inner])
    cut = int(np.searchsorted(acc, need)) + 1
    return np.concatenate([cand[b < c], inner[: min(cut, len(inner))]])


def sample(p: np.ndarray, rng: Uniform) -> int:
    """Draw one token from distribution ``p`` (inverse CDF over its support)."""
    support = np.flatnonzero(p)
    cdf = np.cumsum(p[support])
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(support[min(i, len(support) - 1)])


def verify_greedy(target_logits: np.ndarray, drafts: list[int], bonus: bool = True) -> tuple[int, int]:
    """(accepted, next token): accept while each draft is the target's argmax.

    Without the bonus (a probe: the target saw [last, d1..d(k-1)], k rows), all k accepted gives
    next token -1: the round's last token is the last draft."""
    best = np.argmax(target_logits, axis=-1)
    for i, d in enumerate(drafts):
        if int(best[i]) != d:
            return i, int(best[i])
    return len(drafts), int(best[len(drafts)]) if bonus else -1


def verify_sampled(
    target_logits: np.ndarray,
    drafts: list[int],
    draft_probs: list[np.ndarray | None],
    params: SamplingParams,
    rng: Uniform,
    bonus: bool = True,
) -> tuple[int, int]:
    """Speculative sampling over k drafts; (accepted, next token).

    Without the bonus (k rows of target logits), all k accepted gives next token -1 and draws no
    bonus sample: each emitted token is still distributed as the target's (accept with min(1, p/q),
    else the residual), the round only stops one token early.

    ``draft_probs[i]`` is q for draft i, or None when the drafter proposed d
    deterministically (q is then the point mass on d: a lookup drafter).
    """
    for i, d in enumerate(drafts):
        p = probs(target_logits[i], params)
        q = draft_probs[i]
        qd = 1.0 if q is None else float(q[d])
        if qd <= 0.0:
            raise ValueError(f"draft {d} has zero draft probability: the drafter must sample from its q")
        if rng.random() < min(1.0, p[d] / qd):  # q(d) <= p(d): always accept
            continue
        if q is None:
            residual = p.copy()
            residual[d] = 0.0  # max(0, p - onehot(d))
        else:
            residual = np.maximum(p - q, 0.0)
        if residual.sum() <= 0.0:  # p == q up to rounding: p itself is the residual's limit
            residual = p
        return i, sample(residual / residual.sum(), rng)
    if not bonus:
        return len(drafts), -1
    return len(drafts), sample(probs(target_logits[len(drafts)], params), rng)
