"""``eesd generate``: stream a completion to stdout, the stats line to stderr."""

from __future__ import annotations

import argparse
import sys

from ..drafters import DRAFTERS
from ..engine import EngineConfig, load
from ..events import FinishEvent, TokenEvent
from ..registry import DEFAULT_MODEL, known_models
from .models import pull_with_progress


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that opens an engine (they map onto EngineConfig)."""
    p.add_argument("--model", "-m", default=DEFAULT_MODEL, help=f"registry name or GGUF path (default {DEFAULT_MODEL})")
    p.add_argument("--drafter", default="auto", choices=DRAFTERS, help="how drafts are made (default auto: eesd if a head is known, else lookup)")
    p.add_argument("--head", help="exit-head GGUF for the eesd drafter (default: the shipped head for the model)")
    p.add_argument("--draft-model", help="registry name or GGUF of a separate draft model (same vocabulary)")
    p.add_argument("--controller", default=None, help="draft-length controller: beta-ts, calibration-ts, cost-ts, fixed:K, pmin:P, heuristic")
    p.add_argument("--draft-max", type=int, default=8, help="most tokens drafted per round (default 8)")
    p.add_argument("--ctx", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("--n-gpu-layers", type=int, default=0, help="layers to offload to the GPU (-1: all)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.model in known_models():
        pull_with_progress(args.model)
    for name in (args.draft_model,):
        if name and name in known_models():
            pull_with_progress(name)
    return EngineConfig(model=args.model, drafter=args.drafter, head=args.head, draft_model=args.draft_model,
                        controller=args.controller, draft_max=args.draft_max, n_ctx=args.ctx,
                        n_gpu_layers=args.n_gpu_layers, n_threads=args.threads)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    add_engine_args(p)
    p.add_argument("--prompt", "-p", required=True, help="the prompt text ('-' reads standard input)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template (the prompt is the user turn)")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--max-tokens", "-n", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy, the default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--verbose", "-v", action="store_true", help="print per-round figures to stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    with load(**vars(engine_config(args))) as engine:
        print(engine.drafter_note, file=sys.stderr)
        if args.verbose:
            print(engine.loop_note, file=sys.stderr)
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
            prompt = engine.apply_chat_template(messages)
        events = engine.generate(prompt, max_tokens=args.max_tokens, temperature=args.temp, top_k=args.top_k,
                                 top_p=args.top_p, seed=args.seed)
        fin = None
        try:
            for ev in events:
                if isinstance(ev, TokenEvent):
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                elif isinstance(ev, FinishEvent):
                    fin = ev
                elif args.verbose:
                    print(f"\n[round {ev.index}: drafted {ev.drafted}, accepted {ev.accepted}, "
                          f"draft {1e3 * ev.t_draft:.1f} ms, verify {1e3 * ev.t_verify:.1f} ms]", file=sys.stderr)
        except KeyboardInterrupt:
            events.close()  # runs the engine's rollback
            print("\n[interrupted]", file=sys.stderr)
            return 130
        sys.stdout.write("\n")
        if fin is not None:
            print(f"[{fin.reason}] {fin.stats.summary()}", file=sys.stderr)
    return 0
