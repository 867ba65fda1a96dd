"""``auto``: several sources behind one drafter; the controller picks one per round.

Prompt lookup (free proposals: n-grams of the history) and, when one is known, a model
drafter (the exit head's early-exit draft, or a separate draft model). Before each round the
drafter says what lookup found (:meth:`offer`: how many tokens, how long a match) and how
far the model is behind; a multi-source controller (controllers/multi.py) decides which source
drafts and how many tokens, or none, from each source's own measured acceptance and cost.
A baseline controller (fixed:K, pmin, heuristic) does not choose: then lookup drafts when it
has a match, else the model.
"""

from __future__ import annotations

from eesd_local.speculative.drafters.base import SRC_LOOKUP, SRC_MODEL, DrafterBase, NativeSpec
from eesd_local.speculative.drafters.lookup import LookupDrafter
from eesd_local.speculative.drafters.model import ModelDrafter


class AutoDrafter(DrafterBase):
    free_offers = True  # lookup's offers are free proposals: the controller may learn from each in hindsight

    def __init__(self, model: ModelDrafter | None = None, lookup: LookupDrafter | None = None) -> None:
        self.lookup = lookup or LookupDrafter()
        self.model = model
        self.n_sources = 2 if model is not None else 1
        self.name = f"auto({self.lookup.name}+{model.name})" if model is not None else f"auto({self.lookup.name})"
        self.weight_share = model.weight_share if model is not None else 0.0

    def begin(self, prompt: list[int]) -> None:
        pass  # the model drafter is not fed the prompt: it catches up when the controller first picks it, and that
        # catch-up is charged to resuming it (so where it never pays, it costs no prefill)

    def native(self) -> NativeSpec:
        lookup = (self.lookup.ngram_min, self.lookup.ngram_max)
        return NativeSpec(draft_ctx=self.model.ctx if self.model is not None else None, lookup=lookup, choose=True)

    def source_name(self, source: int) -> str:
        if source == SRC_LOOKUP:
            return self.lookup.name
        return self.model.name if source == SRC_MODEL and self.model is not None else ""

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
