"""The engine never answers wrong and never takes the process down: one generation owns the
contexts at a time, an abandoned or late-collected generator cannot corrupt the KV record,
a closed engine raises EesdError, threads never reach llama.cpp twice at once, and bad input
is a clear EesdError. Checked on the real demo model."""

from __future__ import annotations

import gc
import os
import random
import threading

import pytest

import eesd_local
from eesd_local.base.defaults import DRAFT_MAX
from eesd_local.base.errors import EesdError
from eesd_local.speculative.drafters.base import SRC_ANY, DrafterBase, Proposal
from eesd_local.speculative.events import FinishEvent, TokenEvent

from .conftest import QWEN05

pytestmark = pytest.mark.model  # every test opens the demo model (_open)

# prompts that share prefixes, so the prompt cache is reused (and must be trimmed) between them
PROMPTS = [
    "class Stack:\n    def __init__(self):",
    "class Stack:\n    def push(self, x):",
    "def add(a, b):\n    # add two numbers",
    "SELECT name FROM users WHERE",
    "The capital of Italy is",
    "import os\nimport sys\n\ndef main():",
]
MAX = 12


def _open(drafter: str = "none", **kw) -> eesd_local.LLM:
    kw.setdefault("controller", "fixed:3")
    return eesd_local.load(QWEN05, drafter=drafter, n_ctx=512, **kw)


def _toks(events) -> tuple[list[int], FinishEvent | None]:
    toks, fin = [], None
    for ev in events:
        if isinstance(ev, TokenEvent):
            toks.append(ev.token)
        elif isinstance(ev, FinishEvent):
            fin = ev
    return toks, fin


def _fresh(drafter: str) -> dict[str, list[int]]:
    """Each prompt's greedy answer from a fresh engine, one prompt per engine (nothing cached)."""
    ref = {}
    for p in PROMPTS:
        with _open(drafter) as eng:
            ref[p] = _toks(eng.generate(p, max_tokens=MAX))[0]
    return ref


@pytest.fixture(scope="module")
def references():
    return {d: _fresh(d) for d in ("none", "lookup")}


@pytest.fixture(scope="module")
def reference(references):
    return references["none"]


@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_abandoned_generator_does_not_corrupt_the_cache(drafter, references):
    # the reported bug: take 7 tokens of P, keep the generator, run Q, drop the generator, run P
    p, q = PROMPTS[0], PROMPTS[2]
    reference = references[drafter]
    with _open(drafter) as eng:
        g = eng.generate(p, max_tokens=MAX)
        taken = 0
        for ev in g:
            taken += isinstance(ev, TokenEvent)
            if taken == 7:
                break
        assert _toks(eng.generate(q, max_tokens=MAX))[0] == reference[q]
        del g
        gc.collect()
        assert _toks(eng.generate(p, max_tokens=MAX))[0] == reference[p]


def test_a_superseded_generator_raises_and_leaves_the_new_one_alone(references):
    reference = references["lookup"]
    p, q = PROMPTS[0], PROMPTS[2]
    with _open("lookup") as eng:
        old = eng.generate(p, max_tokens=MAX)
        next(old)
        new = eng.generate(q, max_tokens=MAX)
        with pytest.raises(EesdError, match="newer generation"):
            next(old)
        assert _toks(new)[0] == reference[q]
        old.close()  # closing it later does nothing to the engine
        assert _toks(eng.generate(p, max_tokens=MAX))[0] == reference[p]


def test_abandoned_stream_completion(references):
    reference = references["lookup"]
    p, q = PROMPTS[0], PROMPTS[3]
    with _open("lookup") as eng:
        stream = eng.create_completion(p, max_tokens=MAX, stream=True)
        next(stream), next(stream)
        out = eng.create_completion(q, max_tokens=MAX)
        assert out["usage"]["completion_tokens"] == len(reference[q])
        del stream
        gc.collect()
        assert _toks(eng.generate(p, max_tokens=MAX))[0] == reference[p]


