"""Ctrl-C that lands inside a ctypes callback is not lost.

CPython cannot raise an exception out of a ctypes callback: it prints "Exception ignored on
calling ctypes callback function" with a traceback and carries on. Python code runs in such
callbacks while numba compiles (llvmlite's object-cache hook) and while llama.cpp logs, so a
Ctrl-C at start-up could print a traceback and then be ignored: the program ran on to the end.
:func:`keep_interrupts` installs an unraisable hook that says nothing for a KeyboardInterrupt and
delivers it again to the main thread a moment later, once the callback has returned (if that
lands in another callback, the same happens again: each time the C side has moved on).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

REDELIVER_AFTER_S = 0.02


def _redeliver_interrupts(hook_args: Any) -> None:
    if hook_args.exc_type is not None and issubclass(hook_args.exc_type, KeyboardInterrupt):
        # a real signal, not _thread.interrupt_main: that one does not wake a main thread in a blocking call
        main = threading.main_thread().ident
        timer = threading.Timer(REDELIVER_AFTER_S, signal.pthread_kill, (main, signal.SIGINT))
        timer.daemon = True
        timer.start()
        return
    sys.__unraisablehook__(hook_args)


def keep_interrupts() -> None:
    """For a command-line program's main: a Ctrl-C swallowed by a callback is raised again (see above)."""
    sys.unraisablehook = _redeliver_interrupts
