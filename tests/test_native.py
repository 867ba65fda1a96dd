"""The round loop (eesd_local._native): probes on the demo model; a drafter written in Python
called once a round; its maths against the references of tests/reference.py; its mechanics
(batches, cancel, KV records, memory) and bad input on a tiny synthetic GGUF."""

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
from eesd_local.llama import native as native_ext
from eesd_local.llama.runtime import Context, ContextParams, Model
from eesd_local.speculative import rounds as rounds_mod
from eesd_local.speculative.controllers.cfuncs import addresses
from eesd_local.speculative.drafters import DrafterBase, Offer, Proposal
from eesd_local.speculative.events import FinishEvent, RoundEvent, TokenEvent
from eesd_local.speculative.sampling import SamplingParams, TokenRNG
from tests.reference import Lookup, match_confidence, probs, round_limit

from .conftest import QWEN05

_native = pytest.importorskip("eesd_local._native", reason="the native extension is not built")


def _events(eng, prompt, **kw):
    eng.ctx.clear()
    evs = list(eng.generate(prompt, **kw))
    toks = [(e.token, e.text, e.source, e.round) for e in evs if isinstance(e, TokenEvent)]
    rounds = [(e.index, e.drafted, e.accepted, e.emitted, e.source, e.rows) for e in evs if isinstance(e, RoundEvent)]
    fin = evs[-1]
    assert isinstance(fin, FinishEvent)
    s = fin.stats
    return toks, rounds, (fin.reason, fin.text, s.n_generated, s.n_rounds, s.n_drafted, s.n_accepted, s.drafted_at, s.accepted_at)


# --- the demo model: every drafter, greedy and seeded sampling -----------------------

DRAFTERS = {
    "lookup": dict(drafter="lookup"),
    "eesd": dict(drafter="eesd"),
    "draft-model": dict(drafter="draft-model", draft_model=QWEN05),
}
MESSAGES = [
    [{"role": "user", "content": "Rewrite this without the loop: total = 0\nfor x in xs:\n    total = total + x\nprint(total)"}],
]


@pytest.mark.parametrize(("name", "k"), [("lookup", 3), ("eesd", 1), ("draft-model", 3)])
@pytest.mark.model
def test_probe_rounds_equal_plain_decoding(name, k):
    """Rounds verified without the bonus (cost-ts's probes; here forced on fixed:k for every round):
    greedy output equal to plain decoding, rounds that end on a draft, k rows a verify."""
    spec = dict(DRAFTERS[name], controller=f"fixed:{k}")
    with eesd_local.load(QWEN05, n_ctx=1024, **spec) as eng:
        eng.controller.fields["no_bonus"] = 1.0  # fixed controllers never reset it
        prompt = eng.tokenize(eng.apply_chat_template(MESSAGES[0]))
        py = _events(eng, prompt, max_tokens=24)
        assert any(d > 0 and a == d and e == d for _, d, a, e, _, _ in py[1]), "no probe ended on its last draft"
        assert all(e == (a if a == d and d > 0 else a + 1) for _, d, a, e, _, _ in py[1])
        # a probe's verify batch is [last, d1..d(k-1)]: k rows; plain rounds 1
        assert all(rows == (d if d > 0 else 1) for _, d, _, _, _, rows in py[1])
        sampled = [_events(eng, prompt, max_tokens=16, temperature=0.8, top_p=0.95, seed=11) for _ in range(2)]
        assert sampled[0] == sampled[1]  # seeded: run after run
        eng.set_drafter("none")
        plain = _events(eng, prompt, max_tokens=24)
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


def test_round_limit_is_the_reference_rule():
    """run_batch's draft limit is reference.round_limit, zero and negative inputs included."""
    values = (-5, -1, 0, 1, 2, 3, 8, 1000)
    for draft_max, left, room in itertools.product(values, repeat=3):
        assert _native.round_limit(draft_max, left, room) == round_limit(draft_max, left, room), (draft_max, left, room)


