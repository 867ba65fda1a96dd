"""The speculative engine: one round loop over any drafter, exact verification.

Each round the controller decides how far to draft, the drafter proposes d1..dk,
the target decodes [last, d1..dk] in ONE llama_decode, the accepted prefix plus one
target token is emitted, and the target's KV cache is trimmed past it. Greedy
output equals plain decoding; sampling keeps the target's distribution exactly.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np

from eesd_local.base.defaults import (
    BATCH_MS,
    CACHE_RAM_MB,
    DRAFT_MAX,
    MAX_TOKENS,
    MODEL_DRAFT_MAX,
    N_CTX,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
)
from eesd_local.base.errors import EesdError
from eesd_local.base.params import (
    MAX_THREADS,
    SEED_MAX,
    SEED_MIN,
    ParamError,
    check_choice,
    check_int,
    check_number,
    check_optional_int,
    check_sampling,
    show,
)
from eesd_local.llama import costs, native
from eesd_local.llama.catalog import resolve_model
from eesd_local.llama.rpc import parse_endpoints
from eesd_local.llama.runtime import Context, ContextParams, Detokenizer, Model, common_prefix, exactness
from eesd_local.llama.trunk import open_split
from eesd_local.speculative import chat as chat_mod
from eesd_local.speculative.controllers import CPU_DRAFT_MARGIN, DEFAULT_CONTROLLER, make_controller
from eesd_local.speculative.controllers import Controller as StateController
from eesd_local.speculative.drafters import DRAFTERS, make_drafter, n_sources, placement, shared_trunk_plan, target_on_cpu
from eesd_local.speculative.drafters.base import Drafter, NoDrafter
from eesd_local.speculative.events import Event, FinishEvent, RoundEvent, Stats, TokenEvent
from eesd_local.speculative.promptcache import RESTORE_MIN_TOKENS, SAVE_MIN_TOKENS, PromptCache
from eesd_local.speculative.rounds import Controller, Rounds
from eesd_local.speculative.sampling import SamplingParams, TokenRNG

MAX_BATCH_MS = 3_600_000.0
# the store of earlier answers: tokens held (the oldest answers go first), the shortest match it offers, and
# how much of a prompt's end goes in before its answer (so that the same request again finds it from its start)
STORE_TOKENS = 1 << 18
STORE_MATCH = 8
STORE_PROMPT_END = 64


@dataclass
class EngineConfig:
    model: str = "qwen2.5-coder-0.5b-instruct"
    drafter: Any = "auto"  # auto | none | eesd | lookup | draft-model | hierarchical, or a Drafter object
    head: str | None = None  # exit-head GGUF for eesd (default: the shipped head for the model)
    draft_model: str | None = None  # GGUF or registry name for draft-model
    controller: Any = None  # a Controller, a spec like "cost-ts" / "fixed:4", or None for the default
    draft_max: int = DRAFT_MAX  # most tokens a round drafts (a free offer drafts as far as its match is long)
    model_draft_max: int = MODEL_DRAFT_MAX  # most tokens a drafting model (exit head, draft model) drafts a round
    n_ctx: int = N_CTX
    n_gpu_layers: int = 0
    n_threads: int | None = None
    seed: int = 0  # the controller's seed
    batch_ms: float = BATCH_MS  # run rounds this long in C++ before Python takes them; 0 = one at a time
    # run the exit head on the target's own first N layers (trunk.py) rather than a separate copy of them:
    # None (default): for eesd and hierarchical, and for auto where the cost profile says the exit head can pay
    # here (measured at load where none is kept; where it cannot, auto is prompt lookup and holds no head)
    shared_trunk: bool | None = None
    # kept for its callers: a new prompt reuses all it shares with the cache either way (engine._prefill)
    cache_reuse: str = "exact"
    # HOST:PORT of llama.cpp RPC servers (eesd rpc-server) that hold the layers --n-gpu-layers offloads
    rpc: tuple[str, ...] = ()
    # megabytes of idle prompts' KV states kept in RAM (llama-server's --cache-ram); 0: none
    cache_ram: int = CACHE_RAM_MB


class _Generation:
    """One generation's generator and whether it still owns the engine's contexts."""

    __slots__ = ("inner", "ended")

    def __init__(self, inner: Generator[Event, None, None]) -> None:
        self.inner = inner
        self.ended: str | None = None  # why it no longer runs (then it must not touch the contexts)


class Engine:
    """A target model, a drafter and a controller; ``generate`` yields events.

    One generation runs at a time, and it owns the contexts until it ends: :meth:`run` calls
    from several threads wait for each other; a :meth:`generate` started while an earlier
    generator is still open ends that one first (its KV rollback runs at once, and its next
    step raises :class:`EesdError`), so an abandoned or late-collected generator never leaves
    the cache out of step. llama.cpp is never entered twice at once. After :meth:`close` every
    method raises ``EesdError("the engine is closed")``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._closed = False
        self._lock = threading.RLock()  # held while llama.cpp runs: one step of a generation, close, switches
        self._serial = threading.RLock()  # held by run() and whole completions: they wait for each other
        self._gen: _Generation | None = None  # the generation that owns the contexts
        self._live: Rounds | None = None  # its round loop (for cancel)
        self._cancel = False
        check_config(config)
        native.require()  # the round loop: a missing build is an error here, before any model loads
        t = time.perf_counter()
        self.load_times: dict[str, float] = {}  # seconds per step of the load (eesd generate -v prints them)

        def lap(step: str) -> None:
            nonlocal t
            now = time.perf_counter()
            self.load_times[step] = self.load_times.get(step, 0.0) + now - t
            t = now

        # greedy output byte-identical to plain decoding (runtime.exactness), and why (not)
        self.exact, self.exact_note = exactness(draft_max=config.draft_max, n_gpu_layers=config.n_gpu_layers,
                                                rpc=bool(config.rpc))
        self.model_path = resolve_model(config.model)
        # with the shared trunk the target's weights are the trunk's and the tail's: its own load is vocabulary only
        plan, no_split = shared_trunk_plan(config, self.model_path)
        lap("checks")
        self.model = Model(self.model_path, n_gpu_layers=config.n_gpu_layers, vocab_only=plan is not None, rpc=config.rpc)
        lap("model")
        self.drafter: Drafter = NoDrafter()
        self.drafter_note = ""
        self.trunk: Any = None  # the shared trunk+exit context, when the target is split
        try:
            params = ContextParams(n_ctx=config.n_ctx, n_threads=config.n_threads)
            if plan is not None:
                self.ctx: Any = open_split(self.model, plan[0], params, n_gpu_layers=config.n_gpu_layers, rpc=config.rpc)
                self.trunk = self.ctx.trunk
            else:
                self.ctx = Context(self.model, params)
            lap("context")
            if config.draft_max == DRAFT_MAX and DRAFT_MAX + 1 > self.ctx.n_batch:
                # the default, in a context smaller than it: drafts as long as the batch holds (a value asked for
                # explicitly must fit, below)
                config = self.config = dataclasses.replace(config, draft_max=max(1, self.ctx.n_batch - 1))
            if config.draft_max + 1 > self.ctx.n_batch:  # a round decodes [last, d1..dk] in one batch
                raise EesdError(f"a draft of up to {config.draft_max} tokens does not fit the target's batch of "
                                f"{self.ctx.n_batch} tokens", hint=f"use --draft-max {self.ctx.n_batch - 1} or less")
            self.drafter, self.drafter_note = make_drafter(config, self.model, self.trunk)
            if no_split:
                self.drafter_note += f"; {no_split}: the exit head runs as a separate draft model"
            lap("drafter")
            self.controller = self._new_controller(config.controller, n_sources(self.drafter))
            # idle prompts' states in RAM (a split target saves its trunk's and its tail's)
            self.prompt_cache = PromptCache(config.cache_ram << 20) if config.cache_ram > 0 else None
            # earlier answers (each after its prompt's end), which prompt lookup searches beside the history (None: off)
            self.store: Any = native.require().Store(STORE_TOKENS, STORE_MATCH)
        except BaseException:
            self.close()
            raise
        lap("controller")

    # --- the round loop --------------------------------------------------

    def generate(self, prompt: str | list[int], *, max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE,
                 top_k: int = TOP_K, top_p: float = TOP_P, seed: int | None = SEED,
                 stop: list[str] | str | None = None,
                 prediction: str | list[int] | None = None) -> Generator[Event, None, None]:
        """Yield a TokenEvent per emitted token, a RoundEvent per round, and one FinishEvent.

        ``prediction``: the answer as the caller expects it (OpenAI's predicted outputs: the file an edit
        changes a little), text or token ids. Its tokens are proposed first, free like prompt lookup's,
        wherever the answer follows them; the output is what it would be without it."""
        s = check_sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop)
        params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)
        max_tokens, stops = s.max_tokens, s.stop
        with self._serial:  # wait for a run() of another thread
            with self._lock:
                self._check_open()
                tokens = self._prompt_tokens(prompt)
                predicted = self._prediction_tokens(prediction)
                self._end_generation("a newer generation started on the same engine")
                self._cancel = False  # here, not in _run: a cancel() before the first next() still counts
                gen = self._gen = _Generation(self._run(tokens, max_tokens, params, stops, predicted))
        return self._step(gen)

    def _step(self, gen: _Generation) -> Generator[Event, None, None]:
        """Advance ``gen`` one event at a time under the engine's lock, as long as it owns the engine."""
        try:
            while True:
                with self._lock:
                    if gen.ended:
                        raise EesdError(f"this generation was stopped: {gen.ended}",
                                        hint="finish or close one generator before starting the next on the same engine")
                    try:
                        ev = next(gen.inner)
                    except StopIteration:
                        return
                yield ev
        finally:
            with self._lock:
                if not gen.ended:
                    gen.ended = "it was closed"
                    gen.inner.close()  # runs its rollback now, whoever holds the generator
                if self._gen is gen:
                    self._gen = None

    def _end_generation(self, why: str) -> None:
        """End the generation that owns the contexts (with the lock held): its rollback runs now."""
        gen, self._gen = self._gen, None
        if gen is not None and not gen.ended:
            gen.ended = why
            gen.inner.close()

    def _prompt_tokens(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            tokens = self.tokenize(prompt)
        elif isinstance(prompt, list | tuple) and all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in prompt):
            tokens = [int(t) for t in prompt]
            for i, t in enumerate(tokens):
                self.model.check_token(t, f" at prompt position {i}")
        else:
            raise EesdError(f"the prompt must be text (str) or a list of token ids, got {type(prompt).__name__}",
                            hint="decode bytes first, e.g. prompt.decode('utf-8')" if isinstance(prompt, bytes | bytearray) else None)
        if not tokens:
            raise EesdError("the prompt is empty", hint="give at least one token of text")
        if len(tokens) >= self.ctx.n_ctx:
            raise EesdError(
                f"the prompt has {len(tokens)} tokens but the context holds {self.ctx.n_ctx}",
                hint="shorten the prompt or pass a larger --n-ctx",
            )
        return tokens

    def _prediction_tokens(self, prediction: Any) -> list[int] | None:
        if prediction is None:
            return None
        if isinstance(prediction, str):
            try:
                tokens = self.model.tokenize(prediction, add_special=False, parse_special=False)
            except EesdError as exc:
                raise ParamError("prediction", f"the prediction: {exc.message}", hint=exc.hint) from None
        elif isinstance(prediction, list | tuple) and all(isinstance(t, int | np.integer) and not isinstance(t, bool)
                                                         for t in prediction):
            tokens = [int(t) for t in prediction]
            for i, t in enumerate(tokens):
                self.model.check_token(t, f" at prediction position {i}")
        else:
            raise ParamError("prediction", f"prediction must be text or a list of token ids, got {show(prediction)}")
        if len(tokens) > self.ctx.n_ctx:
            raise ParamError("prediction", f"the prediction has {len(tokens)} tokens but the context holds {self.ctx.n_ctx}",
                             hint="predict only the answer (e.g. the file being edited), or pass a larger --n-ctx")
        return tokens

    def _run(self, prompt: list[int], max_tokens: int, params: SamplingParams, stop: list[str],
             prediction: list[int] | None = None) -> Generator[Event, None, None]:
        ctx, model, drafter, ctl = self.ctx, self.model, self.drafter, self.controller
        rng = params.rng()
        stats = Stats(n_prompt=len(prompt), drafter=drafter.name, controller=ctl.name, exact=self.exact)
        detok = Detokenizer(model)
        text: list[str] = []
        history = list(prompt)
        reason = "length"
        rounds: Rounds | None = None
        t_start = 0.0
        try:
            t0 = time.perf_counter()
            n_fed = self._prefill(prompt)  # the last prompt token gives the first logits
            stats.n_cached = len(prompt) - n_fed
            t_fed = time.perf_counter() - t0
            first = self._pick(ctx.logits(), params, rng)
            drafter.begin(prompt)
            ctl.begin_request()
            share = drafter.weight_share  # a model drafter's weights over the target's
            if share and n_fed >= 16:
                ctl.prime_resume(share * t_fed / n_fed)  # until measured: catching up ~ its share of a prefill
            rounds = Rounds(ctx, drafter, ctl, params, rng, draft_max=self.config.draft_max,
                            model_draft_max=self.config.model_draft_max,
                            batch_s=self.config.batch_ms / 1000.0, prediction=prediction, n_prompt=len(prompt),
                            store=self.store if params.greedy else None)  # a seed's sampled text: never the store's
            self._live = rounds
            stats.t_prefill = time.perf_counter() - t0
            t_start = time.perf_counter()
            pending = [(first, "target")]
            round_no = 0
            while True:
                # emit what the last step produced; stop at end-of-generation, stop strings, limits
                for tok, source in pending:
                    if model.is_eog(tok):
                        reason = "stop"
                        break
                    history.append(tok)
                    stats.n_generated += 1
                    piece = detok.push(tok)
                    text.append(piece)
                    yield TokenEvent(tok, piece, source, round_no)  # type: ignore[arg-type]
                    if stop and _hit_stop(text, stop):
                        reason = "stop"
                        break
                    if stats.n_generated >= max_tokens:
                        reason = "length"
                        break
                else:
                    reason = ""
                if reason or self._cancel:
                    reason = reason or "cancelled"
                    break
                room = rounds.room()
                if room < 1:
                    reason = "context"  # the context is full: the answer stops short of max_tokens
                    break
                # one round: draft, verify in one batch, accept, roll back
                round_no += 1
                r = rounds.run(history, max_tokens - stats.n_generated)
                k, m = len(r.drafted), r.accepted
                stats.t_draft += r.t_draft
                stats.t_verify += r.t_verify
                pending = [(t, "draft") for t in r.drafted[:m]]
                if r.next_token >= 0:  # -1: a probe whose drafts were all accepted ends on its last draft
                    pending.append((r.next_token, "bonus" if m == k and m > 0 else "target"))
                stats.record_round(k, m, len(pending), r.source)
                yield RoundEvent(round_no, k, m, len(pending), r.t_draft, r.t_verify, rounds.belief(), r.source,
                                 r.rows or k + 1)
        except _PrefillCancelled:
            reason = "cancelled"
        finally:
            self._live = None
            if rounds is not None:
                rounds.close()  # the loop hands its KV records back to the contexts
            if ctx.ptr:  # the rollback always runs: the cache holds exactly the emitted history but `last`
                ctx.trim(min(ctx.n_past, max(0, len(history) - 1)))
            if self.store is not None and len(history) > len(prompt):  # the answer after its prompt's end, for later lookups
                self.store.add(history[max(0, len(prompt) - STORE_PROMPT_END):])
            stats.t_decode = time.perf_counter() - t_start if t_start else 0.0
        tail = detok.flush()
        if tail:
            text.append(tail)
        yield FinishEvent(reason, stats, "".join(text))  # type: ignore[arg-type]

    def _prefill(self, prompt: list[int]) -> int:
        """Decode ``prompt`` into the target's cache, reusing the longest prefix it shares with what the
        cache holds (token by token); returns how many tokens were decoded.

        Where greedy output is exact (batch-invariant kernels: runtime.exactness) a row's logits and KV do
        not depend on the batch it was computed in, so a prompt computes the same whatever part of it was
        cached and however it was cut: reusing any shared prefix (an earlier prompt's, an earlier answer's
        decode) leaves the answer what a fresh process gives. Elsewhere (a GPU) nothing is claimed and the
        shared prefix is reused likewise. ``cache_reuse`` is kept for its callers: both of its values reuse
        the whole shared prefix."""
        ctx = self.ctx
        keep = min(common_prefix(ctx.tokens, prompt), len(prompt) - 1)
        saved = self.prompt_cache
        if saved is not None:
            found = saved.best(prompt)
            if ctx.n_past - keep >= SAVE_MIN_TOKENS and ctx.tokens not in saved:
                saved.save(ctx.tokens, ctx)  # another conversation: keep this one's state for its next turn
            if found is not None and min(found[2], len(prompt) - 1) >= keep + RESTORE_MIN_TOKENS:
                ctx.restore_state(found[1], found[0])
                keep = min(found[2], len(prompt) - 1)
        ctx.trim(keep)
        if ctx.decode(prompt[keep:], stop=lambda: self._cancel) < 0:
            # cancelled between two chunks: the cache keeps the chunks decoded, which a later prompt reuses as
            # any cached prefix (with the batch-invariant kernels, as a fresh prefill computes them)
            raise _PrefillCancelled
        return len(prompt) - keep

    def keep_prompt(self) -> bool:
        """Save what the target's cache holds into the RAM prompt cache now, if it is not kept already (the
        server calls this when a response has gone and no request waits: the copy is then off every
        request's path, and a request for another conversation finds this one saved). True when saved."""
        with self._lock:
            self._check_open()
            saved, ctx = self.prompt_cache, self.ctx
            if saved is None or self._gen is not None or ctx.n_past < SAVE_MIN_TOKENS or ctx.tokens in saved:
                return False
            return saved.save(ctx.tokens, ctx)

    def _pick(self, logits: np.ndarray, params: SamplingParams, rng: TokenRNG) -> int:
        tok, rng.state = native.require().pick(logits, params.temperature, params.top_k, params.top_p, rng.state)
        return int(tok)

    def set_drafter(self, kind: str) -> str:
        """Switch to a drafter of ``kind`` on the same target (between requests); returns its note."""
        with self._lock:
            self._check_open()
            self._end_generation("the drafter was switched")
            config = dataclasses.replace(self.config, drafter=kind)
            drafter, note = make_drafter(config, self.model, self.trunk)
            old, self.drafter, self.config, self.drafter_note = self.drafter, drafter, config, note
            old.close()
            if n_sources(drafter) != n_sources(old) and (config.controller is None or isinstance(config.controller, str)):
                # a drafter with another number of sources needs a controller that chooses between them
                self.controller = self._new_controller(config.controller, n_sources(drafter))
            return note

    def forget_answers(self) -> None:
        """Empty the store of earlier answers that prompt lookup searches (a benchmark's repeat, a new user)."""
        with self._lock:
            if self.store is not None:
                self.store = native.require().Store(STORE_TOKENS, STORE_MATCH)

    def forget_prompts(self) -> None:
        """Drop every prompt the engine holds (the context's and the prompt cache's): the next request is
        prefilled from its first token, as in a fresh process (a benchmark's repeat)."""
        with self._lock:
            self._check_open()
            self._end_generation("the prompts were forgotten")
            self.ctx.clear()
            if self.prompt_cache is not None:
                self.prompt_cache = PromptCache(self.prompt_cache.limit)

    def set_controller(self, spec: str) -> None:
        """Switch the draft-length controller (between requests); it starts with a fresh belief."""
        with self._lock:
            self._check_open()
            self._end_generation("the controller was switched")
            self.controller = self._new_controller(spec, n_sources(self.drafter))
            self.config = dataclasses.replace(self.config, controller=spec)

    def _new_controller(self, spec: Any, sources: int) -> Controller:
        """A controller for ``spec``; a fresh one knows this machine's batch costs from the kept cost
        profile (:meth:`Controller.prime_costs`) where one is kept for this model and placement, and drafts
        only where a plan beats plain decoding by CPU_DRAFT_MARGIN where the target runs on the CPU."""
        ctl = _make_controller(spec, self.config.draft_max, self.config.seed, sources, self.config.model_draft_max)
        if not self.drafter.drafts or not isinstance(ctl, StateController) or ctl is spec:
            return ctl
        if target_on_cpu(self.config):
            ctl.raise_margin(CPU_DRAFT_MARGIN)
        try:
            prof, _ = costs.cached(costs.fingerprint(self.model_path, **placement(self.config)))
        except OSError:  # an unreadable cache: the rounds time the batches themselves
            prof = None
        if prof is not None:
            ctl.prime_costs(prof.t1_ms / 1e3, [prof.b(b) for b in range(1, self.config.draft_max + 2)])
        return ctl

    def cancel(self) -> None:
        """Ask a running generation to stop after the current round (thread-safe, never waits)."""
        self._cancel = True
        live = self._live
        if live is not None:
            live.cancel()  # the native loop also stops a running batch

    # --- conveniences ----------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        with self._lock:
            self._check_open()
            return self.model.tokenize(text, add_special=True, parse_special=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat prompt as text (to show it); :meth:`chat_tokens` is what to generate from."""
        self._check_open()
        bos = self._bos_text()
        text = chat_mod.render(self.model.chat_template(), messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos, eos_token="")
        # the template writes the BOS itself; tokenize() must not add a second one
        if bos and text.startswith(bos):
            text = text[len(bos):]
        return text

    def chat_tokens(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The chat prompt's tokens: the template's own markers as control tokens, the messages' text
        as plain text, so that ``<|im_end|><|im_start|>system`` typed into a message stays text and
        cannot open a turn of its own.

        Where no message holds control-token text (tokenized alone, with and without special
        parsing, it gives the same tokens), this is the whole rendered prompt tokenized as
        llama.cpp does, token for token what plain decoding of the template's text reads. Otherwise
        the template's text and the messages' text are tokenized apart (:func:`chat.render_parts`)."""
        msgs = chat_mod.check_messages(messages)
        text = self.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
        with self._lock:
            self._check_open()
            model = self.model
            if not any(model.tokenize(m["content"], add_special=False, parse_special=True)
                       != model.tokenize(m["content"], add_special=False, parse_special=False) for m in msgs):
                return model.tokenize(text, add_special=True, parse_special=True)
            bos = self._bos_text()
            parts = chat_mod.render_parts(model.chat_template(), msgs, add_generation_prompt=add_generation_prompt,
                                          bos_token=bos, eos_token="")
            if bos and parts and not parts[0][1] and parts[0][0].startswith(bos):
                parts[0] = (parts[0][0][len(bos):], False)
            tokens = [model.bos] if model.add_bos else []
            for piece, is_text in parts:
                tokens += model.tokenize(piece, add_special=False, parse_special=not is_text)
            return tokens

    def _bos_text(self) -> str:
        return self.model.token_to_piece(self.model.bos, special=True).decode("utf-8", "replace") if self.model.add_bos else ""

    def run(self, prompt: str | list[int], **kw: Any) -> FinishEvent:
        """Generate to the end and return the FinishEvent (text and stats); runs from several
        threads wait for each other."""
        with self._serial:
            last = None
            for ev in self.generate(prompt, **kw):
                last = ev
        assert isinstance(last, FinishEvent)
        return last

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EesdError("the engine is closed", hint="load the model again (eesd_local.load) to go on")

    def close(self) -> None:
        """Free the contexts and models; a generation still open ends first. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._end_generation("the engine was closed")
            self._closed = True
            for part in (self.drafter, getattr(self, "ctx", None), self.model):
                if part is not None:
                    part.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hit_stop(text: list[str], stop: list[str]) -> bool:
    tail = "".join(text[-64:])
    return any(s and s in tail for s in stop)


def check_config(config: EngineConfig) -> None:
    """The engine's options (load()'s keywords, the command-line flags), checked as request parameters are."""
    if not isinstance(config.model, str | os.PathLike):
        raise ParamError("model", f"model must be a registry name or a GGUF path, got {show(config.model)}")
    if isinstance(config.drafter, str):
        check_choice("drafter", config.drafter, tuple(DRAFTERS))
    for name in ("head", "draft_model"):
        value = getattr(config, name)
        if value is not None and not isinstance(value, str | os.PathLike):
            raise ParamError(name, f"{name} must be a path (a string), got {show(value)}")
    check_int("draft_max", config.draft_max, 1, hint="the most tokens drafted per round, e.g. 64 (--draft-max 64)")
    check_int("model_draft_max", config.model_draft_max, 1, hint="the most tokens a drafting model drafts per round, e.g. 8")
    check_int("n_ctx", config.n_ctx, 1, hint="the context size in tokens, e.g. 4096 (--n-ctx 4096)")
    check_int("n_gpu_layers", config.n_gpu_layers, -1, hint="layers offloaded to a GPU: 0 for none, -1 for all")
    check_optional_int("n_threads", config.n_threads, 1, MAX_THREADS, hint="leave it out to use every core")
    check_int("seed", config.seed, SEED_MIN, SEED_MAX, hint="the controller's seed, e.g. 0")
    check_number("batch_ms", config.batch_ms, 0.0, MAX_BATCH_MS, hint=f"e.g. {BATCH_MS:g}; 0 returns after every round")
    if config.shared_trunk is not None:
        check_choice("shared_trunk", config.shared_trunk, (True, False), hint="or None for the drafter's default")
    check_choice("cache_reuse", config.cache_reuse, ("exact", "conversation"))
    check_int("cache_ram", config.cache_ram, 0, 1 << 30, hint="megabytes of idle prompts' KV states kept in RAM, 0 for none")
    if isinstance(config.rpc, str) or not isinstance(config.rpc, list | tuple) or not all(isinstance(e, str) for e in config.rpc):
        raise ParamError("rpc", f"rpc must be a list of HOST:PORT strings, got {show(config.rpc)}")
    if config.rpc:
        parse_endpoints(list(config.rpc))


class _PrefillCancelled(Exception):
    """cancel() came while the prompt was being decoded (Engine._prefill)."""


def _make_controller(spec: Any, draft_max: int, seed: int, sources: int = 1, model_max: int = MODEL_DRAFT_MAX) -> Controller:
    if spec is not None and not isinstance(spec, str):
        return spec  # a Controller object

    return make_controller(spec or DEFAULT_CONTROLLER, max_draft=draft_max, seed=seed, sources=sources, model_max=model_max)
