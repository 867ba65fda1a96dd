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

import math
import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import EesdError

# top-p works on the few largest logits first; it falls back to a full sort only
# when these do not hold top_p of the mass
_TOP_P_CANDIDATES = 2048


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
        if not isinstance(self.temperature, int | float) or math.isnan(self.temperature) or self.temperature < 0:
            raise EesdError(f"temperature must be >= 0, got {self.temperature}", hint="use 0 for greedy decoding")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise EesdError(f"top_k must be an integer >= 0, got {self.top_k}", hint="use 0 to disable top-k")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise EesdError(f"top_p must be in (0, 1], got {self.top_p}", hint="use 1 to disable top-p")

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
        cand = keep
        if cand is None and n > _TOP_P_CANDIDATES:
            cand = _top_indices(x, _TOP_P_CANDIDATES)
        keep = _top_p(x, cand, params.top_p)
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


def _top_p(x: np.ndarray, cand: np.ndarray | None, top_p: float) -> np.ndarray:
    """Smallest set of tokens, by descending logit (ties: lower index first), whose softmax
    mass reaches top_p."""
    m = x.max()
    total = np.exp(x - m).sum()  # the full softmax denominator at temperature 1
    idx = np.arange(x.shape[0]) if cand is None else np.sort(cand)
    order = idx[np.argsort(-x[idx], kind="stable")]
    mass = np.cumsum(np.exp(x[order] - m)) / total
    cut = int(np.searchsorted(mass, top_p)) + 1
    if cut > len(order):  # the candidates do not hold top_p of the mass: use everything
        return _top_p(x, None, top_p) if cand is not None else order
    return order[:cut]


def sample(p: np.ndarray, rng: Uniform) -> int:
    """Draw one token from distribution ``p`` (inverse CDF over its support)."""
    support = np.flatnonzero(p)
    cdf = np.cumsum(p[support])
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(support[min(i, len(support) - 1)])


def verify_greedy(target_logits: np.ndarray, drafts: list[int]) -> tuple[int, int]:
    """(accepted, next token): accept while each draft is the target's argmax."""
    best = np.argmax(target_logits, axis=-1)
    for i, d in enumerate(drafts):
        if int(best[i]) != d:
            return i, int(best[i])
    return len(drafts), int(best[len(drafts)])


def verify_sampled(
    target_logits: np.ndarray,
    drafts: list[int],
    draft_probs: list[np.ndarray | None],
    params: SamplingParams,
    rng: Uniform,
) -> tuple[int, int]:
    """Speculative sampling over k drafts; (accepted, next token).

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
    return len(drafts), sample(probs(target_logits[len(drafts)], params), rng)
