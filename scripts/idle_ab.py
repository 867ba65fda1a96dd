"""Plain rounds on the shared trunk against the whole model: tokens/s over the built-in chat kinds,
methods interleaved prompt by prompt in one process (greedy, 128 tokens), as ratios to `none`.

    python scripts/idle_ab.py --reps 2
"""

from __future__ import annotations

import argparse
import time

import eesd_local
from eesd_local.speculative.events import TokenEvent
from eesd_local.tools.bench.prompts import load_prompts

METHODS = {
    "none": dict(drafter="none"),
    "auto (copy, default)": dict(drafter="auto"),
    "auto --shared-trunk": dict(drafter="auto", shared_trunk=True),
    "eesd fixed:0 (split, never drafts)": dict(drafter="eesd", controller="fixed:0"),
    "eesd fixed:0 --no-shared-trunk": dict(drafter="eesd", controller="fixed:0", shared_trunk=False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--n-prompts", type=int, default=1, help="prompts per chat kind")
    args = ap.parse_args()
    items = load_prompts("chat", n_per_category=args.n_prompts)
    engines = {name: eesd_local.load(args.model, **kw) for name, kw in METHODS.items()}
    secs = dict.fromkeys(engines, 0.0)
    toks = dict.fromkeys(engines, 0)
    names = list(engines)
    turn = 0
    for _ in range(args.reps):
        for it in items:
            # the order of the methods rotates from prompt to prompt, as in `eesd bench`: on some machines
            # whichever method runs first after another model's rounds runs slower
            turn = (turn + 1) % len(names)
            for name in names[turn:] + names[:turn]:
                eng = engines[name]
                prompt = eng.tokenize(eng.apply_chat_template([{"role": r, "content": c} for r, c in it.messages]))
                t0, n = 0.0, 0
                for ev in eng.generate(prompt, max_tokens=128):
                    if isinstance(ev, TokenEvent):
                        t0 = t0 or time.perf_counter()
                        n += 1
                secs[name] += time.perf_counter() - t0
                toks[name] += max(0, n - 1)
    base = toks["none"] / secs["none"]
    print("| method | tok/s | x none |\n|---|---:|---:|")
    for name in engines:
        rate = toks[name] / secs[name]
        print(f"| {name} | {rate:.2f} | {rate / base:.3f} |")
    for eng in engines.values():
        eng.close()


if __name__ == "__main__":
    main()
