"""Checking that speculative output equals plain decoding, up to certified near-ties.

Batched and single-token decodes can differ in the last bits of the logits, so a
greedy speculative run may take the other branch where the target's two best tokens
are practically tied. :func:`compare` finds the first divergence and certifies it by
recomputing the plain path's logits there: the gap between the token plain decoding
chose and the one speculation chose must be below ``NEAR_TIE`` logits, or, where the gap is
wider (4-bit K-quants batch differently: a 1.5B Q4_K_M row moved by 0.38 logits between a
single-token decode and a batch of 4 on an AVX2 CPU), decoding the same prefix's last tokens as
one batch, as a verify does, must make the speculative token the target's argmax there: the
flip is then shown to come from batching alone. A verify's rows also depend on the keys and values
of earlier tokens, which the run computed in its own earlier batches; so where neither holds,
:func:`replay` decodes the run's own batch schedule again (the verify batch of every round, as the
round events report it) and checks that every token the run emitted is the target's argmax in that
schedule: the speculative output is then greedy decoding of the same model, with the batch shapes
the run used.
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
    batch: int = 0  # > 0: the gap is wider than NEAR_TIE, but a batch of this many tokens makes other_token the argmax;
    # -1: the run's own batch schedule, decoded again, makes every emitted token the argmax (:func:`replay`)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def compare(model: Model, prompt: list[int], plain: list[int], other: list[int], *, n_ctx: int = 4096,
            max_batch: int = 9, schedule: list[tuple[int, int]] | None = None) -> Divergence | None:
    """None when equal (or one is a prefix of the other because it stopped earlier),
    else the first divergence with its certificate (see the module's docstring); ``max_batch``:
    the largest verify batch to try (draft_max + 1); ``schedule``: the other run's (rows, emitted)
    per round, for :func:`replay` where nothing else certifies the divergence."""
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
        if abs(gap) < NEAR_TIE:
            return Divergence(i, plain[i], other[i], gap, True)
        # a verify decodes the row of position i as the last of a batch of k tokens after a prefix
        # decoded one token at a time: does some such batch choose the speculative token?
        seq = prompt + plain[:i]
        for k in range(2, min(max_batch, i + 1) + 1):
            ctx.trim(len(seq) - k)
            ctx.decode(seq[len(seq) - k :], n_logits=1)
            brow = ctx.logits()
            if int(brow.argmax()) == other[i]:
                return Divergence(i, plain[i], other[i], gap, True, batch=k)
    finally:
        ctx.close()
    if schedule and replay(model, prompt, other, schedule, i, n_ctx=n_ctx):
        return Divergence(i, plain[i], other[i], gap, True, batch=-1)
    return Divergence(i, plain[i], other[i], gap, False)


def replay(model: Model, prompt: list[int], other: list[int], schedule: list[tuple[int, int]], upto: int, *,
           n_ctx: int = 4096) -> bool:
    """Decode ``prompt`` and then ``other`` in the run's own verify batches and check that each of
    ``other[:upto + 1]`` is the target's argmax where the run emitted it.

    ``schedule``: (rows, emitted) per round after the first token, as RoundEvent reports them: the
    round decoded [last, d1..d(rows-1)] and emitted ``emitted`` tokens (the accepted drafts and the
    target's token after them). A rejected draft's slot holds the token the target chose instead (the
    run's own draft there is not recorded): rows before it do not depend on it, since attention is causal.
    """
    n = min(upto + 1, len(other))
    if n <= 0:
        return True
    ctx = Context(model, ContextParams(n_ctx=max(n_ctx, len(prompt) + len(other) + 16)))
    try:
        ctx.decode(prompt)
        if int(ctx.logits().argmax()) != other[0]:
            return False
        pos = 1  # other[:pos] checked; the cache holds prompt + other[:pos - 1]
        for rows, emitted in schedule:
            if pos >= n:
                return True
            if rows < 1 or emitted < 1:
                return False
            batch = other[pos - 1 : pos - 1 + rows]
            batch += [other[-1]] * (rows - len(batch))  # past the end of the output: any token (causal)
            ctx.decode(batch, n_logits=rows)
            for j in range(min(emitted, rows)):
                if pos + j < n and int(ctx.logits(j).argmax()) != other[pos + j]:
                    return False
            ctx.trim(len(prompt) + pos - 1 + emitted)
            pos += emitted
        return pos >= n
    finally:
        ctx.close()
