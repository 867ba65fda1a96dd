"""Numba's on-disk cache for the controller kernels, invalidated by an edit to any of them.

Numba stamps a cached function with a hash of its own source file only, but a compiled
function contains the code of everything it calls: after an edit to thompson.py, the
cached kernels.controller_decide (and simulator.run_rounds) would go on running the old
code. These locators stamp every kernel with one hash over all kernel files instead.
They use Numba's cache-locator hook (numba.core.caching); should that move, caching
falls back to Numba's default.

Numba reads its cache files back without checking them: a damaged data file is unpickled
into machine code that runs (or raises an UnpicklingError out of the first call). So the
kernels' index and data files carry a content check (:mod:`..cachefile`): each file Numba
writes for a kernel gets its digest, and a file that fails the check before Numba reads it is
removed and its kernel compiled again.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

from eesd_local import cachefile

_PACKAGE = Path(__file__).resolve().parent
KERNEL_FILES = tuple(sorted(_PACKAGE.glob("*.py"))) + (_PACKAGE.parent / "simulator.py",)


@functools.lru_cache(maxsize=1)
def kernels_stamp() -> str:
    digest = hashlib.sha256()
    for path in KERNEL_FILES:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _stamped(base: type) -> type:
    class Locator(base):  # type: ignore[misc, valid-type]
        def get_source_stamp(self):
            return kernels_stamp()

        @classmethod
        def from_function(cls, py_func, py_file):
            if Path(py_file).resolve() not in KERNEL_FILES:
                return None
            return super().from_function(py_func, py_file)

    Locator.__name__ = f"EesdKernels{base.__name__}"
    return Locator


@functools.lru_cache(maxsize=1)
def install() -> bool:
    """Put the locators first in Numba's list; True when installed."""
    try:
        from numba.core import caching
    except ImportError:
        return False
    names = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
    bases = [b for b in (getattr(caching, name, None) for name in names) if isinstance(b, type)]
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    if len(bases) != len(names) or not isinstance(getattr(impl, "_locator_classes", None), list):
        return False
    impl._locator_classes[:0] = [_stamped(b) for b in bases]  # type: ignore[union-attr]
    files = getattr(caching, "IndexDataCacheFile", None)
    if isinstance(files, type) and all(callable(getattr(files, n, None)) for n in _CHECKED):
        _check_files(files)
    return True


_CHECKED = ("_load_index", "_save_index", "_load_data", "_save_data", "_data_path")


def _check_files(files: type) -> None:
    """Wrap Numba's cache-file reads and writes: the kernels' files (stamped with kernels_stamp())
    get a digest when written and are checked before they are read; other functions' are untouched."""
    load_index, save_index, load_data, save_data = (getattr(files, n) for n in _CHECKED[:4])

    def ours(self: Any) -> bool:
        return self._source_stamp == kernels_stamp()

    def checked_load_index(self: Any) -> Any:
        if ours(self) and os.path.exists(self._index_path) and not cachefile.intact(self._index_path):
            cachefile.discard(self._index_path)  # every kernel of this file is compiled again
            return {}
        return load_index(self)

    def checked_save_index(self: Any, overloads: Any) -> None:
        save_index(self, overloads)
        if ours(self):
            cachefile.record(self._index_path)

    def checked_load_data(self: Any, name: str) -> Any:
        path = self._data_path(name)
        if ours(self) and not cachefile.intact(path):
            cachefile.discard(path)
            raise FileNotFoundError(path)  # Numba's load() reads an OSError as "not cached": it compiles
        return load_data(self, name)

    def checked_save_data(self: Any, name: str, data: Any) -> None:
        save_data(self, name, data)
        if ours(self):
            cachefile.record(self._data_path(name))

    files._load_index = checked_load_index  # type: ignore[attr-defined]
    files._save_index = checked_save_index  # type: ignore[attr-defined]
    files._load_data = checked_load_data  # type: ignore[attr-defined]
    files._save_data = checked_save_data  # type: ignore[attr-defined]
