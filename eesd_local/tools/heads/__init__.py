"""Exit heads for the early-exit (EESD) drafter: training, the teacher corpus, evaluation, the
draft vocabulary. The head files themselves and the draft builder are :mod:`eesd_local.gguf.headfile`
(the engine's side); re-exported here::

    fingerprint(base_path) -> str
    find_head(base_path) -> Path | None
    build_draft(base_path, head_path, *, force=False) -> Path
    read_head_info(head_path) -> dict

``heldout_sharegpt_range()`` names the ShareGPT records that are never trained on (the bench
takes its chat prompts only from there).
"""

from __future__ import annotations

from eesd_local.gguf.headfile import build_draft, find_head, fingerprint, read_head_info
from eesd_local.tools.heads.data import SHAREGPT_HELDOUT, heldout_sharegpt_range

__all__ = ["SHAREGPT_HELDOUT", "build_draft", "find_head", "fingerprint", "heldout_sharegpt_range", "read_head_info"]
