"""Write files under a temporary name and rename them into place.

No file the tool writes ever appears half-written under its final name: a crash or
Ctrl-C leaves at most a ``*.tmp-*`` file beside it, which the next run removes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from .errors import EesdError


def check_overwrite(path: Path, force: bool) -> None:
    """Refuse to replace an existing output unless ``force`` is set."""
    if path.exists() and not force:
        raise EesdError(f"{path} already exists", hint="pass --force to overwrite it")


@contextlib.contextmanager
def atomic_path(path: str | Path, *, force: bool = True) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` on success."""
    final = Path(path)
    check_overwrite(final, force)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EesdError(f"cannot create {final.parent}: {exc.strerror}") from None
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(path: str | Path) -> list[Path]:
    """Remove the temporary files of ``path`` left by runs that were killed (their process is gone)."""
    final = Path(path)
    removed = []
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
                removed.append(tmp)
    return removed


def write_bytes_atomic(path: str | Path, data: bytes, *, force: bool = True) -> Path:
    with atomic_path(path, force=force) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | Path, text: str, *, force: bool = True) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"), force=force)
