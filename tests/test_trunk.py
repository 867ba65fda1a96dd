"""The shared trunk (eesd_local/trunk.py): the target split into trunk+exit and tail gives the
full model's logits bit for bit, the draft over V' keeps sampling exact, the engine runs on it
with no full-model context, and bad input fails cleanly with nothing half-written in the cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import eesd_local
from eesd_local.base.errors import EesdError
from eesd_local.base.paths import models_dir
from eesd_local.gguf import headfile, writer
from eesd_local.gguf import reader as ggufread
from eesd_local.llama import costs, trunk
from eesd_local.llama.runtime import Context, ContextParams, Model, common_prefix
from eesd_local.speculative.events import TokenEvent
from eesd_local.speculative.sampling import SamplingParams
from eesd_local.tools import heads
from tests.reference import probs

from .conftest import QWEN05
from .test_sampling import chi2_critical, chi2_stat, run_spec

pytest.importorskip("eesd_local._native", reason="the shared trunk's capture is in the native extension")

CHAT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "Explain what a hash map is and when a list is the better choice.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def pair(qwen05_path):
    """(full model context, split target) with the same n_ctx, threads and batch size."""
    params = ContextParams(n_ctx=1024, n_threads=2)
    full = Model(qwen05_path)
    fctx = Context(full, params)
    vocab_only = Model(qwen05_path, vocab_only=True)
    split = trunk.open_split(vocab_only, heads.find_head(qwen05_path), params)
    yield full, fctx, split
    split.close()
    fctx.close()
    vocab_only.close()
    full.close()


def test_split_logits_are_bit_identical_to_the_full_model(pair):
    full, fctx, split = pair
    fctx.clear()
    split.clear()
    prompt = full.tokenize(CHAT)
    fctx.decode(prompt)
    split.decode(prompt)
    assert np.array_equal(fctx.logits(), split.logits())
    tok = int(np.argmax(fctx.logits()))
    worst = 0.0
    for _ in range(200):  # plain rounds of a chat answer, row for row
        fctx.decode([tok])
        split.decode([tok])
        a, b = fctx.logits(), split.logits()
        worst = max(worst, float(np.abs(a - b).max()))
        tok = int(np.argmax(a))
    assert worst == 0.0
    assert split.n_past == fctx.n_past == len(prompt) + 200
    # a verify batch, then a rollback past part of it, then another batch
    batch = [tok, 13, 42, 100, 7]
    fctx.decode(batch, n_logits=5)
    split.decode(batch, n_logits=5)
    assert np.array_equal(fctx.logits_rows(), split.logits_rows())
    fctx.trim(fctx.n_past - 3)
    split.trim(split.n_past - 3)
    assert split.trunk.n_past == split.tail.n_past == fctx.n_past
    fctx.decode([5, 6], n_logits=2)
    split.decode([5, 6], n_logits=2)
    assert np.array_equal(fctx.logits_rows(), split.logits_rows())


def test_drafted_rows_are_reused_by_the_verify(pair):
    full, fctx, split = pair
    split.clear()
    prompt = full.tokenize(CHAT)
    split.decode(prompt)
    base = split.n_past
    # the drafter decodes on the trunk (exit logits over V'); the verify then takes those rows
    split.trunk.decode([13])
    ahead = split.trunk.tokens[base:]
    assert split.trunk.n_past == base + 1 and split.tail.n_past == base
    calls = []
    real = Context.decode

    def counting(self, tokens, **kw):
        calls.append((self is split.trunk, list(tokens)))
        return real(self, tokens, **kw)

    try:
        Context.decode = counting  # type: ignore[method-assign]
        split.decode(ahead + [42], n_logits=2)
    finally:
        Context.decode = real  # type: ignore[method-assign]
    assert calls[0] == (True, [42])  # only the token the trunk had not seen
    assert calls[1] == (False, ahead + [42])
    split.clear()


def test_draft_rows_cover_only_v_prime_and_sampling_stays_exact(pair):
    full, fctx, split = pair
    split.clear()
    prompt = full.tokenize(CHAT)
    split.trunk.decode(prompt, n_logits=1)  # the draft's distribution after the prompt ...
    q_row = split.trunk.logits()
    split.decode(prompt)  # ... and the target's (the trunk's rows are reused)
    p_row = split.logits().copy()
    vocab = split.trunk.vocab
    assert len(vocab) == trunk.DRAFT_VOCAB < full.n_vocab
    outside = np.ones(full.n_vocab, bool)
    outside[vocab] = False
    assert np.isneginf(q_row[outside]).all() and np.isfinite(q_row[vocab]).all()
    params = SamplingParams(temperature=3.0, top_k=50)  # flat enough for the test to have many bins
    assert probs(q_row, SamplingParams(temperature=1.0))[outside].sum() == 0.0
    # speculative sampling with the real V' draft keeps the target's distribution (chi-square)
    split.decode([int(np.argmax(p_row))])
    p2 = split.logits().copy()
    first, second, acc = run_spec(p_row, p2, q_row, params, seed=4)
    assert acc > 0.05
    for counts, p in ((first, probs(p_row, params)), (second, probs(p2, params))):
        stat, df = chi2_stat(counts, p)
        assert df >= 10 and stat < chi2_critical(df), f"chi2 {stat:.1f} over {df} dof"
    split.clear()


@pytest.mark.model
def test_the_engine_runs_eesd_on_the_split_target(monkeypatch):
    with eesd_local.load(QWEN05, drafter="eesd", n_ctx=1024, controller="fixed:3") as eng:
        assert isinstance(eng.ctx, trunk.SplitTarget) and eng.trunk is eng.ctx.trunk
        assert eng.model.vocab_only  # no full-model weights or context: the trunk and the tail are the target
        fin = eng.run(CHAT, max_tokens=40)
        assert fin.stats.n_drafted > 0 and 0 < fin.stats.n_generated <= 40
        assert eng.ctx.trunk.n_past == eng.ctx.tail.n_past  # rolled back together
        # switching drafters keeps the split target; eesd again drafts on the same trunk
        eng.set_drafter("lookup")
        eng.set_drafter("eesd")
        assert eng.drafter.ctx is eng.trunk
        toks = [e.token for e in eng.generate(CHAT, max_tokens=12) if isinstance(e, TokenEvent)]
        assert 0 < len(toks) <= 12
    with eesd_local.load(QWEN05, drafter="eesd", n_ctx=1024, shared_trunk=False) as eng:
        assert not isinstance(eng.ctx, trunk.SplitTarget) and eng.trunk is None
    # auto holds no exit head where it cannot pay (a CPU's steep B(k)): no split, no draft; asked, it splits
    steep = costs.CostProfile(20.0, {k: float(k) for k in costs.KS}, {})
    monkeypatch.setattr(costs, "cached", lambda fp: (steep, ""))
    monkeypatch.setattr(costs, "profile", lambda model, **kw: steep)
    with eesd_local.load(QWEN05, drafter="auto", n_ctx=1024) as eng:
        assert eng.trunk is None and not eng.model.vocab_only and eng.drafter.name == "lookup"
    with eesd_local.load(QWEN05, drafter="auto", n_ctx=1024, shared_trunk=True) as eng:
        assert eng.trunk is not None and eng.drafter.model.ctx is eng.trunk


def test_a_split_target_keeps_idle_prompts_in_ram_and_answers_as_the_whole_model(qwen05_path):
    """--cache-ram with the exit head on (auto's choice where B(k) is flat enough): conversations that take
    turns come back from RAM, the trunk's state and the tail's together, and every answer is the whole
    model's, fresh (until 2026-11-29 a split target kept no prompt cache: each conversation's later turn
    was prefilled from its first token)."""
    def chat(user: str, more: str = "") -> str:
        return (f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                f"<|im_start|>assistant\n{more}")
    firsts = ["Write a Python function that reverses a linked list.", "What is the capital of Australia? Say why.",
              "List five uses of a hash map."]
    convs = [[chat(u), chat(u, "Here it is.<|im_end|>\n<|im_start|>user\nNow make it shorter.<|im_end|>\n"
                          "<|im_start|>assistant\n")] for u in firsts]
    order = [(c, t) for t in range(2) for c in range(3)]  # A1 B1 C1 A2 B2 C2
    with eesd_local.load(qwen05_path, drafter="none", n_ctx=1024, shared_trunk=False) as eng:
        fresh = {}
        for c, t in order:
            eng.forget_prompts()
            fresh[c, t] = eng.run(convs[c][t], max_tokens=16).text
        tokens = {k: eng.tokenize(convs[k[0]][k[1]]) for k in order}
    with eesd_local.load(qwen05_path, drafter="eesd", n_ctx=1024, shared_trunk=True, controller="fixed:3") as eng:
        assert isinstance(eng.ctx, trunk.SplitTarget) and eng.prompt_cache is not None
        for c, t in order:
            fin = eng.run(convs[c][t], max_tokens=16)
            assert fin.text == fresh[c, t], (c, t)
            assert eng.ctx.trunk.n_past == eng.ctx.tail.n_past
            if t:  # the conversation's first turn came back from RAM, though two others ran in between
                shared = common_prefix(tokens[c, 0], tokens[c, 1])
                assert fin.stats.n_cached >= shared - 1, (c, fin.stats.n_cached, shared)
        assert len(eng.prompt_cache) >= 2


# --- bad input -------------------------------------------------------------------------


def test_unsupported_architecture_and_exit_layer(gemma_path, qwen05_path, isolated_home):
    with pytest.raises(EesdError, match="shared trunk runs qwen2 and llama"):
        trunk.build_tail(gemma_path, 2)
    n_layer = headfile.model_info(qwen05_path)["n_layer"]
    with pytest.raises(EesdError):
        trunk.build_tail(qwen05_path, n_layer)  # N >= L: nothing would be left for the tail
    assert not list((isolated_home / "drafts").glob("*.gguf")) if (isolated_home / "drafts").exists() else True


def test_head_for_another_model_and_corrupt_head(qwen05_path, isolated_home, tmp_path):
    vocab = np.arange(1000, dtype=np.int32)
    other = models_dir() / "qwen2.5-coder-1.5b-instruct.exit6.gguf"
    with pytest.raises(EesdError, match="was made for"):
        trunk.build_trunk(qwen05_path, other, vocab)
    head = heads.find_head(qwen05_path)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(head.read_bytes()[: head.stat().st_size // 2])
    with pytest.raises(EesdError):
        trunk.build_trunk(qwen05_path, bad, vocab)
    assert not list((isolated_home / "drafts").glob("*trunk*"))


@pytest.mark.parametrize("failure", ["ctrl-c", "full-disk"])
def test_an_interrupted_derivation_leaves_nothing_and_the_next_run_rebuilds(qwen05_path, isolated_home, monkeypatch,
                                                                           failure):
    vocab = np.arange(1000, dtype=np.int32)
    head = heads.find_head(qwen05_path)
    real = writer.write_from

    def breaking(path, base, **kw):
        Path(path).write_bytes(b"GGUF" + b"\0" * 4096)  # part of the file is written, then the failure
        if failure == "ctrl-c":
            raise KeyboardInterrupt
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_from", breaking)
    if failure == "ctrl-c":
        with pytest.raises(KeyboardInterrupt):
            trunk.build_trunk(qwen05_path, head, vocab)
    else:
        with pytest.raises(EesdError, match="No space left"):
            trunk.build_trunk(qwen05_path, head, vocab)
    drafts = isolated_home / "drafts"
    assert list(drafts.iterdir()) == []  # neither the file nor its temp
    monkeypatch.setattr(writer, "write_from", real)
    path = trunk.build_trunk(qwen05_path, head, vocab)
    h = ggufread.read_header(path)
    assert h.tensors["token_embd.weight"].dims[1] == 1000 and h.kv["tokenizer.ggml.model"] == "none"


def test_a_head_for_another_model_is_one_error_line(qwen05_path, isolated_home):
    other = models_dir() / "qwen2.5-coder-1.5b-instruct.exit6.gguf"
    exe = shutil.which("eesd", path=os.path.dirname(sys.executable))
    assert exe
    r = subprocess.run([exe, "generate", "--model", str(qwen05_path), "--drafter", "eesd", "--head", str(other),
                        "--prompt", "hi", "--max-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("eesd: error:")]
    assert len(errors) == 1 and "was made for" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_memory_bound_share_counts_trunk_exit_block_and_vprime_rows(qwen05_path, isolated_home):
    """s of the eval's projection: blocks 0..N-1 of the base + the exit block + the V' rows, over the
    bytes a target step reads."""
    from eesd_local.tools.heads.evaluate import memory_bound_share  # noqa: PLC0415 - the training extra's module

    vocab = np.arange(1000, dtype=np.int32)
    head = heads.find_head(qwen05_path)
    n = int(headfile.read_head_info(head)["exit_layer"])
    base = ggufread.read_header(qwen05_path)
    built = ggufread.read_header(trunk.build_trunk(qwen05_path, head, vocab))
    blocks = sum(t.nbytes for name, t in base.tensors.items() if name.startswith("blk.") and int(name.split(".")[1]) < n)
    exit_block = sum(t.nbytes for name, t in built.tensors.items() if name.startswith(f"blk.{n}."))
    parts = blocks + exit_block + built.tensors["token_embd.weight"].nbytes + built.tensors["output_norm.weight"].nbytes
    s = memory_bound_share(qwen05_path, head, vocab)
    assert abs(s - parts / ggufread.bytes_read_per_token(qwen05_path)) < 1e-9
    assert 0.1 < s < 0.5
