"""Numba's on-disk cache for the controller kernels, invalidated by an edit to any of them.

Numba stamps a cached function with a hash of its own source file only, but a compiled
function contains the code of everything it calls: after an edit to thompson.py, the
cached kernels.controller_decide (and simulator.run_rounds) would go on running the old
code. These locators stamp every kernel with one hash over all kernel files instead.
They use Numba's cache-locator hook (numba.core.caching); should that move, caching
falls back to Numba's default.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

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
    return True
