"""Exit-head files, base-model fingerprints and the draft builder.

A head file is a small GGUF: the exit block named as block N of the base architecture
(``blk.N.*``), its final norm (``output_norm.weight``), optionally its own LM head
(``output.weight``), and ``eesd.head.*`` metadata tying it to its base (fingerprint, N) and
carrying the shared trunk's draft vocabulary V' (``eesd.head.draft_vocab``: the sorted token ids the
draft's LM head keeps), so that running the head never needs the text V' was counted from.
A draft is base + head materialised as an ordinary GGUF that llama.cpp loads: the base's
metadata with ``{arch}.block_count = N+1``, the base's ``token_embd`` and ``blk.0..N-1``
copied byte for byte, then the exit block, the norm, and an LM head (the head's own, or the
base's re-quantised to a cheaper type: drafts need not be exact, the full model verifies).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from eesd_local.base import cachefile
from eesd_local.base.atomic import atomic_path
from eesd_local.base.errors import EesdError
from eesd_local.base.paths import cache_dir, models_dir
from eesd_local.gguf import reader as ggufread
from eesd_local.gguf.check import check_gguf
from eesd_local.gguf.writer import write_derived

HEAD_FORMAT = 1
HEAD_ARCH = "eesd-head"  # general.architecture of a head file: llama.cpp must not take it for a model
DRAFT_FORMAT = 1
_FP_CHUNK = 1 << 16
FFN_PARTS = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_FP_SAMPLES = 16
DRAFT_VOCAB_KEY = "eesd.head.draft_vocab"


def _reader(path: Path, **kw) -> ggufread.GGUFHeader:
    return ggufread.read_header(Path(path), **kw)


def _field(reader: ggufread.GGUFHeader, key: str, default: Any = None) -> Any:
    return reader.kv.get(key, default)


def dequantize(h: ggufread.GGUFHeader, name: str) -> np.ndarray:
    """A tensor of a parsed GGUF as float32, numpy (torch) layout."""
    t = h.tensors[name]
    raw = h.tensor_bytes(name)
    rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
    arr = gguf.quants.dequantize(np.asarray(raw).reshape(rows, -1), gguf.GGMLQuantizationType(t.type))
    return np.ascontiguousarray(arr, dtype=np.float32).reshape(t.shape)


# --- fingerprint ----------------------------------------------------------------


def _fingerprint_uncached(path: Path) -> str:
    """sha256 over the header (metadata + tensor infos), the size and 16 sampled 64 KiB chunks."""
    reader = _reader(path)
    size = reader.size
    digest = hashlib.sha256()
    digest.update(str(size).encode())
    with path.open("rb") as fh:
        digest.update(fh.read(reader.data_offset))
        span = max(size - reader.data_offset - _FP_CHUNK, 0)
        for i in range(_FP_SAMPLES):
            fh.seek(reader.data_offset + span * i // max(_FP_SAMPLES - 1, 1))
            digest.update(fh.read(_FP_CHUNK))
    return digest.hexdigest()[:32]


def fingerprint(base_path: Path) -> str:
    """A cheap identity of a GGUF model, cached by (path, size, mtime)."""
    path = check_gguf(Path(base_path))
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index_path = cache_dir("fingerprints") / "index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key in index:
        return index[key]
    fp = _fingerprint_uncached(path)
    index[key] = fp
    try:
        with atomic_path(index_path) as tmp:
            tmp.write_text(json.dumps(index, indent=0))
    except (OSError, EesdError):
        pass  # a cache miss next time is harmless
    return fp


# --- base model facts -------------------------------------------------------------


def model_info(path: Path) -> dict:
    """arch, n_layer, n_embd, name of a GGUF model."""
    reader = _reader(check_gguf(Path(path)))
    arch = _field(reader, "general.architecture")
    if arch is None or arch == HEAD_ARCH:
        raise EesdError(f"{path} is not a model GGUF (architecture {arch!r})", hint="pass the base model's .gguf file")
    return {
        "arch": str(arch),
        "n_layer": int(_field(reader, f"{arch}.block_count", 0)),
        "n_embd": int(_field(reader, f"{arch}.embedding_length", 0)),
        "n_ff": int(_field(reader, f"{arch}.feed_forward_length", 0)),
        "n_head": int(_field(reader, f"{arch}.attention.head_count", 0)),
        "n_head_kv": int(_field(reader, f"{arch}.attention.head_count_kv", 0)),
        "name": str(_field(reader, "general.name", Path(path).stem)),
        # the rows of token_embd (the vocabulary's size as the weights see it)
        "n_vocab": int(reader.tensors["token_embd.weight"].dims[1]) if "token_embd.weight" in reader.tensors else 0,
    }


Q8_0_BYTES_PER_WEIGHT = 34 / 32  # a block of 32 int8 weights and one f16 scale


def exit_block_mb(info: dict) -> tuple[float, float]:
    """MB the exit block's attention and its MLP weigh in a head file (Q8_0), from ``model_info``."""
    n, kv_heads, heads = info["n_embd"], info["n_head_kv"] or 1, info["n_head"] or 1
    attn = n * (2 * n + 2 * n * kv_heads // heads)  # q, o: n x n; k, v: n x n_kv
    mlp = 3 * n * info["n_ff"]  # gate, up, down
    return attn * Q8_0_BYTES_PER_WEIGHT / 1e6, mlp * Q8_0_BYTES_PER_WEIGHT / 1e6


def check_exit_layer(n: int, n_layer: int, what: str) -> None:
    if not 1 <= n <= n_layer - 1:
        raise EesdError(
            f"exit layer {n} is outside {what}'s layers (it has {n_layer}; N must be 1..{n_layer - 1})",
            hint="pick N between 1 and the layer count minus 1",
        )


# --- head files ---------------------------------------------------------------------


def write_head(
    path: Path,
    *,
    base_path: Path,
    exit_layer: int,
    tensors: dict[str, np.ndarray],
    meta: dict[str, Any],
    qtype: str = "Q8_0",
    force: bool = True,
    draft_vocab: np.ndarray | None = None,
) -> Path:
    """Write a head GGUF. ``tensors`` maps block-local names ('attn_q.weight', ..., and
    'output_norm.weight' / 'output.weight') to float32 arrays in torch layout [out, in]; ``draft_vocab``:
    the shared trunk's V' (sorted token ids) that travels with the head."""
    info = model_info(base_path)
    check_exit_layer(exit_layer, info["n_layer"], str(base_path))
    qt = gguf.GGMLQuantizationType[qtype]
    path = Path(path)
    with atomic_path(path, force=force) as tmp:
        w = gguf.GGUFWriter(str(tmp), HEAD_ARCH)
        w.add_uint32("eesd.head.format", HEAD_FORMAT)
        w.add_string("eesd.head.base_arch", info["arch"])
        w.add_string("eesd.head.base_name", info["name"])
        w.add_string("eesd.head.base_fingerprint", fingerprint(base_path))
        w.add_uint32("eesd.head.base_n_layer", info["n_layer"])
        w.add_uint32("eesd.head.exit_layer", exit_layer)
        w.add_string("eesd.head.meta", json.dumps(meta, sort_keys=True))
        if draft_vocab is not None:
            w.add_array(DRAFT_VOCAB_KEY, _checked_vocab(draft_vocab, info["n_vocab"] or None, str(path)).tolist())
        for name, arr in tensors.items():
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            full = name if name.startswith("output") else f"blk.{exit_layer}.{name}"
            if arr.ndim == 2 and qt != gguf.GGMLQuantizationType.F32 and arr.shape[1] % 32 == 0:
                w.add_tensor(full, gguf.quants.quantize(arr, qt), raw_dtype=qt)
            else:
                w.add_tensor(full, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return path


def _checked_vocab(vocab: Any, n_vocab: int | None, where: str) -> np.ndarray:
    v = np.asarray(vocab)
    if v.ndim != 1 or not len(v) or v.dtype.kind not in "iu" or np.any(np.diff(v) <= 0) or v[0] < 0 \
            or (n_vocab is not None and v[-1] >= n_vocab):
        raise EesdError(f"{where}: the draft vocabulary is not a sorted list of distinct token ids of the model",
                        hint="the head file is damaged: retrain or re-download it")
    return v.astype(np.int32)


def head_draft_vocab(head_path: Path, size: int | None = None) -> np.ndarray | None:
    """V' as the head carries it (sorted int32 token ids), or None for a head written without one (or one
    of another size than ``size``)."""
    reader = _reader(Path(head_path))
    v = reader.kv.get(DRAFT_VOCAB_KEY)
    if v is None:
        return None
    v = _checked_vocab(v, None, str(head_path))  # against the model's vocabulary where it is used (trunk.open_split)
    return v if size is None or len(v) == size else None


def with_draft_vocab(head_path: Path, vocab: np.ndarray, out: Path | None = None) -> Path:
    """A copy of the head at ``out`` (default: in place) that carries ``vocab`` as its V': every other key and
    tensor byte for byte."""
    head_path = Path(head_path)
    read_head_info(head_path)  # a head, or one clear error
    src = gguf.GGUFReader(str(head_path))
    vocab = _checked_vocab(vocab, None, str(head_path))
    with atomic_path(Path(out or head_path), force=True) as tmp:
        w = gguf.GGUFWriter(str(tmp), HEAD_ARCH)
        for field in src.fields.values():
            if field.name.startswith("GGUF.") or field.name in ("general.architecture", DRAFT_VOCAB_KEY):
                continue
            vtype = field.types[0]
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_key_value(field.name, field.contents(), vtype, sub_type=field.types[-1])
            else:
                w.add_key_value(field.name, field.contents(), vtype)
        w.add_array(DRAFT_VOCAB_KEY, vocab.tolist())
        for t in src.tensors:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # quantized: its bytes, shaped per row
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return Path(out or head_path)


def read_head_info(head_path: Path) -> dict:
    """The head's metadata: arch, exit_layer, base_fingerprint, agreement, training summary..."""
    head_path = Path(head_path)
    if not head_path.is_file():
        raise EesdError(f"head file not found: {head_path}", hint="check the path, or train one with `eesd heads train`")
    with head_path.open("rb") as fh:
        if fh.read(4) != b"GGUF":
            raise EesdError(f"{head_path} is not a GGUF head file", hint="pass a head made by `eesd heads train`")
    reader = _reader(head_path)
    if _field(reader, "general.architecture") != HEAD_ARCH or _field(reader, "eesd.head.format") is None:
        raise EesdError(
            f"{head_path} is a GGUF file but not an exit head", hint="pass a head made by `eesd heads train`, not a model"
        )
    try:
        info = {
            "path": str(head_path),
            "format": _int_field(reader, "eesd.head.format"),
            "arch": _str_field(reader, "eesd.head.base_arch"),
            "base_name": _str_field(reader, "eesd.head.base_name"),
            "base_fingerprint": _str_field(reader, "eesd.head.base_fingerprint"),
            "base_n_layer": _int_field(reader, "eesd.head.base_n_layer"),
            "exit_layer": _int_field(reader, "eesd.head.exit_layer"),
            "tensors": {name: _type_name(t.type) for name, t in reader.tensors.items()},
        }
        meta = json.loads(str(_field(reader, "eesd.head.meta", "{}")))
        if not isinstance(meta, dict):
            raise ValueError("eesd.head.meta is not a JSON object")
    except (TypeError, ValueError) as exc:  # a damaged value: wrong type, or JSON that does not parse
        raise EesdError(f"{head_path} has corrupt head metadata ({exc})",
                        hint="the head file is damaged: retrain or re-download it") from None
    info.update(meta)
    return info


def _int_field(reader: ggufread.GGUFHeader, key: str) -> int:
    value = _field(reader, key)
    if type(value) is not int:
        raise TypeError(f"{key} is {value!r}, not an integer")
    return value


def _str_field(reader: ggufread.GGUFHeader, key: str) -> str:
    value = _field(reader, key)
    if not isinstance(value, str):
        raise TypeError(f"{key} is {value!r}, not a string")
    return value


def _type_name(ggml_type: int) -> str:
    return gguf.GGMLQuantizationType(ggml_type).name


def head_tensors(head_path: Path) -> dict[str, np.ndarray]:
    """The head's tensors dequantised to float32, by block-local name."""
    reader = _reader(Path(head_path))
    out = {}
    for name in reader.tensors:
        parts = name.split(".", 2)
        if not name.startswith("output") and (len(parts) < 3 or parts[0] != "blk"):
            raise EesdError(f"{head_path} has a tensor {name!r} that is not part of an exit head",
                            hint="the head file is damaged: retrain or re-download it")
        try:
            out[name if name.startswith("output") else parts[2]] = dequantize(reader, name)
        except (NotImplementedError, ValueError) as exc:  # a type gguf-py cannot dequantise, or a bad shape
            raise EesdError(f"{head_path}: cannot read tensor {name} ({exc})",
                            hint="the head file is damaged: retrain or re-download it") from None
    return out


def base_block_tensors(base_path: Path, layer: int) -> dict[str, np.ndarray]:
    """Block ``layer`` of a base GGUF dequantised to float32 (block-local names), plus its output_norm."""
    reader = _reader(Path(base_path))
    out = {}
    for name in reader.tensors:
        if name.startswith(f"blk.{layer}.") or name == "output_norm.weight":
            out[name if name.startswith("output") else name.split(".", 2)[2]] = dequantize(reader, name)
    return out


# --- finding shipped heads ------------------------------------------------------------


def head_dirs() -> list[Path]:
    dirs = [models_dir()]
    extra = os.environ.get("EESD_HEADS_DIR")
    if extra:
        dirs.insert(0, Path(extra))
    return dirs


def find_head(base_path: Path) -> Path | None:
    """A shipped head under models/ (or $EESD_HEADS_DIR) whose base fingerprint matches."""
    fp = fingerprint(base_path)
    best: tuple[float, Path] | None = None
    for d in head_dirs():
        if not d.is_dir():
            continue
        for p in sorted(d.glob("*.gguf")):
            try:
                info = read_head_info(p)
            except EesdError:
                continue
            if info["base_fingerprint"] != fp:
                continue
            score = float(info.get("agreement", {}).get("all", 0.0)) if isinstance(info.get("agreement"), dict) else 0.0
            if best is None or score > best[0]:
                best = (score, p)
    return best[1] if best else None


# --- the draft builder -----------------------------------------------------------------


def draft_key(base_fp: str, head_path: Path, lm_head_type: str) -> str:
    st = Path(head_path).stat()
    digest = hashlib.sha256()
    digest.update(f"{DRAFT_FORMAT}|{base_fp}|{lm_head_type}|{st.st_size}".encode())
    with Path(head_path).open("rb") as fh:  # heads are small: hash all of it
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()[:24]


def check_head_for(base_path: Path, head_path: Path) -> tuple[dict, str]:
    """(head info, base fingerprint) after checking that the head was made for this base."""
    info = read_head_info(head_path)
    base_fp = fingerprint(base_path)
    if info["base_fingerprint"] != base_fp:
        base = model_info(base_path)
        raise EesdError(
            f"the head {head_path} was made for {info['base_name']!r} (fingerprint {info['base_fingerprint'][:12]}, {info['arch']}, "
            f"{info['base_n_layer']} layers), not for {base_path.name} ({base['name']!r}, fingerprint {base_fp[:12]})",
            hint="use the head trained for this model, or train one: eesd heads train --model MODEL --exit-layer N -o HEAD",
        )
    check_exit_layer(info["exit_layer"], info["base_n_layer"], str(base_path))
    return info, base_fp


def read_head_pair(base_path: Path, head_path: Path, info: dict, *,
                   keep_strings: bool = False) -> tuple[dict, ggufread.GGUFHeader, ggufread.GGUFHeader]:
    """(base model info, base reader, head reader), checking the head has the exit block's tensors;
    ``keep_strings``: the base's string arrays read too (to copy its tokenizer)."""
    n = info["exit_layer"]
    base = model_info(base_path)
    check_exit_layer(n, base["n_layer"], str(base_path))
    breader = _reader(base_path, keep_strings=keep_strings)
    hreader = _reader(head_path)
    missing = [k for k in (f"blk.{n}.attn_norm.weight", "output_norm.weight") if k not in hreader.tensors]
    if info.get("ffn_from_base_block") is None:
        missing += [f"blk.{n}.{p}" for p in FFN_PARTS if f"blk.{n}.{p}" not in hreader.tensors]
    if missing:
        raise EesdError(
            f"the head {head_path} lacks tensors {missing}", hint="the head file is incomplete: retrain or re-download it"
        )
    return base, breader, hreader


def build_draft(
    base_path: Path, head_path: Path, *, force: bool = False, lm_head_type: str = "Q4_0", out_path: Path | None = None
) -> Path:
    """base GGUF + head -> draft GGUF in cache_dir('drafts'), built once and reused."""
    base_path = check_gguf(Path(base_path))
    info, base_fp = check_head_for(base_path, Path(head_path))
    n = info["exit_layer"]
    if out_path is None:
        out_path = cache_dir("drafts") / f"{base_path.stem}.exit{n}.{draft_key(base_fp, Path(head_path), lm_head_type)}.gguf"
    out_path = Path(out_path)
    if not force and cachefile.intact(out_path):  # damaged, truncated or foreign: built again below
        return out_path
    base, breader, hreader = read_head_pair(base_path, Path(head_path), info, keep_strings=True)
    arch = base["arch"]

    # metadata: the base's pairs, block_count (and per-layer arrays) for N+1 blocks
    for key, value in breader.kv.items():
        if key.startswith(f"{arch}.") and isinstance(value, list) and len(value) == base["n_layer"]:
            raise EesdError(f"{base_path} has per-layer metadata ({key}) that drafts do not support yet")
    set_kv = {f"{arch}.block_count": n + 1, "eesd.draft.base_fingerprint": base_fp, "eesd.draft.exit_layer": n}
    tensors: list = []
    for name, t in breader.tensors.items():  # token_embd and blocks 0..N-1, byte for byte
        if name == "token_embd.weight" or any(name.startswith(f"blk.{i}.") for i in range(n)):
            tensors.append((name, t.dims, t.type, lambda name=name: breader.tensor_bytes(name)))
    tensors += exit_tensors(breader, hreader, info, base_path, head_path)
    if "output.weight" not in hreader.tensors:
        src = "output.weight" if "output.weight" in breader.tensors else "token_embd.weight"
        st = breader.tensors[src]
        qt = gguf.GGMLQuantizationType[lm_head_type]
        if st.type == qt:
            tensors.append(("output.weight", st.dims, st.type, lambda: breader.tensor_bytes(src)))
        else:  # a cheaper LM head for the draft: the full model verifies every token anyway

            def requantized() -> np.ndarray:
                return gguf.quants.quantize(dequantize(breader, src), qt)

            tensors.append(("output.weight", st.dims, int(qt), requantized))
    write_derived(out_path, breader, tensors=tensors, set_kv=set_kv)
    return out_path


def exit_tensors(breader: ggufread.GGUFHeader, hreader: ggufread.GGUFHeader, info: dict, base_path: Path,
                 head_path: Path) -> list:
    """The exit block N, its output norm (and the head's own LM head, if it has one) as
    (name, dims, type, data) entries for gguf.writer; MLP parts the head kept from a base
    block come from the base, byte for byte."""
    n = info["exit_layer"]
    tensors: list = []
    for name, t in hreader.tensors.items():
        if name.startswith(f"blk.{n}.") or name in ("output_norm.weight", "output.weight"):
            tensors.append((name, t.dims, t.type, lambda name=name: hreader.tensor_bytes(name)))
    src_block = info.get("ffn_from_base_block")
    if src_block is not None:  # a head that kept the base's MLP: take those tensors from the base, byte for byte
        for part in FFN_PARTS:
            if f"blk.{n}.{part}" not in hreader.tensors:
                sname = f"blk.{int(src_block)}.{part}"
                if sname not in breader.tensors:
                    raise EesdError(f"the head {head_path} needs {sname} from the base, which {base_path.name} lacks")
                st = breader.tensors[sname]
                tensors.append((f"blk.{n}.{part}", st.dims, st.type, lambda sname=sname: breader.tensor_bytes(sname)))
    return tensors