def test_every_method_after_close_raises():
    eng = _open()
    gen = eng.generate(PROMPTS[0], max_tokens=4)
    next(gen)
    eng.close()
    eng.close()  # idempotent
    assert eng.closed
    with pytest.raises(EesdError, match="closed"):
        next(gen)
    for call in (lambda: eng.run("x"), lambda: eng.generate("x"), lambda: eng.tokenize("x"),
                 lambda: eng.apply_chat_template([{"role": "user", "content": "x"}]),
                 lambda: eng.create_completion("x"), lambda: eng.create_chat_completion([{"role": "user", "content": "x"}]),
                 lambda: eng.set_drafter("lookup"), lambda: eng.set_controller("fixed:2")):
        with pytest.raises(EesdError, match="closed"):
            call()
    with _open() as eng2:
        pass
    with pytest.raises(EesdError, match="closed"):
        eng2.run("x")


def test_two_threads_never_reach_llama_cpp_at_once(references):
    reference = references["lookup"]
    """run() from several threads: they wait for each other and all answer right."""
    errors: list[BaseException] = []
    results: dict[tuple[int, int], list[int]] = {}
    with _open("lookup") as eng:
        def worker(t: int) -> None:
            try:
                for i in range(3):
                    p = PROMPTS[(t + i) % len(PROMPTS)]
                    fin = eng.run(p, max_tokens=MAX)
                    results[t, i] = eng.tokenize(fin.text)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=300)
        assert not errors
        assert len(results) == 9
        for (t, i), toks in results.items():
            p = PROMPTS[(t + i) % len(PROMPTS)]
            assert eng.tokenize(eng.model.detokenize(reference[p])) == toks


def test_two_streaming_threads_get_an_error_not_a_crash():
    """generate() streams from two threads at once: the older one is ended with an EesdError."""
    outcomes: list[str] = []
    with _open() as eng:
        barrier = threading.Barrier(2)

        def worker(p: str) -> None:
            try:
                g = eng.generate(p, max_tokens=MAX)
                barrier.wait(timeout=60)
                for _ in g:
                    pass
                outcomes.append("done")
            except EesdError:
                outcomes.append("stopped")

        threads = [threading.Thread(target=worker, args=(p,)) for p in PROMPTS[:2]]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=300)
    assert sorted(outcomes) in (["done", "stopped"], ["done", "done"])


@pytest.mark.parametrize("bad, match", [
    (dict(prompt=b"def f():"), "must be text"),
    (dict(prompt=[1, 2, 10**7]), "outside the vocabulary"),
    (dict(prompt=[1, -1]), "outside the vocabulary"),
    (dict(prompt=[]), "empty"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(stop=[1]), "stop"),
])
def test_bad_generate_arguments(bad, match):
    with _open() as eng:
        kw = dict(prompt="def f():", max_tokens=4) | bad
        with pytest.raises(EesdError, match=match):
            eng.run(kw.pop("prompt"), **kw)
        assert eng.run("def f():", max_tokens=2).stats.n_generated == 2  # still usable


@pytest.mark.parametrize("draft_max", [0, -1, 1000])
def test_draft_max_is_checked(draft_max):
    with pytest.raises(EesdError, match="draft"):
        _open("lookup", draft_max=draft_max)


def test_the_default_draft_length_fits_a_small_context():
    """The default draft_max (64) in a context of 32: drafts as long as its batch holds; a draft_max asked for
    explicitly must fit."""
    with eesd_local.load(QWEN05, drafter="lookup", n_ctx=32) as eng:
        assert eng.config.draft_max == eng.ctx.n_batch - 1 < DRAFT_MAX
        assert eng.run("def f(a, b):", max_tokens=8).stats.n_generated > 0
    with pytest.raises(EesdError, match="does not fit"):
        eesd_local.load(QWEN05, drafter="lookup", n_ctx=32, draft_max=40)


def test_a_full_context_says_so():
    with eesd_local.load(QWEN05, drafter="none", n_ctx=16) as eng:
        fin = eng.run("def f(a, b):", max_tokens=32)
        assert fin.reason == "context" and 0 < fin.stats.n_generated < 32
        out = eng.create_completion("def f(a, b):", max_tokens=32)
        assert out["choices"][0]["finish_reason"] == "length"


