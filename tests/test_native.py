"""The native round loop (eesd_local._native): the same tokens and events as the Python loop
with every drafter, greedy and seeded sampling, on the demo model; its mechanics, fallback
and bad input on a tiny synthetic GGUF."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading

import llama_cpp as lc
import numpy as np
import pytest

import eesd_local
from eesd_local.base.errors import EesdError
from eesd_local.gguf.tiny import write_tiny_gguf
from eesd_local.llama import costs
from eesd_local.llama import native as native_ext
from eesd_local.llama.runtime import Context, ContextParams, Model
from eesd_local.speculative import native_round
from eesd_local.speculative.controllers.cfuncs import addresses
from eesd_local.speculative.events import FinishEvent, RoundEvent, TokenEvent
from eesd_local.speculative.rounds import round_limit
from eesd_local.speculative.sampling import SamplingParams, TokenRNG, probs

from .conftest import QWEN05

_native = pytest.importorskip("eesd_local._native", reason="the native extension is not built")


def _clear(eng) -> None:
    """Empty both KV caches, so that both loops start from the same state."""
    eng.ctx.clear()
    inner = getattr(eng.drafter, "inner", None) or getattr(eng.drafter, "model", None) or eng.drafter
    if hasattr(inner, "ctx"):
        inner.ctx.clear()


def _events(eng, prompt, monkeypatch, native: bool, **kw):
    monkeypatch.setenv("EESD_NATIVE", "1" if native else "0")
    _clear(eng)
    evs = list(eng.generate(prompt, **kw))
    assert eng.loop_note.startswith("round loop: native" if native else "round loop: Python")
    toks = [(e.token, e.text, e.source, e.round) for e in evs if isinstance(e, TokenEvent)]
    rounds = [(e.index, e.drafted, e.accepted, e.emitted, e.source, e.rows) for e in evs if isinstance(e, RoundEvent)]
    fin = evs[-1]
    assert isinstance(fin, FinishEvent)
    s = fin.stats
    return toks, rounds, (fin.reason, fin.text, s.n_generated, s.n_rounds, s.n_drafted, s.n_accepted, s.drafted_at, s.accepted_at)


def _same_both_ways(eng, prompt, monkeypatch, sources: set | None = None, **kw) -> int:
    py = _events(eng, prompt, monkeypatch, False, **kw)
    nat = _events(eng, prompt, monkeypatch, True, **kw)
    assert nat == py
    if sources is not None:
        sources.update(r[4] for r in py[1] if r[4])
    return py[2][4]  # drafted tokens


# --- the demo model: every drafter, greedy and seeded sampling -----------------------

DRAFTERS = {
    "none": dict(drafter="none"),
    "lookup": dict(drafter="lookup", controller="fixed:4"),
    "eesd": dict(drafter="eesd", controller="pmin:0.2"),
    "draft-model": dict(drafter="draft-model", draft_model=QWEN05, controller="fixed:3"),
    "hierarchical": dict(drafter="hierarchical", controller="fixed:3"),
    # a baseline controller does not choose: lookup drafts where it found a match, else the exit head
    "auto": dict(drafter="auto", controller="fixed:3"),
    # the exit head as a separate draft model (eesd's default is the shared trunk, trunk.py; auto's is the copy)
    "eesd-copy": dict(drafter="eesd", controller="pmin:0.2", shared_trunk=False),
    "auto-shared": dict(drafter="auto", controller="fixed:3", shared_trunk=True),
}
MESSAGES = [
    [{"role": "user", "content": "Rewrite this without the loop: total = 0\nfor x in xs:\n    total = total + x\nprint(total)"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
]


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.model
def test_native_equals_python_on_the_demo_model(name, monkeypatch):
    if name == "auto":  # a machine where the exit head can pay (elsewhere auto is lookup itself): both sources
        flat = costs.CostProfile(20.0, {k: 1.0 + 0.02 * (k - 1) for k in costs.KS}, {})
        monkeypatch.setattr(costs, "cached", lambda fp: (None, ""))  # no kept profile: the head as a separate draft
        monkeypatch.setattr(costs, "profile", lambda model, **kw: flat)
    with eesd_local.load(QWEN05, n_ctx=1024, **DRAFTERS[name]) as eng:
        prompts = [eng.tokenize(eng.apply_chat_template(m)) for m in MESSAGES]
        sources: set[str] = set()
        drafted = _same_both_ways(eng, prompts[0], monkeypatch, sources, max_tokens=20)
        drafted += _same_both_ways(eng, prompts[1], monkeypatch, sources, max_tokens=12, temperature=0.8, top_p=0.95, seed=7)
        drafted += _same_both_ways(eng, prompts[0], monkeypatch, sources, max_tokens=12, temperature=1.0, top_k=40, seed=3)
    assert name == "none" or drafted > 0, "nothing was drafted: the test would not test the drafter"
    if name.startswith("auto"):
        assert sources == {"lookup", "eesd"}, f"both sources should draft here, saw {sources}"


@pytest.mark.parametrize(("name", "k"), [("lookup", 3), ("eesd", 1), ("draft-model", 3)])
@pytest.mark.model
def test_probe_rounds_native_equals_python_and_plain(name, k, monkeypatch):
    """Rounds verified without the bonus (cost-ts's probes; here forced on fixed:k for every round):
    the same tokens in both loops, greedy output equal to plain decoding, rounds that end on a draft."""
    spec = dict(DRAFTERS[name], controller=f"fixed:{k}")
    with eesd_local.load(QWEN05, n_ctx=1024, **spec) as eng:
        eng.controller.fields["no_bonus"] = 1.0  # fixed controllers never reset it
        prompt = eng.tokenize(eng.apply_chat_template(MESSAGES[0]))
        py = _events(eng, prompt, monkeypatch, False, max_tokens=24)
        nat = _events(eng, prompt, monkeypatch, True, max_tokens=24)
        assert nat == py
        assert any(d > 0 and a == d and e == d for _, d, a, e, _, _ in py[1]), "no probe ended on its last draft"
        assert all(e == (a if a == d and d > 0 else a + 1) for _, d, a, e, _, _ in py[1])
        # a probe's verify batch is [last, d1..d(k-1)]: k rows; plain rounds 1
        assert all(rows == (d if d > 0 else 1) for _, d, _, _, _, rows in py[1])
        _same_both_ways(eng, prompt, monkeypatch, max_tokens=16, temperature=0.8, top_p=0.95, seed=11)
        eng.set_drafter("none")
        plain = _events(eng, prompt, monkeypatch, True, max_tokens=24)
    assert [t[0] for t in py[0]] == [t[0] for t in plain[0]]


def test_probs_agree_with_numpy(qwen05_path):
    """Same filters, same tie rule; exp and sums may differ in the last bit (numpy's SIMD exp)."""
    model = Model(qwen05_path)
    ctx = Context(model, ContextParams(n_ctx=128))
    ctx.decode(model.tokenize("def fibonacci(n):\n    "))
    row = ctx.logits().copy()
    ctx.close()
    model.close()
    for t, k, p in [(1.0, 0, 1.0), (0.7, 40, 1.0), (0.9, 0, 0.9), (1.0, 50, 0.8), (0.3, 0, 0.95)]:
        a = probs(row, SamplingParams(temperature=t, top_k=k, top_p=p))
        b = _native.probs(row, t, k, p)
        assert np.array_equal(a > 0, b > 0)  # the same support
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-300)


def test_probs_agree_with_numpy_on_a_flat_distribution():
    """An early exit's distribution is flat: top-p 0.95 keeps tens of thousands of tokens (the
    binned search in both implementations, against a plain full sort here)."""
    rng = np.random.default_rng(0)
    for scale in (1.0, 2.0, 4.0):
        row = (rng.standard_normal(151936) * scale).astype(np.float32)
        # (0.02, 0, 1.0): exps far below 1, down to subnormals and zeros
        for t, k, p in [(0.8, 0, 0.95), (1.0, 0, 0.5), (1.0, 0, 0.999), (0.7, 500, 0.9), (0.02, 0, 1.0), (0.05, 0, 0.9)]:
            a = probs(row, SamplingParams(temperature=t, top_k=k, top_p=p))
            b = _native.probs(row, t, k, p)
            assert np.array_equal(a > 0, b > 0)
            np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-300)
            if k == 0 and t >= 0.5:  # (colder, exps of the kept tokens underflow to 0 in both)
                x = row.astype(np.float64)
                order = np.argsort(-x, kind="stable")
                mass = np.cumsum(np.exp(x[order] - x.max()))
                cut = int(np.searchsorted(mass, p * mass[-1])) + 1
                assert np.array_equal(np.flatnonzero(a), np.sort(order[:cut]))


