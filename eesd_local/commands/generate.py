"""``eesd generate``: stream a completion to stdout, the stats line to stderr."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time

import psutil

from eesd_local.api import chat_template_note, load
from eesd_local.base.errors import EesdError
from eesd_local.base.params import check_sampling
from eesd_local.commands.options import add_engine_args, add_sampling_args, engine_config
from eesd_local.speculative.events import FinishEvent, TokenEvent


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    add_engine_args(p)
    p.add_argument("--prompt", "-p", required=True, help="the prompt text ('-' reads standard input)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template (the prompt is the user turn)")
    p.add_argument("--system", help="system message (with --chat)")
    add_sampling_args(p)
    p.add_argument("--verbose", "-v", action="store_true", help="print per-round figures to stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.system is not None and not args.chat:
        raise EesdError("--system needs --chat: a system message goes through the model's chat template",
                        hint="add --chat (the prompt is then the user turn), or put the instruction into the prompt")
    # the sampling options are checked before the model loads (Engine.generate checks them the same way)
    check_sampling(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    prompt: str | list[int] = _read_stdin() if args.prompt == "-" else args.prompt
    t_run = time.perf_counter()
    startup = max(0.0, time.time() - psutil.Process().create_time())  # interpreter and imports
    t_load = time.perf_counter()
    with load(**vars(engine_config(args))) as engine:
        t_load = time.perf_counter() - t_load
        print(engine.drafter_note, file=sys.stderr)
        if args.verbose:
            print(exact_line(engine), file=sys.stderr)
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
            prompt = engine.chat_tokens(messages)  # the messages' text stays text (control tokens in it too)
            note = chat_template_note(engine)
            if note:
                print(f"eesd: --chat: {note}", file=sys.stderr)
        events = engine.generate(prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, seed=args.seed)
        fin = None
        t_gen, t_first, total = time.perf_counter(), 0.0, 0.0
        try:
            for ev in events:
                if isinstance(ev, TokenEvent):
                    if not t_first:
                        now = time.perf_counter()
                        t_first, total = now - t_gen, startup + now - t_run
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                elif isinstance(ev, FinishEvent):
                    fin = ev
                elif args.verbose:
                    by = f" by {ev.source}" if ev.drafted and ev.source else ""
                    print(f"\n[round {ev.index}: drafted {ev.drafted}{by}, accepted {ev.accepted}, "
                          f"draft {1e3 * ev.t_draft:.1f} ms, verify {1e3 * ev.t_verify:.1f} ms]", file=sys.stderr)
        except KeyboardInterrupt:
            with contextlib.suppress(ValueError):  # ValueError: not the main thread
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the rollback short
            events.close()  # runs the engine's rollback
            print("\n[interrupted]", file=sys.stderr)
            return 130
        sys.stdout.write("\n")
        if fin is not None:
            print(f"[{fin.reason}] {fin.stats.summary()}", file=sys.stderr)
            if args.verbose and fin.stats.by_source:
                print(f"[sources] {fin.stats.source_summary()}", file=sys.stderr)
            if args.verbose:
                print(first_token_line(engine, startup, total, t_load, t_first, fin), file=sys.stderr)
            if fin.reason == "context":
                print(f"eesd: the context of {engine.ctx.n_ctx} tokens is full: the answer stopped after "
                      f"{fin.stats.n_generated} of {args.max_tokens} tokens (pass a larger --n-ctx)", file=sys.stderr)
    return 0


def first_token_line(engine, startup: float, total: float, t_load: float, t_first: float, fin: FinishEvent) -> str:
    """Where the time before the first token went: the process's start-up (interpreter and imports),
    the engine's load step by step, then the prompt's prefill and the first token."""
    steps = ", ".join(f"{k} {v:.2f}" for k, v in engine.load_times.items() if v >= 0.005)
    return (f"[first token after {total:.2f} s: start-up {startup:.2f} s, load {t_load:.2f} s ({steps}), "
            f"prompt {fin.stats.t_prefill:.2f} s ({fin.stats.n_prompt} tokens), first token {max(0.0, t_first - fin.stats.t_prefill):.2f} s]")


def exact_line(engine) -> str:
    """What holds of this engine's greedy output, in one line."""
    if engine.exact:
        return f"exact: greedy output is byte-identical to plain decoding ({engine.exact_note})"
    return f"exact: no, greedy output may leave plain decoding's at a near tie: {engine.exact_note}"


def _read_stdin() -> str:
    """Standard input as text whatever the locale says; bytes that are not UTF-8 stay as surrogates,
    which tokenize() reports with their position (as for argv)."""
    return sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