def test_randomised_interleaving(reference):
    """Many short greedy generations with random early breaks, abandoned and late-collected
    generators, cancels, closes and prompt-prefix reuse: every completed answer equals its
    fresh single-run answer, every cut-short one is a prefix of it, every stale generator
    raises EesdError. EESD_INTERLEAVE_STEPS sets the number of steps."""
    steps = int(os.environ.get("EESD_INTERLEAVE_STEPS", "120"))
    rnd = random.Random(1234)
    eng = _open()
    kept: list[tuple[object, str, int, list[int]]] = []  # (generator, prompt, max_tokens, tokens seen)
    owner = None  # the kept generator that no later generation or close has ended

    def same(p: str, want: list[int], got: list[int]) -> None:
        """got == want: a reused prefix is only reused where a fresh prefill computes it the same way."""
        assert got == want, (p, want, got)

    def check(p: str, m: int, toks: list[int], fin: FinishEvent) -> None:
        want = reference[p][:m]
        if fin.reason == "cancelled":
            same(p, want[: len(toks)], toks)
        else:
            assert len(toks) == len(want) or fin.reason == "stop", (p, m, fin.reason)
            same(p, want, toks)

    try:
        for _ in range(steps):
            op = rnd.choices(["run", "keep", "close", "resume", "gc", "cancel", "reopen"], [4, 3, 2, 3, 1, 2, 1])[0]
            p, m = rnd.choice(PROMPTS), rnd.randint(1, MAX)
            if op in ("run", "keep", "close", "cancel", "reopen"):
                owner = None  # each of these starts a generation or closes the engine
            if op == "run":
                toks, fin = _toks(eng.generate(p, max_tokens=m))
                check(p, m, toks, fin)
            elif op in ("keep", "close"):
                g = eng.generate(p, max_tokens=m)
                seen: list[int] = []
                broke = False
                for ev in g:
                    if isinstance(ev, TokenEvent):
                        seen.append(ev.token)
                        if rnd.random() < 0.3:
                            broke = True
                            break
                same(p, reference[p][: len(seen)], seen)
                if op == "keep" and broke:
                    kept.append((g, p, m, seen))
                    owner = g
                else:
                    g.close()
            elif op == "resume" and kept:
                g, p, m, seen = kept.pop(rnd.randrange(len(kept)))
                try:
                    toks, fin = _toks(g)
                except EesdError as exc:
                    assert g is not owner and ("stopped" in str(exc) or "closed" in str(exc))
                else:
                    assert g is owner and fin is not None  # it still owned the engine: it ends its answer right
                    check(p, m, seen + toks, fin)
                if g is owner:
                    owner = None
            elif op == "gc":
                kept.clear()
                owner = None
                gc.collect()
            elif op == "cancel":
                toks = []
                for ev in eng.generate(p, max_tokens=m):
                    if isinstance(ev, TokenEvent):
                        toks.append(ev.token)
                        if rnd.random() < 0.3:
                            eng.cancel()
                    elif isinstance(ev, FinishEvent):
                        check(p, m, toks, ev)
            elif op == "reopen":
                eng.close()
                eng = _open()
    finally:
        kept.clear()
        eng.close()


class _EveryOther(DrafterBase):
    """A drafter written outside the package: proposes the token that came two steps back (the protocol's
    other members are DrafterBase's)."""

    name = "every-other"

    def propose(self, history, want_more, max_n, params, rng, source=SRC_ANY):
        prop = Proposal()
        if max_n > 0 and len(history) >= 2 and want_more(0, 1.0):
            prop.add(history[-2], None, 0.5)
        return prop



def test_a_drafter_object_without_the_protocol_is_one_clear_error():
    class Half:
        name = "half"

        def propose(self, *args):
            return Proposal()

    with pytest.raises(EesdError, match="lacks n_sources, free_offers, weight_share, drafts, begin, offer, source_name, native, close"):
        _open(Half())


def test_a_drafter_is_its_module(reference):
    """A drafter object written in Python plugs in with no engine change: the round loop calls it once a
    round; greedy output stays plain decoding's."""
    with _open(_EveryOther(), controller="fixed:1") as eng:
        toks, fin = _toks(eng.generate(PROMPTS[0], max_tokens=MAX))
        assert fin.stats.n_drafted > 0
        assert toks == reference[PROMPTS[0]]
