"""Prompt lookup: draft the tokens that followed the most recent earlier occurrence of
the current suffix (n-grams from longest to shortest). No model call; strong when
the answer copies its input (edits, code rewrites). The search runs in the round loop
(native/verify.hpp, ``lookup_match``), on the history it holds."""

from __future__ import annotations

from eesd_local.speculative.drafters.base import DrafterBase, NativeSpec


class LookupDrafter(DrafterBase):
    name = "lookup"
    free_offers = True  # its offers are its proposals: the controller may learn from each in hindsight

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def native(self) -> NativeSpec:
        return NativeSpec(lookup=(self.ngram_min, self.ngram_max))
