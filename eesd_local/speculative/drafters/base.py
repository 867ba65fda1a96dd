"""The drafter protocol: begin with the prompt, say how the round loop drafts (:meth:`Drafter.native`).

A drafter never touches the target. The built-in drafters are forms the native round loop runs
itself (a draft context, prompt lookup, both, or the controller's choice of the two). A drafter
written in Python says ``NativeSpec(python=True)`` (:class:`DrafterBase`'s default) and the loop
calls its :meth:`~Drafter.offer` and :meth:`~Drafter.propose` once a round; ``propose`` asks
``want_more(step, confidence)`` (the controller) before each token and stops when it says no, so a
round where the controller wants nothing costs the drafter nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from eesd_local.speculative.sampling import SamplingParams, Uniform

if TYPE_CHECKING:
    from eesd_local.llama.runtime import Context

# want_more(step, confidence): step = tokens drafted so far this round, confidence =
# the drafter's probability of the token it just drafted (1.0 before the first)
WantMore = Callable[[int, float], bool]


# which source drafts a round, as the controller numbers them (controllers/layout.py SRC_*)
SRC_ANY, SRC_NONE, SRC_LOOKUP, SRC_MODEL = -2, -1, 0, 1


class Offer(NamedTuple):
    """What a drafter knows before a round, at no cost: the controller plans with it."""

    n: int = 0  # free proposals on offer (prompt lookup's continuation length)
    confidence: float = 0.0  # their confidence (0: unknown)
    behind: int = 0  # tokens a draft model would catch up on before its first draft
    tokens: tuple[int, ...] = ()  # the free proposals themselves (for learning from them in hindsight)
    match: int = 0  # how many tokens before them match their source (lookup: at least the n-gram, up to MATCH_CAP)


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    probs: list[np.ndarray | None] = field(default_factory=list)  # q per token; None = point mass (deterministic)
    confidences: list[float] = field(default_factory=list)  # q(d) of each drafted token
    source: str = ""  # the source that drafted them ("lookup", "eesd", ...)
    t_catchup: float = 0.0  # seconds a draft model spent catching up before drafting (part of the draft time)

    def add(self, token: int, q: np.ndarray | None, confidence: float) -> None:
        self.tokens.append(token)
        self.probs.append(q)
        self.confidences.append(confidence)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class NativeSpec:
    """How the round loop drafts: with ``draft_ctx`` token by token (its guesses, if any, from
    ``lookup``), else from ``lookup`` alone, else nothing; with ``choose``, each round from the source
    the controller picks; with ``python``, by calling the drafter's own offer and propose."""

    draft_ctx: Context | None = None  # a llama.cpp context drafting token by token
    lookup: tuple[int, int] | None = None  # (ngram_min, ngram_max) of a prompt lookup over the history
    choose: bool = False  # the controller picks the source each round: lookup alone, or draft_ctx alone
    python: bool = False  # a drafter written in Python: offer() and propose() once a round


class Drafter(Protocol):
    """What every drafter has. :class:`DrafterBase` gives the members a simple drafter leaves as they are;
    the engine and the round loops read them directly (a drafter says what it has, nothing is probed)."""

    name: str
    n_sources: int  # sources the controller picks between each round (auto: 2); 1: it only sizes the drafts
    free_offers: bool  # its offers are its proposals (prompt lookup): the controller learns from each in hindsight
    weight_share: float  # its own weights over the target's (what catching up costs); 0: none of its own
    drafts: bool  # False for plain decoding: nothing to plan, no cost profile to read

    def begin(self, prompt: list[int]) -> None:
        """A new request whose history starts with ``prompt``."""

    def offer(self, history: list[int], max_n: int) -> Offer:
        """A drafter written in Python: what a round could have for free before the controller begins it
        (a match, a model's catch-up); ``Offer()``: nothing. Not called for the loop's own forms."""

    def propose(self, history: list[int], want_more: WantMore, max_n: int, params: SamplingParams,
                rng: Uniform, source: int = SRC_ANY) -> Proposal:
        """A drafter written in Python: up to ``max_n`` tokens continuing ``history`` (which ends with the
        last emitted token), from ``source`` (SRC_LOOKUP, SRC_MODEL, SRC_NONE: the controller's pick where
        ``n_sources`` > 1; SRC_ANY: the drafter's own choice). Not called for the loop's own forms."""

    def source_name(self, source: int) -> str:
        """The name a round drafted from ``source`` shows (auto: "lookup" or the model's)."""

    def native(self) -> NativeSpec:
        """How the round loop drafts for this drafter (``NativeSpec(python=True)``: by calling offer and
        propose)."""

    def close(self) -> None:
        """Free what the drafter holds."""


PROTOCOL_MEMBERS = ("name", "n_sources", "free_offers", "weight_share", "drafts", "begin", "offer", "propose",
                    "source_name", "native", "close")


class DrafterBase:
    """The protocol's defaults: one source, no free offers, no weights of its own, offers nothing, proposes
    in Python (the loop calls it once a round), holds nothing. A drafter subclasses it and overrides what it
    has."""

    name = "drafter"
    n_sources = 1
    free_offers = False
    weight_share = 0.0
    drafts = True

    def begin(self, prompt: list[int]) -> None:
        pass

    def offer(self, history: list[int], max_n: int) -> Offer:
        return Offer()

    def propose(self, history: list[int], want_more: WantMore, max_n: int, params: SamplingParams,
                rng: Uniform, source: int = SRC_ANY) -> Proposal:
        return Proposal()

    def source_name(self, source: int) -> str:
        return self.name

    def native(self) -> NativeSpec:
        return NativeSpec(python=True)

    def close(self) -> None:
        pass


class NoDrafter(DrafterBase):
    """Plain decoding through the same loop: proposes nothing, costs nothing."""

    name = "none"
    drafts = False

    def native(self) -> NativeSpec:
        return NativeSpec()
