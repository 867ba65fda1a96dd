"""The methods a benchmark compares, each behind one small interface.

A method turns prompt tokens into a :class:`Turn`: the generated tokens and the times a
user waits for (prefill up to the first token, then the rest), plus the drafting
figures. Our engine runs every drafter (``none`` is plain decoding through the same
loop); the peers are llama-cpp-python's ``Llama`` in the same process, plain and with
its ``LlamaPromptLookupDecoding``, timed the same way from outside, and llama.cpp's own
``llama-server`` with each of its speculative decoding types (servers.py), timed by the
server; ``serve:`` methods time a server (``eesd serve`` or llama-server) end to end over HTTP.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from llama_cpp import Llama, llama_model_size
from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

from eesd_local.base.defaults import BENCH_MAX_TOKENS, SEED, TEMPERATURE, TOP_K, TOP_P
from eesd_local.base.errors import EesdError
from eesd_local.gguf.reader import bytes_read_per_token
from eesd_local.llama.catalog import registry_name_for
from eesd_local.llama.runtime import setup_process
from eesd_local.llama.trunk import measure_trunk_share
from eesd_local.speculative.controllers import make_controller
from eesd_local.speculative.drafters import DRAFTERS
from eesd_local.speculative.drafters.base import SRC_MODEL
from eesd_local.speculative.events import FinishEvent, Stats, TokenEvent

PEER = "llama-cpp-python"
PEER_LOOKUP = "llama-cpp-python-lookup"
ENGINE_DRAFTERS = tuple(DRAFTERS)
SERVER = "llama-server"
METHOD_HELP = ("none, auto, eesd, eesd-fixed:K, lookup, draft-model, hierarchical (any drafter takes -fixed:K, or "
               f"@CONTROLLER as in eesd@beta-ts; auto, eesd, hierarchical take -copy: the exit head as a separate "
               f"draft model, or -shared: on the shared trunk), {PEER}, {PEER_LOOKUP}[:N], {SERVER}[:SPEC-TYPE] "
               f"(llama.cpp's server, plain or with --spec-type SPEC-TYPE), serve:{SERVER}[:SPEC-TYPE] and "
               "serve:eesd[:DRAFTER] (a server timed end to end over HTTP)")
# separate draft models of the same vocabulary, by target registry name
DEFAULT_DRAFT_MODELS = {"qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct"}


@dataclass(frozen=True)
class MethodSpec:
    name: str  # as written on the command line
    drafter: str = "none"  # an engine drafter, or "peer"
    controller: str | None = None  # None: the engine's default controller
    peer_lookup: int = 0  # llama-cpp-python-lookup: num_pred_tokens (0 here: the default for the device)
    shared_trunk: bool | None = None  # NAME-copy / NAME-shared: the exit head as a separate draft model / on the shared trunk
    server_spec: str = ""  # llama-server: its --spec-type ("" plain); serve:eesd: the drafter
    http_server: str = ""  # serve: methods: "llama-server" or "eesd"

    @property
    def is_peer(self) -> bool:
        """Another program than our engine in this process: never claimed exact."""
        return self.drafter in ("peer", "server", "http")

    @property
    def family(self) -> str:
        """Methods compared with one plain reference: ours and llama-cpp-python's (``none``; ``eesd serve`` over
        HTTP too, by text: it is our engine), llama-server's (``llama-server``), llama-server's over HTTP
        (``serve:llama-server``)."""
        if self.drafter == "http" and self.http_server == "eesd":
            return "none"
        return {"server": SERVER, "http": "serve:" + SERVER}.get(self.drafter, "none")

    @property
    def plain(self) -> bool:
        """Plain decoding, in process or over HTTP (``eesd serve --drafter none``, plain llama-server): a
        baseline, so a prediction is not sent to it (``eesd serve`` drafts from one whatever its drafter)."""
        if self.drafter in ("server", "http"):
            return self.server_spec == "none" if self.http_server == "eesd" else not self.server_spec
        return self.drafter == "none"

    @property
    def needs_head(self) -> bool:
        return self.drafter in ("eesd", "hierarchical")


def parse_methods(text: str, controller: str | None = None) -> list[MethodSpec]:
    """``none,eesd,eesd-fixed:4,lookup,...`` -> specs; ``none`` (the baseline) always comes first."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    specs: list[MethodSpec] = []
    for name in names:
        specs.append(_parse_one(name, controller))
    if len({s.name for s in specs}) != len(specs):
        raise EesdError(f"--methods names a method twice: {text}")
    specs = [s for s in specs if s.name != "none"]
    return [MethodSpec("none")] + specs


