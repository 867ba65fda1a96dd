"""The Python API: :func:`load` opens an :class:`LLM`, an engine with OpenAI-shaped completions
(``create_completion``, ``create_chat_completion``) as llama-cpp-python users know them,
on top of :meth:`Engine.generate`.

On the CPU, greedy output is byte-identical to plain decoding, whatever the drafter, the controller
and the timing (elsewhere, such as on a GPU, it can leave plain decoding's at a near tie, and the
``speculation`` block's ``exact`` says which holds); sampling keeps the target's exact distribution
(real speculative sampling, not "sample and match"). The wording is ``eesd_local.base.claim.CLAIM``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eesd_local.base.defaults import MAX_TOKENS, SEED, TEMPERATURE, TOP_K, TOP_P
from eesd_local.base.params import ParamError, check_sampling, show
from eesd_local.speculative.engine import Engine, EngineConfig
from eesd_local.speculative.events import FinishEvent, RoundEvent, TokenEvent
from eesd_local.speculative.rounds import PREDICTION
from eesd_local.tools.prepare import prepare


class LLM(Engine):
    """An :class:`Engine` with OpenAI-shaped completions: a dict, or with ``stream=True`` an
    iterator of chunks; each carries ``usage`` and a ``speculation`` block."""

    def create_completion(self, prompt: str | list[int], *, max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE,
                          top_p: float = TOP_P, top_k: int = TOP_K, seed: int | None = SEED,
                          stop: list[str] | str | None = None, stream: bool = False, prediction: Any = None) -> Any:
        """A text completion of ``prompt``. ``prediction``: the answer as you expect it (text, or OpenAI's
        ``{"type": "content", "content": ...}``), drafted first wherever the answer follows it."""
        return completion(self, prompt, chat=False, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, seed=seed, stop=stop, stream=stream, prediction=prediction)

    def create_chat_completion(self, messages: list[dict[str, str]], **kw: Any) -> Any:
        """A chat completion of ``messages`` through the model's chat template (the same
        options as :meth:`create_completion`)."""
        return completion(self, messages, chat=True, **kw)


def load(model: str | Path = "qwen2.5-coder-0.5b-instruct", **kw: Any) -> LLM:
    """Open ``model`` (registry name or GGUF path) with a drafter; options as :class:`EngineConfig`.
    A registry model not downloaded yet is pulled first, and the files derived from it (a weight
    variant, a shared trunk's draft vocabulary) are made (:func:`eesd_local.tools.prepare.prepare`)."""
    unknown = set(kw) - set(EngineConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"load() got unknown options {sorted(unknown)}")
    config = EngineConfig(model=str(model), **kw)
    prepare(config)
    return LLM(config)


def _cut_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """Text up to the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _usage(fin: FinishEvent, predicted: bool = False) -> dict[str, Any]:
    s = fin.stats
    out: dict[str, Any] = {"prompt_tokens": s.n_prompt, "completion_tokens": s.n_generated,
                           "total_tokens": s.n_prompt + s.n_generated,
                           "prompt_tokens_details": {"cached_tokens": s.n_cached}}  # OpenAI's: taken from the cache
    if predicted:  # OpenAI's fields: predicted tokens the answer kept, and those verified and turned down
        _, drafted, accepted = s.by_source.get(PREDICTION, (0, 0, 0))
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": drafted - accepted}
    return out


def prediction_text(prediction: Any) -> str | None:
    """The text of a prediction: text itself, or OpenAI's ``{"type": "content", "content": text or
    [{"type": "text", "text": ...}, ...]}``; None for none. A ParamError names what is wrong."""
    if prediction is None or isinstance(prediction, str):
        return prediction
    if not isinstance(prediction, dict) or prediction.get("type") != "content" or set(prediction) - {"type", "content"}:
        raise ParamError("prediction", "prediction must be {\"type\": \"content\", \"content\": TEXT}, "
                         f"got {show(prediction)}")
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and set(p) == {"type", "text"}
            for p in content):
        return "".join(p["text"] for p in content)
    raise ParamError("prediction", "prediction.content must be text or a list of {\"type\": \"text\", \"text\": TEXT} "
                     f"parts, got {show(content)}")


def _speculation(fin: FinishEvent, note: str | None = None) -> dict[str, Any]:
    s = fin.stats
    out = {
        "drafter": s.drafter, "controller": s.controller, "exact": s.exact, "rounds": s.n_rounds, "drafted": s.n_drafted,
        "accepted": s.n_accepted, "acceptance_rate": s.acceptance_rate, "tau": s.tau, "tokens_per_s": s.tokens_per_s,
        "acceptance_by_position": s.acceptance_by_position,
    }
    if note:
        out["note"] = note
    return out


def chat_template_note(engine: Engine) -> str | None:
    """What a chat's messages are wrapped in when the model carries no chat template (None: it carries one)."""
    with engine._lock:
        engine._check_open()
        if engine.model.chat_template():
            return None
        known = len(engine.model.tokenize("<|im_start|>", add_special=False, parse_special=True)) == 1
    return ("the model has no chat template: the messages were wrapped in the fallback template, ChatML "
            "(<|im_start|>ROLE ... <|im_end|>)" + ("" if known else ", whose markers are plain text to this model, "
                                                   "not tokens of its vocabulary"))