def test_argmax_is_numpys():
    rng = np.random.default_rng(1)
    for n in (1, 15, 16, 17, 151936):
        row = rng.standard_normal(n).astype(np.float32)
        assert _native.argmax(row) == int(np.argmax(row))
        row[n // 3] = row[(2 * n) // 3] = row.max() + 1.0  # a tie: the first index wins
        assert _native.argmax(row) == int(np.argmax(row)) == n // 3


def test_round_limit_is_the_python_rule():
    """run_batch's draft limit is rounds.round_limit, zero and negative inputs included."""
    values = (-5, -1, 0, 1, 2, 3, 8, 1000)
    for draft_max, left, room in itertools.product(values, repeat=3):
        assert _native.round_limit(draft_max, left, room) == round_limit(draft_max, left, room), (draft_max, left, room)


def test_token_rng_is_splitmix64():
    rng = TokenRNG(1234567)  # the reference outputs of splitmix64 from this seed
    for z in (6457827717110365317, 3203168211198807973, 9817491932198370423):
        assert rng.random() == (z >> 11) * 2.0**-53
    assert TokenRNG(5).random() == TokenRNG(5).random()


# --- the tiny synthetic GGUF: mechanics ----------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return str(write_tiny_gguf(d / "tiny.gguf", seed=0)), str(write_tiny_gguf(d / "draft.gguf", seed=0, n_layer=1))


TINY_PROMPT = list(range(300, 340)) * 3


@pytest.mark.parametrize("drafter", ["none", "lookup", "self", "draft-model", "hierarchical"])
def test_tiny_native_equals_python(tiny, drafter, monkeypatch):
    target, draft = tiny
    kind = {"self": "draft-model"}.get(drafter, drafter)
    extra = {"self": dict(draft_model=target), "draft-model": dict(draft_model=draft),
             "hierarchical": dict(draft_model=draft)}.get(drafter, {})
    with eesd_local.load(target, drafter=kind, n_ctx=2048, controller="fixed:4", **extra) as eng:
        for kw in (dict(), dict(temperature=0.9, seed=3), dict(temperature=0.7, top_k=20, top_p=0.9, seed=4)):
            _same_both_ways(eng, TINY_PROMPT, monkeypatch, max_tokens=120, **kw)
        if drafter == "self":  # p == q: every draft is accepted, greedy and sampled alike
            monkeypatch.setenv("EESD_NATIVE", "1")
            for kw in (dict(), dict(temperature=0.9, seed=1)):
                s = eng.run(TINY_PROMPT, max_tokens=60, **kw).stats
                assert s.n_drafted > 0 and s.n_accepted == s.n_drafted


def test_kv_records_stay_consistent(tiny, monkeypatch):
    target, draft = tiny
    monkeypatch.setenv("EESD_NATIVE", "1")
    with eesd_local.load(target, drafter="hierarchical", draft_model=draft, n_ctx=2048, controller="fixed:4") as eng:
        gen = eng.generate(TINY_PROMPT, max_tokens=100)
        for ev in gen:
            if isinstance(ev, RoundEvent) and ev.index == 5:
                break
        gen.close()  # cancel mid-answer: the records move back and the rollback runs
        for ctx in (eng.ctx, eng.drafter.inner.ctx):
            assert int(lc.llama_memory_seq_pos_max(ctx.mem, 0)) + 1 == ctx.n_past
        fin = eng.run(TINY_PROMPT, max_tokens=50)
        assert fin.stats.n_generated == 50
        assert eng.ctx.tokens[: len(TINY_PROMPT)] == TINY_PROMPT
        assert int(lc.llama_memory_seq_pos_max(eng.ctx.mem, 0)) + 1 == eng.ctx.n_past


def test_fallback_and_notice(tiny, monkeypatch):
    target, _ = tiny
    with eesd_local.load(target, drafter="lookup", n_ctx=512) as eng:
        monkeypatch.setenv("EESD_NATIVE", "0")
        eng.run(TINY_PROMPT, max_tokens=4)
        assert eng.loop_note == "round loop: Python (EESD_NATIVE=0)"
        monkeypatch.delenv("EESD_NATIVE")
        monkeypatch.setattr(native_ext, "load", lambda: (None, "no module named eesd_local._native"))
        fin = eng.run(TINY_PROMPT, max_tokens=4)
        assert fin.stats.n_generated == 4
        assert "native extension unavailable: no module named" in eng.loop_note


def test_bad_input_raises_never_crashes(tiny, monkeypatch):
    target, _ = tiny
    monkeypatch.setenv("EESD_NATIVE", "1")
    with eesd_local.load(target, drafter="none", n_ctx=512) as eng:
        eng.run(TINY_PROMPT, max_tokens=2)
        rounds = _native.Rounds(int(eng.ctx.ptr), 4, 0, 0, *addresses())
        rounds.set_tokens(0, eng.ctx.tokens)
        rounds.set_history(TINY_PROMPT)
        state = eng.controller.state
        with pytest.raises(ValueError, match="configure"):  # settings first
            rounds.run_batch(len(TINY_PROMPT), 2, 10, 4)
        with pytest.raises(ValueError, match="cancel must be"):
            rounds.configure(state, 0, 0.0, 0, 1.0, 1, 0.05, np.zeros((1, 1), dtype=np.uint8))
        with pytest.raises(ValueError, match="controller state must be"):
            rounds.configure(state.reshape(1, -1), 0, 0.0, 0, 1.0, 1, 0.05, np.zeros(1, dtype=np.uint8))
        with pytest.raises(ValueError, match="mode must be"):
            rounds.configure(state, 4, 0.0, 0, 1.0, 1, 0.05, np.zeros(1, dtype=np.uint8))
        with pytest.raises(ValueError, match="draft context"):
            rounds.configure(state, 2, 0.0, 0, 1.0, 1, 0.05, np.zeros(1, dtype=np.uint8))
        with pytest.raises(ValueError, match="lookup n-grams"):
            rounds.set_lookup(3, 2)
        rounds.configure(state, 0, 0.0, 0, 1.0, 1, 0.05, np.zeros(1, dtype=np.uint8))
        with pytest.raises(ValueError, match="does not fit the target's batch of 4"):
            rounds.run_batch(len(TINY_PROMPT), 8, 10, 4)
        with pytest.raises(ValueError, match="history has"):
            rounds.run_batch(3, 2, 10, 4)
        recs = rounds.run_batch(len(TINY_PROMPT), 2, 3, 4)  # one token a round, 3 wanted
        assert [r[5] for r in recs] == [round_limit(2, left, r[6]) for left, r in zip((3, 2, 1), recs, strict=True)]
        rounds.close()
        with pytest.raises(ValueError, match="closed"):
            rounds.run_batch(len(TINY_PROMPT) + 3, 2, 10, 4)
        with pytest.raises(ValueError, match="closed"):
            _native.Rounds(0, 4, 0, 0, *addresses())
        eng.ctx.close()  # a closed context: the glue refuses before any pointer is used
        with pytest.raises(EesdError, match="closed"):
            native_round.NativeRounds(eng.ctx, eng.drafter, eng.controller, SamplingParams(), TokenRNG(0), draft_max=8)


def test_context_full_through_the_native_loop(tiny, monkeypatch):
    target, _ = tiny
    monkeypatch.setenv("EESD_NATIVE", "1")
    with eesd_local.load(target, drafter="lookup", n_ctx=256, controller="fixed:4") as eng:
        n_ctx = eng.ctx.n_ctx
        fin = eng.run((TINY_PROMPT * 3)[: n_ctx - 20], max_tokens=200)
        assert fin.reason == "context" and 0 < fin.stats.n_generated <= 21


def test_version_mismatch_is_refused_at_import():
    code = "import llama_cpp; llama_cpp.__version__ = '0.0.1'; import eesd_local._native"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 1
    assert f"built for llama-cpp-python {_native.LLAMA_CPP_VERSION} but 0.0.1 is installed" in out.stderr
    assert "ImportError" in out.stderr


def test_many_rounds_keep_memory_flat(tiny, monkeypatch):
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1])

    target, _ = tiny
    monkeypatch.setenv("EESD_NATIVE", "1")
    with eesd_local.load(target, drafter="draft-model", draft_model=target, n_ctx=1024, controller="fixed:4") as eng:
        for _ in range(3):
            eng.run(TINY_PROMPT, max_tokens=300, temperature=0.8, seed=1)
        before = rss()
        rounds = 0
        for i in range(10):
            rounds += eng.run(TINY_PROMPT, max_tokens=300, temperature=0.8 * (i % 2), seed=i).stats.n_rounds
        grown_kib = (rss() - before) * 4
    assert rounds > 500
    assert grown_kib < 4096, f"RSS grew by {grown_kib} KiB over {rounds} rounds"


