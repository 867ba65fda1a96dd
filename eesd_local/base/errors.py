"""The one user-facing error type.

Anything a user can cause (bad path, unknown model, wrong head, corrupt file, full
context, invalid sampling values) raises :class:`EesdError` with what went wrong,
the offending value and what to do. The CLI and TUI print it without a traceback
and exit with code 2. Every other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class EesdError(Exception):
    """A problem the user can fix; the message says what, which value, and how."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")


class ContextFullError(EesdError):
    """The prompt (plus what must be generated) does not fit into the context."""
