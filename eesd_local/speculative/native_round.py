"""Glue between the engine and the native round loop (``eesd_local._native``).

The extension runs a whole round in C++: the controller's decisions (the same Numba
kernels, as C function pointers), drafting with the draft context or from the lookup
drafter's n-gram search (run in C++ with the drafter's n-gram sizes), the one batched verify
(one llama_decode; two with a split target: trunk, then tail), greedy or speculative-sampling
acceptance, and the KV trims of both contexts. It keeps its own record of what each
KV cache holds for the length of a generation: the record moves in when the rounds
start and back into the Python contexts on :meth:`NativeRounds.close`.

Which drafters it can run is each drafter's own say (:meth:`Drafter.native`): a draft
context drafting token by token, an n-gram lookup, both (hierarchical), or nothing.

``EESD_NATIVE=0`` forces the Python loop; without the extension the engine falls back
to it by itself. Both give the same tokens and the same events.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import numpy as np

from eesd_local.base.errors import ContextFullError, EesdError
from eesd_local.llama import native as native_ext
from eesd_local.llama.ggmlapi import rpc_failures
from eesd_local.llama.runtime import Context, check_rpc
from eesd_local.speculative.controllers import layout as L
from eesd_local.speculative.controllers.cfuncs import addresses, hindsight_address
from eesd_local.speculative.drafters.base import Drafter, NativeSpec
from eesd_local.speculative.rounds import Controller, PythonRounds, RoundLoop, RoundResult
from eesd_local.speculative.sampling import SamplingParams, TokenRNG

# the extension's drafting modes: nothing, n-gram lookup proposals, a draft context, the controller's choice per round
NONE, POINT, MODEL, CHOOSE = 0, 1, 2, 3


def status(drafter: Drafter) -> tuple[bool, str]:
    """(use the native loop for ``drafter``?, a one-line note saying which loop runs and why)."""
    if os.environ.get("EESD_NATIVE", "").strip() == "0":
        return False, "round loop: Python (EESD_NATIVE=0)"
    native, why = native_ext.load()
    if native is None:
        return False, f"round loop: Python (native extension unavailable: {why})"
    if drafter.native() is None:
        return False, f"round loop: Python (the drafter {drafter.name} has no native form)"
    return True, "round loop: native"


def open_loop(ctx: Context, drafter: Drafter, controller: Controller, params: SamplingParams, rng: TokenRNG, *,
              draft_max: int, batch_s: float) -> tuple[RoundLoop, str]:
    """The round loop for one generation (native when it can run the drafter, else Python) and its note.

    A drafter with free offers (prompt lookup, alone or in ``auto``) has the controller learn from
    every offer in hindsight where the controller can (:meth:`Controller.learn_in_hindsight`)."""
    use_native, note = status(drafter)
    learn = getattr(controller, "learn_in_hindsight", None)
    hindsight = bool(learn(bool(drafter.free_offers))) if learn is not None else False
    if use_native:
        return NativeRounds(ctx, drafter, controller, params, rng, draft_max=draft_max, batch_s=batch_s,
                            hindsight=hindsight), note
    return PythonRounds(ctx, drafter, controller, params, rng, hindsight=hindsight), note


def _mode(spec: NativeSpec) -> int:
    if spec.choose:
        return CHOOSE  # lookup alone or the draft context alone, as the controller's SOURCE says
    if spec.draft_ctx is not None:
        return MODEL  # guesses from spec.lookup, if any, are checked by the draft context (hierarchical)
    return POINT if spec.lookup is not None else NONE


def _open(ctx: Context, what: str) -> int:
    if not ctx.ptr:
        raise EesdError(f"the {what} context is closed", hint="load the engine again")
    return int(ctx.ptr)


class NativeRounds:
    """One generation's rounds through the extension (:class:`eesd_local.speculative.rounds.RoundLoop`).

    The extension runs rounds in batches: one call runs the rounds the engine would ask for
    next (the same :func:`eesd_local.speculative.rounds.round_limit`, from the tokens still wanted and the
    room left) until ``batch_s`` seconds have passed, an end-of-generation token, or
    :meth:`cancel`; the engine then takes them one by one, with the same events as
    round-by-round calls. So Python runs once per batch rather than once per round: on a
    GPU, where a round takes a millisecond or two, that is most of the time outside
    llama.cpp. ``batch_s=0``: one round per call.
    """

    def __init__(self, ctx: Context, drafter: Drafter, controller: Controller, params: SamplingParams, rng: TokenRNG,
                 *, draft_max: int, batch_s: float = 0.0, hindsight: bool = False) -> None:
        native, why = native_ext.load()
        spec = drafter.native()
        if native is None or spec is None:
            raise EesdError(f"the native round loop cannot run here: {why or drafter.name}")
        self.mode = _mode(spec)
        self.draft_ctx = spec.draft_ctx
        self.ctl, self.rng = controller, rng
        self._native = native
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
                              slots["offer_match"])
        if hindsight:
            self.rounds.set_hindsight(hindsight_address())
        self._names = {L.SRC_LOOKUP: drafter.source_name(L.SRC_LOOKUP), L.SRC_MODEL: drafter.source_name(L.SRC_MODEL)}
        for which, c in enumerate((ctx, draft)):
            if c is not None:
                self.rounds.set_tokens(which, c.tokens)
                self.rounds.limit(which, c.n_ctx)
        if spec.lookup is not None:  # the n-gram search runs in C++, on the history the extension holds
            self.rounds.set_lookup(*spec.lookup)
        self._started = False
        self.draft_max = draft_max
        # rounds run ahead, in order: (drafted, accepted, next token, t_draft, t_verify, the draft
        # limit it ran with, free target KV positions before it, the source that drafted)
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

    def run(self, history: list[int], max_n: int, left: int) -> RoundResult:
        """The next round (queued, or the first of a new batch); the batch applies the engine's
        ``round_limit`` itself, round by round, so ``max_n`` is what that rule gives here."""
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
        if self.ctx.ptr:
            self.ctx.tokens[:] = rounds.tokens(0)
        if self.draft_ctx is not None and self.draft_ctx.ptr:
            self.draft_ctx.tokens[:] = rounds.tokens(1)
        rounds.close()
