"""Issue 32's soft-target ablation: KL on the model's top-k vs cross-entropy on its greedy token,
as held-out agreement per CPU-minute.

A hard target is free: the corpus holds the model's greedy answer tokens. A soft target costs one
teacher-forced prefill of prompt + answer through the whole model with logits at every answer row
(this script times it). The same CPU could instead grow the corpus by as many new hard rows (the
grow rate is printed by `eesd heads corpus grow`). So three heads are trained for the same steps,
from the same start (the base's last block, full softmax over V', lr 1e-3), on the training split:

    hard    a share F of the training sequences, hard targets
    soft    the same sequences, soft targets (top-k of the model's distribution at each row)
    hard2x  a share 2F, hard targets: what the labelling CPU buys if spent on new answers instead

All three are checked on the same held-out sequences (1 in 20, hard targets: the greedy token).

    python scripts/heads_soft.py --data $EESD_HOME/heads-data/FP/corpus-KEY --fraction 0.125 --steps 300
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from eesd_local.llama.catalog import resolve_model
from eesd_local.tools.heads import shards, targets, train


def training_picks(data: Path, fraction: float) -> list[int]:
    """The sequence numbers ``train_head`` trains on with ``train_fraction=fraction`` (its own split)."""
    n = 0
    for p in shards.shard_paths(data):
        with np.load(p) as z:
            n += len(z["offsets"]) - 1
    return train.split(n, heldout_every=train.TrainConfig.heldout_every, train_fraction=fraction)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--data", type=Path, required=True, help="trainer shards with hard targets (eesd heads train --corpus builds them)")
    ap.add_argument("--work", type=Path, default=Path("heads-soft"), help="where the soft shards go")
    ap.add_argument("--fraction", type=float, default=0.125, help="share F of the training sequences")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--k", type=int, default=16, help="top-k of the soft targets")
    ap.add_argument("--exit-layer", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", default="hard,soft,hard2x")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/heads/ablation/soft-cpu.jsonl"))
    args = ap.parse_args()

    base = resolve_model(args.model)
    soft_dir = args.work / f"soft-k{args.k}-f{args.fraction:g}"
    stats_path = soft_dir / "labels.json"
    if not stats_path.exists():
        pick = set(training_picks(args.data, args.fraction))
        print(f"soft targets for {len(pick)} sequences ...", file=sys.stderr)
        stats = targets.soft_targets(base, args.data, soft_dir, pick, k=args.k, threads=args.threads,
                                     progress=lambda i, n: print(f"\r  {i}/{n}", end="", file=sys.stderr))
        stats["rows_per_s"] = round(stats["rows"] / max(stats["seconds"], 1e-9), 1)
        stats_path.write_text(json.dumps(stats))
        print(f"\n{stats}", file=sys.stderr)
    stats = json.loads(stats_path.read_text())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for run in args.runs.split(","):
        folder, fraction = {"hard": (args.data, args.fraction), "soft": (soft_dir, args.fraction),
                            "hard2x": (args.data, 2 * args.fraction)}[run]
        cfg = train.TrainConfig(exit_layer=args.exit_layer, steps=args.steps, lr=1e-3, loss="full", draft_vocab=32768,
                                batch_negatives=True, top_k=args.k, train_fraction=fraction, threads=args.threads)
        t0 = time.time()
        s = train.train_head(base, folder, None, cfg, log=lambda m: print(m, file=sys.stderr), use_bar=False)
        line = {"run": run, "fraction": fraction, "steps": s["steps"], "train_tokens": s["train_tokens"],
                "heldout": s["agreement"], "train_s": round(time.time() - t0, 1), "labels": stats if run == "soft" else None,
                "date": time.strftime("%Y-%m-%d"), "recipe": s["recipe"]}
        print(json.dumps(line))
        with args.out.open("a") as fh:
            fh.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
