"""HF -> GGUF conversion: a real round trip on the 0.5B demo model, tiny Llama checks, bad input.

The round trip: transformers loads the demo GGUF (dequantised) and saves it as a Hugging
Face checkpoint; :func:`convert` turns that back into a GGUF; llama.cpp's greedy
next-token choices on both files must agree on >= 98% of teacher-forced positions of
real text. torch and transformers are required (the project's setup installs them):
a missing one fails these tests instead of skipping them.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path

import gguf
import jinja2
import llama_cpp
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from eesd_local.base.errors import EesdError
from eesd_local.base.paths import cache_dir
from eesd_local.cli import main
from eesd_local.gguf.headfile import base_block_tensors, build_draft, fingerprint, head_draft_vocab, head_tensors, read_head_info
from eesd_local.llama.catalog import DEFAULT_MODEL, get_spec
from eesd_local.tools.convert import convert
from eesd_local.tools.heads.draftvocab import draft_vocab

# real text: English prose and Python source from the standard library
TEXT = argparse.__doc__.strip()[:600] + "\n\n" + inspect.getsource(textwrap.indent)
MAX_TOKENS = 300  # teacher-forced positions compared (TEXT is ~260 tokens)
MIN_AGREEMENT = 0.98
NEAR_TIE = 0.25  # logits; the median top-2 gap on TEXT is ~1.7

# the regex Qwen2's tokenizer splits text with before BPE
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"


def _llama(path: Path, **kw) -> llama_cpp.Llama:
    return llama_cpp.Llama(str(path), n_threads=2, verbose=False, **kw)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name or p.suffix == ".gguf")


# --- the round trip on the demo model ---------------------------------------------


@pytest.fixture(scope="module")
def demo_hf(qwen05_path: Path) -> Path:
    """The demo GGUF saved by transformers as an HF checkpoint (f16), cached by the GGUF's sha256."""
    target = cache_dir("test-cache") / f"hf-{get_spec(DEFAULT_MODEL).sha256[:16]}"
    if (target / "done").is_file():
        return target
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.set_num_threads(2)
    kw = {"gguf_file": qwen05_path.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen05_path.parent, dtype=torch.float16, **kw)
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen05_path.parent, **kw)
    model.hf_quantizer = None  # weights are dequantised already; lets save_pretrained write them
    del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "done").touch()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


