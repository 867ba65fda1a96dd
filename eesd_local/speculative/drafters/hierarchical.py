"""Hierarchical drafting: prompt-lookup guesses checked by a model drafter.

Lookup proposes a continuation for free; the model drafter (the early-exit draft)
checks it in one batch and keeps the agreeing prefix, then drafts on by itself.
The tokens handed to the target are distributed as the model drafter's q (in
sampling mode the guesses go through speculative sampling against q), so the
target's verification stays exact.
"""

from __future__ import annotations

from eesd_local.speculative.drafters.base import DrafterBase, NativeSpec
from eesd_local.speculative.drafters.lookup import LookupDrafter
from eesd_local.speculative.drafters.model import ModelDrafter


class HierarchicalDrafter(DrafterBase):
    name = "hierarchical"

    def __init__(self, inner: ModelDrafter, lookup: LookupDrafter | None = None) -> None:
        self.inner = inner
        self.lookup = lookup or LookupDrafter()
        self.name = f"hierarchical({self.lookup.name}>{inner.name})"

    def begin(self, prompt: list[int]) -> None:
        self.inner.begin(prompt)

    def native(self) -> NativeSpec:
        return NativeSpec(draft_ctx=self.inner.ctx, lookup=(self.lookup.ngram_min, self.lookup.ngram_max))

    def close(self) -> None:
        self.inner.close()