# --- batches: several rounds per call into the extension ------------------------------


def _count_fetches(monkeypatch) -> list[int]:
    calls = [0]
    real = native_round.NativeRounds._fetch

    def fetch(self, *a):
        calls[0] += 1
        return real(self, *a)

    monkeypatch.setattr(native_round.NativeRounds, "_fetch", fetch)
    return calls


def test_batches_give_the_events_of_single_rounds(tiny, monkeypatch):
    """The default batches (many rounds per call on the tiny model) and one round per call give
    the same events, greedy and sampled, stopping at max_tokens inside a batch."""
    target, draft = tiny
    calls = _count_fetches(monkeypatch)
    for kind, extra in (("lookup", {}), ("hierarchical", dict(draft_model=draft))):
        seen = {}
        for batch_ms in (50.0, 0.0):
            with eesd_local.load(target, drafter=kind, n_ctx=2048, controller="fixed:4", batch_ms=batch_ms, **extra) as eng:
                calls[0] = 0
                got = [_events(eng, TINY_PROMPT, monkeypatch, True, max_tokens=150, **kw)
                       for kw in (dict(), dict(temperature=0.8, top_p=0.9, seed=5))]
                seen[batch_ms] = got, calls[0]
        (batched, n_batched), (single, n_single) = seen[50.0], seen[0.0]
        assert batched == single
        n_rounds = sum(g[2][3] for g in single)
        assert n_single == n_rounds and n_batched < n_rounds / 4, (n_batched, n_rounds)


