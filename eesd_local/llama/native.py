"""The native extension ``eesd_local._native`` (native/): the round loop in C++ and the shared
trunk's capture of a layer's rows. Built by the install (setup.py); :func:`load` says why it cannot
load, :func:`require` raises that as an error a user can act on."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from eesd_local.base.errors import EesdError


@functools.lru_cache(maxsize=1)
def load() -> tuple[Any, str]:
    """(the extension or None, why not)."""
    try:
        module = importlib.import_module("eesd_local._native")  # loaded on first use (it loads libllama)
    except ImportError as exc:
        return None, str(exc)
    return module, ""


def require() -> Any:
    """The extension, or an EesdError that says why it cannot load."""
    module, why = load()
    if module is None:
        raise EesdError(f"the native round loop (eesd_local._native) cannot load: {why}",
                        hint="reinstall with `pip install --no-build-isolation -e .` (bash scripts/setup.sh) to build it")
    return module
