"""Exit-head files, base-model fingerprints and the draft builder.

A head file is a small GGUF: the exit block named as block N of the base architecture
(``blk.N.*``), its final norm (``output_norm.weight``), optionally its own LM head
(``output.weight``), and ``eesd.head.*`` metadata tying it to its base (fingerprint, N).
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

import numpy as np

from ..atomic import atomic_path
from ..errors import EesdError
from ..paths import cache_dir
from ..registry import check_gguf

HEAD_FORMAT = 1
HEAD_ARCH = "eesd-head"  # general.architecture of a head file: llama.cpp must not take it for a model
DRAFT_FORMAT = 1
_FP_CHUNK = 1 << 16
_FP_SAMPLES = 16


def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - gguf raises ValueError, struct.error, IndexError... on bad files
        raise EesdError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})", hint="the file may be truncated or corrupt: rebuild or re-download it") from None


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


# --- fingerprint ----------------------------------------------------------------


def _fingerprint_uncached(path: Path) -> str:
    """sha256 over the header (metadata + tensor infos), the size and 16 sampled 64 KiB chunks."""
    reader = _reader(path)
    size = path.stat().st_size
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
        "name": str(_field(reader, "general.name", Path(path).stem)),
    }


def check_exit_layer(n: int, n_layer: int, what: str) -> None:
    if not 1 <= n <= n_layer - 1:
        raise EesdError(f"exit layer {n} is outside {what}'s layers (it has {n_layer}; N must be 1..{n_layer - 1})", hint="pick N between 1 and the layer count minus 1")


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
) -> Path:
    """Write a head GGUF. ``tensors`` maps block-local names ('attn_q.weight', ..., and
    'output_norm.weight' / 'output.weight') to float32 arrays in torch layout [out, in]."""
    import gguf

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
        raise EesdError(f"{head_path} is a GGUF file but not an exit head", hint="pass a head made by `eesd heads train`, not a model")
    info = {
        "path": str(head_path),
        "format": int(_field(reader, "eesd.head.format")),
        "arch": str(_field(reader, "eesd.head.base_arch")),
        "base_name": str(_field(reader, "eesd.head.base_name")),
        "base_fingerprint": str(_field(reader, "eesd.head.base_fingerprint")),
        "base_n_layer": int(_field(reader, "eesd.head.base_n_layer")),
        "exit_layer": int(_field(reader, "eesd.head.exit_layer")),
        "tensors": {t.name: t.tensor_type.name for t in reader.tensors},
    }
    info.update(json.loads(str(_field(reader, "eesd.head.meta", "{}"))))
    return info


def head_tensors(head_path: Path) -> dict[str, np.ndarray]:
    """The head's tensors dequantised to float32, by block-local name (for training resumes)."""
    import gguf

    reader = _reader(Path(head_path))
    out = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        name = t.name if t.name.startswith("output") else t.name.split(".", 2)[2]
        out[name] = np.asarray(arr, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)] if len(t.shape) > 1 else -1)
    return out


def base_block_tensors(base_path: Path, layer: int) -> dict[str, np.ndarray]:
    """Block ``layer`` of a base GGUF dequantised to float32 (block-local names), plus its output_norm."""
    import gguf

    reader = _reader(Path(base_path))
    out = {}
    for t in reader.tensors:
        if t.name.startswith(f"blk.{layer}.") or t.name == "output_norm.weight":
            arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            name = t.name if t.name.startswith("output") else t.name.split(".", 2)[2]
            out[name] = arr
    return out


# --- finding shipped heads ------------------------------------------------------------


def head_dirs() -> list[Path]:
    from ..registry import models_dir

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


def _copy_kv(reader, writer, arch: str, n_blocks: int) -> None:
    import gguf

    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == f"{arch}.block_count":
            writer.add_uint32(key, n_blocks)
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[1] if len(f.types) > 1 else None
            if key.startswith(f"{arch}.") and sub is not None and sub != gguf.GGUFValueType.STRING:
                vals = f.contents()
                if isinstance(vals, list) and len(vals) == int(_field(reader, f"{arch}.block_count", -1)):
                    vals = vals[:n_blocks]  # per-layer arrays follow the new layer count
                writer.add_key_value(key, vals, vtype, sub_type=sub)
            else:
                writer.add_key_value(key, f.contents(), vtype, sub_type=sub)
        else:
            writer.add_key_value(key, f.contents(), vtype)
    writer.add_string("eesd.draft.note", "eesd-local draft model: base blocks 0..N-1 + trained exit block")


