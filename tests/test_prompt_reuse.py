"""Prompt reuse at token granularity (issue 42): a prompt takes from the KV cache the longest prefix it shares
with what the cache holds (an earlier prompt, an earlier answer's decode), and its answer is the one a fresh
process gives, for prompts that share prefixes of every length. The batch-invariant kernels make a row's
logits and KV independent of the batch they were computed in; these tests hold the engine to that."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest

import eesd_local
from eesd_local import server
from eesd_local.gguf.tiny import write_tiny_gguf
from eesd_local.llama import runtime
from eesd_local.speculative.events import TokenEvent
from eesd_local.speculative.promptcache import RESTORE_MIN_TOKENS, SLACK, PromptCache

from .conftest import QWEN05


def _answer(eng, prompt, n):
    evs = list(eng.generate(prompt, max_tokens=n))
    return [e.token for e in evs if isinstance(e, TokenEvent)], evs[-1].stats.n_cached


def _pairs(base: list[int], lengths: list[int]) -> list[list[int]]:
    """Prompts that share base[:L] with the one before them, each going on differently after it."""
    out = []
    for i, n in enumerate(lengths):
        out.append(base[:n] + [base[(n * 7 + i) % len(base)], base[(n * 3 + 1) % len(base)]])
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=3))


@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_reused_prefixes_of_every_length_change_no_answer(tiny, drafter):
    base = [int(t) for t in (list(range(100, 420, 3)) + list(range(90, 300, 7))) * 2][:300]
    lengths = [1, 2, 3, 5, 8, 13, 31, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 299]
    prompts = _pairs(base, lengths)
    fresh = []
    with eesd_local.load(tiny, drafter="none", n_ctx=1024) as eng:
        for p in prompts:
            eng.ctx.clear()  # nothing cached: the prompt decoded whole, as a fresh process decodes it
            fresh.append(_answer(eng, p, 12)[0])
    with eesd_local.load(tiny, drafter=drafter, n_ctx=1024, controller="fixed:4") as eng:
        cached = 0
        for p, want in zip(prompts + prompts[::-1], fresh + fresh[::-1], strict=True):
            got, n = _answer(eng, p, 12)
            assert got == want, (len(p), n)
            cached += n
    assert cached > 2000, "the prompts took little from the cache: the test would not test reuse"


FRESH = """import json, sys, eesd_local
prompts, n, model = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
out = []
with eesd_local.load(model, drafter="none", n_ctx=2048) as e:
    for p in prompts:
        e.ctx.clear()  # nothing cached: each prompt decoded whole
        out.append(e.run(p, max_tokens=n).text)
