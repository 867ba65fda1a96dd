"""Glue between the engine and the native round loop (``eesd_local._native``).

The extension runs a whole round in C++: the controller's decisions (the same Numba
kernels, as C function pointers), drafting with the draft context or from the lookup
drafter's n-gram search (run in C++ with the drafter's n-gram sizes), the ONE batched verify, greedy or speculative-sampling
acceptance, and the KV trims of both contexts. It keeps its own record of what each
KV cache holds for the length of a generation: the record moves in when the rounds
start and back into the Python contexts on :meth:`NativeRounds.close`.

``EESD_NATIVE=0`` forces the Python loop; without the extension the engine falls back
to it by itself. Both give the same tokens and the same events.
"""

from __future__ import annotations

import functools
import os
from collections import deque
from typing import Any, NamedTuple

import numpy as np

from .drafters.base import NoDrafter
from .drafters.hierarchical import HierarchicalDrafter
from .drafters.lookup import LookupDrafter
from .drafters.model import ModelDrafter
from .errors import ContextFullError, EesdError
from .runtime import Context
from .sampling import SamplingParams, TokenRNG

NONE, POINT, MODEL = 0, 1, 2  # the extension's drafting modes: nothing, fixed proposals, a draft model


class RoundResult(NamedTuple):
    drafted: list[int]  # d1..dk
    accepted: int  # m: d1..dm were kept
    next_token: int  # the target's token after them (a correction, or the bonus when m == k > 0; -1: none, a probe's)
    t_draft: float
    t_verify: float


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Any, str]:
    """(the extension or None, why not)."""
    try:
        from . import _native
    except ImportError as exc:
        return None, str(exc)
    return _native, ""


def status(drafter: Any) -> tuple[bool, str]:
    """(use the native loop for ``drafter``?, a one-line note saying which loop runs and why)."""
    if os.environ.get("EESD_NATIVE", "").strip() == "0":
        return False, "round loop: Python (EESD_NATIVE=0)"
    native, why = _load()
    if native is None:
        return False, f"round loop: Python (native extension unavailable: {why})"
    if _plan(drafter) is None:
        return False, f"round loop: Python (the native loop does not know the drafter {drafter.name})"
    return True, "round loop: native"


def belief(ctl: Any) -> dict[str, float]:
    """The controller's belief for the round events ({} if it has none)."""
    try:
        return dict(ctl.belief())
    except Exception:
        return {}


def _plan(drafter: Any) -> tuple[int, Context | None, LookupDrafter | None] | None:
    """(mode, draft context, lookup drafter) for the drafters the extension knows."""
    if isinstance(drafter, NoDrafter):
        return NONE, None, None
    if isinstance(drafter, LookupDrafter):
        return POINT, None, drafter
    if isinstance(drafter, ModelDrafter):
        return MODEL, drafter.ctx, None
    if isinstance(drafter, HierarchicalDrafter):
        return MODEL, drafter.inner.ctx, drafter.lookup
    return None


def _open(ctx: Context, what: str) -> int:
    if not getattr(ctx, "ptr", None):
        raise EesdError(f"the {what} context is closed", hint="load the engine again")
    return int(ctx.ptr)


