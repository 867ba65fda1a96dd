"""Hugging Face checkpoint (config.json, safetensors, tokenizer.json) -> a GGUF llama.cpp loads.

Llama- and Qwen2-family checkpoints. Tensor names come from gguf-py's TensorNameMap, limited to
the parts of a plain decoder (:data:`SUPPORTED`, :func:`gguf_tensor_name`); everything else reads
the HF JSON files into GGUF metadata keys. An exit head saved from training in HF
naming (``model.layers.{N}.*`` plus optional ``model.norm`` / ``lm_head``, and a JSON with
``exit_layer`` and ``base_arch``) goes through the same table and is written as a head file
(:func:`eesd_local.gguf.headfile.write_head`) tied to the converted model.

Nothing is written until every input has been read and checked; outputs go to a
temporary name and are renamed into place (:func:`eesd_local.base.atomic.atomic_path`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from eesd_local.base.atomic import atomic_path, check_overwrite
from eesd_local.base.errors import EesdError
from eesd_local.gguf.headfile import check_exit_layer, write_head
from eesd_local.tools.heads.draftvocab import draft_vocab

# progress(done_tensors, total_tensors, gguf_name) is called after each tensor is written
Progress = Callable[[int, int, str], None]

# HF `architectures[0]` -> llama.cpp architecture
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}

# the GGUF tensors of a plain Llama/Qwen2 decoder: gguf-py's TensorNameMap names HF tensors for
# every architecture it knows, and anything it maps outside this set is a part we do not convert
SUPPORTED = {"token_embd", "output_norm", "output", "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
             "ffn_gate", "ffn_up", "ffn_down"}

# HF tensors with no GGUF counterpart (llama.cpp recomputes them)
SKIPPED = ("rotary_emb.inv_freq",)

# tensors the head file accepts besides its exit block
HEAD_EXTRA = {"model.norm.weight": "model.norm.weight", "norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}

# --outtype -> (type of 2-D weights, general.file_type)
OUTTYPES = {
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}

# the pre-tokenizer's split regex -> llama.cpp's `tokenizer.ggml.pre`
PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
}

# safetensors dtype -> numpy dtype of the stored bytes (bf16 is widened by hand)
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}

_BLOCK_RE = re.compile(r"\.(\d+)\.")


@functools.cache
def _name_map(arch: str) -> gguf.TensorNameMap:
    # blocks are numbered in the HF name: the map is built for enough of them
    return gguf.get_tensor_name_map({"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch], 512)


def gguf_tensor_name(hf_name: str, arch: str = "qwen2") -> str | None:
    """The GGUF name of an HF tensor (gguf-py's TensorNameMap), None for one llama.cpp does not need;
    raises for a tensor outside a plain decoder."""
    if hf_name.endswith(SKIPPED):
        return None
    name = _name_map(arch).get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None or _BLOCK_RE.sub(".", name).replace("blk.", "").split(".")[0] not in SUPPORTED:
        raise EesdError(
            f"tensor {hf_name!r} has no GGUF name",
            hint="the checkpoint has parts this converter does not know; only plain Llama/Qwen2 decoders are supported",
        )
    return name


# --- reading the checkpoint ---------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """One tensor stored in a safetensors file: where its bytes are and how to read them."""

    file: Path
    dtype: str  # safetensors dtype, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int

    def load(self) -> np.ndarray:
        """The tensor as float32 (memory-mapped read, one copy)."""
        raw = np.memmap(self.file, dtype=np.uint8, mode="r", offset=self.start, shape=(self.end - self.start,))
        if self.dtype == "BF16":
            data = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)  # bf16 is the top half of an f32
        else:
            data = raw.view(_ST_DTYPES[self.dtype]).astype(np.float32)
        return data.reshape(self.shape)


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """Name -> :class:`Tensor` from one safetensors file's header (the data is not read)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("header length out of range")
            header = json.loads(fh.read(n))
    except OSError as exc:
        raise EesdError(f"cannot read {path}: {exc.strerror}", hint="check the file's permissions") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise EesdError(f"{path} is not a valid safetensors file ({exc})", hint="re-save the checkpoint with save_pretrained") from None
    header.pop("__metadata__", None)
    tensors = {}
    for name, info in header.items():
        start, end = (8 + n + int(o) for o in info["data_offsets"])
        if info["dtype"] not in _ST_DTYPES:
            raise EesdError(f"tensor {name!r} in {path} has dtype {info['dtype']}", hint=f"supported dtypes: {', '.join(_ST_DTYPES)}")
        if end > size:
            raise EesdError(f"{path} is truncated: tensor {name!r} ends at byte {end} of {size}", hint="download or save the checkpoint again")
        tensors[name] = Tensor(path, info["dtype"], tuple(info["shape"]), start, end)
    return tensors


def read_checkpoint_tensors(hf_dir: Path) -> dict[str, Tensor]:
    """All tensors of a checkpoint: one ``*.safetensors`` file, or shards listed by the index."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            raise EesdError(f"{hf_dir} lacks the shard(s) {', '.join(missing)} listed in {index.name}", hint="download the whole checkpoint")
        paths = [hf_dir / f for f in files]
    else:
        paths = sorted(hf_dir.glob("*.safetensors"))
    if not paths:
        raise EesdError(f"no *.safetensors weights in {hf_dir}", hint="save the model with save_pretrained(safe_serialization=True)")
    tensors: dict[str, Tensor] = {}
    for path in paths:
        tensors.update(read_safetensors(path))
    return tensors


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise EesdError(f"cannot read {path}: {exc.strerror}", hint="check the file's permissions") from None
    except ValueError as exc:
        raise EesdError(f"{path} is not valid JSON ({exc})", hint="the checkpoint is damaged: save or download it again") from None


def _optional_json(path: Path) -> dict[str, Any]:
    return _read_json(path) if path.is_file() else {}


def read_config(hf_dir: Path) -> tuple[dict[str, Any], str]:
    """config.json and the llama.cpp architecture it maps to."""
    if not hf_dir.is_dir():
        raise EesdError(f"{hf_dir} is not a directory", hint="pass the directory of a Hugging Face checkpoint (config.json, *.safetensors, tokenizer.json)")
    path = hf_dir / "config.json"
    if not path.is_file():
        raise EesdError(f"{hf_dir} has no config.json", hint="pass the directory of a Hugging Face checkpoint (config.json, *.safetensors, tokenizer.json)")
    config = _read_json(path)
    names = config.get("architectures") or [config.get("model_type", "?")]
    if names[0] not in ARCHITECTURES:
        raise EesdError(f"unsupported architecture {names[0]!r} in {path}", hint=f"supported: {', '.join(ARCHITECTURES)}")
    return config, ARCHITECTURES[names[0]]


# --- metadata ---------------------------------------------------------------------


@dataclass
class Vocab:
    """What llama.cpp's BPE tokenizer needs, read from tokenizer.json and friends."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    special: dict[str, int] = field(default_factory=dict)  # "bos"/"eos"/"pad"/"unk" -> id
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | list[dict[str, str]] | None = None


def _walk(node: Any) -> Iterable[dict[str, Any]]:
    """Every dict in a tokenizer.json component tree (Sequence nests others)."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _token_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def read_vocab(hf_dir: Path, vocab_size: int) -> Vocab:
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise EesdError(f"{hf_dir} has no tokenizer.json", hint="save the tokenizer too: tokenizer.save_pretrained(dir)")
    tok = _read_json(path)
    model = tok.get("model", {})
    parts = list(_walk(tok.get("pre_tokenizer")))
    if model.get("type") != "BPE" or not any(p.get("type") == "ByteLevel" for p in parts):
        raise EesdError(
            f"{path} is not a byte-level BPE tokenizer (model {model.get('type')!r})",
            hint="only GPT-2-style byte-level BPE tokenizers (Llama 3, Qwen2) are supported, not SentencePiece ones (Llama 2)",
        )
    regexes = [p["pattern"]["Regex"] for p in parts if p.get("type") == "Split" and "Regex" in p.get("pattern", {})]
    if not regexes and any(p.get("type") == "ByteLevel" and p.get("use_regex") for p in parts):
        pre = "gpt2"
    elif len(regexes) == 1 and regexes[0] in PRE_TOKENIZERS:
        pre = PRE_TOKENIZERS[regexes[0]]
    else:
        raise EesdError(f"{path} splits text with a pre-tokenizer llama.cpp is not told about here: {regexes}", hint=f"known: {', '.join(PRE_TOKENIZERS.values())}, gpt2")

    ids: dict[str, int] = dict(model["vocab"])
    added = tok.get("added_tokens", [])
    n_tokens = max([*ids.values(), *(a["id"] for a in added)]) + 1
    if n_tokens > vocab_size:
        raise EesdError(f"{path} has {n_tokens} tokens but the model's embedding has {vocab_size} rows", hint="the tokenizer does not belong to this checkpoint")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    merged = {m.replace(" ", "", 1) for m in merges}
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]  # ids the tokenizer never produces pad the embedding
    types = [gguf.TokenType.UNUSED.value] * vocab_size
    for text, i in ids.items():
        reachable = len(text) == 1 or text in merged  # a byte, or what a merge makes; else BPE never yields it
        tokens[i], types[i] = text, (gguf.TokenType.NORMAL if reachable else gguf.TokenType.UNUSED).value
    for a in added:
        added_type = gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED
        tokens[a["id"]], types[a["id"]] = a["content"], added_type.value
        ids[a["content"]] = a["id"]

    tok_config = _optional_json(hf_dir / "tokenizer_config.json")
    gen_config = _optional_json(hf_dir / "generation_config.json")
    special: dict[str, int] = {}
    for kind in ("bos", "eos", "pad", "unk"):
        content = _token_content(tok_config.get(f"{kind}_token"))
        fallback = gen_config.get(f"{kind}_token_id")
        if content is not None and content in ids:
            special[kind] = ids[content]
        elif fallback is not None:
            special[kind] = fallback[0] if isinstance(fallback, list) else int(fallback)

    # the post-processor adds BOS/EOS when its template starts/ends with a special token
    template = next((p.get("single") for p in _walk(tok.get("post_processor")) if p.get("type") == "TemplateProcessing"), None) or []
    add_bos = tok_config.get("add_bos_token")
    add_eos = tok_config.get("add_eos_token")
    if add_bos is None:
        add_bos = bool(template) and "SpecialToken" in template[0]
    if add_eos is None:
        add_eos = bool(template) and "SpecialToken" in template[-1]

    chat_template = tok_config.get("chat_template")
    if chat_template is None and (hf_dir / "chat_template.jinja").is_file():
        chat_template = (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if chat_template is None:
        chat_template = _optional_json(hf_dir / "chat_template.json").get("chat_template")
    return Vocab(tokens, types, merges, pre, special, bool(add_bos), bool(add_eos), chat_template)


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope theta, scaling parameters) from either transformers 4 or 5 style config.json."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    return float(theta), params


def _required(config: dict[str, Any], key: str) -> Any:
    if key not in config:
        raise EesdError(f"config.json has no {key!r}", hint="the checkpoint's config.json is incomplete")
    return config[key]


def _llama3_rope_factors(params: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1's long-context RoPE (llama.cpp reads them as rope_freqs)."""
    factor, low, high = params["factor"], params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    old_ctx = params.get("original_max_position_embeddings", 8192)
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_ctx / high:  # high frequencies: unchanged
            factors.append(1.0)
        elif wavelen > old_ctx / low:  # low frequencies: slowed by the full factor
            factors.append(factor)
        else:  # in between: interpolate smoothly
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_hparams(writer: gguf.GGUFWriter, config: dict[str, Any]) -> np.ndarray | None:
    """The model's shape and RoPE into GGUF keys; returns Llama 3's rope_freqs tensor if it has one."""
    n_embd = _required(config, "hidden_size")
    n_head = _required(config, "num_attention_heads")
    head_dim = config.get("head_dim") or n_embd // n_head
    writer.add_context_length(_required(config, "max_position_embeddings"))
    writer.add_embedding_length(n_embd)
    writer.add_block_count(_required(config, "num_hidden_layers"))
    writer.add_feed_forward_length(_required(config, "intermediate_size"))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config.get("num_key_value_heads") or n_head)
    writer.add_layer_norm_rms_eps(_required(config, "rms_norm_eps"))
    writer.add_vocab_size(_required(config, "vocab_size"))
    if head_dim != n_embd // n_head:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    theta, params = _rope(config)
    writer.add_rope_freq_base(theta)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(params["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
    elif kind == "llama3":
        return _llama3_rope_factors(params, theta, head_dim)
    elif kind != "default":
        raise EesdError(f"unsupported RoPE scaling {kind!r} in config.json", hint="supported: linear, yarn, llama3")
    return None


def write_vocab(writer: gguf.GGUFWriter, vocab: Vocab) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    for kind, token_id in vocab.special.items():
        getattr(writer, f"add_{kind}_token_id")(token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)


# --- tensors ----------------------------------------------------------------------


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF Llama rotates the two halves of each head; llama.cpp's `llama` rotates adjacent pairs.

    Row ``i`` of the first half and row ``i`` of the second half of each head move next
    to each other (rows ``2i`` and ``2i+1``). Qwen2 uses the halves (NEOX) and is not permuted.
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class Planned:
    """One output tensor: its GGUF name and type and where its data comes from."""

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    source: Tensor | np.ndarray
    n_head: int = 0  # > 0: permute rows for llama's RoPE layout with this many heads


def _tensor_type(name: str, shape: tuple[int, ...], outtype: str) -> gguf.GGMLQuantizationType:
    qtype = OUTTYPES[outtype][0]
    if len(shape) == 1:  # norms and biases stay f32
        return gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return gguf.GGMLQuantizationType.F16  # rows that do not split into 32-value blocks
    return qtype


def plan_tensors(tensors: dict[str, Tensor], config: dict[str, Any], arch: str, outtype: str) -> list[Planned]:
    """The output tensors in file order: embeddings, blocks in order, final norm, LM head."""
    n_head = _required(config, "num_attention_heads")
    n_head_kv = config.get("num_key_value_heads") or n_head
    tied = config.get("tie_word_embeddings", False)
    plan = []
    for hf_name, tensor in tensors.items():
        name = gguf_tensor_name(hf_name, arch)
        if name is None or (tied and name == "output.weight"):  # tied: llama.cpp reuses token_embd
            continue
        heads = 0
        if arch == "llama" and ".attn_q." in name:
            heads = n_head
        elif arch == "llama" and ".attn_k." in name:
            heads = n_head_kv
        plan.append(Planned(name, _tensor_type(name, tensor.shape, outtype), tensor.shape, tensor, heads))
    return sorted(plan, key=_file_order)


def _file_order(p: Planned) -> tuple[int, int, str]:
    if p.name.startswith("blk."):
        return (1, int(p.name.split(".")[1]), p.name)
    return (0 if p.name in ("token_embd.weight", "rope_freqs.weight") else 2, 0, p.name)


def _load(p: Planned) -> np.ndarray:
    """The tensor's values as float32, in llama.cpp's row order."""
    data = p.source.load() if isinstance(p.source, Tensor) else p.source
    return permute_rope_rows(data, p.n_head) if p.n_head else data


def _encode(p: Planned) -> np.ndarray:
    data = _load(p)
    if p.qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    return gguf.quants.quantize(np.ascontiguousarray(data), p.qtype)  # f16 as float16, bf16/q8_0 as bytes


def _nbytes(p: Planned) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape as written, numpy dtype as written, byte size) of a planned tensor."""
    if p.qtype == gguf.GGMLQuantizationType.F32:
        return p.shape, np.dtype(np.float32), 4 * math.prod(p.shape)
    if p.qtype == gguf.GGMLQuantizationType.F16:
        return p.shape, np.dtype(np.float16), 2 * math.prod(p.shape)
    shape = gguf.quants.quant_shape_to_byte_shape(p.shape, p.qtype)
    return shape, np.dtype(np.uint8), math.prod(shape)


def write_planned(path: Path, writer: gguf.GGUFWriter, plan: list[Planned], progress: Progress | None) -> None:
    """Stream the planned tensors into ``path`` one at a time with gguf-py's GGUFWriter (the metadata
    is already in ``writer``), so a whole model is never held in memory."""
    for p in plan:
        shape, dtype, nbytes = _nbytes(p)
        raw = None if p.qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else p.qtype
        writer.add_tensor_info(p.name, shape, dtype, nbytes, raw_dtype=raw)
    try:
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, p in enumerate(plan):
            writer.write_tensor_data(_encode(p))
            if progress:
                progress(i + 1, len(plan), p.name)
    finally:
        writer.close()


# --- heads ------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadCheckpoint:
    """A trained exit head in HF naming and the JSON that says where it goes."""

    exit_layer: int
    tensors: dict[str, Tensor]  # HF names: model.layers.{N}.*, model.norm.weight, lm_head.weight
    meta: dict[str, Any]  # the rest of the JSON (training summary), kept in the head file


def read_head_checkpoint(head: Path, config: dict[str, Any], arch: str, base: dict[str, Tensor]) -> HeadCheckpoint:
    """Read and check a head: a directory, or a .safetensors file with a .json beside it."""
    if head.is_dir():
        files = sorted(head.glob("*.safetensors"))
        jsons = sorted(head.glob("*.json"))
    elif head.is_file():
        files = [head]
        jsons = [p for p in (head.with_suffix(".json"), head.parent / "head.json") if p.is_file()][:1]
    else:
        raise EesdError(f"head not found: {head}", hint="pass the head's .safetensors file or its directory")
    if len(files) != 1 or len(jsons) != 1:
        raise EesdError(f"{head} should hold one .safetensors file and one .json file, found {len(files)} and {len(jsons)}",
                        hint='the JSON says {"exit_layer": N, "base_arch": "qwen2"}')
    meta = _read_json(jsons[0])
    exit_layer, base_arch = meta.pop("exit_layer", None), meta.pop("base_arch", None)
    if not isinstance(exit_layer, int):
        raise EesdError(f"{jsons[0]} has no integer exit_layer (found {exit_layer!r})", hint='the JSON says {"exit_layer": N, "base_arch": "qwen2"}')
    check_exit_layer(exit_layer, _required(config, "num_hidden_layers"), "the model")
    if ARCHITECTURES.get(base_arch, base_arch) != arch:
        raise EesdError(f"the head in {head} was made for {base_arch!r}, this model is {arch!r}", hint="convert it with the checkpoint it was trained on")
    tensors = {}
    for name, tensor in read_safetensors(files[0]).items():
        hf_name = HEAD_EXTRA.get(name, name)
        if hf_name not in HEAD_EXTRA.values() and not hf_name.startswith(f"model.layers.{exit_layer}."):
            raise EesdError(f"the head has tensor {name!r}, which is neither part of exit layer {exit_layer} nor norm/lm_head",
                            hint="save only the exit block (model.layers.N.*) and optional model.norm / lm_head")
        like = base.get(hf_name) or (base.get("model.embed_tokens.weight") if hf_name == "lm_head.weight" else None)
        if like is None or like.shape != tensor.shape:
            raise EesdError(f"head tensor {name!r} has shape {list(tensor.shape)}, the model's has {list(like.shape) if like else None}",
                            hint="the head does not belong to this model")
        tensors[hf_name] = tensor
    block = {k for k in base if k.startswith(f"model.layers.{exit_layer}.") and gguf_tensor_name(k, arch)}
    if not block <= tensors.keys():
        raise EesdError(f"the head lacks {', '.join(sorted(block - tensors.keys()))}", hint="save the whole exit block")
    return HeadCheckpoint(exit_layer, tensors, meta)


def head_arrays(head: HeadCheckpoint, config: dict[str, Any], arch: str) -> dict[str, np.ndarray]:
    """Block-local GGUF name ('attn_q.weight', 'output_norm.weight'...) -> float32, as :func:`write_head` takes them."""
    plan = plan_tensors(head.tensors, {**config, "tie_word_embeddings": False}, arch, "f16")
    return {p.name.removeprefix(f"blk.{head.exit_layer}."): _load(p) for p in plan}


def default_head_out(out_path: Path) -> Path:
    """``model.gguf`` -> ``model.head.gguf``."""
    return out_path.with_name(out_path.name.removesuffix(".gguf") + ".head.gguf")


# --- the whole conversion ---------------------------------------------------------


def _check_output(path: Path, force: bool) -> None:
    """Refuse, before any work, an output that exists (without force) or cannot be created."""
    check_overwrite(path, force)
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise EesdError(f"cannot write {path}: {parent} is not a directory", hint="choose another output path with -o")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise EesdError(f"cannot write {path}: {parent} is not writable", hint="choose another output path with -o")


# errors while writing the output that the user can fix by choosing another place
_WRITE_ERRNOS = {errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EROFS, errno.EDQUOT, errno.ENOTDIR, errno.EISDIR}


@contextlib.contextmanager
def _output(path: Path, force: bool) -> Iterator[Path]:
    """:func:`atomic_path`, with a failure to write (no space, no permission) as a user error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path, force=force) as tmp:
            tmp.touch()  # fail here, before the slow part, if the place is not writable
            yield tmp
    except OSError as exc:
        if exc.errno not in _WRITE_ERRNOS:
            raise
        raise EesdError(f"cannot write {path}: {exc.strerror}", hint="choose a writable output path with enough free space") from None