def test_stop_string_inside_a_batch(tiny, monkeypatch):
    """A stop string ends the answer where the Python loop ends it, though the batch ran past it."""
    target, _ = tiny
    with eesd_local.load(target, drafter="lookup", n_ctx=2048, controller="fixed:4") as eng:
        full = _events(eng, TINY_PROMPT, monkeypatch, False, max_tokens=120)
        pieces = [t[1] for t in full[0]]
        at = next(i for i in range(40, len(pieces)) if pieces[i].strip())  # a piece with text, well inside
        stop = "".join(pieces[at - 1: at + 1])
        py = _events(eng, TINY_PROMPT, monkeypatch, False, max_tokens=120, stop=[stop])
        nat = _events(eng, TINY_PROMPT, monkeypatch, True, max_tokens=120, stop=[stop])
        assert nat == py
        assert py[2][0] == "stop" and py[2][2] < 120


def test_cancel_stops_a_running_batch(tiny, monkeypatch):
    """cancel() from another thread ends the batch being run after its current round."""
    target, _ = tiny
    monkeypatch.setenv("EESD_NATIVE", "1")
    with eesd_local.load(target, drafter="none", n_ctx=4096, batch_ms=600_000.0) as eng:
        full = eng.run(TINY_PROMPT, max_tokens=100_000).stats.n_generated  # to the end of the context
        timer = threading.Timer(0.02, eng.cancel)
        timer.start()
        fin = eng.run(TINY_PROMPT, max_tokens=100_000)
        timer.join()
    assert fin.reason == "cancelled"
    assert 0 < fin.stats.n_generated < full - 100, (fin.stats.n_generated, full)
