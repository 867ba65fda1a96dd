"""A minimal, fast GGUF reader and raw writer (header, metadata, tensor infos, raw data).

gguf-py's GGUFReader builds a numpy view per string of the tokenizer arrays (300k of them for a
Qwen vocabulary), which takes tens of seconds on a loaded 2-core machine. This parser walks the
header with ``struct`` and keeps every key/value pair's raw bytes, so a draft can be written by
copying the base's metadata and tensor bytes verbatim, changing only ``block_count``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..errors import EesdError

MAGIC = b"GGUF"
# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}
_NP = {
    U8: np.uint8,
    I8: np.int8,
    U16: np.uint16,
    I16: np.int16,
    U32: np.uint32,
    I32: np.int32,
    F32: np.float32,
    BOOL: np.bool_,
    U64: np.uint64,
    I64: np.int64,
    F64: np.float64,
}


@dataclass
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: ne0 (row length) first
    type: int  # ggml type id
    offset: int  # relative to the data section
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:  # numpy order
        return tuple(reversed(self.dims))


@dataclass
class GGUFHeader:
    path: Path
    version: int
    kv: dict[str, Any]  # scalars and non-string arrays decoded; string arrays as their length
    kv_raw: dict[str, bytes]  # each pair's exact bytes (key included)
    tensors: dict[str, TensorInfo]
    data_offset: int
    alignment: int
    size: int

    def tensor_bytes(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_offset + t.offset, shape=(t.nbytes,))


def _tensor_nbytes(dims: tuple[int, ...], ggml_type: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    n = int(np.prod(dims)) if dims else 1
    return n // block * size


class _Buf:
    def __init__(self, data: bytes | memoryview, path: Path):
        self.d = data
        self.p = 0
        self.path = path

    def take(self, fmt: str):
        try:
            v = struct.unpack_from(fmt, self.d, self.p)
        except struct.error:
            raise EesdError(
                f"{self.path} is truncated or corrupt (header ends early)",
                hint="the file may be truncated or corrupt: rebuild or re-download it",
            ) from None
        self.p += struct.calcsize(fmt)
        return v[0]

    def string(self) -> str:
        n = self.take("<Q")
        if self.p + n > len(self.d):
            raise EesdError(
                f"{self.path} is truncated or corrupt (string past the end)",
                hint="the file may be truncated or corrupt: rebuild or re-download it",
            )
        s = bytes(self.d[self.p : self.p + n])
        self.p += n
        return s.decode("utf-8", errors="replace")

    def value(self, vtype: int, keep_strings: bool) -> Any:
        if vtype == STR:
            return self.string()
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == ARR:
            etype = self.take("<I")
            n = self.take("<Q")
            if etype in _NP:
                width = np.dtype(_NP[etype]).itemsize
                arr = np.frombuffer(self.d, dtype=_NP[etype], count=n, offset=self.p) if n else np.zeros(0, _NP[etype])
                self.p += n * width
                return arr.tolist() if n <= 4096 else arr
            if etype == STR:
                if keep_strings:
                    return [self.string() for _ in range(n)]
                for _ in range(n):  # skip: 8-byte length + bytes
                    self.p += 8 + struct.unpack_from("<Q", self.d, self.p)[0]
                if self.p > len(self.d):
                    raise EesdError(
                        f"{self.path} is truncated or corrupt",
                        hint="the file may be truncated or corrupt: rebuild or re-download it",
                    )
                return n
            return [self.value(etype, keep_strings) for _ in range(n)]
        raise EesdError(f"{self.path} has an unknown GGUF value type {vtype}", hint="the file may be corrupt")


def read_header(path: Path, *, keep_strings: tuple[str, ...] = ()) -> GGUFHeader:
    """Parse a GGUF file's header. String arrays are skipped unless their key is in keep_strings."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as fh:
        if fh.read(4) != MAGIC:
            raise EesdError(f"{path} is not a GGUF file", hint="pass a .gguf file")
        data = np.memmap(path, dtype=np.uint8, mode="r") if size > 0 else b""
    buf = _Buf(memoryview(data), path)
    buf.p = 4
    version = buf.take("<I")
    if version not in (2, 3):
        raise EesdError(f"{path} has unsupported GGUF version {version}")
    n_tensors = buf.take("<Q")
    n_kv = buf.take("<Q")
    kv: dict[str, Any] = {}
    kv_raw: dict[str, bytes] = {}
    for _ in range(n_kv):
        start = buf.p
        key = buf.string()
        vtype = buf.take("<I")
        kv[key] = buf.value(vtype, key in keep_strings)
        kv_raw[key] = bytes(buf.d[start : buf.p])
    tensors: dict[str, TensorInfo] = {}
    for _ in range(n_tensors):
        name = buf.string()
        nd = buf.take("<I")
        dims = tuple(buf.take("<Q") for _ in range(nd))
        ttype = buf.take("<I")
        off = buf.take("<Q")
        try:
            nbytes = _tensor_nbytes(dims, ttype)
        except (KeyError, ValueError):
            raise EesdError(
                f"{path}: tensor {name} has an unknown type {ttype}", hint="the file may be corrupt or too new"
            ) from None
        tensors[name] = TensorInfo(name, dims, ttype, off, nbytes)
    alignment = int(kv.get("general.alignment", 32))
    data_offset = (buf.p + alignment - 1) // alignment * alignment
    end = max((t.offset + t.nbytes for t in tensors.values()), default=0)
    if data_offset + end > size:
        raise EesdError(
            f"{path} is truncated ({size} bytes, its tensors need {data_offset + end})",
            hint="the file may be truncated or corrupt: rebuild or re-download it",
        )
    return GGUFHeader(path, version, kv, kv_raw, tensors, data_offset, alignment, size)


