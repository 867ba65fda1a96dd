"""Slow, obvious references of the round's rules, for the tests to hold the product to.

The product implements each rule once, in the round loop (native/: verify.hpp, probs.hpp,
rounds.cpp); these are the NumPy and plain-Python statements of the same rules, written to be read:
the processed distribution p (top-k, top-p, temperature), the inverse-CDF draw, greedy and
speculative-sampling verification, prompt lookup's match (by an n-gram index rather than the loop's
backward scan), a draft row's pick, and hindsight over free offers. ``scripts/lookup_replay.py``
replays recorded answers through them too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eesd_local.speculative.sampling import SamplingParams, Uniform

MATCH_CAP = 64  # a lookup match is measured up to this many tokens (native/verify.hpp)

# top-p without top-k: the candidates are the logits within SPAN nats of the largest, for
# the first span whose softmax mass reaches top_p; they are grouped into bins 1/32 nat wide,
# the bin where the mass crosses top_p is found from the bin sums, and only that bin is
# sorted. A flat distribution needs tens of thousands of tokens for top_p = 0.95: sorting
# them all cost ~40 ms a row.
_TOP_P_SPANS = (4.0, 8.0, 16.0, 32.0, 64.0)
_TOP_P_BINS = 2048
_TOP_P_BINS_PER_NAT = 32.0



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



def pick(row: np.ndarray, guess: int | None, params: SamplingParams, rng: Uniform) -> tuple[int, np.ndarray | None, float]:
    """(token, q, confidence) from a draft logit row; a guess is kept only as q allows.

    Greedy: the argmax. Sampling: a token distributed exactly as q; with a guess g
    (a deterministic proposal) g is kept with probability q(g), else a token is drawn
    from q with g removed, which is speculative sampling one level down.
    """
    if params.greedy:
        tok = int(np.argmax(row))
        conf = float(1.0 / np.exp(row.astype(np.float64) - float(row[tok])).sum())
        return tok, None, conf
    q = probs(row, params)
    if guess is not None:
        if rng.random() < q[guess]:
            return guess, q, float(q[guess])
        residual = q.copy()
        residual[guess] = 0.0
        if residual.sum() > 0:
            tok = sample(residual / residual.sum(), rng)
            return tok, q, float(q[tok])
    tok = sample(q, rng)
    return tok, q, float(q[tok])



def match_confidence(n: int, ngram_max: int) -> float:
    return n / (ngram_max + 1.0)


class Lookup:
    """Prompt lookup by an n-gram index (the loop scans the history backwards instead)."""

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> last end position seen
        self._seen: list[int] = []  # the history the index was built from
        self._indexed = 0  # n-grams ending before this position are indexed
        self._ambiguous: set[tuple[int, ...]] = set()  # n-grams seen followed by two different tokens

    def begin(self, prompt: list[int]) -> None:
        self._index.clear()
        self._ambiguous.clear()
        self._seen = []
        self._indexed = 0

    def _update(self, history: list[int]) -> None:
        n_same = len(self._seen)
        if history[:n_same] != self._seen:  # history was rewritten: rebuild
            self.begin(history)
        self._seen = list(history)
        # index n-grams ending at e < len-1: the suffix itself must not match itself
        for e in range(self._indexed, len(history) - 1):
            for n in range(self.ngram_min, self.ngram_max + 1):
                if e - n + 1 >= 0:
                    gram = tuple(history[e - n + 1 : e + 1])
                    before = self._index.get(gram)
                    if before is not None and history[before + 1] != history[e + 1]:
                        self._ambiguous.add(gram)
                    self._index[gram] = e
        self._indexed = max(self._indexed, len(history) - 1)

    def lookup(self, history: list[int], max_n: int) -> tuple[list[int], int]:
        """(continuation, n of the matched n-gram) for the longest suffix n-gram seen before."""
        cont, n, _ = self.lookup_match(history, max_n)
        return cont, n

    def lookup_match(self, history: list[int], max_n: int) -> tuple[list[int], int, int]:
        """(continuation, n of the matched n-gram, match length): the match length counts how many
        tokens before the continuation agree with the history's end, n and on, up to MATCH_CAP.
        An ambiguous n-gram (earlier occurrences went on with different tokens) counts as a match of
        one token, whatever its length: its latest continuation is a guess between them (on the built-in
        sets 0.04-0.28 of such offers' first tokens were right after a 4-9 token match, 0.73-0.99 of the
        others')."""
        self._update(history)
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(history) < n:
                continue
            gram = tuple(history[-n:])
            e = self._index.get(gram)
            if e is not None:
                if gram in self._ambiguous:
                    return history[e + 1 : e + 1 + max_n], n, 1
                length = n
                while length < MATCH_CAP and e - length >= 0 and history[e - length] == history[-1 - length]:
                    length += 1
                return history[e + 1 : e + 1 + max_n], n, length
        return [], 0, 0



class Hindsight:
    """Prompt lookup's offers, each reported to the controller once its outcome is known.

    An offer made at history length ``start`` (tokens t1..tn after a match of ``match`` tokens) is
    resolved by the tokens the target emits after it, drafted or not: at the first one that differs
    from the offer (m matched), or when all n matched. Pending offers (at most one per round, each
    resolved within n emitted tokens) are dropped at a new request. The native loop keeps the same
    record (native/rounds.cpp, ``Rounds::see_offers``); this one is the reference, and
    tests/test_hindsight.py holds the two to the same reports."""

    def __init__(self, controller: Any) -> None:
        self.ctl = controller
        self.pending: list[tuple[int, tuple[int, ...], int, int]] = []  # start, tokens, match, reported

    def clear(self) -> None:
        self.pending.clear()

    def add(self, start: int, tokens: tuple[int, ...], match: int) -> None:
        """A new offer, unless a pending one already predicts its tokens (the same copy, offered again a
        round later): the emitted tokens would be counted once per offer, and the copy's end, where the
        longest matches stop, as many misses as there were rounds in it."""
        if tokens and not any(covers(s, toks, start, tokens) for s, toks, _, _ in self.pending):
            self.pending.append((start, tokens, match, 0))

    def see(self, history: list[int]) -> None:
        """Report what this history tells of each pending offer: the tokens of it emitted since the last
        report (accepted, at match lengths match + r ...), and once it is resolved the miss; keep the rest."""
        keep = []
        for start, toks, match, r in self.pending:
            lim = min(len(history) - start, len(toks))
            m = 0
            while m < lim and history[start + m] == toks[m]:
                m += 1
            if m < lim or m == len(toks):
                self.ctl.hindsight(match + r, len(toks) - r, m - r)  # type: ignore[attr-defined]
            else:
                if m > r:
                    self.ctl.hindsight(match + r, m - r, m - r)  # type: ignore[attr-defined]
                keep.append((start, toks, match, m))
        self.pending = keep


def covers(start0: int, toks0: tuple[int, ...] | list[int], start: int, toks: tuple[int, ...] | list[int]) -> bool:
    """Whether the offer (start0, toks0), still pending (the history since start0 matched it), predicts the
    offer (start, toks) wherever they overlap, and overlaps it at all."""
    d = start - start0
    if d <= 0 or d >= len(toks0):
        return False
    n = min(len(toks0) - d, len(toks))
    return tuple(toks0[d:d + n]) == tuple(toks[:n])



def round_limit(draft_max: int, left: int, room: int) -> int:
    """Most tokens a round may draft: k <= left - 1, k <= room - 1, k <= draft_max."""
    return max(0, min(draft_max, left - 1, room - 1))