print(json.dumps(out))
"""


def _fresh_process(prompts: list[str], n: int) -> list[str]:
    """Each prompt's greedy answer from another process, its cache emptied before each prompt."""
    r = subprocess.run([sys.executable, "-c", FRESH, json.dumps(prompts), str(n), QWEN05], capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.model
def test_the_demo_model_answers_reused_prompts_as_a_fresh_process(qwen05_path):
    """Conversations that share prefixes of many lengths (a second turn, the same file with another question,
    a system prompt kept): each answer through a warm engine that reused the cache equals a fresh process's."""
    code = open(eesd_local.__file__.replace("__init__.py", "speculative/rounds.py")).read()[:6000]
    questions = ["What does this module do?", "List its classes.", "Which function is the longest?"]
    prompts = []
    with eesd_local.load(QWEN05, drafter="auto", n_ctx=2048) as eng:
        for cut in (300, 1200, 2400, 4000):
            for q in questions:
                prompts.append(eng.apply_chat_template([{"role": "user", "content": code[:cut] + "\n\n" + q}]))
        prompts.append(prompts[0] + "Sure:")  # a continuation of a whole earlier prompt
        got, cached = [], 0
        for p in prompts:
            fin = eng.run(p, max_tokens=10)
            got.append(fin.text)
            cached += fin.stats.n_cached
    assert cached > 0.5 * sum(len(p) for p in prompts) / 4, "little was reused: the test would not test reuse"
    assert got == _fresh_process(prompts, 10)


def test_conversations_that_come_back_are_restored_from_ram(tiny):
    """Three conversations take turns: each later turn continues its own conversation's state kept in RAM
    (--cache-ram), pays only for its new tokens, and answers as a fresh process does; a bound that holds one
    state at a time keeps the states' bytes under it."""
    def turns(base: int, step: int) -> list[list[int]]:
        first = [(base + step * i) % 500 for i in range(150)]
        more = [(base + 11 * i) % 500 for i in range(80)]
        return [first, first + more[:40], first + more]

    convs = [turns(b, s) for b, s in ((10, 3), (100, 7), (200, 13))]
    order = [(c, t) for t in range(3) for c in range(3)]  # A1 B1 C1 A2 B2 C2 A3 B3 C3
    with eesd_local.load(tiny, drafter="none", n_ctx=1024) as eng:
        fresh = {}
        for c, t in order:
            eng.ctx.clear()
            fresh[c, t] = _answer(eng, convs[c][t], 8)[0]
    with eesd_local.load(tiny, drafter="lookup", n_ctx=1024, controller="fixed:4") as eng:
        for c, t in order:
            got, cached = _answer(eng, convs[c][t], 8)
            assert got == fresh[c, t], (c, t)
            if t > 0:  # the conversation's earlier turn came back from RAM
                assert cached >= len(convs[c][t - 1]) - 1, (c, t, cached)
        assert len(eng.prompt_cache) >= 2
    state = None
    with eesd_local.load(tiny, drafter="none", n_ctx=1024) as eng:
        eng.run(convs[0][0], max_tokens=1)
        state = len(eng.ctx.save_state())
    limit_mb = max(1, (state * 3 // 2) >> 20)
    with eesd_local.load(tiny, drafter="none", n_ctx=1024, cache_ram=limit_mb) as eng:
        for c, t in order:
            assert _answer(eng, convs[c][t], 8)[0] == fresh[c, t]
            assert eng.prompt_cache.bytes <= limit_mb << 20
    with eesd_local.load(tiny, drafter="none", n_ctx=1024, cache_ram=0) as eng:
        assert eng.prompt_cache is None
        assert [_answer(eng, convs[c][t], 8)[0] for c, t in order] == [fresh[k] for k in order]


def test_short_prompts_after_a_shared_system_prompt_come_back_from_ram(tiny):
    """Chat requests share a system prompt and differ in a few tokens each (a short question): each one that
    comes again is restored from RAM whole, however short its own part, and answers as a fresh process does
    (until 2026-11-29 a state came back only when it gave 32 tokens more than the cache, so such a prompt was
    prefilled again every time)."""
    system = [(7 * i + 3) % 500 for i in range(40)]
    own = (6, 12, RESTORE_MIN_TOKENS + 1, 9)  # tokens after the system prompt; the last one gives the first logits
    prompts = [system + [(b + 13 * i) % 500 for i in range(n)] for b, n in zip((5, 50, 90, 130), own)]
    with eesd_local.load(tiny, drafter="none", n_ctx=1024) as eng:
        fresh = []
        for p in prompts:
            eng.ctx.clear()
            fresh.append(_answer(eng, p, 6)[0])
    with eesd_local.load(tiny, drafter="none", n_ctx=1024) as eng:
        for rnd in range(2):
            for p, want in zip(prompts, fresh):
                got, cached = _answer(eng, p, 6)
                assert got == want
                if rnd == 1:  # the whole prompt but its last token (which gives the first logits) came back
                    assert cached == len(p) - 1, (len(p), cached)
                else:
                    assert cached <= len(system) + 1


def test_a_prefill_cancelled_between_chunks_keeps_only_whole_chunks_and_changes_no_answer(tiny):
    """cancel() during a long prompt's prefill stops it at the next chunk (a client that hung up does not hold
    the engine for the rest of its prompt). What the cache keeps is the chunks decoded, recorded as such, and
    the next request with that prompt reuses them and answers as a fresh process does."""
    prompt = [int(t) for t in (list(range(100, 420, 3)) + list(range(90, 300, 7))) * 6][:1300]
    with eesd_local.load(tiny, drafter="none", n_ctx=2048) as eng:
        want = _answer(eng, prompt, 8)[0]
        assert eng.ctx.n_batch < len(prompt), "one chunk: nothing to cancel between"
        eng.ctx.clear()
        gen = eng.generate(prompt, max_tokens=8)
        eng.cancel()  # before the first event: the prefill stops after its first chunk
        evs = list(gen)
        assert evs[-1].reason == "cancelled" and not any(isinstance(e, TokenEvent) for e in evs)
        kept = eng.ctx.n_past
        assert kept == eng.ctx.n_batch and eng.ctx.tokens == prompt[:kept]
        got, cached = _answer(eng, prompt, 8)
        assert got == want and cached == kept


@pytest.mark.parametrize("keep", [0, 1, 200, 255, 300, 700])
def test_a_long_prompt_after_a_cached_prefix_is_cut_where_llama_cpp_pads_its_attention(tiny, keep, monkeypatch):
    """llama.cpp attends over the KV cells up to the highest used one rounded up to 256: a chunk that ends past a
    multiple of 256 makes every row of it attend to up to 255 cells more (a 600-token prompt after a one-token cached
    prefix took 3.7% longer). Chunks before the last end on a multiple of KV_PAD positions; the answer is a fresh
    process's, however the prompt was cut."""
    prompt = [int(t) for t in (list(range(100, 420, 3)) + list(range(90, 300, 7))) * 6][:1500]
    with eesd_local.load(tiny, drafter="none", n_ctx=2048) as eng:
        want = _answer(eng, prompt, 6)[0]
        ctx = eng.ctx
        ctx.clear()
        ctx.decode(prompt[:keep])
        ends, real = [], ctx._llama_decode

        def record():
            ends.append(ctx.n_past + ctx._batch.n_tokens)
            return real()

        monkeypatch.setattr(ctx, "_llama_decode", record)
        got, cached = _answer(eng, prompt, 6)
        assert got == want and cached == keep
        assert all(end % runtime.KV_PAD == 0 for end in ends[:-1]), ends
        assert ends[-1] == len(prompt) and all(b - a <= ctx.n_batch for a, b in zip([keep, *ends], ends)), ends


class _FakeCtx:
    """A context whose KV state is ``size`` bytes of one value (what the prompt cache copies)."""

    def __init__(self, size: int, fill: int) -> None:
        self.size, self.fill = size, fill

    def state_size(self) -> int:
        return self.size

    def save_state_into(self, out) -> None:
        assert len(out) == self.size
        out[:] = bytes([self.fill]) * self.size


def test_the_prompt_cache_reuses_its_buffers_within_its_bound():
    """A state saved again as its conversation grows goes into the buffer of the turn before (its pages mapped
    already: fresh pages are what a save costs); states that go leave their buffers for the next save; the
    buffers kept and free stay within the bound, least recently used states out first."""
    cache = PromptCache(10_000)
    a1, a2, a3 = list(range(50)), list(range(80)), list(range(120))
    assert cache.save(a1, _FakeCtx(1000, 1))
    buf = cache._states[tuple(a1)][1]
    assert len(buf) == int(1000 * SLACK) and cache.bytes == len(buf)
    assert cache.save(a2, _FakeCtx(1200, 2))  # the next turn: a1 is its prefix, a2 takes a1's buffer
    assert tuple(a1) not in cache and a2 in cache and cache._states[tuple(a2)][1] is buf
    key, state, shared = cache.best(a2 + [7])
    assert key == tuple(a2) and shared == len(a2) and bytes(state) == bytes([2]) * 1200
    assert cache.save(a3, _FakeCtx(2000, 3))  # too big for a2's buffer: a new one; a2's is kept free
    assert cache._free == [buf] and cache.bytes == len(buf) + int(2000 * SLACK)
    b = [900 + i for i in range(30)]
    assert cache.save(b, _FakeCtx(1100, 4))  # another conversation fits the free buffer
    assert cache._states[tuple(b)][1] is buf and not cache._free
    assert bytes(cache.best(b)[1]) == bytes([4]) * 1100 and bytes(cache.best(a3)[1]) == bytes([3]) * 2000
    for i in range(6):  # more conversations than the bound holds: the least recently used go
        assert cache.save([2000 + 100 * i + j for j in range(20)], _FakeCtx(2500, 10 + i))
        assert cache.bytes <= cache.limit
    assert tuple(b) not in cache and len(cache) == 3
    assert not cache.save([5] * 20, _FakeCtx(20_000, 9))  # a state over the bound is not kept
    assert cache.bytes <= cache.limit


def test_the_engine_keeps_its_prompt_ahead_of_the_next_conversation(tiny):
    """keep_prompt() (the server calls it when a response has gone and no request waits) saves what the cache
    holds, once; a request for another conversation then does not copy it again, and a request that comes back
    to it is restored from RAM and answers as a fresh process does."""
    first = [(10 + 3 * i) % 500 for i in range(150)]
    other = [(200 + 7 * i) % 500 for i in range(120)]
    with eesd_local.load(tiny, drafter="none", n_ctx=1024) as eng:
        want = []
        for p in (first, other, first + [11, 12]):
            eng.ctx.clear()  # nothing cached: a fresh process's answer
            want.append(_answer(eng, p, 8)[0])
    with eesd_local.load(tiny, drafter="none", n_ctx=1024) as eng:
        assert not eng.keep_prompt()  # nothing held yet
        assert _answer(eng, first, 8)[0] == want[0]
        assert eng.keep_prompt() and not eng.keep_prompt()  # saved once
        saves = []
        orig = eng.ctx.save_state_into
        eng.ctx.save_state_into = lambda out: (saves.append(len(out)), orig(out))[1]
        assert _answer(eng, other, 8)[0] == want[1]
        assert saves == [], "the conversation kept ahead was copied again"
        got, cached = _answer(eng, first + [11, 12], 8)
        assert got == want[2] and cached >= len(first), cached
        assert saves, "the second conversation was not kept when the first came back"


def test_the_server_keeps_an_idle_prompt_only_when_no_next_request_comes_soon(monkeypatch):
    """eesd serve's worker copies the conversation the engine holds into RAM once no request came for KEEP_AFTER_S
    after a response: a next turn sent soon after (an agent, a script) is served first, with no copy before it;
    once the server sits idle the copy is made, once."""
    monkeypatch.setattr(server, "KEEP_AFTER_S", 1.0)
    keeps: list[float] = []
    served: list[tuple[str, int]] = []  # (request, keeps made before it started)
    done = threading.Event()

    class Engine:  # what the worker reads and calls on an engine
        config = eesd_local.EngineConfig(model="m", drafter="none")

        def cancel(self) -> None:
            pass

        def keep_prompt(self) -> bool:
            keeps.append(time.monotonic())
            return True

    def start(engine, job):
        served.append((job.prompt, len(keeps)))
        yield {"choices": []}
        done.set()

    monkeypatch.setattr(server, "_start", start)
    monkeypatch.setattr(server.EngineWorker, "_configure", lambda self, spec: None)
    loop = asyncio.new_event_loop()
    worker = server.EngineWorker(Engine(), "m")
    try:
        assert worker.submit(server.Job(False, "turn 1", {}, None, loop))
        assert done.wait(10)
        done.clear()
        time.sleep(0.1)  # the next turn comes 0.1 s after the first's response
        assert worker.submit(server.Job(False, "turn 2", {}, None, loop))
        assert done.wait(10)
        ended = time.monotonic()
        deadline = ended + 10
        while not keeps and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        assert served == [("turn 1", 0), ("turn 2", 0)], "the prompt was copied before the next turn"
        assert len(keeps) == 1, keeps  # kept once the server sat idle
        assert keeps[0] - ended >= 0.9
    finally:
        worker.stop()
        loop.close()
