"""What eesd-local promises about its output, and the check of a run against plain decoding.

On the CPU backend of the llama.cpp that the set-up builds (runtime.exactness), every row of a
verify batch is bit-identical to the same token decoded alone, so greedy speculative output is
plain greedy decoding's, byte for byte: any difference is a bug, and :func:`compare` reports it.
Where that does not hold (a GPU backend, RPC servers, a build without the patch), batched and
single-token decodes can differ in the last bits of the logits, and a greedy run may take the
other branch where the target's two best tokens are practically tied: there :func:`compare`
measures the gap between them at the divergence, on the plain path's logits, and calls it a near
tie when it is below ``NEAR_TIE``.
"""

from __future__ import annotations

from dataclasses import dataclass

from eesd_local.base.claim import CLAIM
from eesd_local.llama.runtime import Context, ContextParams, Model

__all__ = ["CLAIM", "NEAR_TIE", "Divergence", "compare", "first_divergence"]

NEAR_TIE = 0.25  # logits; batched vs single-token rounding on GPUs and unpatched CPU builds is ~0.1

@dataclass
class Divergence:
    index: int  # first generated position where the outputs differ
    plain_token: int
    other_token: int
    gap: float  # plain path: logit[plain_token] - logit[other_token]
    near_tie: bool  # gap < NEAR_TIE: what batched rounding can explain where output is not exact


def first_divergence(a: list[int], b: list[int]) -> int | None:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def compare(model: Model, prompt: list[int], plain: list[int], other: list[int], *, n_ctx: int = 4096) -> Divergence | None:
    """None when equal (or one is a prefix of the other because it stopped earlier), else the
    first divergence with the gap of the plain path's logits there."""
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
