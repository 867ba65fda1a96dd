"""``eesd serve``: an OpenAI-compatible HTTP server over one engine.

The engine runs one generation at a time and is not thread-safe, so every request goes
through ONE worker thread (:class:`EngineWorker`) fed by a bounded FIFO queue; a request
beyond the queue gets 429 with ``Retry-After``. The worker always streams (the API's
``completion(..., stream=True)``) and posts chunks to the request's asyncio queue: a
streamed response sends them as server-sent events ending in ``data: [DONE]``, a plain one
joins them. A client that goes away cancels its generation: ``engine.cancel()`` stops it
after the current round and the worker closes the generator (its ``finally`` rolls the KV
cache back) before it takes the next request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import ipaddress
import json
import queue
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Generator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Literal, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from eesd_local.api import completion, prediction_text
from eesd_local.base.defaults import SEED, SERVER_MAX_TOKENS, SERVER_TEMPERATURE, TOP_K, TOP_P
from eesd_local.base.errors import EesdError
from eesd_local.base.params import ParamError, check_int, check_optional_int, check_sampling, show
from eesd_local.speculative.controllers import DEFAULT_CONTROLLER
from eesd_local.speculative.drafters import DRAFTERS
from eesd_local.speculative.engine import Engine

_R = TypeVar("_R", bound=BaseModel)
QUEUE = 8  # requests that may wait while one runs; more get 429
RETRY_AFTER_S = 1
# an idle server keeps the conversation it holds in RAM once no request has come for this long after a response:
# the next turn of an agent or a script comes within it and continues the conversation in the KV cache, so the
# copy (a few ms to tens of ms for a long conversation, and a buffer's first touch) stays off its path
KEEP_AFTER_S = 0.25
# the most bytes a request body may hold: a whole context of text, JSON-escaped, is far less (32k tokens of
# \uXXXX-escaped text ~ 0.5 MB); a larger one is refused from its Content-Length before it is read
MAX_BODY = 4 << 20

# --- requests --------------------------------------------------------------


class Speculation(BaseModel):
    """Per-request speculation settings (an extension); left out, the server's own apply."""

    model_config = ConfigDict(extra="forbid")
    drafter: StrictStr | None = None
    controller: StrictStr | None = None
    draft_max: Any = None  # checked by params.check_int, as --draft-max is

    @field_validator("draft_max")
    @classmethod
    def _draft_max(cls, v: Any) -> int | None:
        try:
            return check_optional_int("draft_max", v, 1)
        except ParamError as exc:
            raise ValueError(exc.message.removeprefix("draft_max ")) from None

    @field_validator("drafter")
    @classmethod
    def _known_drafter(cls, v: str | None) -> str | None:
        if v is not None and v not in DRAFTERS:
            raise ValueError(f"unknown drafter {v!r}, choose one of {', '.join(DRAFTERS)}")
        return v


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options`` (with ``stream: true`` only). The last chunk of a stream always
    carries ``usage`` (and ``speculation``), so ``include_usage`` changes nothing but must be a boolean."""

    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = None


class _Sampling(BaseModel):
    """The options every request takes. The sampling numbers are checked by :func:`params.check_sampling`
    (:meth:`sampling`), the same check as the API's and the command line's, with the same bounds and words."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    max_tokens: Any = None
    temperature: Any = SERVER_TEMPERATURE  # OpenAI's default (1); 0 is greedy
    top_p: Any = TOP_P
    top_k: Any = TOP_K  # an extension: 0 is off
    seed: Any = SEED
    stop: Any = None
    n: Any = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    speculation: Speculation | None = None
    prediction: Any = None  # OpenAI's predicted outputs: {"type": "content", "content": ...} (api.prediction_text)

    @field_validator("stream_options", mode="before")
    @classmethod
    def _stream_options(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, dict):
            raise ValueError(f"must be an object such as {{\"include_usage\": true}}, got {show(v)}")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: Any) -> int:
        if isinstance(v, bool) or v != 1:
            raise ValueError(f"only n=1 is supported, got {show(v)}")
        return 1

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        """The checked sampling options (keywords of api.completion); a ParamError names the bad one."""
        s = check_sampling(max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
                           temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=self.stop)
        return dict(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, stop=s.stop,
                    prediction=prediction_text(self.prediction))


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]  # strict: true and false are not token ids 1 and 0

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, str) or isinstance(v, list) and (all(isinstance(t, str) for t in v) or all(
                isinstance(t, int) and not isinstance(t, bool) for t in v)):
            return v
        raise ValueError(f"must be text, a list of token ids (integers) or a list of one string, got {show(v)}")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError(f"one prompt per request, got {len(v)}")
            return v[0]
        return v


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Any = None  # OpenAI's newer name for max_tokens


