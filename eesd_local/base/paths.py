"""Where eesd-local keeps files: ``$EESD_HOME`` or ``~/.cache/eesd-local``."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from eesd_local.base.errors import EesdError


def eesd_home() -> Path:
    """The cache root; ``EESD_HOME`` overrides the default ``~/.cache/eesd-local``."""
    env = os.environ.get("EESD_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eesd-local"


def cache_dir(kind: str) -> Path:
    """A writable sub-directory of the cache (``models``, ``downloads``, ``drafts``...)."""
    path = eesd_home() / kind
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EesdError(
            f"cannot create the cache directory {path}: {exc.strerror}",
            hint="set EESD_HOME to a writable directory",
        ) from None
    if not os.access(path, os.W_OK):
        raise EesdError(
            f"the cache directory {path} is not writable",
            hint="set EESD_HOME to a writable directory",
        )
    return path


def package_root() -> Path:
    """The directory that holds ``eesd_local`` (the repository root in a checkout)."""
    return Path(__file__).resolve().parent.parent


def models_dir() -> Path:
    """The shipped ``models/`` data: the registry and the trained exit heads."""
    try:
        return Path(str(resources.files("eesd_local.models")))
    except ModuleNotFoundError:  # a plain checkout, not installed
        return package_root() / "models"
