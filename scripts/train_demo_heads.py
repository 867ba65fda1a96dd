#!/usr/bin/env python3
"""Train and ship the exit heads for the demo models (writes models/<model>.exit<N>.gguf).

Rerunnable: every stage is cached under $EESD_HOME (teacher shards, trunk states, a training
checkpoint), so an interrupted run resumes and a second run with a larger --tokens only adds data.

    python scripts/train_demo_heads.py                      # both demo models, defaults below
    python scripts/train_demo_heads.py --only qwen2.5-coder-0.5b-instruct --tokens 200000

Defaults are what produced the shipped heads (see models/README.md for the numbers).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eesd_local.heads import data, evaluate, fingerprint, teacher, train  # noqa: E402
from eesd_local.paths import cache_dir  # noqa: E402
from eesd_local.registry import models_dir, resolve_model  # noqa: E402

# model -> (exit layer, teacher settings, training settings)
DEMO = {
    # = `eesd heads train --model qwen2.5-coder-0.5b-instruct --exit-layer 6 --tokens 200000`: the CLI's mix and defaults
    "qwen2.5-coder-0.5b-instruct": {
        "exit_layer": 6,
        "tokens": 200000,
        "mix": "cli",
        "teacher": {"n_parallel": 8, "max_new": 320, "threads": 2},
        "train": {"epochs": 3.0, "lr": 3e-4, "batch_tokens": 2048, "threads": 2},
    },
    "qwen2.5-coder-1.5b-instruct": {
        "exit_layer": 6,
        "teacher": {"n_parallel": 6, "max_new": 256},
        # the 1.5B block is 47M parameters: keep the base's last-block MLP so the head stays small
        "train": {"epochs": 4.0, "lr": 1e-3, "batch_tokens": 512, "freeze_mlp": True, "heldout_every": 10},
    },
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(name: str, args: argparse.Namespace) -> None:
    spec = DEMO[name]
    model = resolve_model(name)
    n = spec["exit_layer"]
    data_dir = cache_dir("heads-data") / fingerprint(model)
    if spec.get("mix") == "cli":  # code : chat : stdlib source 4 : 4 : 1, as `eesd heads train`
        items = data.training_items()
    else:
        items = data.interleave(data.code_items("train"), data.sharegpt_items("train"), weights=(1.0, 1.0), seed=0)
    tcfg = teacher.TeacherConfig(**{"threads": args.threads, **spec["teacher"]})
    budget = args.tokens or spec.get("tokens", 40000)
    last = [0.0]

    def prog(d: dict) -> None:
        if time.time() - last[0] > 60:
            last[0] = time.time()
            log(f"{name} teacher: {d['tokens']} tokens on disk, {d['new'] / max(d['elapsed'], 1e-9):.1f} tok/s")

    got = teacher.run_teacher(
        model, items, data_dir, cfg=tcfg, budget_tokens=budget, time_limit_s=args.teacher_minutes * 60, progress=prog
    )
    log(f"{name}: {got} teacher tokens in {data_dir}")
    train.cache_trunk_states(model, data_dir, (n,), threads=args.threads, progress=log)
    cfg = train.TrainConfig(**{"exit_layer": n, "threads": args.threads, "eval_every": 25, **spec["train"]})
    out = models_dir() / f"{name}.exit{n}.gguf"
    summary = train.train_head(
        model,
        data_dir,
        out,
        cfg,
        ckpt_path=cache_dir("heads-ckpt") / f"{name}.exit{n}.ckpt",
        log=log,
        use_bar=sys.stderr.isatty(),
        data_summary={
            "teacher_tokens": got,
            "mix": "own greedy answers to stdlib code tasks + ShareGPT requests (train range), stdlib source teacher-forced"
            if spec.get("mix") == "cli"
            else "greedy answers of the model to stdlib code tasks and ShareGPT requests (train range), 1:1; prompt positions teacher-forced",
        },
    )
    log(
        f"{name}: wrote {out} ({out.stat().st_size / 1e6:.1f} MB): {json.dumps({k: summary[k] for k in ('steps', 'epochs', 'train_tokens', 'final_loss', 'agreement')})}"
    )
    if not args.no_eval:
        rep = evaluate.evaluate(model, out, models_dir() / "eval_prompts.jsonl", threads=args.threads)
        log(
            f"{name}: eval {json.dumps({c: {'agreement': e['agreement'], 'tau_runs_k4': e['tau_runs'][4]} for c, e in rep['categories'].items()})}, cost {rep['cost_ratio']}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(DEMO), action="append", help="train only this model (repeatable)")
    ap.add_argument("--tokens", type=int, default=None, help="teacher tokens per model (default: the model's own, 200000 / 40000)")
    ap.add_argument("--teacher-minutes", type=float, default=45.0, help="cap on teacher generation time per model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-eval", action="store_true")
    args = ap.parse_args()
    for name in args.only or list(DEMO):
        run(name, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
