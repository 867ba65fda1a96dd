"""The drafter protocol: begin with the prompt, propose tokens, see what was kept.

A drafter never touches the target. ``propose`` asks ``want_more(step, confidence)``
(the controller) before each token and stops when it says no, so a round where the
controller wants nothing costs the drafter nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..sampling import SamplingParams, Uniform

# want_more(step, confidence): step = tokens drafted so far this round, confidence =
# the drafter's probability of the token it just drafted (1.0 before the first)
WantMore = Callable[[int, float], bool]


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    probs: list[np.ndarray | None] = field(default_factory=list)  # q per token; None = point mass (deterministic)
    confidences: list[float] = field(default_factory=list)  # q(d) of each drafted token

    def add(self, token: int, q: np.ndarray | None, confidence: float) -> None:
        self.tokens.append(token)
        self.probs.append(q)
        self.confidences.append(confidence)

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    name: str

    def begin(self, prompt: list[int]) -> None:
        """A new request whose history starts with ``prompt``."""

    def propose(self, history: list[int], want_more: WantMore, max_n: int, params: SamplingParams,
                rng: Uniform) -> Proposal:
        """Up to ``max_n`` tokens continuing ``history`` (which ends with the last emitted token)."""

    def accept(self, history: list[int], n_accepted: int) -> None:
        """The round's outcome: ``history`` now holds the accepted drafts and the target's token."""

    def close(self) -> None:
        """Free what the drafter holds."""


class NoDrafter:
    """Plain decoding through the same loop: proposes nothing, costs nothing."""

    name = "none"

    def begin(self, prompt: list[int]) -> None:
        pass

    def propose(self, history: list[int], want_more: WantMore, max_n: int, params: SamplingParams,
                rng: Uniform) -> Proposal:
        return Proposal()

    def accept(self, history: list[int], n_accepted: int) -> None:
        pass

    def close(self) -> None:
        pass
