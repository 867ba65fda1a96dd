"""The files an engine reads, made before it opens: the engine itself only resolves files that
are present (:func:`eesd_local.llama.catalog.resolve_model`), so whatever downloads or derives a
file runs here, called by the app layer (``eesd_local.load``, the commands, the chat, the bench)."""

from __future__ import annotations

from eesd_local.gguf.headfile import head_draft_vocab
from eesd_local.llama.draftvocab import DRAFT_VOCAB
from eesd_local.speculative.drafters import shared_trunk_plan
from eesd_local.speculative.engine import EngineConfig, check_config
from eesd_local.tools import registry
from eesd_local.tools.heads.draftvocab import draft_vocab
from eesd_local.tools.registry import Progress


def prepare(config: EngineConfig, *, progress: Progress | None = None) -> None:
    """Pull a registry model (and draft model) not downloaded yet, build a weight variant
    (``NAME:KIND``) not built yet, and compute the draft vocabulary V' of a shared trunk not
    computed yet (a head carries its own). Each is done once: a later call finds the files. A bad setting fails first."""
    check_config(config)
    model_path = registry.resolve_model(config.model, progress=progress)
    if config.draft_model:
        registry.resolve_model(config.draft_model, progress=progress)
    plan, _ = shared_trunk_plan(config, model_path)
    if plan is not None and head_draft_vocab(plan[0], DRAFT_VOCAB) is None:  # a head without its own V'
        draft_vocab(model_path, DRAFT_VOCAB)
