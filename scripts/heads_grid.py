"""Issue 32's ablations: which exit head design buys the most agreement for the same training.

Every run trains an exit head from the base's last block on the same corpus targets, for the same
number of steps, and reports held-out agreement (the student's argmax over the whole vocabulary ==
the model's greedy token) by category. The runs differ in one thing each: the exit layer N, the
exit block's form (whole block, attention only, MLP only), the loss (softmax over sampled
negatives, or over the whole vocabulary), the share of the corpus trained on.

Two steps, so the runs can go where a GPU is (training needs torch and these files only):

    # here: a base GGUF with only what training reads (embeddings, blocks 0..7 and the last; the
    # output matrix only with --keep-output: a tied model's GGUF may store the embeddings twice)
    python scripts/heads_grid.py trim --model qwen2.5-coder-0.5b-instruct --out ablate/base.gguf
    # anywhere with torch: the runs, one JSON line each
    python scripts/heads_grid.py run --base ablate/base.gguf --data DIR --out results.jsonl --device cuda

DIR is a folder of trainer shards (``teacher-*.npz``), e.g. what ``eesd heads train --corpus``
builds under $EESD_HOME/heads-data/FP/corpus-KEY. The trunk states are computed there first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# name -> how the run differs from the reference (N=6, whole block, sampled negatives, all data)
RUNS: dict[str, dict] = {
    "n6": {},
    "n6-fullvocab": {"loss": "full"},
    "n4": {"exit_layer": 4},
    "n8": {"exit_layer": 8},
    "n6-attn": {"block": "attn"},
    "n6-mlp": {"block": "mlp"},
    "n6-data50": {"train_fraction": 0.5},
    "n6-data25": {"train_fraction": 0.25},
    "n8-fullvocab": {"exit_layer": 8, "loss": "full"},
    "n6-x3": {"steps_factor": 3},
    "n4-fullvocab": {"exit_layer": 4, "loss": "full"},
    "n6-fullvocab-x3": {"loss": "full", "steps_factor": 3},
    "n6-fullvocab-data50": {"loss": "full", "train_fraction": 0.5},
    "n6-fullvocab-data25": {"loss": "full", "train_fraction": 0.25},
    "n6-fullvocab-lr1e-3": {"loss": "full", "lr": 1e-3},
    "n8-fullvocab-attn": {"exit_layer": 8, "loss": "full", "block": "attn"},
    "n6-fullvocab-mlp": {"loss": "full", "block": "mlp"},
    "n6-fullvocab-attn": {"loss": "full", "block": "attn"},
    "n8-fullvocab-attn-lr1e-3": {"exit_layer": 8, "loss": "full", "block": "attn", "lr": 1e-3},
    "n8-fullvocab-lr1e-3": {"exit_layer": 8, "loss": "full", "lr": 1e-3},
}


def trim(args: argparse.Namespace) -> None:
    from eesd_local.gguf.reader import read_header  # noqa: PLC0415 - trim runs here, with llama.cpp installed
    from eesd_local.gguf.writer import write_from  # noqa: PLC0415
    from eesd_local.llama.catalog import resolve_model  # noqa: PLC0415

    base = resolve_model(args.model)
    h = read_header(base, keep_strings=True)
    arch = h.kv["general.architecture"]
    last = int(h.kv[f"{arch}.block_count"]) - 1
    keep = {f"blk.{i}." for i in [*range(args.layers), last]}
    top = ("token_embd.weight", "output_norm.weight") + (("output.weight",) if args.keep_output else ())
    names = [n for n in h.tensors if n in top or any(n.startswith(k) for k in keep)]
    tensors = [(n, h.tensors[n].dims, h.tensors[n].type, h.tensor_bytes(n)) for n in names]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_from(out, h, tensors=tensors, drop=lambda k: k == "tokenizer.ggml.merges")
    print(f"{out}: {len(names)} tensors, {out.stat().st_size / 1e6:.1f} MB (blocks 0..{args.layers - 1} and {last})")


def run(args: argparse.Namespace) -> None:
    import torch  # noqa: PLC0415 - run needs torch, trim does not

    from eesd_local.tools.heads.train import TrainConfig, cache_trunk_states, train_head  # noqa: PLC0415

    if args.device == "cuda":  # TF32 products: the ranking of runs is what is read, not the last digit
        torch.backends.cuda.matmul.allow_tf32 = True
    names = args.runs.split(",") if args.runs else list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        sys.exit(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
    layers = tuple(sorted({RUNS[n].get("exit_layer", 6) for n in names}))
    t0 = time.time()
    cache_trunk_states(Path(args.base), Path(args.data), layers, threads=args.threads, device=args.device,
                       progress=lambda m: print(m, flush=True))
    print(f"trunk states for N={layers}: {time.time() - t0:.0f}s", flush=True)
    out = Path(args.out)
    for name in names:
        over = dict(RUNS[name])
        steps = args.steps * over.pop("steps_factor", 1)
        cfg = TrainConfig(exit_layer=over.pop("exit_layer", 6), lr=over.pop("lr", args.lr), batch_negatives=True, steps=steps,
                          threads=args.threads, eval_every=args.eval_every, seed=args.seed, **over)
        t = time.time()
        summary = train_head(Path(args.base), Path(args.data), None, cfg, use_bar=False, device=args.device,
                             log=lambda m, name=name: print(f"[{name}] {m}", flush=True))
        row = {"run": name, "steps": summary["steps"], "epochs": summary["epochs"], "train_tokens": summary["train_tokens"],
               "agreement": summary["agreement"], "wall_s": round(time.time() - t, 1), "device": args.device,
               "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
               "config": summary["config"], "history": summary["history"]}
        with out.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        a = summary["agreement"]
        print(f"== {name}: code {a.get('code', 0):.3f} chat {a.get('chat', 0):.3f} all {a.get('all', 0):.3f} "
              f"({summary['steps']} steps, {row['wall_s']:.0f}s)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trim", help="a base GGUF holding only what training reads")
    t.add_argument("--model", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--layers", type=int, default=8, help="keep blocks 0..LAYERS-1 (the deepest N to try)")
    t.add_argument("--keep-output", action="store_true",
                   help="keep the output matrix (else the runs score against the tied embedding matrix, smaller "
                        "where the GGUF stores both: the same weights at another quantisation)")
    r = sub.add_parser("run", help="the ablation runs")
    r.add_argument("--base", required=True)
    r.add_argument("--data", required=True)
    r.add_argument("--out", required=True, help="JSON lines, one a run (appended)")
    r.add_argument("--runs", default="", help=f"comma-separated, of: {', '.join(RUNS)} (default: all)")
    r.add_argument("--steps", type=int, default=800)
    r.add_argument("--lr", type=float, default=3e-4)
    r.add_argument("--eval-every", type=int, default=100)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--device", default="cpu")
    args = p.parse_args()
    trim(args) if args.cmd == "trim" else run(args)


if __name__ == "__main__":
    main()