# --- writing ---------------------------------------------------------------------------


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def kv_bytes(key: str, value: Any) -> bytes:
    """Encode one key/value pair (str, bool, int as u32, float as f32)."""
    if isinstance(value, bool):
        return _str(key) + struct.pack("<I?", BOOL, value)
    if isinstance(value, int):
        return _str(key) + struct.pack("<II", U32, value)
    if isinstance(value, float):
        return _str(key) + struct.pack("<If", F32, value)
    if isinstance(value, str):
        return _str(key) + struct.pack("<I", STR) + _str(value)
    raise TypeError(f"cannot encode {key}={value!r}")


def write_gguf(
    out: BinaryIO, kv_pairs: list[bytes], tensors: list[tuple[str, tuple[int, ...], int, Any]], alignment: int = 32
) -> None:
    """Write a GGUF: raw key/value pairs, then tensors given as (name, dims, ggml type, data)
    where data is a bytes-like object (or a callable returning one, read when written)."""
    sizes = [_tensor_nbytes(dims, ttype) for _, dims, ttype, _ in tensors]
    head = bytearray(MAGIC + struct.pack("<IQQ", 3, len(tensors), len(kv_pairs)))
    for p in kv_pairs:
        head += p
    offset = 0
    for (name, dims, ttype, _), nbytes in zip(tensors, sizes):
        head += (
            _str(name)
            + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", ttype, offset)
        )
        offset += (nbytes + alignment - 1) // alignment * alignment
    head += b"\0" * ((-len(head)) % alignment)
    out.write(head)
    for (name, _, _, data), nbytes in zip(tensors, sizes):
        raw = data() if callable(data) else data
        mv = memoryview(np.ascontiguousarray(raw)).cast("B") if isinstance(raw, np.ndarray) else memoryview(raw).cast("B")
        if len(mv) != nbytes:
            raise ValueError(f"tensor {name}: {len(mv)} bytes, expected {nbytes}")
        out.write(mv)
        out.write(b"\0" * ((-nbytes) % alignment))
