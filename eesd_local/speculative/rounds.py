"""The round contract: what a round loop is, what a round returns, and the rules both loops share.

A round: the drafter says what it has for free (:meth:`Drafter.offer`: lookup's match, how far a
draft model is behind), the controller decides which source drafts and how far, the drafter proposes d1..dk, the target
decodes [last, d1..dk] in ONE llama_decode, the accepted prefix plus one target token is
emitted, and the target's KV cache is trimmed past it. :class:`PythonRounds` is the
reference implementation; the native loop (:mod:`.native_round`) must give the same events
for every drafter and is tested against it. The engine sees only :class:`RoundLoop`.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Protocol

import numpy as np

from eesd_local.llama.runtime import Context
from eesd_local.speculative.drafters.base import SRC_ANY, Drafter
from eesd_local.speculative.sampling import SamplingParams, Uniform, verify_greedy, verify_sampled


class RoundResult(NamedTuple):
    drafted: list[int]  # d1..dk
    accepted: int  # m: d1..dm were kept
    next_token: int  # the target's token after them (a correction, or the bonus when m == k > 0; -1: none, a probe's)
    t_draft: float
    t_verify: float
    source: str = ""  # the source that drafted (lookup, eesd, ...); "" when nothing was drafted
    rows: int = 0  # tokens in the verify batch [last, d1..]: k + 1, or k for a probe without the bonus (0: not told)


class Controller(Protocol):
    """A draft-length controller (:mod:`.controllers`): one float64 state array that its Numba
    kernels update in place, so the native loop can run the same decisions through cfuncs."""

    name: str
    max_draft: int
    state: np.ndarray

    def begin_request(self) -> None: ...

    def begin_round(self, offer: int = 0, confidence: float = 0.0, behind: int = 0, match: int = 0) -> None: ...

    def source(self) -> int: ...

    def draft_more(self, step: int, confidence: float) -> bool: ...

    def no_bonus(self) -> bool: ...

    def end_round(self, confidences: np.ndarray, n_accepted: int, t_draft: float, t_verify: float,
                  t_catchup: float = 0.0) -> None: ...

    def belief(self) -> dict[str, float]: ...


class RoundLoop(Protocol):
    """One generation's rounds over a target context that the loop owns until :meth:`close`."""

    def run(self, history: list[int], max_n: int, left: int) -> RoundResult:
        """One round continuing ``history`` (which ends with the last emitted token), drafting at
        most ``max_n`` tokens; ``left``: tokens still wanted (a loop may run later rounds ahead)."""
        ...

    def room(self) -> int:
        """Free target KV positions before the next round."""
        ...

    def belief(self) -> dict[str, float]:
        """The controller's belief after the last round (for its RoundEvent)."""
        ...

    def cancel(self) -> None:
        """Stop rounds that run ahead after the current one (thread-safe)."""
        ...

    def close(self) -> None:
        """Hand the target context back with its record matching its KV cache exactly."""
        ...


class Hindsight:
    """Prompt lookup's offers, each reported to the controller once its outcome is known.

    An offer made at history length ``start`` (tokens t1..tn after a match of ``match`` tokens) is
    resolved by the tokens the target emits after it, drafted or not: at the first one that differs
    from the offer (m matched), or when all n matched. Pending offers (at most one per round, each
    resolved within n emitted tokens) are dropped at a new request. The native loop keeps the same
    record (native/rounds.cpp, ``Rounds::see_offers``); this one is the reference, and
    tests/test_hindsight.py holds the two to the same reports."""

    def __init__(self, controller: Controller) -> None:
        self.ctl = controller
        self.pending: list[tuple[int, tuple[int, ...], int]] = []

    def clear(self) -> None:
        self.pending.clear()

    def add(self, start: int, tokens: tuple[int, ...], match: int) -> None:
        """A new offer, unless a pending one already predicts its tokens (the same copy, offered again a
        round later): the emitted tokens would be counted once per offer, and the copy's end, where the
        longest matches stop, as many misses as there were rounds in it."""
        if tokens and not any(covers(s, toks, start, tokens) for s, toks, _ in self.pending):
            self.pending.append((start, tokens, match))

    def see(self, history: list[int]) -> None:
        """Report the offers this history resolves; keep the rest."""
        keep = []
        for start, toks, match in self.pending:
            lim = min(len(history) - start, len(toks))
            m = 0
            while m < lim and history[start + m] == toks[m]:
                m += 1
            if m < lim or m == len(toks):
                self.ctl.hindsight(match, len(toks), m)  # type: ignore[attr-defined]
            else:
                keep.append((start, toks, match))
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
    """Most tokens a round may draft: a round emits up to k + 1 tokens, so k <= left - 1
    (tokens still wanted) and k <= room - 1 (free KV positions after `last`), and never
    more than ``draft_max``. The C++ loop applies the same rule (tested against this one)."""
    return max(0, min(draft_max, left - 1, room - 1))


class PythonRounds:
    """The reference round loop, one round per call."""

    def __init__(self, ctx: Context, drafter: Drafter, controller: Controller, params: SamplingParams,
                 rng: Uniform, *, hindsight: bool = False) -> None:
        self.ctx, self.drafter, self.ctl, self.params, self.rng = ctx, drafter, controller, params, rng
        self._hindsight = Hindsight(controller) if hindsight else None
        self._choose = drafter.n_sources > 1

    def room(self) -> int:
        return self.ctx.room()

    def run(self, history: list[int], max_n: int, left: int) -> RoundResult:
        ctx, ctl, params = self.ctx, self.ctl, self.params
        t1 = time.perf_counter()
        # what is free to know before the round (lookup's match, a model's catch-up); optional for a drafter
        if self._hindsight is not None:
            self._hindsight.see(history)
        offer = self.drafter.offer(history, max_n)
        if self._hindsight is not None:
            self._hindsight.add(len(history), offer.tokens, offer.match)
        ctl.begin_round(offer.n, offer.confidence, offer.behind, offer.match)
        # the source the controller picked, where the drafter has several
        prop = self.drafter.propose(history, ctl.draft_more, max_n, params, self.rng, source=ctl.source() if self._choose else SRC_ANY)
        t2 = time.perf_counter()
        k = len(prop)
        # a probe verifies its drafts without the bonus: [last, d1..d(k-1)], k rows (plain decoding when k = 1)
        bonus = k == 0 or not ctl.no_bonus()
        n_rows = k + 1 if bonus else k
        n_keep = ctx.n_past + 1  # the cache keeps `last` ...
        ctx.decode([history[-1], *prop.tokens[: n_rows - 1]], n_logits=n_rows)
        if params.greedy:
            m, nxt = verify_greedy(np.stack([ctx.logits(i) for i in range(n_rows)]), prop.tokens, bonus)
        else:
            m, nxt = verify_sampled(ctx.logits_rows(), prop.tokens, prop.probs, params, self.rng, bonus)
        ctx.trim(n_keep + min(m, n_rows - 1))  # ... and the accepted drafts it decoded; the rest is rolled back
        t3 = time.perf_counter()
        ctl.end_round(np.asarray(prop.confidences, dtype=np.float64), m, t2 - t1, t3 - t2, prop.t_catchup)
        return RoundResult(prop.tokens, m, nxt, t2 - t1, t3 - t2, (prop.source or self.drafter.name) if k else "",
                           n_rows)

    def belief(self) -> dict[str, float]:
        return self.ctl.belief()

    def cancel(self) -> None:
        pass  # one round per call: the engine checks its own flag between rounds

    def close(self) -> None:
        pass  # every round left the context's record matching its cache
