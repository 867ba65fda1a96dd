"""Sampling parameters and the token sampler's random stream.

The maths lives in the round loop (native/probs.hpp, native/verify.hpp): the target's distribution
p and the drafter's q go through the very same processing (top-k, top-p, temperature, in
llama.cpp's order), so speculative sampling keeps the target's distribution exactly:

    accept draft d with probability min(1, p(d) / q(d))
    on rejection sample from  r = max(0, p - q) / sum(max(0, p - q))
    when all k drafts are accepted sample a bonus token from p_{k+1}
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

from eesd_local.base.defaults import SEED, TEMPERATURE, TOP_K, TOP_P
from eesd_local.base.params import SEED_MAX, SEED_MIN, check_optional_int, check_temperature, check_top_k, check_top_p
from eesd_local.llama import native


class Uniform(Protocol):
    """A source of U[0, 1) draws: :class:`TokenRNG`, or a NumPy Generator in tests."""

    def random(self) -> float: ...


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = TEMPERATURE  # 0 means greedy (argmax)
    top_k: int = TOP_K  # 0 disables
    top_p: float = TOP_P  # 1 disables
    seed: int | None = SEED

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        check_top_k(self.top_k)
        check_top_p(self.top_p)
        check_optional_int("seed", self.seed, SEED_MIN, SEED_MAX, hint="leave it out for a random seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def rng(self) -> TokenRNG:
        return TokenRNG(self.seed)


_MASK64 = 0xFFFFFFFFFFFFFFFF


class TokenRNG:
    """The token sampler's random stream: splitmix64 (Steele, Lea and Flood 2014), one 64-bit word of
    state. The round loop draws from it in C++ and hands the state back; ``random()`` (a drafter
    written in Python) draws from the same generator there: (z >> 11) * 2**-53, a double in [0, 1)."""

    __slots__ = ("state",)

    def __init__(self, seed: int | None = None) -> None:
        self.state = (int.from_bytes(os.urandom(8), "little") if seed is None else seed) & _MASK64

    def random(self) -> float:
        u, self.state = native.require().random(self.state)
        return float(u)