def test_lookup_match_is_the_index_reference():
    """The loop's backward scan finds what an n-gram index finds: continuation, n-gram and match length
    (an ambiguous n-gram as a one-token match), on histories with repeats of every length."""
    rng = np.random.default_rng(4)
    for trial in range(60):
        alphabet = int(rng.integers(2, 12))
        hist = [int(t) for t in rng.integers(0, alphabet, size=int(rng.integers(1, 160)))]
        ngram_max = int(rng.integers(1, 6))
        ref = Lookup(ngram_max=ngram_max, ngram_min=1)
        for end in range(1, len(hist) + 1):
            max_n = int(rng.integers(1, 40))
            want = ref.lookup_match(hist[:end], max_n)
            got = _native.lookup(hist[:end], 1, ngram_max, max_n)
            assert (list(got[0]), got[1], got[2] if want[1] else 0) == (want[0], want[1], want[2] if want[1] else 0), (trial, end)
    assert _native.match_confidence(3, 4) == match_confidence(3, 4)


def test_reference_at_realigns_a_prediction():
    """Where a request's prediction goes on (native/verify.hpp reference_at, the round's realignment): from the
    answer's length while the answer is the prediction's start, else after the longest suffix of the history found
    in it (min_match tokens at least, ties to the end nearest where the answer was expected), nowhere past its end."""
    ref = [10, 11, 12, 13, 5, 6, 7, 14, 15, 5, 6, 7, 16]
    prompt = [1, 2, 3]
    assert _native.reference_at(prompt, 0, ref, 0, 3, 64) == (0, 1)  # nothing answered yet: from the start
    assert _native.reference_at(prompt + ref[:4], 4, ref, 0, 3, 64) == (4, 4)  # the answer so far is its start
    assert _native.reference_at(prompt + ref, len(ref), ref, 0, 3, 64) == (-1, len(ref))  # all of it answered
    changed = prompt + [10, 11, 99, 5, 6, 7]  # left it, then came back: both copies of 5 6 7 match 3 tokens
    assert _native.reference_at(changed, 6, ref, 7, 3, 64) == (7, 3)
    assert _native.reference_at(changed, 6, ref, 12, 3, 64) == (12, 3)  # the tie goes to the nearer end
    assert _native.reference_at(changed, 6, ref, 7, 4, 64)[0] == -1  # shorter than min_match: nowhere
    longer = prompt + [13, 5, 6, 7]  # 4 tokens match before the first copy, 3 before the second
    assert _native.reference_at(longer, 4, ref, 12, 1, 64) == (7, 4)  # the longest match wins, however far
    assert _native.reference_at(longer, 4, ref, 12, 2, 2) == (12, 2)  # counted up to cap: a tie again
    with pytest.raises(ValueError):
        _native.reference_at(prompt, 4, ref, 0, 3, 64)


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


class PyLookup(DrafterBase):
    """Prompt lookup written in Python (the reference index): the loop calls it once a round."""

    name = "pylookup"
    free_offers = True

    def __init__(self) -> None:
        self.ref = Lookup(ngram_max=4, ngram_min=1)

    def begin(self, prompt):
        self.ref.begin(prompt)

    def offer(self, history, max_n):
        cont, n, length = self.ref.lookup_match(history, max_n)
        if length < _native.LOOKUP_MIN_MATCH:  # the loop's floor: no offer on a shorter match
            cont = []
        return Offer(len(cont), match_confidence(n, 4) if cont else 0.0, tokens=tuple(cont), match=length if cont else 0)

    def propose(self, history, want_more, max_n, params, rng, source=-2):
        prop = Proposal(source=self.name)
        cont, n, length = self.ref.lookup_match(history, max_n)
        if length < _native.LOOKUP_MIN_MATCH or not cont or max_n <= 0 or not want_more(0, 1.0):
            return prop
        for i, tok in enumerate(cont):
            if i and not want_more(i, match_confidence(n, 4)):
                break
            prop.add(tok, None, match_confidence(n, 4))
        return prop


@pytest.mark.parametrize("controller", ["fixed:4", "cost-ts"])
def test_a_python_drafter_runs_in_the_same_loop(tiny, controller):
    """A drafter written in Python, called once a round, gives the events of the loop's own form of the
    same rule (prompt lookup), greedy and sampled: the same verification and random stream. With cost-ts,
    drafting is priced out (a draft step taken to cost seconds: rounds are then the same whatever the
    Python call costs) and what counts is hindsight: the offers the Python drafter made are learned to the
    bit as the loop's own."""
    target, _ = tiny
    got, states = {}, {}
    for name, drafter in (("native", "lookup"), ("python", PyLookup())):
        with eesd_local.load(target, drafter=drafter, n_ctx=2048, controller=controller, seed=1) as eng:
            eng.store = None  # the same rule on both sides: the history alone, no earlier answers
            if controller == "cost-ts":
                eng.controller.fields["ema_t_draft"] = 1e3
            got[name] = [_events(eng, TINY_PROMPT, max_tokens=120, **kw)
                         for kw in (dict(), dict(temperature=0.9, seed=3), dict(temperature=0.7, top_k=20, top_p=0.9, seed=4))]
            if controller == "cost-ts":  # the match classes and the request ratio (in the first position)
                f = eng.controller.fields
                states[name] = np.concatenate([f["classes"], f["pos"][:1]])
    assert [[r[:4] for r in g[1]] for g in got["python"]] == [[r[:4] for r in g[1]] for g in got["native"]]
    assert [g[2] for g in got["python"]] == [g[2] for g in got["native"]]
    if controller == "cost-ts":
        assert eng.controller.fields["hindsight"] == 1.0
        assert np.array_equal(states["python"], states["native"])
    else:
        assert sum(g[2][4] for g in got["native"]) > 0, "nothing was drafted: the test would not test the drafter"


