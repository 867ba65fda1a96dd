"""The speculative engine: one round loop over any drafter, exact verification.

Each round the controller decides how far to draft, the drafter proposes d1..dk,
the target decodes [last, d1..dk] in ONE llama_decode, the accepted prefix plus one
target token is emitted, and the target's KV cache is trimmed past it. Greedy
output equals plain decoding; sampling keeps the target's distribution exactly.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import chat as chat_mod
from . import native_round
from .drafters import make_drafter
from .drafters.base import Drafter, NoDrafter
from .errors import EesdError
from .events import Event, FinishEvent, RoundEvent, Stats, TokenEvent
from .native_round import RoundResult
from .registry import resolve_model
from .runtime import Context, ContextParams, Detokenizer, Model, common_prefix
from .sampling import SamplingParams, TokenRNG, Uniform, probs, sample, verify_greedy, verify_sampled


@dataclass
class EngineConfig:
    model: str = "qwen2.5-coder-0.5b-instruct"
    drafter: str = "auto"  # auto | none | eesd | lookup | draft-model | hierarchical
    head: str | None = None  # exit-head GGUF for eesd (default: the shipped head for the model)
    draft_model: str | None = None  # GGUF or registry name for draft-model
    controller: Any = None  # a Controller, a spec like "cost-ts" / "fixed:4", or None for the default
    draft_max: int = 8
    n_ctx: int = 4096
    n_gpu_layers: int = 0
    n_threads: int | None = None
    seed: int = 0  # the controller's seed
    # the native loop runs rounds in batches of about this long before Python takes them (and
    # streams their tokens): fewer Python calls per token; 0 = back to Python after every round
    batch_ms: float = 50.0


class PythonRounds:
    """The round in Python: the controller drafts d1..dk, the target decodes [last, d1..dk]
    in ONE llama_decode, the accepted prefix is kept and the rest of the KV rolled back."""

    def __init__(self, ctx: Context, drafter: Drafter, controller: Any, params: SamplingParams, rng: Uniform) -> None:
        self.ctx, self.drafter, self.ctl, self.params, self.rng = ctx, drafter, controller, params, rng
        self.no_bonus = getattr(controller, "no_bonus", None)  # a duck-typed controller may not have it

    def room(self) -> int:
        return self.ctx.room()

    def run(self, history: list[int], max_n: int, left: int | None = None) -> RoundResult:
        ctx, ctl, params = self.ctx, self.ctl, self.params
        ctl.begin_round()
        t1 = time.perf_counter()
        prop = self.drafter.propose(history, ctl.draft_more, max_n, params, self.rng)
        t2 = time.perf_counter()
        k = len(prop)
        # a probe verifies its drafts without the bonus: [last, d1..d(k-1)], k rows (plain decoding when k = 1)
        bonus = k == 0 or self.no_bonus is None or not self.no_bonus()
        n_rows = k + 1 if bonus else k
        n_keep = ctx.n_past + 1  # the cache keeps `last` ...
        ctx.decode([history[-1], *prop.tokens[: n_rows - 1]], n_logits=n_rows)
        if params.greedy:
            m, nxt = verify_greedy(np.stack([ctx.logits(i) for i in range(n_rows)]), prop.tokens, bonus)
        else:
            m, nxt = verify_sampled(ctx.logits_rows(), prop.tokens, prop.probs, params, self.rng, bonus)
        ctx.trim(n_keep + min(m, n_rows - 1))  # ... and the accepted drafts it decoded; the rest is rolled back
        t3 = time.perf_counter()
        ctl.end_round(np.asarray(prop.confidences, dtype=np.float64), m, t2 - t1, t3 - t2)
        self.drafter.accept(history + prop.tokens[:m] + ([nxt] if nxt >= 0 else []), m)
        return RoundResult(prop.tokens, m, nxt, t2 - t1, t3 - t2)

    def belief(self) -> dict[str, float]:
        """The controller's belief after the last round (for its RoundEvent)."""
        return native_round.belief(self.ctl)

    def cancel(self) -> None:
        pass  # the engine checks its own flag between rounds

    def close(self) -> None:
        pass


