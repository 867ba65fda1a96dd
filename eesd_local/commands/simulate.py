"""``eesd simulate``: draft-length controllers on synthetic rounds (no model needed)."""

from __future__ import annotations

import argparse

from eesd_local.base.defaults import MODEL_DRAFT_MAX as DRAFT_MAX  # the simulator's drafters are models
from eesd_local.base.errors import EesdError
from eesd_local.tools.simulate_sources import SOURCE_PROCESSES
from eesd_local.tools.simulate_sources import table as sources_table
from eesd_local.tools.simulator import PROCESSES, PROFILES, TABLE_CONTROLLERS, decision_cost, table


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--controllers", default=",".join(TABLE_CONTROLLERS), help="comma-separated controller specs (default: %(default)s)")
    p.add_argument("--processes", default=",".join(PROCESSES), help="comma-separated acceptance processes (default: %(default)s)")
    p.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated cost profiles (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=4000, help="rounds per run (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the controllers and the process (default: %(default)s)")
    p.add_argument("--draft-max", "--max-draft", dest="draft_max", type=int, default=DRAFT_MAX, help="longest draft (default: %(default)s)")
    p.add_argument("--no-adapt", dest="adapt", action="store_false", help="skip the rounds-to-adapt table after regime switches")
    p.add_argument("--timing", action="store_true", help="also measure what a controller decision costs")
    p.add_argument("--sources", action="store_true",
                   help="instead: auto's choice between lookup and a model drafter against each source alone "
                        "(processes: " + ", ".join(SOURCE_PROCESSES) + ")")


def epilog() -> str:
    lines = ["processes:"] + [f"  {n:10s} {p.about}" for n, p in PROCESSES.items()]
    lines += ["processes of --sources:"] + [f"  {n:16s} {p.about}" for n, p in SOURCE_PROCESSES.items()]
    lines += ["cost profiles:"] + [f"  {n:10s} {p.about}" for n, p in PROFILES.items()]
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="compare draft-length controllers on synthetic acceptance processes",
        description="Throughput of each controller relative to the best fixed draft length in hindsight.",
        epilog=epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.sources:
        profiles = _names(args.profiles)
        bad = [n for n in profiles if n not in PROFILES]
        if bad:
            raise EesdError(f"unknown cost profile {', '.join(bad)}", hint=f"choose from {', '.join(PROFILES)}")
        print("target tokens per target-token time (plain decoding = 1.00), one run per policy, seed", args.seed)
        print(sources_table(list(SOURCE_PROCESSES), profiles, seed=args.seed))
        return 0
    controllers, processes, profiles = _names(args.controllers), _names(args.processes), _names(args.profiles)
    for kind, names, known in (("process", processes, PROCESSES), ("cost profile", profiles, PROFILES)):
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise EesdError(f"unknown {kind} {', '.join(bad) or '(none given)'}", hint=f"choose from {', '.join(known)}")
    if args.rounds < 100:
        raise EesdError(f"--rounds {args.rounds} is too few to compare controllers", hint="use 1000 or more")
    print(table(controllers, processes, profiles, rounds=args.rounds, seed=args.seed, max_draft=args.draft_max, adapt=args.adapt))
    if args.timing:
        print()
        print("decision cost, compiled (ns): per draft_more in a Numba loop | per whole round (begin + decisions + update) "
              "| per draft_more called from Python")
        for spec in controllers:
            c = decision_cost(spec, max_draft=args.draft_max)
            print(f"  {spec:22s} {c['decide_ns']:8.0f} | {c['round_ns']:8.0f} ({c['decisions_per_round']:.1f} decisions) | {c['python_call_ns']:8.0f}")
    return 0
