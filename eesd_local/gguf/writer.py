"""Writing GGUF files: gguf-py's GGUFWriter for every file eesd-local makes.

Converted models and head files are written from arrays (tools/convert.py, gguf/headfile.py,
gguf/tiny.py); the files derived from a model (the shared trunk and tail, a copy-mode draft) take
most of their metadata and tensors from the base file as they are: :func:`write_from` copies the
base's key/value pairs by their own types (but those it is told to set or drop) and its tensors'
bytes straight from the mapped file (a view of the base's memory map, so nothing is held in
memory), and adds the tensors it is given. :func:`write_derived` does that atomically into the
cache, with the file's digest (:mod:`eesd_local.base.cachefile`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from eesd_local.base import cachefile
from eesd_local.base.errors import EesdError
from eesd_local.gguf.reader import GGUFHeader

# (name, dims in GGUF order, ggml type, bytes or a callable returning them when written)
Tensor = tuple[str, tuple[int, ...], int, Any]


def _value_type(value: Any) -> gguf.GGUFValueType:
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.UINT32
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    raise TypeError(f"no GGUF type for {value!r}")


def byte_tensor(dims: tuple[int, ...], data: Any) -> np.ndarray:
    """A tensor's bytes as the uint8 array GGUFWriter takes for a raw type: numpy order, the last
    axis in bytes (GGUFWriter turns it back into elements by the type's block size)."""
    contiguous = np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data
    buf = np.frombuffer(memoryview(contiguous).cast("B"), dtype=np.uint8)  # type: ignore[arg-type]  # an ndarray is a buffer
    if len(dims) == 1:
        return buf
    rows = int(np.prod(dims[1:]))
    return buf.reshape(*reversed(dims[1:]), buf.size // rows)


def write_from(path: Path, base: GGUFHeader, *, tensors: list[Tensor], set_kv: dict[str, Any] | None = None,
               drop: Callable[[str], bool] = lambda key: False) -> None:
    """Write a GGUF at ``path`` whose metadata is ``base``'s (but the keys ``drop`` names, and those
    ``set_kv`` sets: int as u32, str, bool, float as f32, after the base's) and whose tensors are
    ``tensors``. ``base`` must have been read with the string arrays it copies kept
    (``read_header(..., keep_strings=True)``)."""
    set_kv = dict(set_kv or {})
    arch = str(set_kv.pop("general.architecture", base.kv.get("general.architecture", "llama")))
    w = gguf.GGUFWriter(str(path), arch)
    if base.alignment != gguf.GGUF_DEFAULT_ALIGNMENT:
        w.add_custom_alignment(base.alignment)
    skip = {"general.architecture", "general.alignment"}
    for key, value in base.kv.items():
        if key in skip or key in set_kv or drop(key):
            continue
        vtype, etype = base.kv_types[key]
        if vtype == gguf.GGUFValueType.ARRAY:
            if etype == gguf.GGUFValueType.STRING and isinstance(value, int):
                raise ValueError(f"{base.path}: read {key} with its strings kept to copy it")
            value = value.tolist() if isinstance(value, np.ndarray) else value
            assert etype is not None  # an array's element type is read with it
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(etype))
        else:
            w.add_key_value(key, value, gguf.GGUFValueType(vtype))
    for key, value in set_kv.items():
        w.add_key_value(key, value, _value_type(value))
    for name, dims, ggml_type, data in tensors:
        raw = data() if callable(data) else data
        w.add_tensor(name, byte_tensor(dims, raw), raw_dtype=gguf.GGMLQuantizationType(ggml_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_derived(out_path: Path, base: GGUFHeader, *, tensors: list[Tensor], set_kv: dict[str, Any] | None = None,
                  drop: Callable[[str], bool] = lambda key: False) -> None:
    """:func:`write_from` into the cache, atomically and with its digest: on any failure (a full
    disk, Ctrl-C) nothing is left but a temp file that is removed at once, and the next run builds
    the file again."""
    try:
        with cachefile.derived_path(out_path) as tmp:
            write_from(tmp, base, tensors=tensors, set_kv=set_kv, drop=drop)
    except OSError as exc:
        raise EesdError(f"cannot write {out_path}: {exc.strerror or exc}",
                        hint="free some disk space (or set EESD_HOME to a larger disk) and run again") from None
