"""The round loop: one implementation, in C++ (``eesd_local._native``, native/rounds.cpp).

A round: the drafter says what it has for free (lookup's match, how far a draft model is behind),
the controller decides which source drafts and how far, the drafter proposes d1..dk, the target
decodes [last, d1..dk] in ONE llama_decode (two with a split target: trunk, then tail), the
accepted prefix plus one target token is emitted, and the target's KV cache is trimmed past it.
Every rule of it lives in native/: the round limit, prompt lookup's match, hindsight over free
offers, greedy and speculative-sampling verification, top-k/top-p, the random stream. The
controller's decisions are the Numba kernels of :mod:`.controllers`, called through cfuncs.

Which form a drafter takes is its own say (:meth:`Drafter.native`): a draft context drafting token
by token, an n-gram lookup, both (hierarchical), the controller's choice of the two (auto), nothing
(plain decoding), or a drafter written in Python, which the loop calls once a round.

The extension keeps its own record of what each KV cache holds for the length of a generation:
the record moves in when the rounds start and back into the Python contexts on :meth:`Rounds.close`.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple, Protocol

import numpy as np

from eesd_local.base.defaults import MODEL_DRAFT_MAX
from eesd_local.base.errors import ContextFullError, EesdError
from eesd_local.llama import native as native_ext
from eesd_local.llama.ggmlapi import rpc_failures
from eesd_local.llama.runtime import Context, check_rpc
from eesd_local.speculative.controllers import layout as L
from eesd_local.speculative.controllers.cfuncs import addresses, hindsight_address
from eesd_local.speculative.drafters.base import SRC_ANY, SRC_LOOKUP, SRC_MODEL, Drafter, NativeSpec
from eesd_local.speculative.sampling import SamplingParams, TokenRNG

# the extension's drafting modes: nothing, n-gram lookup proposals, a draft context, the controller's
# choice per round, a drafter written in Python
NONE, POINT, MODEL, CHOOSE, CALL = 0, 1, 2, 3, 4
SRC_PREDICTION = 2  # a round whose lookup proposals came from the request's prediction (native/rounds.hpp)
PREDICTION = "prediction"  # its source's name in events and statistics
SRC_STORE = 3  # ... from the store of earlier answers
STORE = "earlier-answers"


class RoundResult(NamedTuple):
    drafted: list[int]  # d1..dk
    accepted: int  # m: d1..dm were kept
    next_token: int  # the target's token after them (a correction, or the bonus when m == k > 0; -1: none, a probe's)
    t_draft: float
    t_verify: float
    source: str = ""  # the source that drafted (lookup, eesd, ...); "" when nothing was drafted
    rows: int = 0  # tokens in the verify batch [last, d1..]: k + 1, or k for a probe without the bonus


class Controller(Protocol):
    """A draft-length controller (:mod:`.controllers`): one float64 state array that its Numba
    kernels update in place, so the native loop runs the same decisions through cfuncs."""

    name: str
    max_draft: int
    state: np.ndarray

    def begin_request(self) -> None: ...

    def begin_round(self, offer: int = 0, confidence: float = 0.0, behind: int = 0, match: int = 0,
                    reach: int = 0) -> None: ...

    def source(self) -> int: ...

    def draft_more(self, step: int, confidence: float) -> bool: ...

    def no_bonus(self) -> bool: ...

    def learn_in_hindsight(self, on: bool) -> bool: ...

    def prime_resume(self, seconds_per_token: float) -> None: ...

    def end_round(self, confidences: np.ndarray, n_accepted: int, t_draft: float, t_verify: float,
                  t_catchup: float = 0.0) -> None: ...

    def belief(self) -> dict[str, float]: ...


def _mode(spec: NativeSpec) -> int:
    if spec.python:
        return CALL
    if spec.choose:
        return CHOOSE  # lookup alone or the draft context alone, as the controller's source says
    if spec.draft_ctx is not None:
        return MODEL  # guesses from spec.lookup, if any, are checked by the draft context (hierarchical)
    return POINT if spec.lookup is not None else NONE


def _open(ctx: Context, what: str) -> int:
    if not ctx.ptr:
        raise EesdError(f"the {what} context is closed", hint="load the engine again")
    return int(ctx.ptr)


class _PythonDrafter:
    """A drafter written in Python, as the loop calls it once a round: its offer, the controller's
    begin and its proposal (the controller deciding token by token through ``draft_more``)."""

    def __init__(self, drafter: Drafter, controller: Controller, params: SamplingParams, free_offers: bool) -> None:
        self.drafter, self.ctl, self.params = drafter, controller, params
        self.history: list[int] = []
        self.choose = drafter.n_sources > 1
        self.free_offers = free_offers
        self.rng = TokenRNG(0)

    def __call__(self, fresh: list[int], max_n: int, rng_state: int) -> tuple[Any, ...]:
        history = self.history
        history.extend(fresh)
        offer = self.drafter.offer(history, max_n)
        self.ctl.begin_round(offer.n, offer.confidence, offer.behind, offer.match)
        source = self.ctl.source() if self.choose else SRC_ANY
        self.rng.state = rng_state
        prop = self.drafter.propose(history, self.ctl.draft_more, max_n, self.params, self.rng, source=source)
        qs = None if all(q is None for q in prop.probs) else list(prop.probs)
        return (list(prop.tokens), [float(c) for c in prop.confidences], qs, float(prop.t_catchup),
                source if self.choose else SRC_LOOKUP, list(offer.tokens) if self.free_offers else [], int(offer.match),
                self.rng.state)


class Rounds:
    """One generation's rounds.

    The extension runs rounds in batches: one call runs the rounds the engine would ask for next
    (round r drafts at most ``round_limit(draft_max, left_r, room_r)``) until ``batch_s`` seconds have
    passed, an end-of-generation token, or :meth:`cancel`; the engine then takes them one by one. So
    Python runs once per batch rather than once per round: on a GPU, where a round takes a millisecond
    or two, that is most of the time outside llama.cpp. ``batch_s=0``: one round per call.
    """

    def __init__(self, ctx: Context, drafter: Drafter, controller: Controller, params: SamplingParams, rng: TokenRNG,
                 *, draft_max: int, batch_s: float = 0.0, prediction: list[int] | None = None, n_prompt: int = 0,
                 store: Any = None, model_draft_max: int = MODEL_DRAFT_MAX) -> None:
        native = native_ext.require()
        spec = drafter.native()
        self.mode = _mode(spec)
        self.draft_ctx = spec.draft_ctx
        self.ctl, self.rng = controller, rng
        self._native = native
        # a drafter with free offers (prompt lookup, alone or in auto) has the controller learn from every
        # offer in hindsight, where the controller can
        hindsight = bool(controller.learn_in_hindsight(bool(drafter.free_offers)))
        split = getattr(ctx, "trunk", None) is not None  # the shared trunk's split target (trunk.py)
        if split:  # the loop runs the tail as the target and the trunk as the draft context, whatever drafts
            self.draft_ctx, ctx = ctx.trunk, ctx.tail  # type: ignore[attr-defined]
        self.ctx = ctx
        draft = self.draft_ctx
        slots = L.loop_slots()
        self.rounds = native.Rounds(_open(ctx, "target"), ctx.n_batch, 0 if split or not draft else _open(draft, "draft"),
                                    draft.n_batch if draft else 0, *addresses(), no_bonus_slot=slots["no_bonus"])
        if split:
            trunk: Any = draft
            t = trunk.table
            self.rounds.set_split(_open(trunk, "trunk"), trunk.n_batch, trunk.capture.user_data, t._raw.ctypes.data,
                                  t.row_bytes, t.type, t.n_rows, t.n_embd, [int(v) for v in trunk.vocab],
                                  int(trunk.target_model.ptr))
        self.rounds.set_slots(slots["offer_n"], slots["offer_conf"], slots["behind"], slots["source"], slots["t_catchup"],
                              slots["offer_match"], slots["offer_reach"])
        if hindsight:
            self.rounds.set_hindsight(hindsight_address())
        if self.mode == CALL:
            self.rounds.set_call(_PythonDrafter(drafter, controller, params, hindsight))
        self._names = {s: drafter.source_name(s) for s in (SRC_LOOKUP, SRC_MODEL)}
        self._names[SRC_PREDICTION] = PREDICTION
        self._names[SRC_STORE] = STORE
        if store is not None and spec.lookup is not None:  # earlier answers, searched beside the history
            self.rounds.set_store(store)
        if prediction and self.mode != CALL:  # the answer's expected tokens, proposed where the answer follows them
            self.rounds.set_reference(prediction, n_prompt)
        for which, c in enumerate((ctx, draft)):
            if c is not None:
                self.rounds.set_tokens(which, c.tokens)
                self.rounds.limit(which, c.n_ctx)
        if spec.lookup is not None:  # the n-gram search runs in C++, on the history the extension holds
            self.rounds.set_lookup(*spec.lookup)
        self.rounds.set_model_max(model_draft_max)  # a drafting model stops there; free offers go to draft_max
        self._started = False
        self.draft_max = draft_max
        # rounds run ahead, in order: (drafted, accepted, next token, t_draft, t_verify, the draft
        # limit it ran with, free target KV positions before it, the source that drafted, rows)
        self._queue: deque[tuple[list[int], int, int, float, float, int, int, int, int]] = deque()
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

    def run(self, history: list[int], left: int) -> RoundResult:
        """The next round continuing ``history`` (which ends with the last emitted token); ``left``:
        tokens still wanted. A queued round, or the first of a new batch."""
        if not self._queue:
            self._fetch(history, left)
            self._belief = None
        drafted, m, nxt, t_draft, t_verify, _, _, src, rows = self._queue.popleft()
        return RoundResult(drafted, m, nxt, t_draft, t_verify, self._names.get(src, "") if drafted else "", rows)

    def belief(self) -> dict[str, float]:
        """The controller's belief after the current batch: it changed in C++, round by round, but
        Python sees it once a batch (so all rounds of a batch report this one)."""
        if self._belief is None:
            self._belief = self.ctl.belief()
        return self._belief

    def _fetch(self, history: list[int], left: int) -> None:
        if not self._started:  # the history is known from the first round on; the extension extends it itself
            self.rounds.set_history(history)
            self._started = True
        _open(self.ctx, "target")
        if self.draft_ctx is not None:
            _open(self.draft_ctx, "draft")
        model = self.ctx.model
        lost = rpc_failures() if model.rpc else 0
        try:
            batch = self.rounds.run_batch(len(history), self.draft_max, left, 1 << 20)
        except self._native.ContextFull as exc:
            raise ContextFullError(str(exc), hint="start a new conversation or pass a larger --n-ctx") from None
        if model.rpc:
            check_rpc(model, lost)  # a server lost during the batch: none of its rounds is taken
        self._queue.extend(batch)

    def close(self) -> None:
        """Hand the KV records back to the Python contexts (the engine calls this before any other
        generation touches them, so the records are the caches' own)."""
        rounds = self.rounds
        if rounds is None:
            return
        self.rounds = None
        self.rng.state = rounds.rng_state()  # the random stream goes on where the batches left it
        self.t_llama = rounds.t_llama
        rounds.set_call(None)  # the Python drafter (and what it holds) is not kept alive by the extension
        if self.ctx.ptr:
            self.ctx.tokens[:] = rounds.tokens(0)
        if self.draft_ctx is not None and self.draft_ctx.ptr:
            self.draft_ctx.tokens[:] = rounds.tokens(1)
        rounds.close()