# OpenAI request fields this server does not implement, with the values that ask for nothing: any other
# value is a 400 rather than an answer that silently ignores what was asked
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
}


def _unsupported(data: Any) -> ApiError | None:
    """A 400 for the first field of UNSUPPORTED that asks for something (None if none does)."""
    if not isinstance(data, dict):
        return None
    for name, off in UNSUPPORTED.items():
        if name in data and not any(_same(data[name], v) for v in off):
            return ApiError(400, f"{name} is not supported by this server (eesd-local), got {show(data[name])}",
                            param=name, code="unsupported_parameter", hint=f"leave {name} out")
    return None


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b or (isinstance(a, int | float) and not isinstance(a, bool)
                                             and isinstance(b, int) and not isinstance(b, bool) and a == b)


class ApiError(Exception):
    """An error answered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None, hint: str | None = None) -> None:
        message = f"{message}; {hint}" if hint else message
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code, self.headers = status, message, param, type, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_FIELDS = ("speculation.drafter", "speculation.controller", "speculation.draft_max", "max_tokens", "temperature", "top_p",
           "top_k", "seed", "stop", "max_completion_tokens", "prediction")


def _bad_request(exc: EesdError, where: str) -> ApiError:
    """An EesdError as a 400; ``param`` is the parameter it names (a ParamError's, or the field its message
    names), else ``where``."""
    param = getattr(exc, "param", None)
    if param is None or param not in _FIELDS:
        param = next((f for f in _FIELDS if f in exc.message), where)
    return ApiError(400, exc.message, param=param, hint=exc.hint)


# --- metrics ---------------------------------------------------------------


class Metrics:
    """The figures behind ``GET /metrics``: prometheus_client metrics in a registry of this app's own
    (two apps in one process never share counts), exposed in Prometheus' text format."""

    _PER_DRAFTER = {  # key: (metric, help)
        "generations": ("eesd_generations", "generations run"),
        "prompt_tokens": ("eesd_prompt_tokens", "prompt tokens"),
        "cached_tokens": ("eesd_cached_prompt_tokens", "prompt tokens taken from the KV cache, not decoded again"),
        "completion_tokens": ("eesd_completion_tokens", "tokens generated"),
        "drafted": ("eesd_drafted_tokens", "tokens drafted"),
        "accepted": ("eesd_accepted_tokens", "drafted tokens the target accepted"),
        "rounds": ("eesd_rounds", "target verifications"),
        "seconds": ("eesd_generation_seconds", "wall time of generations"),
    }

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("eesd_requests", "HTTP requests to /v1 by endpoint and status code",
                                ["endpoint", "code"], registry=r)
        self.cancelled = Counter("eesd_requests_cancelled", "requests whose client went away, by where they were",
                                 ["stage"], registry=r)
        for stage in ("queued", "running"):
            self.cancelled.labels(stage)  # reported from the start, at 0
        self.per_drafter = {key: Counter(name, f"{help}, by drafter", ["drafter"], registry=r)
                            for key, (name, help) in self._PER_DRAFTER.items()}
        self._emitted = Counter("eesd_emitted_tokens", "tokens the rounds emitted, by drafter", ["drafter"], registry=r)
        # derived gauges are read from the counters when scraped
        self.tau = Gauge("eesd_tau", "tokens emitted per target verification, by drafter", ["drafter"], registry=r)
        self.time_per_token = Gauge("eesd_time_per_token_seconds", "generation wall time per generated token, by drafter",
                                    ["drafter"], registry=r)
        self.waiting = Gauge("eesd_queue_waiting", "requests waiting for the engine", registry=r)
        self.limit = Gauge("eesd_queue_limit", "requests that may wait (--queue)", registry=r)
        self.cache_bytes = Gauge("eesd_prompt_cache_bytes", "bytes of idle prompts' KV states kept in RAM (--cache-ram)",
                                 registry=r)
        self.cache_limit = Gauge("eesd_prompt_cache_limit_bytes", "the bound on them (--cache-ram)", registry=r)
        self.cache_states = Gauge("eesd_prompt_cache_states", "idle prompts' KV states kept in RAM", registry=r)
        self._lock = threading.Lock()
        self._sums: dict[str, list[float]] = {}  # drafter -> [rounds, emitted, seconds, tokens] for the gauges

    def request(self, endpoint: str, code: int) -> None:
        self.requests.labels(endpoint, str(code)).inc()

    def cancel(self, stage: str) -> None:
        self.cancelled.labels(stage).inc()

    def generation(self, last: dict[str, Any], seconds: float) -> None:
        """Add one generation from its last chunk (``usage`` and ``speculation``)."""
        usage, spec = last["usage"], last["speculation"]
        d = spec["drafter"]
        values = {"generations": 1, "prompt_tokens": usage["prompt_tokens"],
                  "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "completion_tokens": usage["completion_tokens"],
                  "drafted": spec["drafted"], "accepted": spec["accepted"], "rounds": spec["rounds"], "seconds": seconds}
        emitted = round(spec["tau"] * spec["rounds"])  # tau = emitted / rounds
        with self._lock:
            for key, value in values.items():
                self.per_drafter[key].labels(d).inc(value)
            self._emitted.labels(d).inc(emitted)
            sums = self._sums.setdefault(d, [0.0, 0.0, 0.0, 0.0])
            for i, v in enumerate((spec["rounds"], emitted, seconds, usage["completion_tokens"])):
                sums[i] += v

    def render(self, waiting: int, limit: int, cache: Any = None) -> bytes:
        """The registry as Prometheus text; ``cache``: the engine's prompt cache (None: off)."""
        with self._lock:
            self.cache_bytes.set(cache.bytes if cache is not None else 0)
            self.cache_limit.set(cache.limit if cache is not None else 0)
            self.cache_states.set(len(cache) if cache is not None else 0)
            for d, (rounds, emitted, seconds, tokens) in self._sums.items():
                self.tau.labels(d).set(emitted / rounds if rounds else 0.0)
                self.time_per_token.labels(d).set(seconds / tokens if tokens else 0.0)
            self.waiting.set(waiting)
            self.limit.set(limit)
            return generate_latest(self.registry)


