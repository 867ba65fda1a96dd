"""A minimal, fast GGUF reader (header, metadata, tensor infos, raw data), with the checks that
keep a damaged file away from llama.cpp.

Hand-written where gguf-py has a reader because of speed: gguf-py's GGUFReader builds a numpy
view per string of the tokenizer arrays (300k of them for a Qwen vocabulary); measured on the
2-core machine, GGUFReader took 6.6 s to read the header of the 0.5B demo model, this parser
0.08 s, and every model and head load checks a header first (gguf/check.py). It walks the
header with ``struct``, skips string arrays unless asked for them, keeps every key/value pair's
type and raw bytes, and maps tensor data lazily. Writing is gguf-py's (gguf/writer.py).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from eesd_local.base.errors import EesdError

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
    kv_types: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # key -> (value type, array element type)

    def tensor_bytes(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_offset + t.offset, shape=(t.nbytes,))


def _tensor_nbytes(dims: tuple[int, ...], ggml_type: int) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    n = math.prod(dims) if dims else 1
    return n // block * size


MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 63  # GGML_MAX_NAME - 1: llama.cpp's longest tensor name
_MAX_DEPTH = 2  # an array of arrays at most (gguf-py writes no deeper)


def _corrupt(path: Path, what: str) -> EesdError:
    return EesdError(f"{path} is truncated or corrupt ({what})",
                     hint="the file may be truncated or corrupt: rebuild or re-download it")


class _Buf:
    """A cursor over the file's bytes; every read is checked against the end first."""

    def __init__(self, data: bytes | memoryview, path: Path):
        self.d = data
        self.p = 0
        self.path = path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.p + n > len(self.d):
            raise _corrupt(self.path, f"{what} past the end of the file")

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        self.need(size, "header ends early:")
        v = struct.unpack_from(fmt, self.d, self.p)
        self.p += size
        return v[0]

    def count(self, min_item: int, what: str) -> int:
        """A u64 element count that the rest of the file can hold (each item >= min_item bytes)."""
        n = self.take("<Q")
        if n * min_item > len(self.d) - self.p:
            raise _corrupt(self.path, f"{what} count {n} cannot fit in the file")
        return n

    def string(self) -> str:
        n = self.take("<Q")
        self.need(n, f"a string of {n} bytes")
        s = bytes(self.d[self.p : self.p + n])
        self.p += n
        return s.decode("utf-8", errors="replace")

    def value(self, vtype: int, keep_strings: bool, depth: int = 0) -> Any:
        if vtype == STR:
            return self.string()
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == ARR:
            if depth >= _MAX_DEPTH:
                raise _corrupt(self.path, "arrays nested too deep")
            etype = self.take("<I")
            if etype in _NP:
                width = np.dtype(_NP[etype]).itemsize
                n = self.count(width, "array")
                arr: np.ndarray = np.frombuffer(self.d, dtype=_NP[etype], count=n, offset=self.p) if n else np.zeros(0, _NP[etype])
                self.p += n * width
                return arr.tolist() if n <= 4096 else arr
            if etype == STR:
                n = self.count(8, "string array")
                if keep_strings:
                    return [self.string() for _ in range(n)]
                for _ in range(n):  # skip: 8-byte length + bytes
                    self.need(8, "a string length")
                    self.p += 8 + struct.unpack_from("<Q", self.d, self.p)[0]
                    self.need(0, "a string")
                return n
            if etype == ARR:
                n = self.count(12, "array of arrays")
                return [self.value(etype, keep_strings, depth + 1) for _ in range(n)]
            raise _corrupt(self.path, f"unknown array element type {etype}")
        raise _corrupt(self.path, f"unknown GGUF value type {vtype}")