@pytest.fixture(scope="module")
def converted(demo_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("convert") / "demo-f16.gguf"
    steps = []
    assert convert(demo_hf, out, outtype="f16", progress=lambda done, total, name: steps.append((done, total))) == out
    assert steps[-1][0] == steps[-1][1] == len(steps)
    yield out
    out.unlink()  # 1.3 GB: do not keep it among pytest's last three temp dirs


@pytest.fixture(scope="module")
def pair(qwen05_path: Path, converted: Path) -> tuple[llama_cpp.Llama, llama_cpp.Llama]:
    return _llama(qwen05_path, n_ctx=512, logits_all=True), _llama(converted, n_ctx=512, logits_all=True)


def test_round_trip_next_token_agreement(pair):
    original, ours = pair
    tokens = original.tokenize(TEXT.encode(), add_bos=False)[:MAX_TOKENS]
    assert len(tokens) >= 200
    logits = []
    for llm in pair:
        llm.reset()
        llm.eval(tokens)
        logits.append(np.array(llm.scores[: len(tokens)]))
    differ = np.flatnonzero(logits[0].argmax(1) != logits[1].argmax(1))
    agreement = 1 - len(differ) / len(tokens)
    top2 = np.sort(logits[0][differ], axis=1)[:, -2:]
    print(f"round-trip greedy agreement: {agreement:.2%} of {len(tokens)} positions; top-2 gaps where they differ: {top2[:, 1] - top2[:, 0]}")
    assert agreement >= MIN_AGREEMENT
    assert np.all(top2[:, 1] - top2[:, 0] < NEAR_TIE)  # they differ only where the original nearly ties


def test_round_trip_metadata(pair):
    original, ours = pair
    same = ["general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template",
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
            "tokenizer.ggml.add_bos_token"]
    same += [f"qwen2.{k}" for k in ("block_count", "context_length", "embedding_length", "feed_forward_length",
                                    "attention.head_count", "attention.head_count_kv", "rope.freq_base",
                                    "attention.layer_norm_rms_epsilon")]
    for key in same:
        assert ours.metadata.get(key) == original.metadata.get(key), key
    assert ours.metadata["general.file_type"] == str(int(gguf.LlamaFileType.MOSTLY_F16))
    n_vocab = original._model.n_vocab()
    assert ours._model.n_vocab() == n_vocab
    differ = [i for i in range(n_vocab) if ours._model.token_get_attr(i) != original._model.token_get_attr(i)]
    assert differ == []


def test_round_trip_tokenization(pair):
    original, ours = pair
    chat = jinja2.Environment().from_string(original.metadata["tokenizer.chat_template"]).render(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list in Python?"}],
        add_generation_prompt=True,
    )
    assert chat.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    samples = [TEXT, chat, "héllo wörld, 中文 🙂 \t\n  x=1_000", "<tool_call>{}</tool_call><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>"]
    for text in samples:
        for special in (True, False):
            expected = original.tokenize(text.encode(), add_bos=True, special=special)
            assert ours.tokenize(text.encode(), add_bos=True, special=special) == expected
    assert ours.tokenize(b"<|im_end|>", add_bos=False, special=True) == [int(original.metadata["tokenizer.ggml.eos_token_id"])]
    assert ours.detokenize(ours.tokenize(TEXT.encode(), add_bos=False)) == TEXT.encode()


# --- a tiny random Llama: q/k permutation, GQA, Llama 3 RoPE, all output types, heads -----


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer trained here on stdlib source (~500 tokens), Qwen2-style split."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False)
    tok.train_from_iterator([inspect.getsource(textwrap), inspect.getsource(argparse)[:50_000]], trainer)
    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


LLAMA3_ROPE = {"rope_theta": 10000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def _tiny_llama(tokenizer_dir: Path, directory: Path, dtype: torch.dtype, rope: dict) -> tuple[Path, transformers.PreTrainedModel]:
    torch.manual_seed(0)
    n_vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"].__len__() + 4  # 4 padding rows
    config = transformers.LlamaConfig(
        vocab_size=n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False,
        rope_parameters=rope,
    )
    model = transformers.LlamaForCausalLM(config).to(dtype).float().eval()  # weights exact in `dtype`
    model.to(dtype).save_pretrained(directory)
    model.float()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory, model


@pytest.fixture(scope="module")
def tiny_llama(tiny_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory):
    """bf16 weights, GQA, Llama 3.1 RoPE scaling (written as rope_freqs)."""
    return _tiny_llama(tiny_tokenizer, tmp_path_factory.mktemp("tiny-llama"), torch.bfloat16, LLAMA3_ROPE)


@pytest.fixture(scope="module")
def tiny_llama_plain_rope(tiny_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory):
    """f32 weights, plain RoPE."""
    return _tiny_llama(tiny_tokenizer, tmp_path_factory.mktemp("tiny-llama-plain"), torch.float32, {"rope_theta": 10000.0, "rope_type": "default"})


@pytest.mark.parametrize("outtype, min_corr, min_agreement", [("f16", 0.9999, 0.97), ("bf16", 0.999, 0.95), ("q8_0", 0.995, 0.9)])
def test_tiny_llama_logits_match_transformers(tiny_llama, tmp_path, outtype, min_corr, min_agreement):
    directory, model = tiny_llama
    out = convert(directory, tmp_path / "tiny.gguf", outtype=outtype)
    ids = list(range(300, 400))
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    llm = _llama(out, n_ctx=256, logits_all=True)
    llm.eval(ids)
    got = np.asarray(llm.scores[: len(ids)])
    corr, agreement = np.corrcoef(expected.ravel(), got.ravel())[0, 1], np.mean(expected.argmax(1) == got.argmax(1))
    print(f"{outtype}: logit correlation {corr:.6f}, argmax agreement {agreement:.2%}")
    assert corr > min_corr
    assert agreement >= min_agreement


def test_tiny_qwen2_tied_embeddings_and_biases(tiny_tokenizer, tmp_path):
    torch.manual_seed(1)
    n_vocab = len(json.loads((tiny_tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    config = transformers.Qwen2Config(
        vocab_size=n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # biases start at zero: make them count
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(std=0.5)
    model.save_pretrained(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer / name, tmp_path / "hf" / name)
    out = convert(tmp_path / "hf", tmp_path / "qwen2.gguf")
    names = [t.name for t in gguf.GGUFReader(out).tensors]
    assert "output.weight" not in names and "blk.1.attn_k.bias" in names
    ids = list(range(300, 400))
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    llm = _llama(out, n_ctx=256, logits_all=True)
    llm.eval(ids)
    assert np.corrcoef(expected.ravel(), np.asarray(llm.scores[: len(ids)]).ravel())[0, 1] > 0.9999


def test_tiny_tokenizer_matches_tokenizers_library(tiny_llama, tmp_path):
    directory, _ = tiny_llama
    out = convert(directory, tmp_path / "tiny.gguf")
    hf = Tokenizer.from_file(str(directory / "tokenizer.json"))
    llm = _llama(out, vocab_only=True)
    for text in [inspect.getsource(textwrap.dedent), "Hello, wörld! 12345 <|im_start|>user\nhi<|im_end|>\n", "  \t\n\n x"]:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == hf.encode(text).ids
    assert llm.metadata["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert llm.metadata["tokenizer.ggml.eos_token_id"] == str(hf.token_to_id("<|im_end|>"))
    assert llm._model.n_vocab() == hf.get_vocab_size() + 4


def _save_head(directory: Path, model, layer: int, info: dict, lm_head: bool = True) -> Path:
    from safetensors.torch import save_file  # noqa: PLC0415 - optional (train extra)

    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if k.startswith(f"model.layers.{layer}.") or k == "model.norm.weight" or (lm_head and k == "lm_head.weight")}
    directory.mkdir()
    save_file(state, str(directory / "head.safetensors"))
    (directory / "head.json").write_text(json.dumps(info))
    return directory


def test_head_converted_alongside(tiny_llama_plain_rope, tmp_path, isolated_home):
    directory, model = tiny_llama_plain_rope
    head = _save_head(tmp_path / "head", model, 1, {"exit_layer": 1, "base_arch": "llama", "steps": 12, "final_loss": 0.5})
    out = convert(directory, tmp_path / "tiny.gguf", head=head)
    head_gguf = tmp_path / "tiny.head.gguf"
    info = read_head_info(head_gguf)
    assert (info["arch"], info["exit_layer"], info["steps"], info["final_loss"]) == ("llama", 1, 12, 0.5)
    assert info["base_fingerprint"] == fingerprint(out)
    assert np.array_equal(head_draft_vocab(head_gguf), draft_vocab(out))  # the shared trunk's V' travels with it
    block = [f"blk.1.{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]
    assert sorted(info["tensors"]) == sorted([*block, "output_norm.weight", "output.weight"])
    ours, base = head_tensors(head_gguf), base_block_tensors(out, 1)  # same source, same conversion (q/k permuted alike)
    for name in base:
        assert np.array_equal(ours[name].reshape(-1), base[name].reshape(-1)), name

    # the draft built from it is the model cut after block 1: llama.cpp agrees with transformers on that
    draft = build_draft(out, head_gguf, out_path=tmp_path / "draft.gguf")
    model = copy.deepcopy(model)
    model.model.layers = model.model.layers[:2]
    ids = list(range(300, 340))
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    llm = _llama(draft, n_ctx=64, logits_all=True)
    llm.eval(ids)
    assert np.corrcoef(expected.ravel(), np.asarray(llm.scores[: len(ids)]).ravel())[0, 1] > 0.9999


def test_sharded_checkpoint(tiny_llama_plain_rope, tmp_path):
    directory, model = tiny_llama_plain_rope
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(directory / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    one = gguf.GGUFReader(convert(directory, tmp_path / "one.gguf")).tensors
    many = gguf.GGUFReader(convert(sharded, tmp_path / "many.gguf")).tensors
    assert [t.name for t in one] == [t.name for t in many]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(one, many, strict=True))


def test_cli(tiny_llama_plain_rope, tmp_path, isolated_home, capsys):
    directory, model = tiny_llama_plain_rope
    head = _save_head(tmp_path / "head", model, 2, {"exit_layer": 2, "base_arch": "LlamaForCausalLM"}, lm_head=False)
    out = tmp_path / "cli.gguf"
    argv = ["convert", str(directory), "-o", str(out), "--outtype", "q8_0", "--head", str(head / "head.safetensors")]
    assert main(argv) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert read_head_info(tmp_path / "cli.head.gguf")["exit_layer"] == 2
    assert _llama(out, vocab_only=True).metadata["general.file_type"] == str(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    assert main(argv) == 2  # exists: refused
    assert "already exists" in capsys.readouterr().err


# --- bad input: one clear error each, nothing at the output path -------------------------


def _expect_error(match: str, hf_dir: Path, out: Path, **kw) -> EesdError:
    with pytest.raises(EesdError, match=match) as info:
        convert(hf_dir, out, **kw)
    assert info.value.hint, "every user error says what to do"
    assert not out.exists()
    if out.parent.is_dir():
        assert _leftovers(out.parent) == []
    return info.value


@pytest.fixture
def tiny_copy(tiny_llama, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_llama[0], tmp_path / "hf"))


def test_missing_directory(tmp_path):
    _expect_error("is not a directory", tmp_path / "nope", tmp_path / "out" / "m.gguf")


@pytest.mark.parametrize("missing, match", [("config.json", "has no config.json"), ("model.safetensors", "no \\*.safetensors"),
                                            ("tokenizer.json", "has no tokenizer.json")])
def test_missing_file(tiny_copy, tmp_path, missing, match):
    (tiny_copy / missing).unlink()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    _expect_error(match, tiny_copy, out_dir / "m.gguf")


def test_unsupported_architecture(tiny_copy, tmp_path):
    config = json.loads((tiny_copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tiny_copy / "config.json").write_text(json.dumps(config))
    error = _expect_error("unsupported architecture 'GPT2LMHeadModel'", tiny_copy, tmp_path / "m.gguf")
    assert "LlamaForCausalLM" in error.hint and "Qwen2ForCausalLM" in error.hint


def test_truncated_weights(tiny_copy, tmp_path):
    weights = tiny_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    _expect_error("truncated", tiny_copy, tmp_path / "m.gguf")


def test_unwritable_output(tiny_copy, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    _expect_error("is not a directory", tiny_copy, blocker / "m.gguf")
    assert blocker.read_text() == "not a directory"


def test_existing_output_needs_force(tiny_copy, tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(EesdError, match="already exists") as info:
        convert(tiny_copy, out)
    assert "--force" in info.value.hint
    assert out.read_bytes() == b"keep me"
    convert(tiny_copy, out, force=True, outtype="q8_0")
    assert out.read_bytes()[:4] == b"GGUF"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


@pytest.mark.parametrize("info, match", [({"exit_layer": 3, "base_arch": "llama"}, "exit layer 3 is outside the model's layers"),
                                         ({"exit_layer": 1, "base_arch": "qwen2"}, "made for 'qwen2'")])
def test_bad_head(tiny_llama, tiny_copy, tmp_path, info, match):
    head = _save_head(tmp_path / "head", tiny_llama[1], 1, info)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    _expect_error(match, tiny_copy, out_dir / "m.gguf", head=head)
    assert not (out_dir / "m.head.gguf").exists()
