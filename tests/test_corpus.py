"""The teacher corpus (eesd_local.tools.heads.corpus): shard format, damage, foreign shards, concurrent readers, resume.

The format tests use synthetic answers; the grow tests run llama.cpp on the tiny random qwen2 model of
test_heads (the demo model's tokenizer, 4 blocks of width 64: it answers in a blink); one test grows two
short answers with the real 0.5B demo model. Those skip when the demo model is not in the cache.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

from eesd_local.base.errors import EesdError
from eesd_local.cli import main
from eesd_local.gguf.headfile import read_head_info
from eesd_local.llama.runtime import Model
from eesd_local.tools.heads import corpus, shards, targets
from eesd_local.tools.heads.corpus import Answer, CorpusWarning, ModelStamp
from eesd_local.tools.heads.teacher import chat_formatter

from .test_heads import DEMO, needs_demo, write_tiny_model

STAMP = ModelStamp("a" * 32, "Model A", "a.gguf", 151_936)
OTHER = ModelStamp("b" * 32, "Model B", "b.gguf", 151_936)
SETTINGS = {"greedy": True, "max_new": 320, "n_parallel": 48}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("EESD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EESD_CORPUS", str(tmp_path / "corpus-root"))


def _answers(n: int, seed: int = 0, n_vocab: int = STAMP.n_vocab, prefix: str = "sharegpt") -> list[Answer]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        toks = rng.integers(0, n_vocab, size=int(rng.integers(1, 300)), dtype=np.int32)
        out.append(Answer(f"{prefix}:{seed * 1000 + i}", corpus.prompt_sha([i, seed]), int(rng.integers(20, 384)), toks, bool(i % 2)))
    return out


def _same(a: list[Answer], b: list[Answer]) -> None:
    assert [(x.source, x.prompt_sha, x.n_prompt, x.finished) for x in a] == [(x.source, x.prompt_sha, x.n_prompt, x.finished) for x in b]
    for x, y in zip(a, b):
        assert x.tokens.dtype == np.int32 and np.array_equal(x.tokens, y.tokens)


def test_token_codec_round_trips():
    ids = np.array([0, 1, 255, 256, 65535, 65536, 151_645, (1 << 31) - 1], np.int32)
    assert np.array_equal(corpus.decode_tokens(corpus.encode_tokens(ids), len(ids)), ids)
    with pytest.raises(ValueError):
        corpus.decode_tokens(corpus.encode_tokens(ids), len(ids) + 1)


def test_shards_round_trip(tmp_path):
    first, second = _answers(40, seed=1), _answers(25, seed=2, prefix="code")
    p1 = corpus.write_shard(tmp_path, STAMP, SETTINGS, first)
    p2 = corpus.write_shard(tmp_path, STAMP, SETTINGS, second)
    assert p1.name.startswith("shard-00001-") and p2.name.startswith("shard-00002-")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is skipped
        c = corpus.read_corpus(tmp_path, model=STAMP)
    _same(c.answers, first + second)
    assert c.shards[0].header["settings"] == SETTINGS and c.shards[0].header["model"]["fingerprint"] == STAMP.fingerprint
    st = c.stats()
    tokens = sum(len(a.tokens) for a in first + second)
    assert (st["shards"], st["answers"], st["tokens"], st["sources"]) == (2, 65, tokens, {"sharegpt": 40, "code": 25})
    assert st["bytes"] == p1.stat().st_size + p2.stat().st_size
    assert st["bytes_per_1m_tokens"] == round(st["bytes"] / tokens * 1e6)


def test_an_answer_seen_twice_counts_once(tmp_path):
    a = _answers(5, seed=3)
    corpus.write_shard(tmp_path, STAMP, SETTINGS, a)
    corpus.write_shard(tmp_path, STAMP, SETTINGS, a[2:])  # a clone that grew apart answered the same prompts
    c = corpus.read_corpus(tmp_path, model=STAMP)
    _same(c.answers, a)
    assert c.duplicates == 3


def _damaged(raw: bytes) -> dict[str, bytes]:
    n_head = int.from_bytes(raw[8:12], "little")
    flipped = bytearray(raw)
    flipped[len(raw) - 40] ^= 0x10
    header_broken = bytearray(raw)
    header_broken[12] = ord("[")
    return {
        "empty": b"",
        "in the magic": raw[:5],
        "in the header": raw[: 12 + n_head // 2],
        "in the payload": raw[: len(raw) - 100],
        "one flipped bit": bytes(flipped),
        "a broken header": bytes(header_broken),
        "another format": raw.replace(b'"format": 1', b'"format": 9', 1),
    }


@pytest.mark.parametrize("damage", list(_damaged(b"EESDCORP\x10\x00\x00\x00" + b"x" * 200)))
def test_a_damaged_shard_is_skipped_with_a_warning(tmp_path, damage):
    good = _answers(10, seed=4)
    corpus.write_shard(tmp_path, STAMP, SETTINGS, good)
    victim = corpus.write_shard(tmp_path, STAMP, SETTINGS, _answers(10, seed=5))
    victim.write_bytes(_damaged(victim.read_bytes())[damage])
    later = _answers(3, seed=6)
    corpus.write_shard(tmp_path, STAMP, SETTINGS, later)
    with pytest.warns(CorpusWarning, match=victim.name):
        c = corpus.read_corpus(tmp_path, model=STAMP)
    _same(c.answers, good + later)  # the damaged shard contributes nothing, the others everything
    assert [p for p, _ in c.skipped] == [victim]


def test_a_shard_of_another_model_is_refused_naming_both(tmp_path):
    corpus.write_shard(tmp_path, OTHER, SETTINGS, _answers(3))
    with pytest.raises(EesdError) as exc:
        corpus.read_corpus(tmp_path, model=STAMP)
    msg = exc.value.message
    assert "\n" not in msg and OTHER.label() in msg and STAMP.label() in msg
    corpus.write_shard(tmp_path, STAMP, SETTINGS, _answers(3, seed=1))
    with pytest.raises(EesdError, match="Model B"):  # without a model: the shards must agree among themselves
        corpus.read_corpus(tmp_path)


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    small = ModelStamp(STAMP.fingerprint, STAMP.name, STAMP.file, 1000)
    bad = _answers(3, n_vocab=STAMP.n_vocab)
    with pytest.raises(EesdError, match="outside the vocabulary"):  # the writer refuses them
        corpus.write_shard(tmp_path, small, SETTINGS, bad)
    with pytest.raises(EesdError, match="outside the vocabulary"):
        corpus.write_shard(tmp_path, STAMP, SETTINGS, [Answer("code:x", "0" * 16, 5, np.array([-1, 3], np.int32), True)])
    # a shard whose ids exceed the reader's vocabulary (written as if by a larger one) is skipped, never trained on
    corpus.write_shard(tmp_path, STAMP, SETTINGS, bad)
    with pytest.warns(CorpusWarning, match="outside the vocabulary"):
        c = corpus.read_corpus(tmp_path, model=small)
    assert c.answers == [] and len(c.skipped) == 1


def test_reading_while_a_writer_renames_shards_in(tmp_path):
    # a dead writer's temporary file and a live one's half-written file are never listed
    (tmp_path / ".shard-00007-deadbeef.bin.tmp-999999999").write_bytes(b"EESDCORP" + b"\x00" * 10)
    written: list[Path] = []
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for k in range(40):
                written.append(corpus.write_shard(tmp_path, STAMP, SETTINGS, _answers(4, seed=100 + k)))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    t = threading.Thread(target=writer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a half-written shard would be skipped with a warning: it must never be seen
        t.start()
        seen = 0
        while t.is_alive() or seen < 40:
            c = corpus.read_corpus(tmp_path, model=STAMP)
            assert len(c.shards) >= seen and len(c.answers) == 4 * len(c.shards)
            seen = len(c.shards)
        t.join()
    assert not errors and seen == 40 and len(set(written)) == 40


def test_one_grower_per_corpus(tmp_path):
    with corpus.grow_lock(tmp_path):
        with pytest.raises(EesdError, match=f"pid {os.getpid()}"):
            with corpus.grow_lock(tmp_path):
                pass
    with corpus.grow_lock(tmp_path):  # released
        pass


# --- growing, with llama.cpp ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not DEMO.is_file():
        pytest.skip("demo model not in the cache")
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-corpus.gguf", 7)


@pytest.fixture(scope="module")
def prompts():
    return corpus.prompt_items()[:12]


@needs_demo
def test_minutes_stop_new_prompts_only_on_a_rate_measured_over_ended_answers():
    """--minutes: no new prompt once one would not be answered in time, but judged only after an answer
    has ended (before that the rate counts prompts being prefilled: a slow model's first minute projected
    43 minutes an answer and stopped a 22-minute run after its first batch), and judged again every step."""
    deadline = 1000.0
    assert not corpus.time_is_short(100.0, deadline, 2600.0, answers_ended=0)  # every sequence still prefilling
    assert corpus.time_is_short(100.0, deadline, 2600.0, answers_ended=3)
    assert not corpus.time_is_short(100.0, deadline, 300.0, answers_ended=3)  # the rate recovered: admit again
    assert corpus.time_is_short(800.0, deadline, 300.0, answers_ended=40)


def test_grow_resumes_after_an_interruption(tiny, prompts, tmp_path):
    folder = tmp_path / "c"
    cfg = corpus.GrowConfig(n_parallel=3, max_new=6, max_prompt=2048, shard_tokens=12)  # a shard every two answers

    def interrupt_after_two(d: dict) -> None:
        if d["answers"] >= 2 and not d["stop"]:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does; grow turns it into a clean stop

    first = corpus.grow(tiny, folder, cfg, items=prompts, progress=interrupt_after_two)
    assert first.stop == "interrupted" and first.signum == signal.SIGINT and 2 <= first.answers < len(prompts)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    # what a kill -9 in the middle of writing leaves: a temporary file of a dead process, and a truncated shard
    (folder / ".shard-00099-00000000.bin.tmp-999999999").write_bytes(b"EESDCORP")
    last = corpus.shard_paths(folder)[-1]
    lost = {a.source for a in corpus.read_shard(last).answers}
    last.write_bytes(last.read_bytes()[:-7])
    with pytest.warns(CorpusWarning, match="truncated"):
        second = corpus.grow(tiny, folder, cfg, items=prompts)
    assert second.stop == "prompts"
    with pytest.warns(CorpusWarning):
        c = corpus.read_corpus(folder, model=ModelStamp.of(tiny))
    sources = [a.source for a in c.answers]
    assert sorted(sources) == sorted(it.id for it in prompts) and c.duplicates == 0  # each prompt answered once
    assert lost <= {a.source for s in c.shards[-len(second.shards):] for a in s.answers}  # answered again
    assert all(len(a.tokens) == 6 or a.finished for a in c.answers)
    assert c.shards[0].header["settings"]["n_parallel"] == 3 and c.shards[0].header["settings"]["max_new"] == 6


@needs_demo
def test_cli_grow_stops_at_the_size_budget_and_info_reports(tiny, capsys):
    folder = corpus.corpus_root() / "c"
    args = ["heads", "corpus", "grow", "--model", str(tiny), "--corpus", str(folder), "--n-parallel", "2", "--max-new", "4"]
    assert main([*args, "--max-mb", "0.0001"]) == 0
    err = capsys.readouterr().err
    assert "size budget is reached" in err
    st = corpus.read_corpus(folder).stats()
    assert st["answers"] == 2 and st["tokens"] <= 8
    assert main([*args, "--max-mb", "0.0001"]) == 0  # over budget already: stops before loading the model
    assert "size budget is reached" in capsys.readouterr().err and corpus.read_corpus(folder).stats()["answers"] == 2
    assert main(["heads", "corpus", "info", "--model", str(tiny), "--corpus", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "answers   2 " in out and "bytes per token" in out and ("sharegpt" in out or "code" in out)
    assert main(["heads", "corpus", "info", "--json"]) == 0  # every corpus under models/corpus (here EESD_CORPUS)
    (st,) = json.loads(capsys.readouterr().out)
    assert (st["folder"], st["answers"], st["fingerprint_checked"]) == (str(folder), 2, False)
    assert main(["heads", "corpus", "grow", "--model", str(tiny), "--corpus", str(folder), "--n-parallel", "0"]) == 2
    assert "--n-parallel must be an integer from 1" in capsys.readouterr().err


@pytest.mark.model
@needs_demo
def test_real_model_answers_two_prompts(prompts, tmp_path):
    folder = tmp_path / "c"
    cfg = corpus.GrowConfig(n_parallel=2, max_new=8, max_prompt=2048)
    report = corpus.grow(DEMO, folder, cfg, items=prompts[:2])
    assert (report.answers, report.stop) == (2, "prompts")
    c = corpus.read_corpus(folder, model=ModelStamp.of(DEMO))
    render = chat_formatter(DEMO)
    model = Model(DEMO, vocab_only=True)
    try:
        for a, item in zip(c.answers, prompts[:2]):
            assert a.source == item.id and len(a.tokens) == 8 and not a.finished
            rebuilt = model.tokenize(render([{"role": r, "content": t} for r, t in item.messages]), add_special=False)
            assert corpus.prompt_sha(rebuilt) == a.prompt_sha and len(rebuilt) == a.n_prompt
    finally:
        model.close()


@needs_demo
def test_training_reads_the_corpus_with_hard_targets(tiny, prompts, tmp_path, capsys):
    """The corpus' answers become the trainer's shards: prompt rebuilt and checked against its sha256,
    the row before each answer token holds that token (the greedy choice), prompt rows no target; an
    answer whose prompt no longer rebuilds is left out and counted; an unchanged corpus is not rebuilt;
    then `eesd heads train --corpus` trains a head from it and the head says so."""
    pytest.importorskip("torch")
    folder = tmp_path / "c"
    cfg = corpus.GrowConfig(n_parallel=3, max_new=12, max_prompt=2048)
    corpus.grow(tiny, folder, cfg, items=prompts[:6])
    stamp = ModelStamp.of(tiny)
    stale = Answer(prompts[6].id, corpus.prompt_sha([1, 2, 3]), 3, np.asarray([5, 6], np.int32), False)
    corpus.write_shard(folder, stamp, SETTINGS, [stale])
    root = tmp_path / "targets"
    got = targets.build(tiny, folder, root)
    assert got.answers == 6 and got.left_out == {"its prompt rebuilds to other tokens": 1}
    answers = {a.source: a for a in corpus.read_corpus(folder).answers}
    (shard,) = shards.shard_paths(got.folder)
    with np.load(shard) as z:
        offsets, n_prompt, ids_, tokens = z["offsets"], z["n_prompt"], z["topk_ids"], z["tokens"]
        sources = [str(x) for x in z["ids"]]
    for i, src in enumerate(sources):
        a, b, n = int(offsets[i]), int(offsets[i + 1]), int(n_prompt[i])
        assert n == answers[src].n_prompt and list(tokens[a + n : b]) == answers[src].tokens.tolist()
        assert list(ids_[a + n - 1 : b - 1, 0]) == answers[src].tokens.tolist()  # row j predicts token j + 1
        assert (ids_[a : a + n - 1, 0] == -1).all() and ids_[b - 1, 0] == -1
    mtime = shard.stat().st_mtime_ns
    again = targets.build(tiny, folder, root)
    assert again.folder == got.folder and again.answers == 6 and shard.stat().st_mtime_ns == mtime
    # soft targets (issue 32's KL-vs-CE ablation): the picked sequence gets the model's top-k at each answer
    # row from one teacher-forced prefill, the others keep their hard target; everything else is mirrored
    soft = targets.soft_targets(tiny, got.folder, tmp_path / "soft", {0}, k=4, threads=1)
    n0 = int(offsets[1] - offsets[0]) - int(n_prompt[0])
    assert soft["sequences"] == 1 and soft["rows"] == n0 and soft["argmax_is_answer"] >= 0.9
    with np.load(tmp_path / "soft" / shard.name) as z:
        assert np.array_equal(z["tokens"], tokens) and np.array_equal(z["offsets"], offsets)
        sid, slp = z["topk_ids"], z["topk_logp"].astype(np.float32)
    a, n, b = int(offsets[0]), int(n_prompt[0]), int(offsets[1])
    rows = slice(a + n - 1, b - 1)
    assert sid.shape[1] == 4 and (sid[rows] >= 0).all() and (slp[rows] <= 0).all()
    assert (np.diff(slp[rows], axis=1) <= 1e-3).all()  # log-probs, best first
    assert abs(float((sid[rows, 0] == ids_[rows, 0]).mean()) - soft["argmax_is_answer"]) < 1e-3
    assert (sid[a : a + n - 1] == -1).all() and (sid[b - 1] == -1).all()  # prompt rows and the last: no target
    assert (sid[b:, 1:] == -1).all() and np.array_equal(sid[b:, 0], ids_[b:, 0])  # the others: hard, as they were
    # the corpus as it was when a head was made: its first shards only, kept apart from the whole corpus
    n_shards = len(corpus.shard_paths(folder))
    assert got.shards == n_shards and got.summary()["last_shard"] == corpus.shard_paths(folder)[-1].name
    pinned = targets.build(tiny, folder, root, first=n_shards - 1)
    assert pinned.folder != got.folder and pinned.shards == n_shards - 1 and pinned.answers == 6 and not pinned.left_out
    for bad in (0, n_shards + 1):
        with pytest.raises(EesdError, match=f"has {n_shards} shards, not {bad}"):
            targets.build(tiny, folder, root, first=bad)
    out = tmp_path / "corpus-head.gguf"
    args = ["heads", "train", "--model", str(tiny), "--exit-layer", "2", "-o", str(out), "--corpus", str(folder),
            "--epochs", "1", "--threads", "1", "--batch-tokens", "512"]
    assert main(args) == 0
    info = read_head_info(out)
    assert info["data"]["source"] == "corpus" and info["data"]["answer_tokens"] == got.answer_tokens
    # the corpus recipe (issue 32's ablations): full softmax over V', lr 1e-3, from the base's last block
    assert info["config"]["loss"] == "full" and info["config"]["lr"] == 1e-3 and info["config"]["draft_vocab"] > 0
    assert info["recipe"].startswith("exit block full from the base's last block; softmax over V'")
    assert info["data"]["corpus_shards"] == n_shards
    assert main([*args[:-8], "--corpus", str(tmp_path / "empty"), "--force"]) == 2
    assert "no corpus shards" in capsys.readouterr().err
    assert main([*args[:-8], "--corpus-shards", "1", "--force"]) == 2
    assert "--corpus-shards picks shards of the teacher corpus" in capsys.readouterr().err
