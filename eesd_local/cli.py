"""``eesd``: one entry point, one sub-command module per tool.

Each module in :data:`COMMAND_MODULES` has ``register(subparsers)`` that adds its
parsers with ``set_defaults(func=...)``; ``func(args)`` returns an exit code. ``main``
only parses and turns :class:`EesdError` into a clean message with exit code 2, and Ctrl-C
(at any point, imports included) into ``eesd: interrupted`` with exit code 130.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
from importlib.metadata import PackageNotFoundError, version

from eesd_local.base.claim import CLAIM
from eesd_local.base.errors import EesdError
from eesd_local.base.interrupts import Terminated, keep_interrupts

# command -> the module that registers it
COMMANDS = {
    "models": "eesd_local.commands.models",
    "generate": "eesd_local.commands.generate",
    "serve": "eesd_local.commands.serve",
    "convert": "eesd_local.commands.convert",
    "simulate": "eesd_local.commands.simulate",
    "heads": "eesd_local.commands.heads",
    "bench": "eesd_local.commands.bench",
    "rpc-server": "eesd_local.commands.rpcserver",
}
COMMAND_MODULES = list(COMMANDS.values())


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given ``argv`` that names a command, only that command's module is imported (the
    others bring the HTTP server, the bench and the training stack: ~0.5 s before `eesd generate`'s
    first token), else every command (help, a mistyped command)."""
    parser = argparse.ArgumentParser(prog="eesd", description="Lossless speculative decoding on llama.cpp.", epilog=CLAIM)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    named = next((a for a in argv or () if not a.startswith("-")), None)
    for name in [COMMANDS[named]] if named in COMMANDS else COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _version() -> str:
    try:
        return version("eesd-local")
    except PackageNotFoundError:
        return "0+checkout"


def report_error(exc: EesdError) -> None:
    print(f"eesd: error: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"  hint: {exc.hint}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C may come at any moment, the sub-commands' imports (llama.cpp, numba) included:
    # everything from building the parser on runs inside the handler (and one that lands in a ctypes
    # callback, which CPython would print and swallow, is raised again once the callback returned)
    keep_interrupts()
    try:
        return _run(argv)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM where a command turned it into Terminated
        with contextlib.suppress(ValueError):  # ValueError: not the main thread
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while exiting must not print a traceback
        terminated = isinstance(exc, Terminated)
        print(f"\neesd: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return Terminated.exit_code if terminated else 130


def _run(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EesdError as exc:
        report_error(exc)
        return exc.exit_code
    except BrokenPipeError:  # `eesd generate ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