Rounds = PythonRounds | native_round.NativeRounds


class Engine:
    """A target model, a drafter and a controller; ``generate`` yields events."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = resolve_model(config.model)
        self.model = Model(self.model_path, n_gpu_layers=config.n_gpu_layers)
        self.ctx = Context(self.model, ContextParams(n_ctx=config.n_ctx, n_threads=config.n_threads))
        self.drafter: Drafter = NoDrafter()
        self.drafter_note = ""
        try:
            self.drafter, self.drafter_note = make_drafter(config, self.model)
            self.controller = _make_controller(config.controller, config.draft_max, config.seed)
        except BaseException:
            self.close()
            raise
        self._cancel = False
        self._live: Rounds | None = None  # the running generation's round loop (for cancel)
        self.loop_note = native_round.status(self.drafter)[1]  # which round loop runs, and why

    # --- the round loop --------------------------------------------------

    def generate(self, prompt: str | list[int], *, max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None) -> Generator[Event, None, None]:
        """Yield a TokenEvent per emitted token, a RoundEvent per round, and one FinishEvent."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if max_tokens < 1:
            raise EesdError(f"max_tokens must be >= 1, got {max_tokens}")
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not tokens:
            raise EesdError("the prompt is empty", hint="give at least one token of text")
        if len(tokens) >= self.ctx.n_ctx:
            raise EesdError(
                f"the prompt has {len(tokens)} tokens but the context holds {self.ctx.n_ctx}",
                hint="shorten the prompt or pass a larger --ctx",
            )
        self._cancel = False  # here, not in _run: a cancel() before the first next() still counts
        return self._run(tokens, max_tokens, params, stop or [])

    def _run(self, prompt: list[int], max_tokens: int, params: SamplingParams, stop: list[str]) -> Generator[Event, None, None]:
        ctx, model, drafter, ctl = self.ctx, self.model, self.drafter, self.controller
        rng = params.rng()
        stats = Stats(n_prompt=len(prompt), drafter=drafter.name, controller=getattr(ctl, "name", "?"))
        detok = Detokenizer(model)
        text: list[str] = []
        history = list(prompt)
        reason = "length"
        rounds: Rounds | None = None
        try:
            t0 = time.perf_counter()
            # prefill, reusing the cached common prefix; the last prompt token gives the first logits
            keep = min(common_prefix(ctx.tokens, prompt), len(prompt) - 1)
            ctx.trim(keep)
            ctx.decode(prompt[keep:])
            first = self._pick(ctx.logits(), params, rng)
            drafter.begin(prompt)
            rounds = self._live = self._rounds(params, rng)
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
                    reason = "length"
                    break
                # one round: draft, verify in one batch, accept, roll back (Python or native)
                round_no += 1
                left = max_tokens - stats.n_generated
                r = rounds.run(history, max(0, min(self.config.draft_max, left - 1, room - 1)), left)
                k, m = len(r.drafted), r.accepted
                stats.t_draft += r.t_draft
                stats.t_verify += r.t_verify
                pending = [(t, "draft") for t in r.drafted[:m]]
                if r.next_token >= 0:  # -1: a probe whose drafts were all accepted ends on its last draft
                    pending.append((r.next_token, "bonus" if m == k and m > 0 else "target"))
                stats.record_round(k, m, len(pending))
                yield RoundEvent(round_no, k, m, len(pending), r.t_draft, r.t_verify, rounds.belief())
        finally:
            self._live = None
            if rounds is not None:
                rounds.close()  # the native loop hands its KV records back to the contexts
            # the rollback always runs: the cache holds exactly the emitted history but `last`
            ctx.trim(min(ctx.n_past, max(0, len(history) - 1)))
            stats.t_decode = time.perf_counter() - t_start if "t_start" in locals() else 0.0
        tail = detok.flush()
        if tail:
            text.append(tail)
        yield FinishEvent(reason, stats, "".join(text))  # type: ignore[arg-type]

    def _rounds(self, params: SamplingParams, rng: TokenRNG) -> Rounds:
        """The round loop for this generation: native when the extension can run it, else Python."""
        use_native, self.loop_note = native_round.status(self.drafter)
        if use_native:
            return native_round.NativeRounds(self.ctx, self.drafter, self.controller, params, rng,
                                             draft_max=self.config.draft_max, batch_s=self.config.batch_ms / 1000.0)
        return PythonRounds(self.ctx, self.drafter, self.controller, params, rng)

    def _pick(self, logits: np.ndarray, params: SamplingParams, rng: Uniform) -> int:
        if params.greedy:
            return int(np.argmax(logits))
        return sample(probs(logits, params), rng)

    def set_drafter(self, kind: str) -> str:
        """Switch to a drafter of ``kind`` on the same target (between requests); returns its note."""
        config = dataclasses.replace(self.config, drafter=kind)
        drafter, note = make_drafter(config, self.model)
        old, self.drafter, self.config, self.drafter_note = self.drafter, drafter, config, note
        old.close()
        return note

    def set_controller(self, spec: str) -> None:
        """Switch the draft-length controller (between requests); it starts with a fresh belief."""
        self.controller = _make_controller(spec, self.config.draft_max, self.config.seed)
        self.config = dataclasses.replace(self.config, controller=spec)

    def cancel(self) -> None:
        """Ask a running generation to stop after the current round (thread-safe)."""
        self._cancel = True
        live = self._live
        if live is not None:
            live.cancel()  # the native loop also stops a running batch

    # --- conveniences ----------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.model.tokenize(text, add_special=True, parse_special=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        bos = self.model.token_to_piece(self.model.bos, special=True).decode("utf-8", "replace") if self.model.add_bos else ""
        text = chat_mod.render(self.model.chat_template(), messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos, eos_token="")
        # the template writes the BOS itself; tokenize() must not add a second one
        if bos and text.startswith(bos):
            text = text[len(bos):]
        return text

    def run(self, prompt: str | list[int], **kw: Any) -> FinishEvent:
        """Generate to the end and return the FinishEvent (text and stats)."""
        last = None
        for ev in self.generate(prompt, **kw):
            last = ev
        assert isinstance(last, FinishEvent)
        return last

    def create_completion(self, prompt: str, *, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                          top_k: int = 0, seed: int | None = None, stop: list[str] | str | None = None,
                          stream: bool = False) -> Any:
        """An OpenAI-shaped text completion (a dict, or an iterator of chunks with stream=True)."""
        from .api import completion

        return completion(self, prompt, chat=False, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, seed=seed, stop=stop, stream=stream)

    def create_chat_completion(self, messages: list[dict[str, str]], *, max_tokens: int = 256, temperature: float = 0.0,
                               top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                               stop: list[str] | str | None = None, stream: bool = False) -> Any:
        """An OpenAI-shaped chat completion using the model's chat template."""
        from .api import completion

        return completion(self, messages, chat=True, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, seed=seed, stop=stop, stream=stream)

    def close(self) -> None:
        for part in (getattr(self, "drafter", None), getattr(self, "ctx", None), getattr(self, "model", None)):
            if part is not None:
                part.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hit_stop(text: list[str], stop: list[str]) -> bool:
    tail = "".join(text[-64:])
    return any(s and s in tail for s in stop)


def _make_controller(spec: Any, draft_max: int, seed: int) -> Any:
    if spec is not None and not isinstance(spec, str):
        return spec
    from .controllers import DEFAULT_CONTROLLER, make_controller

    return make_controller(spec or DEFAULT_CONTROLLER, max_draft=draft_max, seed=seed)


def load(model: str | Path = "qwen2.5-coder-0.5b-instruct", **kw: Any) -> Engine:
    """Open ``model`` (registry name or GGUF path) with a drafter; see :class:`EngineConfig`."""
    unknown = set(kw) - set(EngineConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"load() got unknown options {sorted(unknown)}")
    return Engine(EngineConfig(model=str(model), **kw))