class Sampler(DrafterBase):
    """A Python drafter with a distribution of its own: q = the target's tiny twin's row, sampled."""

    name = "sampler"

    def __init__(self, fail: str = "") -> None:
        self.fail = fail

    def propose(self, history, want_more, max_n, params, rng, source=-2):
        prop = Proposal(source=self.name)
        if self.fail == "raise":
            raise RuntimeError("the drafter broke")
        n = min(3, max_n) if self.fail != "too-many" else max_n + 1
        q = np.full(512, 1.0 / 512)
        for i in range(n):
            if i < max_n and not want_more(i, 0.5):
                break
            tok = min(int(rng.random() * 512), 511)
            prop.add(tok, q if not params.greedy else None, 0.5)
        return prop


def test_a_python_drafter_with_its_own_distribution(tiny):
    """q arrays cross into the loop's speculative sampling; greedy output stays plain decoding's; a drafter's
    error is raised as itself, a malformed proposal as a ValueError that says what is wrong."""
    target, _ = tiny
    with eesd_local.load(target, drafter="none", n_ctx=2048) as eng:
        plain = eng.run(TINY_PROMPT, max_tokens=40).text
    with eesd_local.load(target, drafter=Sampler(), n_ctx=2048, controller="fixed:3") as eng:
        if eng.model.n_vocab != 512:
            pytest.skip("the tiny model's vocabulary is not 512")
        assert eng.run(TINY_PROMPT, max_tokens=40).text == plain
        a = eng.run(TINY_PROMPT, max_tokens=40, temperature=0.9, seed=5)
        b = eng.run(TINY_PROMPT, max_tokens=40, temperature=0.9, seed=5)
        assert a.text == b.text and a.stats.n_drafted > 0
    with eesd_local.load(target, drafter=Sampler("raise"), n_ctx=2048, controller="fixed:3") as eng:
        with pytest.raises(RuntimeError, match="the drafter broke"):
            eng.run(TINY_PROMPT, max_tokens=10)
    with eesd_local.load(target, drafter=Sampler("too-many"), n_ctx=2048, controller="fixed:3") as eng:
        with pytest.raises(ValueError, match="more than the"):
            eng.run(TINY_PROMPT, max_tokens=10)


def test_the_draft_model_twin_accepts_every_draft(tiny):
    """p == q (the target drafting for itself): every draft is accepted, greedy and sampled alike."""
    target, _ = tiny
    with eesd_local.load(target, drafter="draft-model", draft_model=target, n_ctx=2048, controller="fixed:4") as eng:
        for kw in (dict(), dict(temperature=0.9, seed=1)):
            s = eng.run(TINY_PROMPT, max_tokens=60, **kw).stats
            assert s.n_drafted > 0 and s.n_accepted == s.n_drafted


def test_kv_records_stay_consistent(tiny):
    target, draft = tiny
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


def test_a_missing_extension_is_an_error_at_load(tiny, monkeypatch):
    target, _ = tiny
    monkeypatch.setattr(native_ext, "load", lambda: (None, "no module named eesd_local._native"))
    with pytest.raises(EesdError, match="cannot load: no module named") as err:
        eesd_local.load(target, drafter="lookup", n_ctx=512)
    assert "pip install" in (err.value.hint or "")


def test_bad_input_raises_never_crashes(tiny):
    target, _ = tiny
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
            rounds.configure(state, 5, 0.0, 0, 1.0, 1, 0.05, np.zeros(1, dtype=np.uint8))
        with pytest.raises(ValueError, match="set_call"):
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
            rounds_mod.Rounds(eng.ctx, eng.drafter, eng.controller, SamplingParams(), TokenRNG(0), draft_max=8)


