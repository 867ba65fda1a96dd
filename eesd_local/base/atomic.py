"""Write files under a temporary name and rename them into place.

No file the tool writes ever appears half-written under its final name: a crash or
Ctrl-C leaves at most a hidden ``.NAME.tmp-PID`` file beside it. The next write into a
folder of the cache removes every such file there whose process is gone (elsewhere, only
those of the same NAME: a user's folder may hold other tools' files); a live process's
are left alone, so two processes can build files in one folder at once.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from eesd_local.base.errors import EesdError
from eesd_local.base.paths import eesd_home

_TMP = re.compile(r"^\..+\.tmp-(\d+)$")  # .NAME.tmp-PID, the name atomic_path writes to


def _alive(pid: int) -> bool:
    """True unless no process ``pid`` exists (a process of another user counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only the existence and permission checks
    except ProcessLookupError:
        return False
    except (OverflowError, OSError):
        return True  # PermissionError: it exists under another user; or we cannot tell: keep the file
    return True


def remove_stale_temps(folder: str | Path, name: str | None = None) -> list[Path]:
    """Remove the temporary files of writes whose process died (a killed pull, a crash), only
    those for the output ``name`` if given; return them."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = _TMP.match(entry.name)
        if m is None or (name is not None and not entry.name.startswith(f".{name}.tmp-")) or _alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):  # another process may have removed it first
            if entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def in_cache(folder: Path) -> bool:
    """Whether ``folder`` lies in eesd-local's cache ($EESD_HOME)."""
    try:
        return folder.resolve().is_relative_to(eesd_home().resolve())
    except OSError:
        return False


def check_overwrite(path: Path, force: bool) -> None:
    """Refuse to replace an existing output unless ``force`` is set, and a folder always."""
    if path.is_dir():
        raise EesdError(f"the output {path} is a folder, not a file", hint="give the path of a file to write (it may lie in that folder)")
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
    remove_stale_temps(final.parent, None if in_cache(final.parent) else final.name)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_bytes_atomic(path: str | Path, data: bytes, *, force: bool = True) -> Path:
    with atomic_path(path, force=force) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | Path, text: str, *, force: bool = True) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"), force=force)
