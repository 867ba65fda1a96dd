"""Drafters: each a short module behind the protocol in :mod:`.base`.

``make_drafter`` turns the engine's configuration into a drafter and a one-line note
saying which one runs and why (``auto`` holds prompt lookup and, when an exit head is known
for the model or a draft model is given, that model drafter: the controller picks per round).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eesd_local.base.errors import EesdError
from eesd_local.gguf import headfile
from eesd_local.gguf.check import check_gguf
from eesd_local.gguf.headfile import check_head_for
from eesd_local.llama import costs, native
from eesd_local.llama.catalog import resolve_model
from eesd_local.llama.runtime import Model, default_threads
from eesd_local.llama.trunk import SPLIT_ARCHS
from eesd_local.speculative.controllers.thompson import CPU_DRAFT_MARGIN
from eesd_local.speculative.drafters.auto import AutoDrafter
from eesd_local.speculative.drafters.base import PROTOCOL_MEMBERS, Drafter, DrafterBase, NoDrafter, Offer, Proposal
from eesd_local.speculative.drafters.hierarchical import HierarchicalDrafter
from eesd_local.speculative.drafters.lookup import LookupDrafter
from eesd_local.speculative.drafters.model import ModelDrafter

__all__ = ["DRAFTERS", "REGISTRY", "AutoDrafter", "Drafter", "DrafterBase", "NoDrafter", "Offer", "Proposal", "LookupDrafter",
           "make_drafter", "n_sources", "shared_trunk_plan"]


def n_sources(drafter: Drafter) -> int:
    """How many sources the controller chooses between (1: it only sizes the drafts)."""
    return int(drafter.n_sources)


def _eesd_draft_path(config: Any, model: Model, required: bool) -> Any:
    """The draft GGUF (target's first N layers + exit head), or None when no head is known."""
    if config.head:
        head = resolve_head(config.head)
    else:
        head = headfile.find_head(model.path)
        if head is None:
            if required:
                raise EesdError(
                    f"no exit head is known for {model.path.name}",
                    hint="train one with `eesd heads train`, pass --head HEAD.gguf, or use --drafter lookup",
                )
            return None
    return headfile.build_draft(model.path, head)


def resolve_head(spec: str) -> Any:
    return check_gguf(Path(spec).expanduser(), what="head")


def placement(config: Any) -> dict[str, Any]:
    """Where the target runs, as a cost profile is keyed (costs.fingerprint's keyword arguments)."""
    return dict(n_threads=config.n_threads or default_threads(), n_gpu_layers=config.n_gpu_layers, rpc=tuple(config.rpc))


def target_on_cpu(config: Any) -> bool:
    """Whether the target runs on this machine's CPU (no layer offloaded, no RPC server): there a round
    drafts only where its plan beats plain decoding by CPU_DRAFT_MARGIN."""
    return config.n_gpu_layers == 0 and not config.rpc


def auto_head(config: Any, model_path: Any, model: Model | None = None, *,
              measure: bool = False) -> tuple[Any, costs.Verdict | None]:
    """The exit head ``auto`` would hold (None: none is known for the model), and whether it could
    ever pay on this machine, from the kept cost profile (measured now with ``model`` where none is
    kept; without ``model``, with the model loaded for it where ``measure``, else None when none is kept)."""
    head = resolve_head(config.head) if config.head else headfile.find_head(model_path)
    if head is None:
        return None, None
    info = headfile.read_head_info(head)
    agreement = info.get("agreement")
    agreement = float(agreement.get("all", 0.0)) if isinstance(agreement, dict) else 0.0
    place = placement(config)
    if model is None:
        prof, _ = costs.cached(costs.fingerprint(model_path, **place))
        if prof is None:
            if not measure:
                return head, None
            loaded = Model(model_path, n_gpu_layers=config.n_gpu_layers, rpc=config.rpc)
            try:
                prof = costs.profile(loaded, **place)
            finally:
                loaded.close()
    else:
        prof = costs.profile(model, **place)
    # where the target runs on the CPU the controller drafts only where a plan beats plain decoding by
    # CPU_DRAFT_MARGIN (engine._new_controller): a head that cannot clear it would never draft, yet held on
    # the shared trunk it costs every round (the 1.5B on a 2-core Xeon: 2-3% a round that drafts nothing, more
    # with the probes that fail; BENCHMARKS.md)
    v = costs.head_verdict(prof, agreement=agreement, exit_layer=int(info["exit_layer"]),
                           n_layer=int(info["base_n_layer"]), k_max=int(config.draft_max),
                           margin=CPU_DRAFT_MARGIN if target_on_cpu(config) else 0.0)
    if prof.note and prof.plausible:  # an implausible profile's note is the verdict's already
        v.note += f"; {prof.note}"
    return head, v


def shared_trunk_plan(config: Any, model_path: Any) -> tuple[tuple[Any, int] | None, str]:
    """((exit head GGUF, exit layer), "") when the engine should run the target split around the
    exit head's trunk (:mod:`eesd_local.llama.trunk`): a drafter that uses the exit head, a head made for this
    model, a supported architecture and the native capture; else (None, why not) and one
    full-model context (the head, if any, then runs as a separate draft model)."""
    kind = config.drafter
    wanted = getattr(config, "shared_trunk", None)
    if wanted is None:  # the default: where the exit head drafts every round it may (see EngineConfig.shared_trunk),
        # and for auto where the cost profile says the head can pay here (no second copy of the weights). With
        # none kept (a new build or machine) it is measured now, on the model loaded for that alone: deciding
        # without it held a head that pays as a separate draft model beside a whole target until the next start
        wanted = kind in REGISTRY and REGISTRY[kind].head == "always"
        if kind in REGISTRY and REGISTRY[kind].head == "where it pays" and not config.draft_model:
            wanted = bool((v := auto_head(config, model_path, measure=True)[1]) and v.pays)
    if not wanted or not isinstance(kind, str) or config.draft_model:
        return None, ""
    if kind not in REGISTRY or REGISTRY[kind].head is None:
        return None, ""
    head = resolve_head(config.head) if config.head else headfile.find_head(model_path)
    if head is None:
        return None, ""
    info, _ = check_head_for(model_path, head)  # a head for another model: its own clear error
    if info["arch"] not in SPLIT_ARCHS:
        return None, f"no shared trunk for {info['arch']} models (it runs {' and '.join(SPLIT_ARCHS)})"
    if native.load()[0] is None:
        return None, "no shared trunk without the native extension"  # the capture is in C++
    return (head, int(info["exit_layer"])), ""


def make_drafter(config: Any, model: Model, trunk: Any = None) -> tuple[Drafter, str]:
    """``trunk``: the shared trunk+exit context of a split target; the exit head then drafts on it."""
    kind = config.drafter
    if not isinstance(kind, str):  # a drafter object: it must have every member of the protocol
        missing = [m for m in PROTOCOL_MEMBERS if not hasattr(kind, m)]
        if missing:
            raise EesdError(f"the drafter {kind!r} lacks {', '.join(missing)} of the Drafter protocol",
                            hint="subclass eesd_local.speculative.drafters.DrafterBase, which has them all")
        return kind, f"drafter: {kind.name}"
    if kind not in REGISTRY:
        raise EesdError(f"unknown drafter {kind!r}", hint=f"choose one of {', '.join(DRAFTERS)}")
    return REGISTRY[kind].build(config, model, trunk)


def _common(config: Any) -> dict[str, Any]:
    return dict(n_ctx=config.n_ctx, n_gpu_layers=config.n_gpu_layers, n_threads=config.n_threads, rpc=config.rpc)


def _auto(config: Any, model: Model, trunk: Any) -> tuple[Drafter, str]:
    if config.draft_model:
        path = resolve_model(config.draft_model)
        inner = ModelDrafter(path, model, name="draft-model", **_common(config))
        return AutoDrafter(inner), f"drafter: auto (lookup or the draft model {path.name}, chosen per round)"
    if trunk is not None:
        # the verdict that put the head on the trunk (read from the kept cost profile), as the other branches say theirs
        verdict = auto_head(config, model.path)[1]
        why = f"; {verdict.note}" if verdict is not None else ""
        return AutoDrafter(ModelDrafter.on_trunk(trunk)), f"drafter: auto (lookup or the exit head, chosen per round; shared trunk{why})"
    # the exit head is mapped, built and probed only where it could pay: else auto is prompt lookup itself
    head, verdict = auto_head(config, model.path, model)
    if head is None:
        return LookupDrafter(), "drafter: auto (lookup; no exit head is known for this model)"
    assert verdict is not None
    if not verdict.pays:
        return LookupDrafter(), f"drafter: auto (lookup; {verdict.note})"
    inner = ModelDrafter(headfile.build_draft(model.path, head), model, name="eesd", **_common(config))
    return AutoDrafter(inner), f"drafter: auto (lookup or the exit head, chosen per round; {verdict.note})"


def _none(config: Any, model: Model, trunk: Any) -> tuple[Drafter, str]:
    return NoDrafter(), "drafter: none (plain decoding)"


def _lookup(config: Any, model: Model, trunk: Any) -> tuple[Drafter, str]:
    return LookupDrafter(), "drafter: lookup"


def _eesd(config: Any, model: Model, trunk: Any) -> tuple[Drafter, str]:
    if trunk is not None:
        return ModelDrafter.on_trunk(trunk), "drafter: eesd (shared trunk)"
    return ModelDrafter(_eesd_draft_path(config, model, required=True), model, name="eesd", **_common(config)), "drafter: eesd"


def _draft_model(config: Any, model: Model, trunk: Any) -> tuple[Drafter, str]:
    if not config.draft_model:
        raise EesdError("--drafter draft-model needs --draft-model M", hint="e.g. --draft-model qwen2.5-coder-0.5b-instruct")
    path = resolve_model(config.draft_model)
    return ModelDrafter(path, model, name="draft-model", **_common(config)), f"drafter: draft-model ({path.name})"


def _hierarchical(config: Any, model: Model, trunk: Any) -> tuple[Drafter, str]:
    # lookup guesses checked by the eesd draft (or the draft model when given)
    if config.draft_model:
        inner = ModelDrafter(resolve_model(config.draft_model), model, name="draft-model", **_common(config))
    elif trunk is not None:
        inner = ModelDrafter.on_trunk(trunk)
    else:
        inner = ModelDrafter(_eesd_draft_path(config, model, required=True), model, name="eesd", **_common(config))
    d = HierarchicalDrafter(inner)
    return d, f"drafter: {d.name}"


@dataclass(frozen=True)
class DrafterEntry:
    """One drafter the engine builds by name."""

    build: Callable[[Any, Model, Any], tuple[Drafter, str]]  # (config, target model, shared trunk or None) -> (drafter, its line)
    head: str | None  # the exit head: "always" (runs on the shared trunk by default), "where it pays" (auto), None
    summary: str  # one line for help texts


# every drafter the engine builds by name: the CLI's choices, the server's, the bench's, the shared-trunk plan
REGISTRY: dict[str, DrafterEntry] = {
    "auto": DrafterEntry(_auto, "where it pays", "lookup, and the exit head or --draft-model where it can pay; per round"),
    "none": DrafterEntry(_none, None, "plain decoding"),
    "eesd": DrafterEntry(_eesd, "always", "the exit head (the model's first N layers and one exit block)"),
    "lookup": DrafterEntry(_lookup, None, "prompt lookup: continuations of n-grams of the context"),
    "draft-model": DrafterEntry(_draft_model, None, "a separate small model (--draft-model)"),
    "hierarchical": DrafterEntry(_hierarchical, "always", "lookup's guesses checked by the exit head"),
}
DRAFTERS = list(REGISTRY)
