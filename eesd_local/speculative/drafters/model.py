"""Drafters that run a llama.cpp model of their own: a separate small model
(``draft-model``) or the target's first N layers plus a trained exit layer (``eesd``).

The draft context takes the prompt with the target's prefill, then is kept in step
lazily: before drafting it is trimmed to its common prefix with the history and the
tokens it missed are decoded in one batch, so rounds where nothing is drafted cost
nothing here.
"""

from __future__ import annotations

from pathlib import Path

from eesd_local.base.errors import EesdError
from eesd_local.llama.runtime import Context, ContextParams, Model, common_prefix
from eesd_local.speculative.drafters.base import DrafterBase, NativeSpec


def check_same_vocab(target: Model, draft: Model, what: str) -> None:
    if target.vocab_signature() != draft.vocab_signature():
        raise EesdError(
            f"the {what} {draft.path.name} has another vocabulary than the target {target.path.name} "
            f"({draft.n_vocab} vs {target.n_vocab} tokens)",
            hint="pick a draft model of the same family (same tokenizer), e.g. the 0.5B Qwen2.5-Coder for the 1.5B",
        )


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

    def native(self) -> NativeSpec:
        return NativeSpec(draft_ctx=self.ctx)

    def close(self) -> None:
        if not self.shared:  # the shared trunk belongs to the target
            self.ctx.close()
            self.model.close()
