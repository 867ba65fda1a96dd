"""Hierarchical drafting: prompt-lookup guesses checked by a model drafter.

Lookup proposes a continuation for free; the model drafter (the early-exit draft)
checks it in one batch and keeps the agreeing prefix, then drafts on by itself.
The tokens handed to the target are distributed as the model drafter's q (in
sampling mode the guesses go through speculative sampling against q), so the
target's verification stays exact.
"""

from __future__ import annotations

from eesd_local.speculative.drafters.base import SRC_ANY, DrafterBase, NativeSpec, Offer, Proposal, WantMore
from eesd_local.speculative.drafters.lookup import LookupDrafter
from eesd_local.speculative.drafters.model import ModelDrafter
from eesd_local.speculative.sampling import SamplingParams, Uniform


class HierarchicalDrafter(DrafterBase):
    name = "hierarchical"

    def __init__(self, inner: ModelDrafter, lookup: LookupDrafter | None = None) -> None:
        self.inner = inner
        self.lookup = lookup or LookupDrafter()
        self.name = f"hierarchical({self.lookup.name}>{inner.name})"

    def begin(self, prompt: list[int]) -> None:
        self.lookup.begin(prompt)
        self.inner.begin(prompt)

    def offer(self, history: list[int], max_n: int) -> Offer:
        return Offer(behind=self.inner.behind(history))  # the lookup's guesses are not free proposals: the model checks them

    def propose(self, history: list[int], want_more: WantMore, max_n: int, params: SamplingParams,
                rng: Uniform, source: int = SRC_ANY) -> Proposal:
        guesses, _ = self.lookup.lookup(history, max_n)
        prop = self.inner.propose(history, want_more, max_n, params, rng, guess=guesses)
        prop.source = self.name
        return prop

    def native(self) -> NativeSpec | None:
        return NativeSpec(draft_ctx=self.inner.ctx, lookup=(self.lookup.ngram_min, self.lookup.ngram_max))

    def close(self) -> None:
        self.inner.close()
