"""Issue 32's V' size ablation: how many rows the shared trunk's draft LM head should keep.

A larger V' lets the draft propose more of the model's tokens (coverage, agreement) and costs more
bytes a draft step (s of the memory-bound projection, evaluate.MEMORY_BOUND_FORMULA). One pass of
the shipped head's draft over the target's greedy answers gives the argmax over every V' size at
once; the projection then weighs each size's agreement runs against its s. The head was trained
over V' = 32,768 rows, so a larger V' here is read with a head never taught to keep the extra rows
down: an upper bound on what it costs, a lower bound on what it could gain.

    python scripts/heads_vprime.py [--head models/qwen2.5-coder-0.5b-instruct.exit6.gguf] \\
        [--prompts models/eval_prompts.jsonl,benchmarks/prompts/chat-kinds.jsonl] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from eesd_local.gguf.headfile import build_draft, find_head
from eesd_local.llama.catalog import resolve_model
from eesd_local.tools.heads import evaluate, shards
from eesd_local.tools.heads.draftvocab import draft_vocab

SIZES = (8192, 16384, 32768, 65536)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--head", type=Path, default=None, help="default: the shipped head of the model")
    ap.add_argument("--prompts", default="models/eval_prompts.jsonl,benchmarks/prompts/chat-kinds.jsonl")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/heads/vprime-0.5b.json"))
    args = ap.parse_args()

    model = resolve_model(args.model)
    head = args.head or find_head(model)
    draft = build_draft(model, head)
    sizes = [int(x) for x in args.sizes.split(",")]
    vocabs = [draft_vocab(model, n).astype(np.int64) for n in sizes]
    share = {n: evaluate.memory_bound_share(model, head, v) for n, v in zip(sizes, vocabs)}
    report: dict = {"model": str(model), "head": str(head), "date": time.strftime("%Y-%m-%d"),
                    "formula": evaluate.MEMORY_BOUND_FORMULA, "sizes": {}}
    for prompts in args.prompts.split(","):
        answers = evaluate.target_answers(model, Path(prompts))
        tokens: dict[str, list[np.ndarray]] = {}
        for shard in shards.shard_paths(answers):
            with np.load(shard) as z:
                for i, (a, b) in enumerate(zip(z["offsets"][:-1], z["offsets"][1:])):
                    for key in (str(z["categories"][i]), "all"):
                        tokens.setdefault(key, []).append(z["tokens"][a + int(z["n_prompt"][i]) : b])
        per_seq = evaluate.draft_agreement(draft, answers, more_vocabs=vocabs)
        for j, (n, v) in enumerate(zip(sizes, vocabs)):
            rows = report["sizes"].setdefault(str(n), {"memory_bound_share": round(share[n], 4), "prompts": {}})
            cats: dict[str, list[np.ndarray]] = {}
            for r in per_seq:
                for key in (r["category"], "all"):
                    cats.setdefault(key, []).append(r["agree_more"][j])
            out = rows["prompts"].setdefault(Path(prompts).name, {})
            for cat, arrs in cats.items():
                mb = evaluate.memory_bound_speedup(arrs, share[n])
                best = max(mb, key=lambda k: mb[k])
                out[cat] = {"coverage": round(float(np.isin(np.concatenate(tokens[cat]), v).mean()), 4),
                            "agreement": round(float(np.mean(np.concatenate(arrs))), 4),
                            "best_k": best, "projection": round(mb[best], 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for n, e in report["sizes"].items():
        print(f"V' {n:>6}  s {e['memory_bound_share']:.3f}  " + "  ".join(
            f"{p}/{c}: cov {x['coverage']:.3f} agr {x['agreement']:.3f} proj {x['projection']:.2f} (k={x['best_k']})"
            for p, cs in e["prompts"].items() for c, x in cs.items() if c in ("code", "chat", "all")))


if __name__ == "__main__":
    main()
