"""`auto` against plain decoding (`none`) in process, prompt by prompt, many alternations: whether drafting costs
anything on kinds where little is drafted (one bench pass of a one-prompt kind moves by a tenth).

Both engines stay loaded in this process; each prompt runs `--repeats` times on each, alternating (which goes
first flips every time), both forgetting their cached prompts and earlier answers after every run (so `auto` never
drafts from its own previous answer). Decode tok/s from the first token to the last; the median of auto/none
over the repeats.

usage: python scripts/auto_vs_none.py MODEL [--kinds chat-explain,chat-math,agent] [--repeats 6] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import eesd_local
from eesd_local.llama.catalog import resolve_model
from eesd_local.speculative.events import FinishEvent, TokenEvent
from eesd_local.tools.bench.prompts import load_prompts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--kinds", default="chat-explain,chat-writing,chat-list,chat-math,agent")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    items = [it for it in load_prompts("chat,code,rewrite,edits,rework,agent", n_per_category=1) if it.category in kinds]
    path = str(resolve_model(args.model))
    engines = {d: eesd_local.load(path, drafter=d, draft_max=64, n_ctx=4096) for d in ("none", "auto")}
    for eng in engines.values():
        eng.run(eng.apply_chat_template([{"role": "user", "content": "Say hello."}]), max_tokens=16)
    for it in items:
        ref = engines["none"]
        if it.prompt is not None:
            prompt = ref.tokenize(it.prompt)
        else:
            msgs = [{"role": r, "content": c} for r, c in it.messages] if it.messages else [{"role": "user", "content": it.turns[0]}]
            prompt = ref.tokenize(ref.apply_chat_template(msgs))
        rates: dict[str, list[float]] = {d: [] for d in engines}
        last = None
        for r in range(args.repeats):
            for d in (("none", "auto") if r % 2 == 0 else ("auto", "none")):
                stamps = []
                for ev in engines[d].generate(prompt, max_tokens=args.max_tokens, temperature=0.0):
                    if isinstance(ev, TokenEvent):
                        stamps.append(time.perf_counter())
                    elif isinstance(ev, FinishEvent) and d == "auto":
                        last = ev.stats
                rates[d].append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
                engines[d].forget_prompts()
                engines[d].forget_answers()
        ratio = statistics.median(a / n for a, n in zip(rates["auto"], rates["none"], strict=True))
        assert last is not None
        print(f"{it.category}: {len(prompt)} prompt tokens; none {statistics.median(rates['none']):.1f} tok/s, auto "
              f"{statistics.median(rates['auto']):.1f}; auto/none median {ratio:.3f}; auto's last run drafted "
              f"{last.n_drafted}, kept {last.n_accepted}, in {last.n_rounds} rounds", flush=True)
    for eng in engines.values():
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
