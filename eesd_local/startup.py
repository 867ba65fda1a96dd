"""The console scripts' entry: a Ctrl-C from the program's first line on ends in one line and exit 130.

A console script runs ``from <module> import <function>`` and only then calls it: an interrupt during
that import (argparse, Textual, numpy: tens of milliseconds) escaped every handler of ours and printed
a traceback from inside the imports. So ``eesd`` and ``eesd-chat`` name this module, which imports
only what the interpreter has loaded before any program runs (``sys``, ``_signal``), and it imports
the command inside the handler. What comes before the script's first line is CPython's own start-up:
a Ctrl-C there ends the process by the signal itself, silently (a shell reports 130), or, during
``site`` (several milliseconds; ~30 ms in an editable install, whose import hook loads pathlib), with
CPython's "Fatal Python error: init_import_site".
"""

from __future__ import annotations

import _signal
import sys

_SIGINT = 2


def _interrupted(prog: str) -> int:
    # a second Ctrl-C while exiting must not print a traceback
    _signal.signal(_SIGINT, _signal.SIG_IGN)
    sys.stderr.write(f"\n{prog}: interrupted\n")
    sys.stderr.flush()
    return 130


def _run(prog: str, module: str, function: str) -> int:
    try:
        interrupts = __import__("eesd_local.base.interrupts", fromlist=["keep_interrupts"])
        # a Ctrl-C inside a ctypes callback during the imports (numba compiling) is raised again, not lost
        interrupts.keep_interrupts()
        main = getattr(__import__(module, fromlist=[function]), function)
    except KeyboardInterrupt:
        return _interrupted(prog)
    return int(main())


def eesd() -> int:
    """``eesd``: :func:`eesd_local.cli.main`, its imports inside the handler."""
    return _run("eesd", "eesd_local.cli", "main")


def eesd_chat() -> int:
    """``eesd-chat``: :func:`eesd_chat.app.main`, Textual's imports inside the handler."""
    return _run("eesd-chat", "eesd_chat.app", "main")
