"""Plain decoding against a drafter over a sequence of requests, as a session sends them: in process, side by side.

    .venv/bin/python scripts/sequence_ab.py                                  # code, then three kinds of chat
    .venv/bin/python scripts/sequence_ab.py --kinds code,chat-explain --order drafter-first

Two engines in one process (``none`` and ``--drafter``, default ``auto``) answer the built-in sets' first
prompt of each kind in the order given, the drafter's engine keeping what it learns from one request to
the next (its controller and its store of earlier answers) as `eesd serve` does; each pass starts both
from nothing. Every pass runs both engines on each prompt, one right after the other (``--order``: which
first). Prints per kind the median time per token after the first (each prompt ``--passes`` times) and
the drafter's speed over plain, and the drafter's rounds on a kind (``--show``) in the first pass.
Why: a drafter's loss on one kind of request can come from what it learned on the kind before it
(a chat answer right after a code request), which a bench that reorders methods per prompt mixes up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eesd_local.speculative.engine import Engine, EngineConfig  # noqa: E402
from eesd_local.speculative.events import RoundEvent, TokenEvent  # noqa: E402
from eesd_local.tools.bench.prompts import load_prompts  # noqa: E402
from eesd_local.tools.bench.runner import _messages  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--kinds", default="code,chat-coding,chat-explain,chat-writing",
                    help="prompt kinds (built-in categories), in the order sent")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--order", choices=("plain-first", "drafter-first"), default="plain-first")
    ap.add_argument("--show", default="chat-explain", help="print the drafter's drafting rounds on this kind")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    sets = {"code", "chat", "rewrite", "edits", "rework", "agent"}
    items = [it for s in sorted(sets) for it in load_prompts(s, n_per_category=1) if it.category in kinds]
    items.sort(key=lambda it: kinds.index(it.category))
    names = ("none", args.drafter)
    engines = {d: Engine(EngineConfig(model=args.model, drafter=d)) for d in names}

    def run(eng: Engine, prompt: list[int]) -> tuple[float, list[tuple[int, int]]]:
        first = last = 0.0
        n = 0
        drafts = []
        for ev in eng.generate(prompt, max_tokens=args.max_tokens, temperature=0.0):
            if isinstance(ev, TokenEvent):
                last = time.perf_counter()
                first = first or last
                n += 1
            elif isinstance(ev, RoundEvent) and ev.drafted:
                drafts.append((ev.drafted, ev.accepted))
        return (last - first) / max(1, n - 1), drafts

    for eng in engines.values():
        run(eng, eng.tokenize("def f(x):"))  # warm-up
    ms: dict[tuple[str, str], list[float]] = {}
    order = names if args.order == "plain-first" else names[::-1]
    for p in range(args.passes):
        for eng in engines.values():
            eng.forget_answers()
            eng.forget_prompts()
        for it in items:
            eng0 = engines["none"]
            prompt = eng0.tokenize(eng0.apply_chat_template(_messages(it.messages))) if it.messages else eng0.tokenize(it.turns[0])
            for d in order:
                t, drafts = run(engines[d], prompt)
                ms.setdefault((it.category, d), []).append(t * 1e3)
                if p == 0 and d != "none" and it.category == args.show:
                    print(f"{args.drafter} on {it.category} (first pass), rounds that drafted (drafted, accepted): {drafts}")
    for it in items:
        plain, drafted = statistics.median(ms[(it.category, "none")]), statistics.median(ms[(it.category, args.drafter)])
        print(f"{it.category:14s} none {plain:6.2f} ms/token  {args.drafter} {drafted:6.2f}  speed over plain {plain / drafted:5.3f}")
    for eng in engines.values():
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
