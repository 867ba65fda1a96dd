"""The draft vocabulary V' of the shared trunk (FR-Spec, VocabTrim): the V' tokens the model
writes most, so that the draft's LM head is V' rows rather than all of them.

For a small model the LM head is most of a draft step (Qwen2.5-0.5B: 136M of its parameters
against ~15M per block); restricted to the 32,768 most frequent tokens it costs a fifth. The
target still verifies over the full vocabulary: a draft is zero outside V', which greedy
verification and speculative sampling (q(d) = 0 outside V') handle exactly; the only loss is
a target token outside V', which the draft cannot propose.

Frequencies come from text like the model's answers, never from held-out prompts: the
training split of the ShareGPT assistant turns and of the stdlib source (models/README.md's
held-out rules), read from the installed packages, so that every machine computes the same V'
(it once also counted the head-training teacher cache, which made V' depend on what a machine
had trained before: a head trained on one V' ran with another). The end-of-generation tokens
are always in V'. The list is computed once per model and size and cached. A head carries the V'
it was made with (``eesd.head.draft_vocab``, written by ``eesd heads train`` and ``eesd convert``), which
the engine takes before this; where neither exists and ShareGPT is not installed (a plain install: it
is in the dev and train extras only), the stdlib source alone is counted.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eesd_local.base import cachefile
from eesd_local.base.errors import EesdError
from eesd_local.llama.draftvocab import DRAFT_VOCAB, cached_draft_vocab, vocab_path
from eesd_local.llama.runtime import Model
from eesd_local.tools.heads import data


def token_counts(base_path: Path, n_vocab: int, *, max_chars: int = 16_000_000) -> np.ndarray:
    """How often the model would write each token, from training text (the same on every machine)."""
    counts = np.zeros(n_vocab, dtype=np.int64)
    try:
        items = data.interleave(data.sharegpt_text_items(), data.source_items(), weights=(0.7, 0.3))
    except EesdError:  # ShareGPT is in the dev and train extras only: the Python source every install has
        items = data.source_items()
    model = Model(base_path, vocab_only=True)
    try:
        used = 0
        for it in items:
            if used >= max_chars:
                break
            used += len(it.text)
            toks = np.asarray(model.tokenize(it.text, add_special=False, parse_special=False), dtype=np.int64)
            counts += np.bincount(toks, minlength=n_vocab)
    finally:
        model.close()
    return counts


def draft_vocab(base_path: Path, size: int = DRAFT_VOCAB, *, force: bool = False) -> np.ndarray:
    """V': the ``size`` most frequent token ids (sorted ascending, int32), cached per model."""
    base_path = Path(base_path)
    path = vocab_path(base_path, size)
    if not force:  # a damaged, truncated or foreign file is computed again below
        v = cached_draft_vocab(base_path, size)
        if v is not None:
            return v
    model = Model(base_path, vocab_only=True)
    try:
        n_vocab = model.n_vocab
        eog = [t for t in range(n_vocab) if model.is_eog(t)]
    finally:
        model.close()
    if size >= n_vocab:
        v = np.arange(n_vocab, dtype=np.int32)
    else:
        counts = token_counts(base_path, n_vocab).astype(np.float64)
        counts[eog] = np.inf  # always proposable
        order = np.argsort(-counts, kind="stable")  # ties: the lower id first (BPE's earlier, commoner merges)
        v = np.sort(order[:size]).astype(np.int32)
    try:
        with cachefile.derived_path(path) as tmp:
            with open(tmp, "wb") as fh:
                np.save(fh, v)
    except OSError as exc:
        raise EesdError(f"cannot write {path}: {exc.strerror or exc}",
                        hint="free some disk space (or set EESD_HOME to a larger disk) and run again") from None
    return v