def read_header(path: Path, *, keep_strings: tuple[str, ...] | bool = ()) -> GGUFHeader:
    """Parse and check a GGUF file's header; any damage raises EesdError, never another error.

    Checked before each use: counts and lengths against the bytes left, value types, tensor
    names (unique, <= 63 bytes), dims (1..4, each >= 1, a whole number of quant blocks per
    row), ggml types, the alignment (a power of two), each tensor's offset (aligned) and its
    bytes lying inside the file. String arrays are skipped unless their key is in keep_strings (True: all are kept).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            magic = fh.read(4)
            if magic != MAGIC:
                raise EesdError(f"{path} is not a GGUF file", hint="pass a .gguf file")
            data = np.memmap(path, dtype=np.uint8, mode="r") if size > 0 else b""
    except OSError as exc:
        raise EesdError(f"cannot read {path}: {exc.strerror or exc}") from None
    buf = _Buf(memoryview(data), path)  # type: ignore[arg-type]  # an ndarray is a buffer
    buf.p = 4
    version = buf.take("<I")
    if version not in (2, 3):
        raise EesdError(f"{path} has unsupported GGUF version {version}",
                        hint="the file may be corrupt, or written by a newer tool: re-create it")
    n_tensors = buf.count(8 + 4 + 4 + 8, "tensor")  # name length, n_dims, type, offset
    n_kv = buf.count(8 + 4, "key/value")  # key length, value type
    keep_all = keep_strings is True
    keep = () if isinstance(keep_strings, bool) else keep_strings
    kv: dict[str, Any] = {}
    kv_raw: dict[str, bytes] = {}
    kv_types: dict[str, tuple[int, int | None]] = {}
    for _ in range(n_kv):
        start = buf.p
        key = buf.string()
        if key in kv:
            raise _corrupt(path, f"key {key!r} appears twice")
        vtype = buf.take("<I")
        etype = struct.unpack_from("<I", buf.d, buf.p)[0] if vtype == ARR and buf.p + 4 <= len(buf.d) else None
        kv[key] = buf.value(vtype, keep_all or key in keep)
        kv_raw[key] = bytes(buf.d[start : buf.p])
        kv_types[key] = (vtype, etype)
    alignment = kv.get("general.alignment", 32)
    if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
        raise _corrupt(path, f"general.alignment is {alignment!r}, not a power of two")
    tensors: dict[str, TensorInfo] = {}
    for _ in range(n_tensors):
        name = buf.string()
        if not name or len(name.encode("utf-8", "surrogateescape")) > MAX_NAME or name in tensors:
            raise _corrupt(path, f"tensor name {name[:80]!r} is empty, too long or repeated")
        nd = buf.take("<I")
        if not 1 <= nd <= MAX_DIMS:
            raise _corrupt(path, f"tensor {name} has {nd} dimensions")
        dims = tuple(buf.take("<Q") for _ in range(nd))
        ttype = buf.take("<I")
        off = buf.take("<Q")
        try:
            block = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)][0]
        except (KeyError, ValueError):
            raise EesdError(
                f"{path}: tensor {name} has an unknown type {ttype}", hint="the file may be corrupt or too new"
            ) from None
        if min(dims) < 1 or dims[0] % block or math.prod(dims) >= 1 << 62:
            raise _corrupt(path, f"tensor {name} has dims {dims} (type {ttype}, {block} values a block)")
        if off % alignment:
            raise _corrupt(path, f"tensor {name} has offset {off}, not a multiple of the alignment {alignment}")
        tensors[name] = TensorInfo(name, dims, ttype, off, _tensor_nbytes(dims, ttype))
    data_offset = (buf.p + alignment - 1) // alignment * alignment
    end = max((t.offset + t.nbytes for t in tensors.values()), default=0)
    if data_offset + end > size:
        raise EesdError(
            f"{path} is truncated ({size} bytes, its tensors need {data_offset + end})",
            hint="the file may be truncated or corrupt: rebuild or re-download it",
        )
    return GGUFHeader(path, version, kv, kv_raw, tensors, data_offset, alignment, size, kv_types)


def _byte_level_chars() -> set[str]:
    """GPT-2's byte-level alphabet: the 256 one-character tokens every BPE vocabulary holds."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {chr(b) if b in printable else chr(next(extra)) for b in range(256)}


