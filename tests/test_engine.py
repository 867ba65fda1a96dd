"""The speculative engine on the real demo model: the target as its own drafter, provenance,
cancellation, bad input, the Python API. (Greedy output equal to plain decoding: test_exact.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import eesd_local
from eesd_local.base.errors import EesdError
from eesd_local.llama import costs
from eesd_local.speculative.events import FinishEvent, RoundEvent, TokenEvent
from eesd_local.tools import heads

from .conftest import QWEN05

pytestmark = pytest.mark.model  # every test here loads a demo model

PROMPTS = [json.loads(line) for line in (Path(__file__).parent / "data" / "lossless_prompts.jsonl").read_text().splitlines()]
MAX_TOKENS = 32


def _tokens(engine, prompt, **kw):
    evs = list(engine.generate(prompt, **kw))
    return [e.token for e in evs if isinstance(e, TokenEvent)], evs


@pytest.fixture(scope="module")
def plain():
    with eesd_local.load(QWEN05, drafter="none", n_ctx=2048) as eng:
        prompts = [eng.tokenize(eng.apply_chat_template(p["messages"])) for p in PROMPTS]
        outs = {2: _tokens(eng, prompts[2], max_tokens=MAX_TOKENS)[0]}  # plain answers of the prompts a test compares
        yield eng, prompts, outs


def test_target_as_its_own_drafter_accepts_everything_when_sampling(plain):
    """p == q makes min(1, p/q) == 1: every draft of the target itself is accepted. (Greedy: tests/test_exact.py.)"""
    eng0, prompts, outs = plain
    with eesd_local.load(QWEN05, n_ctx=2048, drafter="draft-model", draft_model=QWEN05, controller="fixed:4") as eng:
        fin = eng.run(prompts[0], max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=5)
        assert fin.stats.n_drafted > 0 and fin.stats.n_accepted == fin.stats.n_drafted


def test_rounds_and_provenance(plain):
    eng0, prompts, _ = plain
    with eesd_local.load(QWEN05, n_ctx=2048, drafter="lookup", controller="fixed:6") as eng:
        # a sentence asked back word for word: lookup pays (it offers on matches of LOOKUP_MIN_MATCH tokens or more);
        # the answer ends by length, before the sentence does (drafts accepted past an end of text are not emitted)
        copy = "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank."
        evs = list(eng.generate(eng.tokenize(eng.apply_chat_template([{"role": "user", "content": copy}])), max_tokens=12))
    toks = [e for e in evs if isinstance(e, TokenEvent)]
    rounds = [e for e in evs if isinstance(e, RoundEvent)]
    fin = evs[-1]
    assert isinstance(fin, FinishEvent)
    assert {e.source for e in toks} <= {"draft", "target", "bonus"}
    assert sum(e.source == "draft" for e in toks) == fin.stats.n_accepted > 0
    assert fin.stats.n_generated == len(toks) <= 1 + sum(r.emitted for r in rounds)
    assert fin.stats.tau == pytest.approx((fin.stats.n_accepted + len(rounds)) / len(rounds))
    assert "".join(e.text for e in toks) == fin.text


def test_cancel_leaves_cache_consistent(plain):
    eng0, prompts, outs = plain
    with eesd_local.load(QWEN05, n_ctx=2048, drafter="draft-model", draft_model=QWEN05, controller="fixed:4") as eng:
        gen = eng.generate(prompts[1], max_tokens=MAX_TOKENS)
        for ev in gen:
            if isinstance(ev, RoundEvent) and ev.index == 3:
                break
        gen.close()  # cancel mid-answer: the rollback in the engine's finally runs
        assert eng.ctx.n_past < len(prompts[1]) + MAX_TOKENS
        got, _ = _tokens(eng, prompts[2], max_tokens=MAX_TOKENS)
    assert got == outs[2]


def test_context_full_stops_with_reason_context():
    with eesd_local.load(QWEN05, n_ctx=256, drafter="lookup") as eng:
        n_ctx = eng.ctx.n_ctx  # llama.cpp may round the size up
        unit = eng.tokenize("def f(x):\n    return x\n")
        prompt = (unit * n_ctx)[: n_ctx - 20]
        fin = eng.run(prompt, max_tokens=200)
        assert fin.reason == "context"
        assert 0 < fin.stats.n_generated <= 21  # the last token need not fit: it is emitted, not cached
        assert len(prompt) + fin.stats.n_generated <= n_ctx + 1
        with pytest.raises(EesdError, match="context holds"):
            eng.run("word " * (n_ctx + 10), max_tokens=4)


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(max_tokens=0)])
def test_invalid_sampling_values(plain, kw):
    eng0, prompts, _ = plain
    with pytest.raises(EesdError):
        eng0.generate(prompts[0], **kw)


def test_draft_model_with_another_vocabulary_is_refused(gemma_path):
    with pytest.raises(EesdError, match="vocabulary"):
        eesd_local.load(QWEN05, drafter="draft-model", draft_model=str(gemma_path), n_ctx=512)


def test_unknown_drafter_and_controller():
    with pytest.raises(EesdError, match="drafter"):
        eesd_local.load(QWEN05, drafter="magic")
    with pytest.raises(EesdError, match="controller"):
        eesd_local.load(QWEN05, drafter="lookup", controller="bogus")


def test_openai_shaped_api(plain):
    with eesd_local.load(QWEN05, n_ctx=2048, drafter="lookup") as llm:
        out = llm.create_chat_completion([{"role": "user", "content": "Say hello in French."}], max_tokens=16)
        assert out["object"] == "chat.completion"
        msg = out["choices"][0]["message"]
        assert msg["role"] == "assistant" and msg["content"]
        assert out["usage"]["completion_tokens"] <= 16
        assert {"tau", "acceptance_rate", "drafter"} <= set(out["speculation"])
        chunks = list(llm.create_chat_completion([{"role": "user", "content": "Say hello in French."}], max_tokens=16, stream=True))
        streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert streamed == msg["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        comp = llm.create_completion("def fibonacci(n):", max_tokens=24, stop=["\n\n"])
        assert "\n\n" not in comp["choices"][0]["text"]


def test_auto_tells_which_drafter_runs(qwen05_path, monkeypatch):
    # a machine where a batch costs about one token (a GPU's B(k)): the exit head could pay, so auto holds
    # it (where it cannot, auto is lookup itself: tests/test_costs.py)
    flat = costs.CostProfile(20.0, {k: 1.0 + 0.02 * (k - 1) for k in costs.KS}, {})
    monkeypatch.setattr(costs, "cached", lambda fp: (flat, ""))
    monkeypatch.setattr(costs, "profile", lambda model, **kw: flat)
    with eesd_local.load(QWEN05, n_ctx=512) as eng:
        head = heads.find_head(qwen05_path)
        assert eng.drafter.name == ("auto(lookup+eesd)" if head else "auto(lookup)")
        assert ("exit head, chosen per round" if head else "no exit head is known") in eng.drafter_note
        # with a head, the controller chooses between two sources; without one it sizes lookup's drafts
        assert eng.controller.state[0] == (5 if head else 4)
        eng.set_drafter("lookup")  # one source: the controller is rebuilt for it
        assert eng.controller.state[0] == 4 and eng.drafter.name == "lookup"
        eng.set_drafter("auto")
        assert eng.controller.state[0] == (5 if head else 4)


def test_speculative_sampling_is_seeded(plain):
    eng0, prompts, _ = plain
    with eesd_local.load(QWEN05, n_ctx=2048, drafter="lookup", controller="fixed:4") as eng:
        a = eng.run(prompts[15], max_tokens=24, temperature=0.8, seed=11).text
        b = eng.run(prompts[15], max_tokens=24, temperature=0.8, seed=11).text
    assert a == b