def test_context_full_through_the_native_loop(tiny):
    target, _ = tiny
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


def test_many_rounds_keep_memory_flat(tiny):
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1])

    target, _ = tiny
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


LONG_BATCH_MS = 600_000.0  # a batch this long ends only at max_tokens, an end of generation or a cancel


def _count_fetches(monkeypatch) -> list[int]:
    calls = [0]
    real = rounds_mod.Rounds._fetch

    def fetch(self, *a):
        calls[0] += 1
        return real(self, *a)

    monkeypatch.setattr(rounds_mod.Rounds, "_fetch", fetch)
    return calls


def test_batches_give_the_events_of_single_rounds(tiny, monkeypatch):
    """Batches of many rounds per call and one round per call give the same events, greedy and
    sampled, stopping at max_tokens inside a batch. The batches are ten minutes long, so they end at
    max_tokens or an end of generation however slow the machine (50 ms on a loaded CI machine gave
    about four rounds a call)."""
    target, draft = tiny
    calls = _count_fetches(monkeypatch)
    for kind, extra in (("lookup", {}), ("hierarchical", dict(draft_model=draft))):
        seen = {}
        for batch_ms in (LONG_BATCH_MS, 0.0):
            with eesd_local.load(target, drafter=kind, n_ctx=2048, controller="fixed:4", batch_ms=batch_ms, **extra) as eng:
                calls[0] = 0
                got = [_events(eng, TINY_PROMPT, max_tokens=150, **kw)
                       for kw in (dict(), dict(temperature=0.8, top_p=0.9, seed=5))]
                seen[batch_ms] = got, calls[0]
        (batched, n_batched), (single, n_single) = seen[LONG_BATCH_MS], seen[0.0]
        assert batched == single
        n_rounds = sum(g[2][3] for g in single)
        assert n_single == n_rounds and n_batched < n_rounds / 4, (n_batched, n_rounds)


def test_stop_string_inside_a_batch(tiny):
    """A stop string ends the answer where one round per call ends it, though the batch ran past it
    (a ten-minute batch runs to max_tokens)."""
    target, _ = tiny
    got = {}
    for batch_ms in (LONG_BATCH_MS, 0.0):
        with eesd_local.load(target, drafter="lookup", n_ctx=2048, controller="fixed:4", batch_ms=batch_ms) as eng:
            full = _events(eng, TINY_PROMPT, max_tokens=120)
            pieces = [t[1] for t in full[0]]
            at = next(i for i in range(40, len(pieces)) if pieces[i].strip())  # a piece with text, well inside
            stop = "".join(pieces[at - 1: at + 1])
            got[batch_ms] = _events(eng, TINY_PROMPT, max_tokens=120, stop=[stop])
    assert got[LONG_BATCH_MS] == got[0.0]
    assert got[0.0][2][0] == "stop" and got[0.0][2][2] < 120


def test_cancel_stops_a_running_batch(tiny):
    """cancel() from another thread ends the batch being run after its current round."""
    target, _ = tiny
    with eesd_local.load(target, drafter="none", n_ctx=4096, batch_ms=600_000.0) as eng:
        full = eng.run(TINY_PROMPT, max_tokens=100_000).stats.n_generated  # to the end of the context
        timer = threading.Timer(0.02, eng.cancel)
        timer.start()
        fin = eng.run(TINY_PROMPT, max_tokens=100_000)
        timer.join()
    assert fin.reason == "cancelled"
    assert 0 < fin.stats.n_generated < full - 100, (fin.stats.n_generated, full)


# --- a prediction (OpenAI's predicted outputs) --------------------------------------------