def completion(engine: Engine, prompt: Any, *, chat: bool, max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE,
               top_p: float = TOP_P, top_k: int = TOP_K, seed: int | None = SEED, stop: list[str] | str | None = None,
               stream: bool = False, prediction: Any = None) -> Any:
    """``prompt`` (messages when ``chat``) completed as OpenAI's API does; bad arguments raise EesdError
    here, before any chunk. A chat's message text is tokenized as text (Engine.chat_tokens): only the
    template's own markers are control tokens."""
    s = check_sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop)
    if not isinstance(stream, bool):
        raise ParamError("stream", f"stream must be True or False, got {show(stream)}")
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    model = engine.model_path.name
    obj = "chat.completion" if chat else "text_completion"
    predicted = prediction_text(prediction)
    options: dict[str, Any] = dict(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                   seed=s.seed, stop=s.stop, prediction=predicted)
    note = chat_template_note(engine) if chat else None
    if stream:  # as generate(): a stream started while another is open ends that one (README)
        events = engine.generate(engine.chat_tokens(prompt) if chat else prompt, **options)
        return _stream(events, ident, created, model, obj, chat, s.stop, note, predicted is not None)
    fin = None
    # a whole completion holds the engine from its start to its end, as Engine.run: one started on another
    # thread meanwhile waits for it rather than ending it
    with engine._serial:
        for ev in engine.generate(engine.chat_tokens(prompt) if chat else prompt, **options):
            if isinstance(ev, FinishEvent):
                fin = ev
    assert fin is not None
    text, cut = _cut_stop(fin.text, s.stop)
    reason = "stop" if cut else ("length" if fin.reason in ("length", "context") else "stop")
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": ident, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": _usage(fin, predicted is not None), "speculation": _speculation(fin, note)}


def _stream(events: Iterator[Any], ident: str, created: int, model: str, obj: str, chat: bool,
            stops: list[str], note: str | None = None, predicted: bool = False) -> Iterator[dict[str, Any]]:
    """Chunks as text arrives, one per round (the tokens a round emits arrive together); text that could
    start a stop string is held back until it cannot."""
    sent = ""
    full = ""
    hold = max((len(s) for s in stops), default=1) - 1

    def chunk(piece: str, reason: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": piece} if piece else {}, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": piece, "finish_reason": reason, "logprobs": None}
        out = {"id": ident, "object": obj + ".chunk" if chat else obj, "created": created, "model": model, "choices": [choice]}
        if extra:
            out.update(extra)
        return out

    if chat:
        yield {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
    left = 1  # tokens still to come from the current round (the first token comes alone)
    try:
        for ev in events:
            if isinstance(ev, RoundEvent):
                left = ev.emitted
            elif isinstance(ev, TokenEvent):
                full += ev.text
                left -= 1
                if left > 0:  # more of this round's tokens follow at once: one chunk for them all (a round
                    # of 30 accepted drafts is one event for the client, not 30 hops through the server)
                    continue
                visible, cut = _cut_stop(full, stops)
                safe = len(visible) if cut else max(len(sent), len(visible) - hold)
                if safe > len(sent):
                    yield chunk(visible[len(sent):safe], None)
                    sent = visible[:safe]
            elif isinstance(ev, FinishEvent):
                visible, cut = _cut_stop(ev.text, stops)
                rest = visible[len(sent):]
                reason = "stop" if cut else ("length" if ev.reason in ("length", "context") else "stop")
                yield chunk(rest, reason, {"usage": _usage(ev, predicted), "speculation": _speculation(ev, note)})
    finally:
        close = getattr(events, "close", None)
        if close:
            close()
