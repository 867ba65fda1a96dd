"""Checking that speculative output equals plain decoding, up to certified near-ties.

Batched and single-token decodes can differ in the last bits of the logits, so a
greedy speculative run may take the other branch where the target's two best tokens
are practically tied. :func:`compare` finds the first divergence and certifies it by
recomputing the plain path's logits there: the gap between the token plain decoding
chose and the one speculation chose must be below ``NEAR_TIE`` logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from .runtime import Context, ContextParams, Model

NEAR_TIE = 0.25  # logits; batched vs single-token rounding is ~0.1 (BENCHMARKS.md)

# what eesd-local promises, in these words wherever it is said (README, API, eesd-chat --help)
CLAIM = ("Greedy output equals plain decoding, except where the target's two best tokens tie within the float "
         "noise between batched and single-token decodes (the bench certifies each such divergence); sampling "
         'keeps the target\'s exact distribution (real speculative sampling, not "sample and match").')


@dataclass
class Divergence:
    index: int  # first generated position where the outputs differ
    plain_token: int
    other_token: int
    gap: float  # plain path: logit[plain_token] - logit[other_token]
    near_tie: bool


def first_divergence(a: list[int], b: list[int]) -> int | None:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def compare(model: Model, prompt: list[int], plain: list[int], other: list[int], *, n_ctx: int = 4096) -> Divergence | None:
    """None when equal (or one is a prefix of the other because it stopped earlier),
    else the first divergence with its near-tie certificate."""
    i = first_divergence(plain, other)
    if i is None or i >= min(len(plain), len(other)):
        return None
    ctx = Context(model, ContextParams(n_ctx=max(n_ctx, len(prompt) + i + 8)))
    try:
        ctx.decode(prompt)  # the same shapes as plain decoding: prefill, then one token at a time
        for tok in plain[:i]:
            ctx.decode([tok])
        row = ctx.logits()
        gap = float(row[plain[i]] - row[other[i]])
    finally:
        ctx.close()
    return Divergence(i, plain[i], other[i], gap, abs(gap) < NEAR_TIE)