def _parse_one(name: str, controller: str | None) -> MethodSpec:
    for suffix, shared in (("-copy", False), ("-shared", True)):
        if name.endswith(suffix) and name[: -len(suffix)].split("-fixed:")[0].split("@")[0] in ("auto", "eesd", "hierarchical"):
            inner = _parse_one(name[: -len(suffix)], controller)
            return dataclasses.replace(inner, name=name, shared_trunk=shared)
    if name in ENGINE_DRAFTERS:
        return MethodSpec(name, name, None if name == "none" else controller)
    drafter, at, ctl = name.partition("@")
    if at and drafter in ENGINE_DRAFTERS and drafter != "none":
        make_controller(ctl)  # a bad spec fails here, before any model loads
        return MethodSpec(name, drafter, ctl)
    m = re.fullmatch(r"(auto|eesd|lookup|draft-model|hierarchical)-fixed:(\d+)", name)
    if m:
        if int(m.group(2)) < 1:
            raise EesdError(f"method {name}: K must be at least 1", hint="e.g. eesd-fixed:4")
        return MethodSpec(name, m.group(1), f"fixed:{m.group(2)}")
    if name == PEER:
        return MethodSpec(name, "peer")
    server, colon, kind = name.partition(":")
    if server == SERVER:
        if colon and not kind:
            raise EesdError(f"method {name}: name a --spec-type after the colon, e.g. {SERVER}:ngram-mod")
        return MethodSpec(name, "server", server_spec=kind)
    if server == "serve":
        which, _, kind = kind.partition(":")
        if which not in (SERVER, "eesd"):
            raise EesdError(f"method {name}: serve:{SERVER}[:SPEC-TYPE] or serve:eesd[:DRAFTER]")
        if which == "eesd" and kind and kind not in ENGINE_DRAFTERS:
            raise EesdError(f"method {name}: unknown drafter {kind!r}", hint=f"drafters: {', '.join(ENGINE_DRAFTERS)}")
        return MethodSpec(name, "http", server_spec=kind, http_server=which)
    m = re.fullmatch(re.escape(PEER_LOOKUP) + r"(?::(\d+))?", name)
    if m:
        k = int(m.group(1) or 0)
        if m.group(1) and k < 1:
            raise EesdError(f"method {name}: N must be at least 1")
        return MethodSpec(name, "peer", peer_lookup=k or -1)
    raise EesdError(f"unknown method {name!r}", hint=f"methods: {METHOD_HELP}")


def default_draft_model(model_path: Path) -> str | None:
    return DEFAULT_DRAFT_MODELS.get(registry_name_for(model_path) or "")


@dataclass
class Turn:
    """One generation: what came out, how long the user waited, what the drafter did."""

    tokens: list[int]
    text: str
    t_prefill: float  # request start -> first token (prompt processing and the first token)
    t_decode: float  # first token -> last token: everything after the prompt, drafting included
    rounds: Stats = field(default_factory=Stats)  # target verifications after the first token, drafts, acceptance
    count: int | None = None  # tokens generated, where ``tokens`` cannot say (a server timed over HTTP returns text)

    @property
    def n(self) -> int:
        return len(self.tokens) if self.count is None else self.count


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = BENCH_MAX_TOKENS
    temperature: float = TEMPERATURE
    top_k: int = TOP_K
    top_p: float = TOP_P
    seed: int | None = SEED


class Method(Protocol):
    spec: MethodSpec
    drafter: str  # what actually drafts, e.g. "eesd" or "hierarchical(lookup>eesd)"
    controller: str
    model_bytes: int  # weights this method loads (target + drafter)
    exact: bool  # claims greedy output byte-identical to plain decoding

    def generate(self, prompt: list[int], s: Sampling, *, prediction: str | None = None) -> Turn:
        """One generation; ``prediction``: the answer as expected (predicted outputs), for a method that takes one."""
        ...

    def close(self) -> None: ...


class EngineMethod:
    """Our engine with one drafter; the times are taken from outside, as for the peers."""

    def __init__(self, spec: MethodSpec, engine: Any) -> None:
        self.spec = spec
        self.engine = engine
        self.drafter = engine.drafter.name
        self.controller = "-" if spec.drafter == "none" else engine.controller.name
        self.exact = bool(engine.exact)  # greedy output claimed byte-identical to plain decoding (runtime.exactness)
        form = engine.drafter.native()  # a draft context, if the drafter runs one, is the weights it adds
        draft = form.draft_ctx.model if form is not None and form.draft_ctx is not None else None
        self.model_bytes = int(engine.model.size_bytes) + (int(draft.size_bytes) if draft is not None else 0)
        # a model source's draft step, in target steps of weights read (lookup's drafts read nothing)
        self.draft_share: dict[str, float] = {}
        self.trunk_share: float | None = None  # shared trunk: the trunk's part of a target token, timed
        if engine.trunk is not None:  # the split target: its weights are the trunk+exit's and the tail's
            # (the tail's token_embd of an untied model is mapped but never read, and not held: trunk.release_unread)
            self.model_bytes = int(engine.ctx.weight_bytes)
            draft = engine.trunk.model
        if draft is not None:
            share = bytes_read_per_token(Path(draft.path)) / max(1, bytes_read_per_token(Path(engine.model.path)))
            self.draft_share[engine.drafter.source_name(SRC_MODEL)] = share

    def fresh(self) -> None:
        """As a fresh process for the next pass over the prompts: no earlier answers, no cached prompts."""
        self.engine.forget_answers()
        self.engine.forget_prompts()

    def measure_trunk(self, prompt: list[int]) -> None:
        """Time the shared trunk's part of a target token (after the warm-up; the cache is left empty)."""
        if self.engine.trunk is not None and len(prompt) >= 2:
            with self.engine._lock:
                self.trunk_share = measure_trunk_share(self.engine.ctx, prompt)

    def generate(self, prompt: list[int], s: Sampling, *, prediction: str | None = None) -> Turn:
        tokens: list[int] = []
        t_first = t_last = 0.0
        fin: FinishEvent | None = None
        t0 = time.perf_counter()
        events = self.engine.generate(prompt, max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k,
                                      top_p=s.top_p, seed=s.seed, prediction=prediction)
        try:
            for ev in events:
                if isinstance(ev, TokenEvent):
                    t_last = time.perf_counter()
                    t_first = t_first or t_last
                    tokens.append(ev.token)
                elif isinstance(ev, FinishEvent):
                    fin = ev
        finally:
            events.close()  # on Ctrl-C this runs the engine's KV rollback
        assert fin is not None
        st = fin.stats
        if not tokens:
            t_first = t_last = time.perf_counter()
        return Turn(tokens, fin.text, t_first - t0, t_last - t_first, st)

    def close(self) -> None:
        self.engine.close()


