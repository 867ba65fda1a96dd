"""The shared trunk's draft vocabulary V', as the engine reads it: the cached list of the V'
token ids a model writes most (computed once per model and size by
``eesd_local.tools.heads.draftvocab``, which the app layer runs before an engine opens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eesd_local.base import cachefile
from eesd_local.base.errors import EesdError
from eesd_local.base.paths import cache_dir
from eesd_local.gguf.headfile import fingerprint

DRAFT_VOCAB = 32768  # V': the default draft vocabulary size
VOCAB_FORMAT = 1


def vocab_path(base_path: Path, size: int) -> Path:
    """Where the V' of ``size`` tokens of the model ``base_path`` is cached."""
    base_path = Path(base_path)
    return cache_dir("drafts") / f"{base_path.stem}.vocab{size}.v{VOCAB_FORMAT}.{fingerprint(base_path)[:16]}.npy"


def cached_draft_vocab(base_path: Path, size: int = DRAFT_VOCAB) -> np.ndarray | None:
    """V' (token ids sorted ascending, int32) from the cache; None when it is missing, damaged,
    truncated or not the file that was written."""
    path = vocab_path(base_path, size)
    if not cachefile.intact(path):
        return None
    try:
        v = np.load(path)
    except (OSError, ValueError):
        return None
    return v if v.dtype == np.int32 and v.ndim == 1 else None


def read_draft_vocab(base_path: Path, size: int = DRAFT_VOCAB) -> np.ndarray:
    """V' from the cache, or a user error naming how to compute it."""
    v = cached_draft_vocab(base_path, size)
    if v is None:
        raise EesdError(f"the draft vocabulary ({size} tokens) of {Path(base_path).name} is not computed yet",
                        hint="open the model through eesd_local.load or the eesd commands (they compute it), or call "
                             "eesd_local.tools.heads.draftvocab.draft_vocab(path)")
    return v