def _raw_tensor(writer, name: str, t) -> None:
    """Add a reader tensor to a writer byte for byte."""
    writer.add_tensor(name, t.data, raw_dtype=t.tensor_type)


def draft_key(base_fp: str, head_path: Path, lm_head_type: str) -> str:
    st = Path(head_path).stat()
    digest = hashlib.sha256()
    digest.update(f"{DRAFT_FORMAT}|{base_fp}|{lm_head_type}|{st.st_size}".encode())
    with Path(head_path).open("rb") as fh:  # heads are small: hash all of it
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()[:24]


def build_draft(base_path: Path, head_path: Path, *, force: bool = False, lm_head_type: str = "Q4_0", out_path: Path | None = None) -> Path:
    """base GGUF + head -> draft GGUF in cache_dir('drafts'), built once and reused."""
    import gguf

    base_path = check_gguf(Path(base_path))
    info = read_head_info(Path(head_path))
    base_fp = fingerprint(base_path)
    if info["base_fingerprint"] != base_fp:
        base = model_info(base_path)
        raise EesdError(
            f"the head {head_path} was made for {info['base_name']!r} (fingerprint {info['base_fingerprint'][:12]}, {info['arch']}, "
            f"{info['base_n_layer']} layers), not for {base_path.name} ({base['name']!r}, fingerprint {base_fp[:12]})",
            hint="use the head trained for this model, or train one: eesd heads train --model MODEL --exit-layer N -o HEAD",
        )
    n = info["exit_layer"]
    check_exit_layer(n, info["base_n_layer"], str(base_path))
    if out_path is None:
        out_path = cache_dir("drafts") / f"{base_path.stem}.exit{n}.{draft_key(base_fp, Path(head_path), lm_head_type)}.gguf"
    out_path = Path(out_path)
    if out_path.is_file() and not force:
        return out_path
    base = model_info(base_path)
    check_exit_layer(n, base["n_layer"], str(base_path))
    arch = base["arch"]
    breader = _reader(base_path)
    hreader = _reader(Path(head_path))
    head_t = {t.name: t for t in hreader.tensors}
    base_t = {t.name: t for t in breader.tensors}
    missing = [k for k in (f"blk.{n}.attn_norm.weight", "output_norm.weight") if k not in head_t]
    if missing:
        raise EesdError(f"the head {head_path} lacks tensors {missing}", hint="the head file is incomplete: retrain or re-download it")
    with atomic_path(out_path, force=True) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch)
        _copy_kv(breader, w, arch, n + 1)
        w.add_string("eesd.draft.base_fingerprint", base_fp)
        w.add_uint32("eesd.draft.exit_layer", n)
        for t in breader.tensors:  # token_embd and blocks 0..N-1, byte for byte
            if t.name == "token_embd.weight" or any(t.name.startswith(f"blk.{i}.") for i in range(n)):
                _raw_tensor(w, t.name, t)
        for name, t in head_t.items():
            if name.startswith(f"blk.{n}.") or name == "output_norm.weight":
                _raw_tensor(w, name, t)
        if "output.weight" in head_t:
            _raw_tensor(w, "output.weight", head_t["output.weight"])
        else:
            src = base_t.get("output.weight") or base_t["token_embd.weight"]
            qt = gguf.GGMLQuantizationType[lm_head_type]
            if src.tensor_type == qt:
                _raw_tensor(w, "output.weight", src)
            else:
                dense = gguf.quants.dequantize(src.data, src.tensor_type)
                w.add_tensor("output.weight", gguf.quants.quantize(np.ascontiguousarray(dense, np.float32), qt), raw_dtype=qt)
                del dense
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out_path