class NativeRounds:
    """One generation's rounds through the extension (see :class:`eesd_local.engine.PythonRounds`).

    The extension runs rounds in batches: one call runs the rounds the engine would ask for
    next (the same draft limits, from the tokens still wanted and the room left) until
    ``batch_s`` seconds have passed, an end-of-generation token, or :meth:`cancel`; the
    engine then takes them one by one, with the same events as round-by-round calls. So
    Python runs once per batch rather than once per round: on a GPU, where a round takes a
    millisecond or two, that is most of the time outside llama.cpp. ``batch_s=0``: one
    round per call.
    """

    def __init__(self, ctx: Context, drafter: Any, controller: Any, params: SamplingParams, rng: TokenRNG,
                 draft_max: int = 8, batch_s: float = 0.0) -> None:
        from .controllers.cfuncs import addresses
        from .controllers.layout import NO_BONUS

        native, why = _load()
        plan = _plan(drafter)
        if native is None or plan is None:
            raise EesdError(f"the native round loop cannot run here: {why or drafter.name}")
        self.mode, self.draft_ctx, self.lookup = plan
        self.ctx, self.ctl, self.rng = ctx, controller, rng
        self._native = native
        draft = self.draft_ctx
        self.rounds = native.Rounds(_open(ctx, "target"), ctx.n_batch, _open(draft, "draft") if draft else 0,
                                    draft.n_batch if draft else 0, *addresses(), no_bonus_slot=NO_BONUS)
        for which, c in enumerate((ctx, draft)):
            if c is not None:
                self.rounds.set_tokens(which, c.tokens)
                self.rounds.limit(which, c.n_ctx)
        if self.lookup is not None:  # the n-gram search runs in C++, on the history the extension holds
            self.rounds.set_lookup(self.lookup.ngram_min, self.lookup.ngram_max)
        self._started = False
        self.draft_max = draft_max
        # rounds run ahead, in order: (drafted, accepted, next token, t_draft, t_verify, the draft
        # limit it ran with, free target KV positions before it)
        self._queue: deque[tuple[list[int], int, int, float, float, int, int]] = deque()
        self._cancel = np.zeros(1, dtype=np.uint8)  # read by the extension between rounds
        self._belief: dict[str, float] | None = None  # the controller's belief after the current batch
        self.rounds.configure(controller.state, self.mode, params.temperature, params.top_k, params.top_p, rng.state,
                              batch_s, self._cancel)
        self.t_llama = 0.0  # seconds inside llama_decode, both contexts (for overhead measurements)

    def room(self) -> int:
        """Free target KV positions before the next round (a queued one's, if any)."""
        return self._queue[0][6] if self._queue else int(self.rounds.room())

    def cancel(self) -> None:
        """Stop a running batch after its current round (thread-safe)."""
        self._cancel[0] = 1

    def run(self, history: list[int], max_n: int, left: int | None = None) -> RoundResult:
        """The next round; ``left``: tokens still wanted (lets the extension run the rounds after it)."""
        queue = self._queue
        if not queue:
            self._fetch(history, max_n, left)
            self._belief = None
        drafted, m, nxt, t_draft, t_verify, limit, _ = queue.popleft()
        if limit != max_n:  # the engine and the batch must agree on every round's limit
            raise EesdError(f"internal: the native batch drafted up to {limit} tokens where {max_n} were asked")
        return RoundResult(drafted, m, nxt, t_draft, t_verify)

    def belief(self) -> dict[str, float]:
        """The controller's belief after the current batch: it changed in C++, round by round, but
        Python sees it once a batch (so all rounds of a batch report this one)."""
        if self._belief is None:
            self._belief = belief(self.ctl)
        return self._belief

    def _fetch(self, history: list[int], max_n: int, left: int | None) -> None:
        if not self._started:  # the history is known from the first round on; the extension extends it itself
            self.rounds.set_history(history)
            self._started = True
        if not self.ctx.ptr or (self.draft_ctx is not None and not self.draft_ctx.ptr):  # closed meanwhile
            _open(self.ctx, "target")
            _open(self.draft_ctx, "draft")  # type: ignore[arg-type]
        try:
            if left is None:  # the engine asks for max_n = min(draft_max, left - 1, room - 1): without `left`, one round
                self._queue.extend(self.rounds.run_batch(len(history), max_n, max_n + 1, 1))
            else:
                self._queue.extend(self.rounds.run_batch(len(history), self.draft_max, left, 1 << 20))
        except self._native.ContextFull as exc:
            raise ContextFullError(str(exc), hint="start a new conversation or pass a larger --ctx") from None

    def close(self) -> None:
        """Hand the KV records back to the Python contexts."""
        rounds = getattr(self, "rounds", None)
        if rounds is None:
            return
        self.rng.state = rounds.rng_state()  # the random stream goes on where the batches left it
        self.t_llama = rounds.t_llama
        if getattr(self.ctx, "ptr", None):
            self.ctx.tokens[:] = rounds.tokens(0)
        if self.draft_ctx is not None and getattr(self.draft_ctx, "ptr", None):
            self.draft_ctx.tokens[:] = rounds.tokens(1)
        rounds.close()
        self.rounds = None
