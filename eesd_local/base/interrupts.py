"""Ctrl-C that lands inside a ctypes callback is not lost.

CPython cannot raise an exception out of a ctypes callback: it prints "Exception ignored on
calling ctypes callback function" with a traceback and carries on. Python code runs in such
callbacks while numba compiles (llvmlite's object-cache hook) and while llama.cpp logs, so a
Ctrl-C at start-up could print a traceback and then be ignored: the program ran on to the end.
:func:`keep_interrupts` installs an unraisable hook that says nothing for a KeyboardInterrupt and
delivers it again to the main thread a moment later, once the callback has returned (if that
lands in another callback, the same happens again: each time the C side has moved on). The same
hook keeps quiet about llvmlite objects whose construction such an interrupt cut short: their
``__del__`` fails on a missing attribute with nothing to free. :class:`Terminated` is SIGTERM raised
the same way (exit 143) where a command asks for it.

:class:`SignalHold` holds SIGINT and SIGTERM back over code that must not see them raised inside it
(numba's C extensions while they import: one prints the KeyboardInterrupt and raises an ImportError in its
place; llvmlite's callbacks while numba compiles) and delivers them once it is left.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

REDELIVER_AFTER_S = 0.02


def _interrupted_construction(hook_args: Any) -> bool:
    """llvmlite's ObjectRef.__del__ failing on an object whose construction a Ctrl-C cut short (numba was
    compiling): it has nothing to free, and its AttributeError is noise after the interrupt."""
    obj = hook_args.object
    return (hook_args.exc_type is AttributeError and getattr(obj, "__name__", "") == "__del__"
            and getattr(obj, "__module__", "").startswith("llvmlite."))


def _redeliver_interrupts(hook_args: Any) -> None:
    if _interrupted_construction(hook_args):
        return
    if hook_args.exc_type is not None and issubclass(hook_args.exc_type, KeyboardInterrupt):
        # a real signal, not _thread.interrupt_main: that one does not wake a main thread in a blocking call
        main = threading.main_thread().ident
        for _ in range(3):
            try:
                timer = threading.Timer(REDELIVER_AFTER_S, signal.pthread_kill, (main, signal.SIGINT))
                timer.daemon = True
                timer.start()
                return
            except KeyboardInterrupt:
                # a second Ctrl-C landed in this hook (waiting for the timer's thread to start): it would be
                # printed as an exception in the hook; schedule again (a redelivery too many is harmless)
                continue
        return
    sys.__unraisablehook__(hook_args)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as an interrupt so that the same cleanup runs as for Ctrl-C; the command exits 143."""

    exit_code = 128 + signal.SIGTERM


def interrupt_for(signum: int) -> KeyboardInterrupt:
    """The exception a command raises for ``signum`` once it has stopped cleanly."""
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Meanwhile SIGTERM raises :class:`Terminated`, so a plain ``kill`` stops like Ctrl-C (exit 143)."""
    def terminate(signum: int, frame: object) -> None:
        raise Terminated

    try:
        old = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SignalHold:
    """On the main thread, between :meth:`hold` and :meth:`release` (nested holds counted), SIGINT and SIGTERM
    with a Python handler are recorded instead of handled, then raised again once the outermost hold is
    released, with the handlers put back. Python runs signal handlers on the main thread only, so a hold on
    another thread does nothing (and needs nothing)."""

    def __init__(self) -> None:
        self.depth = 0
        self.saved: dict[int, Any] = {}
        self.pending: list[int] = []

    def _record(self, signum: int, frame: object) -> None:
        if signum not in self.pending:
            self.pending.append(signum)

    def hold(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.depth += 1
        if self.depth > 1:
            return
        self.saved, self.pending = {}, []
        for sig in HELD_SIGNALS:
            old = signal.getsignal(sig)
            if callable(old):
                self.saved[sig] = old
                signal.signal(sig, self._record)

    def release(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self.depth == 0:
            return
        self.depth -= 1
        if self.depth:
            return
        for sig, old in self.saved.items():
            if signal.getsignal(sig) == self._record:  # nobody replaced it meanwhile
                signal.signal(sig, old)
        self.saved = {}
        pending, self.pending = self.pending, []
        for sig in pending:
            signal.raise_signal(sig)  # the handler runs now, outside what was held


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM meanwhile held and delivered on leaving (see :class:`SignalHold`)."""
    hold = SignalHold()
    hold.hold()
    try:
        yield
    finally:
        hold.release()


def keep_interrupts() -> None:
    """For a command-line program's main: a Ctrl-C swallowed by a callback is raised again (see above)."""
    sys.unraisablehook = _redeliver_interrupts