@pytest.mark.parametrize("drafter", ["none", "lookup", "auto"])
def test_a_prediction_drafts_and_changes_nothing(tiny, drafter):
    """The answer's expected tokens are proposed where the answer follows them, realigned after a stretch
    where it does not (an edit), and the output is the one without them, greedy and sampled."""
    target, _ = tiny
    with eesd_local.load(target, drafter=drafter, n_ctx=2048, controller="fixed:8") as eng:
        eng.store = None  # (the earlier answers would draft where the prediction does not: tested apart)
        want = eng.run(TINY_PROMPT, max_tokens=120)
        answer = [e.token for e in eng.generate(TINY_PROMPT, max_tokens=120) if isinstance(e, TokenEvent)]
        edited = answer[:40] + [7, 8, 9, 10, 11] + answer[50:]  # ten tokens replaced by five others
        got = eng.run(TINY_PROMPT, max_tokens=120, prediction=edited)
        assert got.text == want.text
        rounds, drafted, accepted = got.stats.by_source["prediction"]
        assert accepted >= 90 and drafted > accepted, got.stats.by_source  # it missed at the edit, then went on
        sampled = [eng.run(TINY_PROMPT, max_tokens=60, temperature=0.8, seed=9, prediction=edited) for _ in range(2)]
        assert sampled[0].text == sampled[1].text
        with pytest.raises(EesdError, match="prediction"):
            eng.run(TINY_PROMPT, max_tokens=4, prediction=[1, 2, 10**7])
        with pytest.raises(EesdError, match="prediction must be text"):
            eng.run(TINY_PROMPT, max_tokens=4, prediction=3.5)
        with pytest.raises(EesdError, match="the prediction has"):
            eng.run(TINY_PROMPT, max_tokens=4, prediction=[5] * 5000)


# --- earlier answers (lookup across requests) ----------------------------------------------


def test_the_store_finds_the_longest_earlier_match_and_the_most_frequent_continuation():
    store = _native.Store(1000, 3)
    store.add([1, 2, 3, 4, 5, 6, 7])
    store.add([9, 2, 3, 4, 8, 8])
    store.add([0, 2, 3, 4, 8, 1])
    cont, n, share = store.find([7, 7, 2, 3, 4], 3)  # 2 3 4 went on with 8 twice, with 5 once
    assert (cont, n) == ([8, 1], 3) and share == pytest.approx(2 / 3)
    cont, n, share = store.find([1, 2, 3, 4], 4)  # the longest match wins over the most frequent
    assert (cont, n, share) == ([5, 6, 7], 4, 1.0)
    assert store.find([5, 5, 5], 4)[1] == 0 and store.find([3, 4], 4)[1] == 0  # nothing, too short
    small = _native.Store(10, 2)
    for i in range(5):
        small.add([100 + i] * 3 + [i, i + 1])
    assert small.size <= 10 and small.entries == 2  # the oldest went
    assert small.find([104, 4], 2)[0] == [5] and small.find([100, 0], 2)[1] == 0


@pytest.mark.parametrize("drafter", ["lookup", "auto"])
def test_the_same_request_again_drafts_from_its_earlier_answer(tiny, drafter):
    target, _ = tiny
    prompt = [(7 * i) % 500 for i in range(120)]
    with eesd_local.load(target, drafter=drafter, n_ctx=2048, controller="fixed:8") as eng:
        first = eng.run(prompt, max_tokens=100)
        again = eng.run(prompt, max_tokens=100)
        assert again.text == first.text
        _, drafted, accepted = again.stats.by_source["earlier-answers"]
        assert accepted >= 80 and first.stats.by_source.get("earlier-answers") is None
        assert eng.store.entries == 2


@pytest.mark.parametrize("drafter", ["lookup", "auto"])
def test_lookup_drafts_only_after_a_match_of_the_floor(tiny, drafter):
    """Prompt lookup (and the store) bet a verify only where the context matches its source for at least
    LOOKUP_MIN_MATCH tokens: on a prompt full of short repeats, no round drafts at a shorter match, while
    shorter matches were there to draft on; the output is plain decoding's."""
    target, _ = tiny
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(300, 306, size=240)] + list(range(400, 440)) * 2  # short repeats, then a long one
    floor = _native.LOOKUP_MIN_MATCH
    with eesd_local.load(target, drafter=drafter, n_ctx=2048, controller="fixed:8") as eng:
        eng.store = None
        want = eng.run(prompt, max_tokens=80, prediction=None)
        tokens: list[int] = []
        short = drafted_long = 0
        for ev in eng.generate(prompt, max_tokens=80):
            if isinstance(ev, TokenEvent):
                tokens.append(ev.token)
            elif isinstance(ev, RoundEvent):  # (it comes before the tokens it emits)
                history = prompt + tokens
                cont, _, match = _native.lookup(history, 1, 4, 8)
                if ev.drafted and ev.source == "lookup":
                    assert match >= floor, (ev.index, match)
                    drafted_long += 1
                elif cont and match < floor:
                    short += 1
        assert short > 0 and drafted_long > 0  # both kinds of round came up
        assert eng.run(prompt, max_tokens=80).text == want.text
