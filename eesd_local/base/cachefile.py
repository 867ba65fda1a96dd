"""Derived cache files carry a content check, recorded when they are written and checked before each use.

The files eesd-local derives and keeps (the shared trunk's trunk and tail GGUFs, exit-head drafts, the
draft vocabulary, requantised variants, the numba cache of the controller kernels) are read as if they
were the model: a trunk with damaged tensor data is the target's own first layers gone wrong, and the
answer changes. So each such file gets ``NAME.digest`` beside it (JSON, written atomically after the
file is in place) and :func:`intact` says whether the file is still the one that was written; a file
that is not (damaged, truncated, emptied, replaced by another GGUF, or without a digest) is rebuilt by
its owner as if it were missing.

What is recorded and checked:

- the sha256 of the whole file, and the file's stamp (size, mtime, ctime, inode, device) once it is in
  place. Every write to a file through the file system sets its ctime to the clock, and no call sets it
  back, so a stamp that matches means the bytes are those that were hashed; a stamp that differs (the
  file was written to, copied or touched) makes :func:`intact` hash the whole file again: a match
  renews the stamp, a mismatch means rebuild;
- on top of that, on every check, a sha256 over SAMPLE bytes at every STRIDE: damage that bypassed the
  file system (a disk's bad sector) is caught where it spans STRIDE bytes or more.

A check with a matching stamp costs a stat, the JSON and the samples: a millisecond or two for the
0.5B model's trunk and tail, against a few tenths of a second to hash them whole (BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eesd_local.base.atomic import atomic_path, write_text_atomic
from eesd_local.base.errors import EesdError

FORMAT = 1
SUFFIX = ".digest"
STRIDE = 1 << 20  # a sample every MiB
SAMPLE = 4096  # bytes per sample: one page
_CHUNK = 1 << 20


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + SUFFIX)


def stamp(st: os.stat_result) -> list[int]:
    """What any write through the file system changes: size, mtime, ctime (no call sets it back), inode, device."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _full(fh: Any) -> str:
    fh.seek(0)
    return hashlib.file_digest(fh, "sha256").hexdigest()


def _samples(fh: Any, size: int) -> str:
    digest = hashlib.sha256()
    for at in range(0, size, STRIDE):
        digest.update(os.pread(fh.fileno(), SAMPLE, at))
    return digest.hexdigest()


def _measure(path: Path) -> tuple[os.stat_result, dict[str, Any]]:
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        info = {"format": FORMAT, "size": st.st_size, "sha256": _full(fh), "stride": STRIDE, "sample": SAMPLE,
                "samples_sha256": _samples(fh, st.st_size)}
    return st, info


def _write(path: Path, info: dict[str, Any], st: os.stat_result) -> None:
    try:
        write_text_atomic(digest_path(path), json.dumps(dict(info, stamp=stamp(st))) + "\n")
    except (OSError, EesdError):
        pass  # no digest: the next use rebuilds the file, which is slower but never wrong


def forget(path: Path) -> None:
    """Remove ``path``'s digest (before a new version of the file is written)."""
    with contextlib.suppress(OSError):
        digest_path(Path(path)).unlink()


def record(path: str | os.PathLike[str]) -> None:
    """Write the digest of ``path`` as it is now (a file some other code wrote and renamed into place)."""
    path = Path(path)
    try:
        st0, info = _measure(path)
        st = os.stat(path)
    except OSError:
        return
    if stamp(st) == stamp(st0):  # nobody replaced or wrote the file while it was hashed
        _write(path, info, st)


@contextlib.contextmanager
def derived_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """:func:`atomic.atomic_path` for a derived cache file: yields the temporary path to write; once it is
    renamed into place, its digest (hashed from the temporary file, before anyone could see it) is recorded."""
    path = Path(path)
    forget(path)
    with atomic_path(path, force=True) as tmp:
        yield tmp
        _, info = _measure(tmp)
    try:
        st = os.stat(path)
    except OSError:
        return
    if st.st_size == info["size"]:
        _write(path, info, st)


def intact(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` exists and is the file its digest was recorded for (see the module's docstring)."""
    path = Path(path)
    try:
        info = json.loads(digest_path(path).read_text())
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not isinstance(info, dict) or info.get("format") != FORMAT or info.get("size") != st.st_size:
                return False
            if (info.get("stride"), info.get("sample")) != (STRIDE, SAMPLE) or _samples(fh, st.st_size) != info.get("samples_sha256"):
                return False
            if info.get("stamp") == stamp(st):
                return True
            if _full(fh) != info.get("sha256"):
                return False
    except (OSError, ValueError):  # no digest, no file, or a digest that is not JSON
        return False
    _write(path, info, st)  # the same bytes under a new stamp (copied, touched): checked in full once
    return True


def discard(path: str | os.PathLike[str]) -> None:
    """Remove a derived file that failed its check, and its digest."""
    path = Path(path)
    for p in (path, digest_path(path)):
        with contextlib.suppress(OSError):
            p.unlink()