def convert(
    hf_dir: str | Path,
    out_path: str | Path,
    *,
    head: str | Path | None = None,
    head_out: str | Path | None = None,
    outtype: str = "f16",
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Convert an HF checkpoint to ``out_path`` (and a head to ``head_out``); returns ``out_path``."""
    hf_dir, out_path = Path(hf_dir).expanduser(), Path(out_path).expanduser()
    if outtype not in OUTTYPES:
        raise EesdError(f"unknown output type {outtype!r}", hint=f"use one of {', '.join(OUTTYPES)}")
    config, arch = read_config(hf_dir)
    tensors = read_checkpoint_tensors(hf_dir)
    vocab = read_vocab(hf_dir, _required(config, "vocab_size"))
    plan = plan_tensors(tensors, config, arch, outtype)
    head_src = read_head_checkpoint(Path(head).expanduser(), config, arch, tensors) if head is not None else None
    head_path = Path(head_out).expanduser() if head_out is not None else default_head_out(out_path)
    _check_output(out_path, force)
    if head_src is not None:
        _check_output(head_path, force)

    writer = gguf.GGUFWriter(None, arch)
    writer.add_type("model")
    writer.add_name(config.get("_name_or_path") or config.get("_model_name_or_path") or hf_dir.name)
    rope_freqs = write_hparams(writer, config)
    writer.add_file_type(OUTTYPES[outtype][1])
    if outtype == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_vocab(writer, vocab)
    if rope_freqs is not None:
        plan.insert(1, Planned("rope_freqs.weight", gguf.GGMLQuantizationType.F32, rope_freqs.shape, rope_freqs))
    with _output(out_path, force) as tmp:
        write_planned(tmp, writer, plan, progress)

    if head_src is not None:
        write_head(head_path, base_path=out_path, exit_layer=head_src.exit_layer, tensors=head_arrays(head_src, config, arch),
                   meta=head_src.meta, qtype=OUTTYPES[outtype][0].name, force=force,
                   draft_vocab=draft_vocab(out_path))  # the shared trunk's V' travels with the head
    return out_path