# --- the engine's one thread -------------------------------------------------

_STARTED, _END = "started", "end"  # markers a job's queue carries besides chunks and errors


@dataclass(eq=False)
class Job:
    """One request on its way through the worker; ``items`` is read on the event loop."""

    chat: bool
    prompt: Any  # text or token ids, or the messages for chat
    sampling: dict[str, Any]
    speculation: Speculation | None
    loop: asyncio.AbstractEventLoop
    items: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # the client went away (set on the event loop, read by the worker)
    done: bool = False
    checked: float = 0.0  # when the client's connection was last checked (time.monotonic)

    def post(self, item: Any) -> None:
        """Hand ``item`` to the event loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is gone
            pass


class EngineWorker:
    """Runs every generation on one thread, in arrival order, one at a time."""

    def __init__(self, engine: Engine, model_id: str, *, queue_max: int = QUEUE, metrics: Metrics | None = None) -> None:
        self.engine, self.model_id, self.queue_max = engine, model_id, queue_max
        self.metrics = metrics or Metrics()
        self.defaults = (engine.config.drafter, engine.config.controller or DEFAULT_CONTROLLER, engine.config.draft_max)
        self._applied: tuple[Any, str, int] | None = self.defaults
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _waiting, _running and _current
        self._waiting = 0
        self._running = False  # a job was taken from the queue and has not ended
        self._current: Job | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="eesd-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False when the queue is full."""
        with self._lock:
            if self._closing:
                raise ApiError(503, "the server is shutting down", type="server_error")
            # full: queue_max jobs wait already and the engine is not free for one more (with --queue 0,
            # a request is answered when nothing runs and refused while one does)
            if self._waiting >= self.queue_max and (self._running or self._waiting > 0):
                return False
            self._waiting += 1
        self._jobs.put(job)
        return True

    def cancel(self, job: Job) -> None:
        """The client of ``job`` went away: stop its generation after the current round."""
        job.cancelled = True
        with self._lock:  # only while it runs: a late cancel() must not hit the next request
            if self._current is job:
                self.engine.cancel()

    def close(self) -> None:
        """Shutting down (never waits): the running generation is cancelled, the waiting ones get 503."""
        self._closing = True
        with self._lock:
            if self._current is not None:
                self._current.cancelled = True
                self.engine.cancel()

    def stop(self) -> None:
        """:meth:`close`, then end the thread."""
        self.close()
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        job = self._jobs.get()
        while job is not None:
            with self._lock:
                self._waiting -= 1
                self._running = True
            try:
                self._serve(job)
            except BaseException as exc:  # a bug: say so, keep serving
                traceback.print_exc(file=sys.stderr)
                job.post(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error"))
            finally:
                with self._lock:
                    self._running = False
                job.post(_END)
            try:
                job = self._jobs.get(timeout=KEEP_AFTER_S)
            except queue.Empty:
                self._idle()
                job = self._jobs.get()

    def _idle(self) -> None:
        """No request came for KEEP_AFTER_S after the last response: keep the prompt the engine holds in RAM now,
        off the next request's path (a request for another conversation would else copy it first)."""
        if self._waiting or self._closing:
            return
        try:
            self.engine.keep_prompt()
        except EesdError:  # the engine closed meanwhile
            pass
        except Exception:  # a bug: say so, keep serving
            traceback.print_exc(file=sys.stderr)

    def _serve(self, job: Job) -> None:
        if self._closing:
            job.post(ApiError(503, "the server is shutting down", type="server_error"))
            return
        if job.cancelled:
            self.metrics.cancel("queued")
            return
        where = "messages" if job.chat else "prompt"
        try:
            self._configure(job.speculation)
            t0 = time.perf_counter()
            chunks = _start(self.engine, job)
        except EesdError as exc:
            job.post(_bad_request(exc, where))
            return
        last: dict[str, Any] | None = None
        with self._lock:
            self._current = job
        try:
            job.post(_STARTED)
            for chunk in chunks:
                chunk["model"] = self.model_id
                if job.cancelled:
                    self.engine.cancel()  # the generation ends after this round; what is left is drained unsent
                else:
                    job.post(chunk)
                last = chunk
        except EesdError as exc:
            job.post(_bad_request(exc, where))
        finally:
            chunks.close()  # the engine's finally rolls the KV back before the next request starts
            with self._lock:
                self._current = None
        if job.cancelled:
            self.metrics.cancel("running")
            if self._closing:
                job.post(ApiError(503, "the server is shutting down", type="server_error"))
        if last is not None and "speculation" in last:
            self.metrics.generation(last, time.perf_counter() - t0)

    def _configure(self, spec: Speculation | None) -> None:
        """Apply the request's drafter, controller and draft_max (the server's own where it gives none)."""
        d_drafter, d_controller, d_max = self.defaults
        want = self.defaults if spec is None else (spec.drafter or d_drafter, spec.controller or d_controller,
                                                   spec.draft_max or d_max)
        if want == self._applied:
            return
        drafter, controller, draft_max = want
        engine = self.engine
        if draft_max + 1 > engine.ctx.n_batch:  # a round decodes [last, d1..dk] in one batch
            raise EesdError(f"speculation.draft_max {draft_max} does not fit the target's batch of {engine.ctx.n_batch} "
                            f"tokens", hint=f"use {engine.ctx.n_batch - 1} or less")
        self._applied = None  # until every switch below has gone through
        if drafter != engine.config.drafter:
            try:
                engine.set_drafter(drafter)
            except EesdError as exc:
                if drafter == "draft-model" and not engine.config.draft_model:
                    message = "this server was started without a draft model"
                else:  # the message's hint speaks of the server's command line, which a client cannot change
                    message = exc.message
                raise EesdError(f"speculation.drafter {drafter!r}: {message}",
                                hint=f"leave speculation.drafter out to use the server's own ({d_drafter}), or pick "
                                     "another drafter") from None
        old = engine.config
        engine.config = dataclasses.replace(old, draft_max=draft_max)  # the engine's round limit reads it
        try:
            engine.set_controller(controller)  # a fresh controller sized for draft_max
        except EesdError as exc:
            engine.config = old
            raise EesdError(f"speculation.controller {controller!r}: {exc.message}", hint=exc.hint) from None
        self._applied = want


def _start(engine: Engine, job: Job) -> Generator[dict[str, Any], None, None]:
    """The request's chunks (the server's one use of the Python API): OpenAI chunk dicts, the
    last with ``usage`` and ``speculation``; bad input raises EesdError here, before any chunk."""
    return completion(engine, job.prompt, chat=job.chat, stream=True, **job.sampling)


def _joined(chunks: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    """A whole response from its stream chunks."""
    first, last = chunks[0], chunks[-1]
    if chat:
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": "".join(c["choices"][0]["text"] for c in chunks)}
    choice.update(finish_reason=last["choices"][0]["finish_reason"], logprobs=None)
    return {"id": first["id"], "object": "chat.completion" if chat else "text_completion", "created": first["created"],
            "model": first["model"], "choices": [choice], "usage": last["usage"], "speculation": last["speculation"]}


# --- the app -----------------------------------------------------------------


def create_app(engine: Engine, *, model_id: str, aliases: tuple[str, ...] = (), queue_max: int = QUEUE) -> FastAPI:
    """The FastAPI app serving ``engine`` under the name ``model_id`` (and ``aliases``); its worker
    thread runs from the app's startup to its shutdown (``app.state.worker``)."""
    metrics = Metrics()
    names = {model_id, *aliases}
    state: dict[str, EngineWorker] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state["worker"] = app.state.worker = EngineWorker(engine, model_id, queue_max=queue_max, metrics=metrics)
        yield
        state["worker"].stop()

    app = FastAPI(title="eesd-local", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind).response()

    app.add_middleware(_CountRequests, metrics=metrics)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_id, "waiting": state["worker"].waiting}

    @app.get("/metrics")
    async def metrics_text() -> Response:
        worker = state["worker"]
        return Response(metrics.render(worker.waiting, worker.queue_max, engine.prompt_cache), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "eesd-local"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Any:
        body = _parse(CompletionRequest, await _read_body(request))
        return await _answer(body, False, body.prompt, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Any:
        body = _parse(ChatCompletionRequest, await _read_body(request))
        if body.max_completion_tokens is not None:
            try:
                check_int("max_completion_tokens", body.max_completion_tokens, 1)
            except ParamError as exc:
                raise _bad_request(exc, "max_completion_tokens") from None
            body.max_tokens = body.max_completion_tokens
        return await _answer(body, True, [m.as_dict() for m in body.messages], request)

    async def _answer(body: _Sampling, chat: bool, prompt: Any, request: Request) -> Any:
        if body.model is not None and body.model not in names:
            raise ApiError(400, f"model {body.model!r} is not served here; this server serves {model_id!r}",
                           param="model", code="model_not_found")
        if body.stream_options is not None and not body.stream:  # as OpenAI answers it
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options",
                           hint="leave stream_options out or set stream to true")
        try:  # checked here, before the request queues: a bad number never waits for the engine
            # OpenAI's defaults: 16 tokens for a completion, the rest of the context for a chat
            sampling = body.sampling(engine.ctx.n_ctx if chat else SERVER_MAX_TOKENS)
            if body.speculation is not None and body.speculation.draft_max is not None:
                # a round verifies [last, d1..dk] in one batch of the target: a longer draft cannot run at all
                n_batch = engine.ctx.n_batch
                check_int("speculation.draft_max", body.speculation.draft_max, 1, n_batch - 1,
                          hint=f"a round verifies its draft and one more token in one batch of the target's {n_batch}")
        except ParamError as exc:
            raise _bad_request(exc, exc.param) from None
        worker = state["worker"]
        job = Job(chat, prompt, sampling, body.speculation, asyncio.get_running_loop())
        if not worker.submit(job):
            raise ApiError(429, f"the server is busy: {worker.queue_max} requests are already waiting",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            first = await _next(job, request)
        except BaseException:
            worker.cancel(job)
            raise
        if isinstance(first, ApiError):
            raise first
        if first == _END:  # cancelled before it ran
            raise ApiError(499, "the client went away", type="cancelled")
        if body.stream:
            return EventSourceResponse(_events(worker, job), ping=15)
        chunks: list[dict[str, Any]] = []
        try:
            while (item := await _next(job, request)) != _END:
                if isinstance(item, ApiError):
                    raise item
                chunks.append(item)
            job.done = True
        finally:
            if not job.done:
                worker.cancel(job)
        return _joined(chunks, chat)

    return app


async def _read_body(request: Request) -> bytes:
    """The request body, at most MAX_BODY bytes: a larger Content-Length is a 413 before a byte of it
    is read, and a body without one (chunked) is cut off as soon as it grows past the limit. A client
    that hangs up before it sent the whole body gets a 499 it will not read (no traceback in the log)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY:
        raise _too_large(f"is {int(declared)} bytes, more than")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                raise _too_large("is more than")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(499, "the client went away before it sent the whole request", type="cancelled") from None
    return b"".join(chunks)


def _too_large(what: str) -> ApiError:
    return ApiError(413, f"the request body {what} the {MAX_BODY} bytes ({MAX_BODY >> 20} MiB) this server takes",
                    code="request_too_large", hint="send a shorter prompt")


_UNION_TAGS = ("str", "int", "float", "bool")  # pydantic names the member of a union it tried in the error's location


def _parse(model: type[_R], raw: bytes) -> _R:
    """The request body as ``model`` (JSON whatever the content type says); a 400 naming the field if not."""
    try:
        data = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, bytes that are not UTF-8, an integer of too many digits
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise ApiError(400, "the request body is nested too deeply to be a request", code="invalid_json") from None
    unsupported = _unsupported(data)
    if unsupported is not None:
        raise unsupported
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(x) for x in err["loc"]]
        loc = loc[: next((i for i, x in enumerate(loc) if x in _UNION_TAGS or "[" in x), len(loc))]  # stop.str -> stop
        param = ".".join(loc) or None
        msg = err["msg"].removeprefix("Value error, ")
        if loc and err["type"] != "value_error" and not isinstance(err.get("input"), dict | list):
            msg += f", got {_show(err.get('input'))}"
        raise ApiError(400, f"{param}: {msg}" if param else f"the request body: {msg}", param=param) from None


class _CountRequests:
    """Counts /v1 requests by endpoint and status (plain ASGI: it leaves streams and disconnects alone)."""

    ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions")

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        endpoint = path if path in self.ENDPOINTS else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.request(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counted)


async def _next(job: Job, request: Request | None = None) -> Any:
    """The job's next item; a client that hangs up meanwhile (checked twice a second) raises a 499."""
    if request is None:
        return await job.items.get()
    while True:
        now = time.monotonic()
        if now - job.checked > 0.5:
            job.checked = now
            if await request.is_disconnected():
                raise ApiError(499, "the client went away", type="cancelled")
        try:
            return await asyncio.wait_for(job.items.get(), timeout=0.5)
        except TimeoutError:
            pass


async def _events(worker: EngineWorker, job: Job) -> AsyncIterator[dict[str, str]]:
    """Server-sent events: one per chunk, then ``[DONE]``; if the client goes away this generator
    is closed mid-way and its ``finally`` cancels the generation."""
    try:
        while (item := await _next(job)) != _END:
            if isinstance(item, ApiError):
                job.done = True
                yield {"data": json.dumps(item.body())}
                break
            yield {"data": json.dumps(item)}
        else:
            job.done = True
        yield {"data": "[DONE]"}
    finally:
        if not job.done:
            worker.cancel(job)


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str | int | float | bool | None) else repr(value)


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port``, made before the model loads: a bad address or a port in
    use is one line at once, not a traceback after the load."""
    check_int("port", port, 1, 65535, hint="e.g. --port 8080")
    where = f"{host}:{port}"
    hint = "pass an address of this machine: --host 127.0.0.1 (this machine only) or --host 0.0.0.0 (every interface)"
    if re.fullmatch(r"[\d.]+", host):  # dotted numbers are an IPv4 address or nothing: never a name to look up
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise EesdError(f"cannot listen on {where}: {host} is not an IPv4 address", hint=hint) from None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (OSError, UnicodeError) as exc:
        raise EesdError(f"cannot listen on {where}: {getattr(exc, 'strerror', None) or exc}", hint=hint) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            hint = "another program listens there: stop it or pick another --port"
        raise EesdError(f"cannot listen on {where}: {exc.strerror or exc}", hint=hint) from None
    sock.set_inheritable(True)
    return sock


def server_config(app: ASGIApp, *, host: str, port: int, log_level: str) -> uvicorn.Config:
    """uvicorn's settings for ``eesd serve``. Its defaults take httptools' HTTP parser and uvloop's event loop where
    installed (the package depends on both; uvloop has no Windows build), else its pure-Python h11 and asyncio. On a
    2-core EPYC a request with a cached prompt and a one-token answer took 53.4 ms with h11 and asyncio, 50.7 with
    these (the one-token decode alone: 46): the event loop's work shares the cores with the decode."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


def serve(engine: Engine, *, model_id: str, aliases: tuple[str, ...] = (), host: str = "127.0.0.1", port: int = 8080,
          queue_max: int = QUEUE, log_level: str = "info", sock: socket.socket | None = None) -> None:
    """Serve ``engine`` until Ctrl-C; streams still open get a few seconds to end. ``sock``: a socket
    :func:`listen_socket` bound already (else uvicorn binds ``host``:``port`` itself)."""
    app = create_app(engine, model_id=model_id, aliases=aliases, queue_max=queue_max)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            worker = getattr(app.state, "worker", None)
            if worker is not None:  # before uvicorn waits for open connections: let them end now
                worker.close()
            super().handle_exit(sig, frame)

    try:
        Server(server_config(app, host=host, port=port, log_level=log_level)).run(sockets=None if sock is None else [sock])
    except KeyboardInterrupt:  # uvicorn raises the Ctrl-C it handled again once it has shut down
        pass
