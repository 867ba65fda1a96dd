"""Where the time of a prompt-lookup run goes, against plain decoding, on prose prompts.

Runs `none` and `lookup` (default controller) in one process, alternating prompt by prompt over
the built-in chat set's prose kinds, and accounts for every millisecond per generated token:
the target's decodes (plain rounds, one-token rounds, longer drafts), the lookup search, and
the loop around them (Python, events, detokenizing). Prints a markdown table.

    python scripts/lookup_breakdown.py --n-prompts 4 --kinds writing,explain,list,other
"""

from __future__ import annotations

import argparse
import collections
import time

from eesd_local.speculative.engine import Engine, EngineConfig
from eesd_local.speculative.events import FinishEvent, RoundEvent
from eesd_local.tools.bench.prompts import load_prompts
from eesd_local.tools.prepare import prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--kinds", default="writing,explain,list,other", help="chat kinds (see bench.prompts.chat_kind)")
    ap.add_argument("--n-prompts", type=int, default=4, help="prompts per kind")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", default="none,lookup")
    args = ap.parse_args()
    methods = args.methods.split(",")
    items = load_prompts("chat", categories=[f"chat-{k}" for k in args.kinds.split(",")], n_per_category=args.n_prompts)
    configs = {m: EngineConfig(model=args.model, drafter=m) for m in methods}
    for c in configs.values():
        prepare(c)  # the files an engine reads: a pull, a draft vocabulary
    engines = {m: Engine(c) for m, c in configs.items()}
    for e in engines.values():  # warm-up: the controller learns this machine's costs
        e.run(e.apply_chat_template([{"role": "user", "content": "Say hello."}]), max_tokens=16)
    # per method: bucket -> [rounds, seconds of target decode, tokens emitted]
    buckets = {m: collections.defaultdict(lambda: [0, 0.0, 0]) for m in methods}
    tot = {m: collections.Counter() for m in methods}
    t0 = time.perf_counter()
    for i, it in enumerate(items):
        for m, e in engines.items():
            prompt = e.apply_chat_template([{"role": r, "content": c} for r, c in it.messages])
            for ev in e.generate(prompt, max_tokens=args.max_tokens):
                if isinstance(ev, RoundEvent):
                    kind = "plain rounds (nothing drafted)" if ev.drafted == 0 else (
                        "one-token rounds" if ev.drafted == 1 else "rounds drafting 2+ tokens")
                    b = buckets[m][kind]
                    b[0] += 1
                    b[1] += ev.t_verify
                    b[2] += ev.emitted
                    tot[m]["draft"] += ev.t_draft
                elif isinstance(ev, FinishEvent):
                    s = ev.stats
                    tot[m]["decode"] += s.t_decode
                    tot[m]["tokens"] += s.n_generated
                    tot[m]["rounds"] += s.n_rounds
                    tot[m]["verify"] += s.t_verify
        print(f"{i + 1}/{len(items)} {it.category}/{it.id} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print()
    print("| ms per generated token | " + " | ".join(methods) + " |")
    print("|---|" + "---:|" * len(methods))
    kinds = sorted({k for m in methods for k in buckets[m]})
    per = {m: 1e3 / max(1, tot[m]["tokens"]) for m in methods}
    for k in kinds:
        cells = []
        for m in methods:
            n, t, em = buckets[m].get(k, [0, 0.0, 0])
            cells.append(f"{t * per[m]:.2f} ({n} rounds, {1e3 * t / n:.1f} ms each, {em / n:.2f} tokens)" if n else "-")
        print(f"| target decode: {k} | " + " | ".join(cells) + " |")
    print("| drafting (lookup search, in the loop) | " + " | ".join(f"{tot[m]['draft'] * per[m]:.3f}" for m in methods) + " |")
    print("| loop around the decodes (Python, events, detokenizing) | " + " | ".join(
        f"{(tot[m]['decode'] - tot[m]['verify'] - tot[m]['draft']) * per[m]:.3f}" for m in methods) + " |")
    print("| **total** | " + " | ".join(f"**{tot[m]['decode'] * per[m]:.2f}**" for m in methods) + " |")
    print("| rounds per token | " + " | ".join(f"{tot[m]['rounds'] / max(1, tot[m]['tokens']):.3f}" for m in methods) + " |")
    base = tot[methods[0]]["decode"] / max(1, tot[methods[0]]["tokens"])
    print("| speedup vs " + methods[0] + " | " + " | ".join(
        f"{base / (tot[m]['decode'] / max(1, tot[m]['tokens'])):.3f}" for m in methods) + " |")
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
