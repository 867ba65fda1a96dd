"""The optional native extension ``eesd_local._native`` (native/): the round loop in C++ and the
shared trunk's capture of a layer's rows. Where it was not built, :func:`load` says why and the
engine runs its Python round loop (the same tokens)."""

from __future__ import annotations

import functools
import importlib
from typing import Any


@functools.lru_cache(maxsize=1)
def load() -> tuple[Any, str]:
    """(the extension or None, why not)."""
    try:
        module = importlib.import_module("eesd_local._native")  # optional, loaded on first use (libllama)
    except ImportError as exc:
        return None, str(exc)
    return module, ""
