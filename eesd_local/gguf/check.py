"""Checking a GGUF file before llama.cpp sees it: llama.cpp aborts the process on some damaged
files, so every model and head path is checked here first (magic, then the whole header)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from eesd_local.errors import EesdError
from eesd_local.gguf.reader import check_for_llama, read_header

GGUF_MAGIC = b"GGUF"


def check_gguf(path: Path, *, what: str = "model") -> Path:
    """Raise a user error unless ``path`` is a readable, intact GGUF file.

    ``what`` is "model" or "head" (an exit-head file, named only by path). The whole header is
    parsed and checked in Python (counts, lengths, types, tensor offsets and sizes against the
    file, hyperparameters llama.cpp asserts on, the vocabulary's byte tokens), so llama.cpp is
    never handed a truncated or corrupt file it would crash on.
    """
    if what == "head":
        hint = "pass an exit-head GGUF path (--head takes a file, not a registry name; make one with `eesd heads train`)"
    else:
        hint = "check the path, or use a registry name (eesd models list)"
    if not path.exists():
        raise EesdError(f"{'exit-head' if what == 'head' else 'model'} file not found: {path}", hint=hint)
    if not path.is_file():
        raise EesdError(f"not a file: {path}", hint=hint if what == "head" else "pass the path of a .gguf file")
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
        st = path.stat()
    except OSError as exc:
        raise EesdError(f"cannot read {path}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise EesdError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')",
                        hint=hint if what == "head" else "convert it with `eesd convert` or pick a .gguf file")
    _check_header(str(path.resolve()), st.st_size, st.st_mtime_ns)
    return path


@cache
def _check_header(path: str, size: int, mtime_ns: int) -> None:
    """Parse the header once per file version (size and mtime in the key); raises EesdError."""
    check_for_llama(read_header(Path(path), keep_strings=("tokenizer.ggml.tokens",)))
