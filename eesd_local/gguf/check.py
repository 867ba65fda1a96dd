"""Checking a GGUF file before llama.cpp sees it: llama.cpp aborts the process on some damaged
files, so every model and head path is checked here first (magic, then the whole header)."""

from __future__ import annotations

import hashlib
import os
from functools import cache
from pathlib import Path

from eesd_local.base import cachefile
from eesd_local.base.errors import EesdError
from eesd_local.base.paths import cache_dir
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


HEADER_CHECK = 1  # bump when _check_header checks more: every file is then checked again


@cache
def _check_header(path: str, size: int, mtime_ns: int) -> None:
    """Parse the header once per file version; raises EesdError.

    A file that passed is remembered under the cache's ``checked/`` by its stamp (size, mtime,
    ctime, inode, device): any write through the file system moves its ctime, so a matching stamp
    means the bytes that passed. Reading the 0.5B model's 151,936 vocabulary strings took 0.26 s
    of each load, a sixth of the time to its first token."""
    key = f"{HEADER_CHECK}|{path}|{cachefile.stamp(os.stat(path))}"
    try:
        stamp: Path | None = cache_dir("checked") / hashlib.sha256(key.encode()).hexdigest()[:32]
    except EesdError:
        stamp = None  # a read-only cache: checked every time
    if stamp is not None and stamp.is_file():
        return
    check_for_llama(read_header(Path(path), keep_strings=("tokenizer.ggml.tokens",)))
    if stamp is not None:
        try:
            stamp.write_text(path + "\n")
        except OSError:
            pass