MAX_LAYERS = 512  # LLAMA_MAX_LAYERS


def check_for_llama(h: GGUFHeader) -> None:
    """What llama.cpp asserts (GGML_ASSERT aborts the process) about a model's hyperparameters
    and vocabulary: checked here so such a file is an EesdError instead."""
    arch = h.kv.get("general.architecture")
    if isinstance(arch, str):
        n_layer = h.kv.get(f"{arch}.block_count")
        if n_layer is not None and (type(n_layer) is not int or not 1 <= n_layer <= MAX_LAYERS):
            raise _corrupt(h.path, f"{arch}.block_count is {n_layer!r}, not 1..{MAX_LAYERS}")
        for key in (f"{arch}.attention.layer_norm_rms_epsilon", f"{arch}.attention.layer_norm_epsilon"):
            eps = h.kv.get(key)  # ggml's norms assert eps >= 0 (NaN fails it too)
            if eps is not None and not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
                raise _corrupt(h.path, f"{key} is {eps!r}")
        n_expert, n_used = h.kv.get(f"{arch}.expert_count", 0), h.kv.get(f"{arch}.expert_used_count", 0)
        if type(n_expert) is not int or type(n_used) is not int or n_used > n_expert or (n_expert > 0) != (n_used > 0):
            raise _corrupt(h.path, f"{arch}.expert_count {n_expert!r} with expert_used_count {n_used!r}")
    check_vocab(h)


def check_vocab(h: GGUFHeader) -> None:
    """What llama.cpp's tokenizer takes for granted and aborts the process on (an uncaught C++
    exception) when it is missing: arrays of one length per token, known token types, and the
    byte-fallback tokens it looks up by name. ``h`` must keep ``tokenizer.ggml.tokens``."""
    kind = h.kv.get("tokenizer.ggml.model")
    if kind is None or kind == "none":
        return
    tokens = h.kv.get("tokenizer.ggml.tokens")
    if not isinstance(kind, str) or not isinstance(tokens, list) or not tokens or not isinstance(tokens[0], str):
        raise _corrupt(h.path, f"tokenizer {kind!r} with tokens {type(tokens).__name__}")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        arr = h.kv.get(key)
        if arr is not None and (isinstance(arr, (int, float, str)) or len(arr) != len(tokens)):
            raise _corrupt(h.path, f"{key} does not have one entry per token ({len(tokens)})")
    types = np.asarray(h.kv.get("tokenizer.ggml.token_type", []))
    if types.size and (types.dtype.kind not in "iu" or types.min() < 0 or types.max() > 6):  # llama_token_type: 0..6
        raise _corrupt(h.path, "unknown token types in tokenizer.ggml.token_type")
    have = set(tokens)
    if kind == "llama" and types.size and (types == 6).any():  # SentencePiece with byte fallback
        # byte_to_token looks up "<0xXX>", else the byte itself as a one-character token
        missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in have and (b >= 0x80 or chr(b) not in have)]
        bad = [tokens[i] for i in np.flatnonzero(types == 6) if len(tokens[i]) != 6 or not tokens[i].startswith("<0x")]
        if missing or bad:
            raise _corrupt(h.path, f"byte tokens missing or malformed: {(missing + bad)[:3]}")
    if kind == "gpt2":
        missing = sorted(_byte_level_chars() - have)
        if missing:
            raise _corrupt(h.path, f"byte-level tokens missing: {missing[:3]}")


def bytes_read_per_token(path: Path) -> int:
    """Weight bytes one decode step of this model reads: every tensor but the token embeddings,
    of which a step reads one row (negligible), unless the output layer is tied to them (no
    ``output.weight``), when the LM head reads all of ``token_embd``. What a memory-bound device
    pays per step, as a first-order model."""
    h = read_header(path)
    total = sum(t.nbytes for name, t in h.tensors.items() if name != "token_embd.weight")
    if "output.weight" not in h.tensors and "token_embd.weight" in h.tensors:
        total += h.tensors["token_embd.weight"].nbytes
    return total