def _counting_draft(inner: Any) -> Any:
    """llama-cpp-python's draft model wrapped to count drafts and time them: it yields
    plain tokens, so acceptance is read off which yielded tokens equal the draft."""
    class CountingDraft(LlamaDraftModel):
        def __init__(self) -> None:
            self.start()

        def start(self) -> None:
            self.stats = Stats()
            self.draft: list[int] | None = None  # the current round's drafts (None before the first)
            self.pos = 0  # of those, accepted so far

        def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
            self.finish()
            t = time.perf_counter()
            out = inner(input_ids, **kwargs)
            self.stats.t_draft += time.perf_counter() - t
            self.draft = [int(x) for x in out]
            self.pos = 0
            return out

        def see(self, token: int) -> None:
            # Llama.generate yields the target's token at each drafted position and stops the round at the first miss
            if self.draft is not None and self.pos < len(self.draft) and token == self.draft[self.pos]:
                self.pos += 1
            elif self.draft is not None:
                self.finish()

        def finish(self) -> None:
            """Count the current round, once its outcome is known."""
            if self.draft is not None:
                self.stats.record_round(len(self.draft), self.pos)
                self.draft = None

    return CountingDraft()


class PeerMethod:
    """llama-cpp-python's own ``Llama`` generation (optionally with its prompt-lookup drafts)."""

    def __init__(self, spec: MethodSpec, model_path: Path, *, n_ctx: int, n_threads: int, n_gpu_layers: int,
                 is_eog: Callable[[int], bool]) -> None:
        self.spec = spec
        self.is_eog = is_eog
        self.counter = None
        self.drafter, self.controller = "llama-cpp-python", "-"
        self.exact = False  # another program's prefill and batches: compared with ours, never claimed equal
        if spec.peer_lookup:
            # llama-cpp-python's documented advice: 10 predicted tokens on a GPU, 2 on CPU only
            k = spec.peer_lookup if spec.peer_lookup > 0 else (10 if n_gpu_layers else 2)
            self.counter = _counting_draft(LlamaPromptLookupDecoding(num_pred_tokens=k))
            self.drafter, self.controller = "llama-cpp-python prompt lookup", f"num_pred_tokens={k}"
        setup_process()  # llama.cpp's safe model defaults for this Llama too
        self.llm = Llama(model_path=str(model_path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                         n_gpu_layers=n_gpu_layers, draft_model=self.counter, verbose=False)
        self.model_bytes = int(llama_model_size(self.llm.model))

    def generate(self, prompt: list[int], s: Sampling, *, prediction: str | None = None) -> Turn:
        llm, counter = self.llm, self.counter  # (llama-cpp-python takes no prediction)
        if counter is not None:
            counter.start()
        if s.seed is not None:
            llm.set_seed(s.seed)
        tokens: list[int] = []
        t_first = t_last = 0.0
        t0 = time.perf_counter()
        gen = llm.generate(prompt, temp=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=0.0, typical_p=1.0,
                           repeat_penalty=1.0)
        try:
            for tok in gen:
                if self.is_eog(tok):
                    break
                t_last = time.perf_counter()
                t_first = t_first or t_last
                tokens.append(int(tok))
                if counter is not None:
                    counter.see(int(tok))
                if len(tokens) >= s.max_tokens:
                    break
        finally:
            gen.close()
        if not tokens:
            t_first = t_last = time.perf_counter()
        text = llm.detokenize(tokens).decode("utf-8", "replace")
        turn = Turn(tokens, text, t_first - t0, t_last - t_first)
        if counter is not None:
            counter.finish()
            turn.rounds = counter.stats
        else:
            turn.rounds.n_rounds = turn.rounds.n_emitted = max(0, len(tokens) - 1)  # one target call per token after the first
        return turn

    def close(self) -> None:
        self.llm.close()
