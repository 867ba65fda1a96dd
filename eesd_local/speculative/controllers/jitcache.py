"""Numba's on-disk cache for the controller kernels, invalidated by an edit to any of them.

Numba stamps a cached function with a hash of its own source file only, but a compiled
function contains the code of everything it calls: after an edit to thompson.py, the
cached kernels.controller_decide (and simulator.run_rounds) would go on running the old
code. Our kernels are compiled with :func:`kernel` and :func:`kernel_cfunc`, which give each its
own cache (a subclass of Numba's FunctionCache) whose locators stamp it with one hash over all
kernel files instead. Nothing of Numba's is patched: other Numba code in the process caches as
before. Should Numba's caching internals
(numba.core.caching) move, the kernels fall back to Numba's own cache.

Numba reads its cache files back without checking them: a damaged data file is unpickled
into machine code that runs (or raises an UnpicklingError out of the first call). So the
kernels' index and data files carry a content check (:mod:`eesd_local.base.cachefile`): each file Numba
writes for a kernel gets its digest, and a file that fails the check before Numba reads it is
removed and its kernel compiled again.

While Numba holds its compiler lock (compiling a kernel, or loading one from the cache), a SIGINT or
SIGTERM whose handler is Python's is held and delivered once the lock is released (:class:`HoldSignals`,
listening only while one of these kernels compiles or loads: importing registers nothing, and other
Numba code in the process compiles as before): the handler would otherwise raise inside llvmlite's ctypes callbacks, whose C
side then goes on with what the callback never returned (a segmentation fault, seen 1 in ~150 Ctrl-Cs
landing while eesd-chat loads). Importing Numba holds them the same way (its C extensions print an
interrupt and raise an ImportError in its place).
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eesd_local.base import cachefile
from eesd_local.base.interrupts import SignalHold, signals_held

# Numba's C extensions must not see a Ctrl-C while they import: numba._dispatcher prints the
# KeyboardInterrupt's traceback and raises "ImportError: numba._devicearray failed to import" instead
with signals_held():
    import numba
    from numba.core import caching, event, sigutils
    from numba.core.ccallback import CFunc
    from numba.core.dispatcher import Dispatcher


class HoldSignals(event.Listener):
    """Numba's "numba:compiler_lock" events: while the lock is held on the main thread, SIGINT and SIGTERM
    are held (:class:`~eesd_local.base.interrupts.SignalHold`) and delivered once it is released."""

    def __init__(self) -> None:
        self.signals = SignalHold()

    def on_start(self, ev: event.Event) -> None:
        self.signals.hold()

    def on_end(self, ev: event.Event) -> None:
        self.signals.release()


_HOLD = HoldSignals()
_listening = threading.local()


def _holding_signals(compile: Callable) -> Callable:
    """``compile`` (a kernel's) with :class:`HoldSignals` listening meanwhile; nested compiles (a cfunc's
    callees) inside the outermost one's listening."""

    @functools.wraps(compile)
    def held(*args: Any, **kw: Any) -> Any:
        if getattr(_listening, "on", False):
            return compile(*args, **kw)
        _listening.on = True
        try:
            with event.install_listener("numba:compiler_lock", _HOLD):
                return compile(*args, **kw)
        finally:
            _listening.on = False

    return held

_PACKAGE = Path(__file__).resolve().parent
# the kernel files: the controllers' and the simulator's (whose run_rounds calls them)
KERNEL_FILES = tuple(sorted(_PACKAGE.glob("*.py"))) + (_PACKAGE.parent.parent / "tools" / "simulator.py",)


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


_LOCATORS = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
_CHECKED = ("_load_index", "_save_index", "_load_data", "_save_data", "_data_path")


@functools.cache
def _cache_class() -> type | None:
    """A FunctionCache for the kernels: stamped locators first, checked cache files; None where
    Numba's caching internals are not the ones this was written against."""
    bases: list[Any] = [getattr(caching, name, None) for name in _LOCATORS]
    impl: Any = getattr(caching, "CompileResultCacheImpl", None)
    cache: Any = getattr(caching, "FunctionCache", None)
    files: Any = getattr(caching, "IndexDataCacheFile", None)
    if not all(isinstance(b, type) for b in bases) or not all(isinstance(c, type) for c in (impl, cache, files)):
        return None
    if not isinstance(getattr(impl, "_locator_classes", None), list) or not all(callable(getattr(files, n, None)) for n in _CHECKED):
        return None

    class KernelCacheImpl(impl):  # type: ignore[misc, valid-type]
        _locator_classes = [_stamped(b) for b in bases] + impl._locator_classes

    checked = _checked_files(files)

    class KernelCache(cache):  # type: ignore[misc, valid-type]
        _impl_class = KernelCacheImpl

        def __init__(self, py_func: Any) -> None:
            super().__init__(py_func)
            self._cache_file = checked(cache_path=self._cache_path, filename_base=self._impl.filename_base,
                                       source_stamp=self._impl.locator.get_source_stamp())

    return KernelCache



def _cached(compiled: Any, py_func: Any) -> Any:
    """``compiled`` (a dispatcher or a cfunc) with the kernels' cache, or Numba's own as a fallback, and
    signals held while it compiles or loads (Numba calls a dispatcher's ``compile`` for a call from
    Python and for a call from another kernel alike)."""
    compiled.compile = _holding_signals(compiled.compile)
    cache = _cache_class()
    if cache is None:
        compiled.enable_caching()
    else:
        compiled._cache = cache(py_func)  # what enable_caching() does, with our cache class
    return compiled


def kernel(fn: Callable) -> Any:
    """``numba.njit(cache=True)`` for a controller or simulator kernel, cached with the stamp over
    every kernel file."""
    compiled = numba.njit(fn)
    if not isinstance(compiled, Dispatcher):  # NUMBA_DISABLE_JIT: the Python function
        return compiled
    return _cached(compiled, compiled.py_func)


def kernel_cfunc(sig: Any) -> Callable[[Callable], Any]:
    """``numba.cfunc(sig, cache=True)`` for a kernel handed to the native loop, cached as :func:`kernel`."""

    def wrap(fn: Callable) -> Any:
        compiled = CFunc(fn, sigutils.normalize_signature(sig), locals={}, options={})
        _cached(compiled, fn)
        compiled.compile()
        return compiled

    return wrap


def _checked_files(files: type) -> type:
    """Numba's cache-file class with the kernels' files (all stamped with kernels_stamp()) given a
    digest when written and checked before they are read."""

    class CheckedCacheFile(files):  # type: ignore[misc, valid-type]
        def _load_index(self) -> Any:
            if os.path.exists(self._index_path) and not cachefile.intact(self._index_path):
                cachefile.discard(self._index_path)  # every kernel of this file is compiled again
                return {}
            return super()._load_index()

        def _save_index(self, overloads: Any) -> None:
            super()._save_index(overloads)
            cachefile.record(self._index_path)

        def _load_data(self, name: str) -> Any:
            path = self._data_path(name)
            if not cachefile.intact(path):
                cachefile.discard(path)
                raise FileNotFoundError(path)  # Numba's load() reads an OSError as "not cached": it compiles
            return super()._load_data(name)

        def _save_data(self, name: str, data: Any) -> None:
            super()._save_data(name, data)
            cachefile.record(self._data_path(name))

    return CheckedCacheFile
