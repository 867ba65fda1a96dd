"""Random numbers for controller kernels, held inside the controller's own state array.

The generator is xoshiro128** (Blackman and Vigna): four 32-bit words, each stored
as an exact integer in a float64 slot (every integer below 2**53 is exact), so the
whole controller is one float64 array. Every operation is on integers below 2**41 or
on IEEE doubles with libm calls, so compiled code and plain Python
(``NUMBA_DISABLE_JIT=1``) produce the same bits, hence the same decisions.
"""

from __future__ import annotations

import math

from eesd_local.llama import native
from eesd_local.speculative.controllers.jitcache import kernel

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF
TWO32 = 4294967296.0
RNG_WORDS = 4


def seed_words(seed: int) -> list[int]:
    """Four non-zero 32-bit words from a seed, by splitmix64 (the token sampler's generator, in native/probs.hpp)."""
    splitmix64 = native.require().splitmix64
    x = seed & MASK64
    words: list[int] = []
    while len(words) < RNG_WORDS:
        z, x = splitmix64(x)
        words.extend([z & MASK32, z >> 32])
    if not any(words):
        words[0] = 1  # the all-zero state is the one fixed point of xoshiro
    return words[:RNG_WORDS]


@kernel
def _rotl32(x, k):
    return ((x << k) | (x >> (32 - k))) & MASK32


@kernel
def next_u32(state, at):
    """Next 32-bit output of the xoshiro128** generator whose words sit at state[at:at+4]."""
    s0 = int(state[at])
    s1 = int(state[at + 1])
    s2 = int(state[at + 2])
    s3 = int(state[at + 3])
    result = (_rotl32((s1 * 5) & MASK32, 7) * 9) & MASK32
    t = (s1 << 9) & MASK32
    s2 ^= s0
    s3 ^= s1
    s1 ^= s2
    s0 ^= s3
    s2 ^= t
    s3 = _rotl32(s3, 11)
    state[at] = s0
    state[at + 1] = s1
    state[at + 2] = s2
    state[at + 3] = s3
    return result


@kernel
def uniform(state, at):
    """U(0, 1), never exactly 0 or 1: (n + 1/2) / 2**32."""
    return (next_u32(state, at) + 0.5) / TWO32


@kernel
def normal(state, at):
    """N(0, 1) by Box-Muller: sqrt(-2 ln u1) cos(2 pi u2)."""
    u1 = uniform(state, at)
    u2 = uniform(state, at)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


@kernel
def gamma(state, at, shape):
    """Gamma(shape, 1) by Marsaglia and Tsang (2000).

    For shape < 1: Gamma(shape) = Gamma(shape + 1) * U**(1/shape).
    """
    boost = 1.0
    if shape < 1.0:
        boost = math.pow(uniform(state, at), 1.0 / shape)
        shape += 1.0
    d = shape - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    while True:
        x = normal(state, at)
        v = 1.0 + c * x
        if v <= 0.0:
            continue
        v = v * v * v
        u = uniform(state, at)
        x2 = x * x
        if u < 1.0 - 0.0331 * x2 * x2:  # squeeze: accepts ~98% without a log
            return d * v * boost
        if math.log(u) < 0.5 * x2 + d * (1.0 - v + math.log(v)):
            return d * v * boost


@kernel
def beta(state, at, a, b):
    """Beta(a, b) as X / (X + Y) with X ~ Gamma(a), Y ~ Gamma(b)."""
    x = gamma(state, at, a)
    y = gamma(state, at, b)
    return x / (x + y)
