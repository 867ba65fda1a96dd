"""Command-line options shared by every command that opens an engine or samples.

Each engine flag is named after its :class:`EngineConfig` field (``--n-ctx`` for ``n_ctx``),
with the short spellings of earlier versions kept as aliases; defaults come from
:class:`EngineConfig` itself.
"""

from __future__ import annotations

import argparse

from eesd_local.base.defaults import MAX_TOKENS, SEED, TEMPERATURE, TOP_K, TOP_P
from eesd_local.base.errors import EesdError
from eesd_local.commands.models import pull_with_progress
from eesd_local.llama.catalog import DEFAULT_MODEL, known_models
from eesd_local.llama.rpc import parse_endpoints
from eesd_local.speculative.drafters import DRAFTERS
from eesd_local.speculative.engine import EngineConfig, check_config

_DEFAULT = EngineConfig()
# the EngineConfig fields that add_engine_args makes flags of (seed is the controller's, not sampling's --seed)
ENGINE_FLAGS = ("model", "drafter", "head", "draft_model", "controller", "draft_max", "model_draft_max", "n_ctx", "n_gpu_layers", "n_threads",
                "batch_ms", "shared_trunk", "cache_reuse", "rpc", "cache_ram")


def add_engine_args(p: argparse.ArgumentParser, *, positional_model: bool = False) -> None:
    """The EngineConfig flags (``eesd generate``, ``eesd serve``, ``eesd-chat``)."""
    model_help = f"registry name or GGUF path (default {DEFAULT_MODEL}, pulled if missing)"
    if positional_model:  # MODEL or --model MODEL, as every command takes it
        p.add_argument("model_positional", nargs="?", default=argparse.SUPPRESS, metavar="MODEL", action=_ModelArg,
                       help=f"{model_help}; or --model MODEL")
        p.add_argument("--model", "-m", default=DEFAULT_MODEL, action=_ModelArg, help="the model, as MODEL")
    else:
        p.add_argument("--model", "-m", default=DEFAULT_MODEL, help=model_help)
    p.add_argument("--drafter", default=_DEFAULT.drafter, choices=DRAFTERS,
                   help="how drafts are made (default auto: prompt lookup, the exit head when one is known, or nothing, "
                        "chosen each round by the controller)")
    p.add_argument("--head", help="exit-head GGUF path for the eesd drafter (default: the shipped head for the model)")
    p.add_argument("--draft-model", help="registry name or GGUF of a separate draft model (same vocabulary)")
    p.add_argument("--shared-trunk", action=argparse.BooleanOptionalAction, default=_DEFAULT.shared_trunk,
                   help="run the exit head on the target's own first N layers, split out of it (default for eesd and "
                        "hierarchical; auto keeps a lazy separate draft model unless this is given); "
                        "--no-shared-trunk: always as a separate draft model holding its own copy of them")
    p.add_argument("--controller", default=None,
                   help="draft-length controller: cost-ts (default), beta-ts, calibration-ts, fixed:K, pmin:P, heuristic")
    p.add_argument("--draft-max", type=int, default=_DEFAULT.draft_max,
                   help="most tokens drafted per round (default %(default)s: prompt lookup, earlier answers and a prediction "
                        "draft as far as their match is long, up to this)")
    p.add_argument("--model-draft-max", type=int, default=_DEFAULT.model_draft_max,
                   help="most tokens a drafting model (the exit head, a draft model) drafts per round (default %(default)s)")
    p.add_argument("--n-ctx", "--ctx", dest="n_ctx", type=int, default=_DEFAULT.n_ctx,
                   help="context size in tokens (default %(default)s)")
    p.add_argument("--n-gpu-layers", type=int, default=_DEFAULT.n_gpu_layers, help="layers to offload to the GPU (-1: all)")
    p.add_argument("--n-threads", "--threads", dest="n_threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--batch-ms", type=float, default=_DEFAULT.batch_ms,
                   help="native loop: milliseconds of rounds run before their tokens stream out (default %(default)s; 0: every round)")
    p.add_argument("--rpc", type=endpoints_arg, default=(), metavar="HOST:PORT[,HOST:PORT...]",
                   help="llama.cpp RPC servers (eesd rpc-server) to offload layers to, with --n-gpu-layers")
    p.add_argument("--cache-ram", type=int, default=_DEFAULT.cache_ram, metavar="MB",
                   help="megabytes of idle prompts' KV states kept in RAM, so that a conversation that comes back pays "
                        "only for its new turn (default %(default)s; 0: none)")
    p.add_argument("--cache-reuse", choices=("exact", "conversation"), default=_DEFAULT.cache_reuse,
                   help="kept for compatibility: a new prompt reuses all it shares with the cache either way (with the "
                        "batch-invariant kernels an answer is still the one a fresh process gives)")


class _ModelArg(argparse.Action):
    """The model, given as the positional MODEL or as --model/-m (stored as ``model``); naming two
    different models is an error."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        if values is None:  # the positional left out
            return
        given = getattr(namespace, "_model_given", None)
        if given is not None and given[1] != values:
            parser.error(f"the model is named twice: {given[0]} {given[1]} and {option_string or 'MODEL'} {values}; "
                         "name it once (MODEL or --model MODEL)")
        namespace._model_given = (option_string or "MODEL", values)
        namespace.model = values


def endpoints_arg(text: str) -> tuple[str, ...]:
    try:
        return tuple(parse_endpoints(text))
    except EesdError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def add_sampling_args(p: argparse.ArgumentParser, *, max_tokens: int = MAX_TOKENS) -> None:
    """Sampling flags, named after :meth:`Engine.generate`'s arguments, with the defaults of base.defaults."""
    p.add_argument("--max-tokens", "-n", type=int, default=max_tokens, help="most tokens generated (default %(default)s)")
    p.add_argument("--temperature", "--temp", dest="temperature", type=float, default=TEMPERATURE,
                   help="temperature (0 = greedy, the default)")
    p.add_argument("--top-k", type=int, default=TOP_K, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=TOP_P, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=int, default=SEED, help="sampling seed (default: random)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags ask for; registry models that are missing are pulled first."""
    config = EngineConfig(**{name: getattr(args, name) for name in ENGINE_FLAGS})
    check_config(config)  # before a download or a load: a bad number fails at once
    for name in (args.model, args.draft_model):
        if name and name in known_models():
            pull_with_progress(name)
    return config
