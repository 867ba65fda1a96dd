"""Drafters that run a llama.cpp model of their own: a separate small model
(``draft-model``) or the target's first N layers plus a trained exit layer (``eesd``).

The draft context takes the prompt with the target's prefill, then is kept in step
lazily: before drafting it is trimmed to its common prefix with the history and the
tokens it missed are decoded in one batch, so rounds where nothing is drafted cost
nothing here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from eesd_local.base.errors import EesdError
from eesd_local.llama.runtime import Context, ContextParams, Model, common_prefix
from eesd_local.speculative.drafters.base import SRC_ANY, DrafterBase, NativeSpec, Offer, Proposal, WantMore
from eesd_local.speculative.sampling import SamplingParams, Uniform, probs, sample


def check_same_vocab(target: Model, draft: Model, what: str) -> None:
    if target.vocab_signature() != draft.vocab_signature():
        raise EesdError(
            f"the {what} {draft.path.name} has another vocabulary than the target {target.path.name} "
            f"({draft.n_vocab} vs {target.n_vocab} tokens)",
            hint="pick a draft model of the same family (same tokenizer), e.g. the 0.5B Qwen2.5-Coder for the 1.5B",
        )


def pick(row: np.ndarray, guess: int | None, params: SamplingParams, rng: Uniform) -> tuple[int, np.ndarray | None, float]:
    """(token, q, confidence) from a draft logit row; a guess is kept only as q allows.

    Greedy: the argmax. Sampling: a token distributed exactly as q; with a guess g
    (a deterministic proposal) g is kept with probability q(g), else a token is drawn
    from q with g removed, which is speculative sampling one level down.
    """
    if params.greedy:
        tok = int(np.argmax(row))
        conf = float(1.0 / np.exp(row.astype(np.float64) - float(row[tok])).sum())
        return tok, None, conf
    q = probs(row, params)
    if guess is not None:
        if rng.random() < q[guess]:
            return guess, q, float(q[guess])
        residual = q.copy()
        residual[guess] = 0.0
        if residual.sum() > 0:
            tok = sample(residual / residual.sum(), rng)
            return tok, q, float(q[tok])
    tok = sample(q, rng)
    return tok, q, float(q[tok])


class ModelDrafter(DrafterBase):
    """Draft token by token with a llama.cpp model sharing the target's vocabulary."""

    def __init__(self, path: Path, target: Model, *, name: str = "draft-model", n_ctx: int = 4096,
                 n_gpu_layers: int = 0, n_threads: int | None = None, rpc: tuple[str, ...] = ()) -> None:
        self.name = name
        self.model = Model(path, n_gpu_layers=n_gpu_layers, rpc=rpc)
        check_same_vocab(target, self.model, "draft model" if name == "draft-model" else "draft file")
        # the draft's weights over the target's: what a token of catching up costs, roughly, against a target token
        self.weight_share = path.stat().st_size / max(1, Path(target.path).stat().st_size)
        self.ctx = Context(self.model, ContextParams(n_ctx=n_ctx, n_threads=n_threads))
        self.shared = False

    @classmethod
    def on_trunk(cls, trunk: Context, *, name: str = "eesd") -> ModelDrafter:
        """The exit head's draft on the shared trunk (:mod:`eesd_local.llama.trunk`): the target's own trunk+exit
        context, which every verify keeps in step, so it never catches up and begins with nothing."""
        self = cls.__new__(cls)
        self.name, self.model, self.ctx, self.shared = name, trunk.model, trunk, True
        self.weight_share = 0.0
        return self

    def begin(self, prompt: list[int]) -> None:
        # the prompt (but its last token, which the first draft step feeds) goes in now, as part of
        # the request's prefill: caught up inside the first round it would count as draft time and
        # tell the controller that a drafted token costs as much as a whole prompt
        if self.shared:
            return  # the target's prefill ran the trunk
        ctx = self.ctx
        n0 = min(common_prefix(ctx.tokens, prompt), len(prompt) - 1)
        ctx.trim(n0)
        if n0 < len(prompt) - 1:
            ctx.decode(prompt[n0:-1])

    def behind(self, history: list[int]) -> int:
        """Tokens of ``history`` the draft context lacks, but the last one (which every draft step feeds)."""
        return len(history) - 1 - min(common_prefix(self.ctx.tokens, history), len(history) - 1)

    def offer(self, history: list[int], max_n: int) -> Offer:
        return Offer(behind=self.behind(history))

    def propose(self, history: list[int], want_more: WantMore, max_n: int, params: SamplingParams,
                rng: Uniform, source: int = SRC_ANY, guess: Sequence[int] = ()) -> Proposal:
        prop = Proposal(source=self.name)
        if max_n <= 0 or not want_more(0, 1.0):
            return prop
        ctx = self.ctx
        n0 = min(common_prefix(ctx.tokens, history), len(history) - 1)
        ctx.trim(n0)
        feed = history[n0:]
        guesses = list(guess[: max(0, min(max_n, ctx.room() - len(feed)))])
        if len(feed) + len(guesses) > ctx.room():
            return prop
        if len(feed) > 1:  # catching up on tokens emitted while it did not draft: timed apart (charged to resuming)
            t0 = time.perf_counter()
            ctx.decode(feed[:-1], n_logits=0)
            prop.t_catchup = time.perf_counter() - t0
            feed = feed[-1:]
        ctx.decode(feed + guesses, n_logits=len(guesses) + 1)
        # greedy on the shared trunk: argmax and confidence over the V' row itself, mapped to a target id
        # (the same token as over the full row with -inf outside V', without writing 150k entries per step)
        vmap = getattr(ctx, "vocab", None) if self.shared and params.greedy else None
        row_of = getattr(ctx, "draft_logits") if vmap is not None else ctx.logits  # noqa: B009 (a TrunkContext's)
        rows: list[np.ndarray] = [row_of(i) for i in range(len(guesses) + 1)] if guesses else [row_of(-1)]
        while True:
            j = len(prop)  # rows[j] is the distribution after history + prop
            g = guesses[j] if j < len(guesses) else None
            tok, q, conf = pick(rows[j], g, params, rng)
            if vmap is not None:
                tok = int(vmap[tok])
            prop.add(tok, q, conf)
            if len(prop) >= max_n or not want_more(len(prop), conf):
                break
            if tok == g and j + 1 < len(rows):
                continue  # the next row was computed with g in place
            ctx.trim(len(history) + j)  # drop the guesses from j on: the KV holds history + prop[:-1]
            guesses = guesses[:j]
            if ctx.room() < 1:
                break
            ctx.decode([tok])
            rows = rows[: j + 1] + [row_of(-1)]
        return prop

    def native(self) -> NativeSpec | None:
        return NativeSpec(draft_ctx=self.ctx)

    def close(self) -> None:
        if not self.shared:  # the shared trunk belongs to the target
            self.ctx.close()
            self.model.close()
