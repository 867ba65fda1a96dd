#!/usr/bin/env python3
"""Train and ship the exit heads for the demo models (writes models/<model>.exit<N>.gguf).

Rerunnable: every stage is cached under $EESD_HOME (teacher shards, trunk states, a training
checkpoint), so an interrupted run resumes and a second run with a larger --tokens only adds data.

    python scripts/train_demo_heads.py                      # both demo models, 55 minutes each
    python scripts/train_demo_heads.py --only qwen2.5-coder-1.5b-instruct --minutes 30

models/README.md gives the command that produced each shipped head and its numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eesd_local.base.paths import cache_dir, models_dir
from eesd_local.gguf.headfile import fingerprint  # noqa: E402
from eesd_local.tools.heads import data, evaluate, teacher, train
from eesd_local.tools.registry import resolve_model  # noqa: E402

# model -> (exit layer, teacher settings, training settings)
DEMO = {
    # the 0.5B: `eesd heads train`'s recipe (its mix, 3 epochs, lr 3e-4), continued from the
    # previous shipped head when --init-shipped is given (more data than one run can hold)
    "qwen2.5-coder-0.5b-instruct": {
        "exit_layer": 6,
        "teacher": {"n_parallel": 16, "max_new": 320},
        "train": {"epochs": 3.0, "lr": 3e-4, "batch_tokens": 2048},
    },
    "qwen2.5-coder-1.5b-instruct": {
        "exit_layer": 6,
        "teacher": {"n_parallel": 16, "max_new": 320},
        # the 1.5B block is 47M parameters: keep the base's last-block MLP so the head stays small
        "train": {"epochs": 3.0, "lr": 3e-4, "batch_tokens": 2048, "freeze_mlp": True},
    },
}
# tokens per second of trunk states and of a training epoch (the 1.5B's block is ~3x the 0.5B's)
RATES = {"qwen2.5-coder-0.5b-instruct": (train.TRUNK_TOK_S, train.TRAIN_TOK_S), "qwen2.5-coder-1.5b-instruct": (200.0, 300.0)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(name: str, args: argparse.Namespace) -> None:
    t_start = time.time()
    deadline = t_start + args.minutes * 60
    spec = DEMO[name]
    model = resolve_model(name)
    n = spec["exit_layer"]
    data_dir = args.data or cache_dir("heads-data") / fingerprint(model) / args.mix
    tcfg = teacher.TeacherConfig(**{"threads": args.threads, **spec["teacher"]})
    tr = {**spec["train"], **({"epochs": args.epochs} if args.epochs else {})}
    trunk_tok_s, train_tok_s = RATES[name]
    last = [0.0]

    def prog(d: dict) -> None:
        if time.time() - last[0] > 60:
            last[0] = time.time()
            log(f"{name} teacher: {d['tokens']} tokens on disk, {d['new'] / max(d['elapsed'], 1e-9):.1f} tok/s")

    got = teacher.run_teacher(
        model,
        data.mix_items(args.mix),
        data_dir,
        cfg=tcfg,
        budget_tokens=args.tokens or 10**12,
        progress=prog,
        stop_when=train.teacher_stop_rule(deadline, tr["epochs"], trunk_tok_s=trunk_tok_s, train_tok_s=train_tok_s),
    )
    log(f"{name}: {got} teacher tokens in {data_dir}")
    train.cache_trunk_states(model, data_dir, (n,), threads=args.threads, progress=log)
    cfg = train.TrainConfig(**{"exit_layer": n, "threads": args.threads, "eval_every": 25, **tr})
    out = models_dir() / f"{name}.exit{n}.gguf" if args.output is None else args.output
    init = None
    if args.init_shipped:  # continue from the shipped head: it holds what earlier runs' data taught it
        init = out.with_name(out.name + ".init")
        shutil.copyfile(models_dir() / f"{name}.exit{n}.gguf", init)
    summary = train.train_head(
        model,
        data_dir,
        out,
        cfg,
        ckpt_path=cache_dir("heads-ckpt") / f"{out.name}.{fingerprint(model)[:12]}.ckpt",
        log=log,
        use_bar=sys.stderr.isatty(),
        data_summary={"teacher_tokens": got, "mix": data.MIXES[args.mix], "init": "the previous shipped head" if init else "base's last block"},
        init_head=init,
        deadline=deadline,
    )
    if init is not None:
        init.unlink()
    log(
        f"{name}: wrote {out} ({out.stat().st_size / 1e6:.1f} MB) in {(time.time() - t_start) / 60:.1f} min: "
        f"{json.dumps({k: summary[k] for k in ('steps', 'planned_steps', 'epochs', 'train_tokens', 'final_loss', 'agreement')})}"
    )
    if not args.no_eval:
        rep = evaluate.evaluate(model, out, models_dir() / "eval_prompts.jsonl", threads=args.threads)
        log(
            f"{name}: eval {json.dumps({c: {'agreement': e['agreement'], 'vprime': e['agreement_vprime'], 'tau_runs_k4': e['tau_runs'][4]} for c, e in rep['categories'].items()})}, cost {rep['cost_ratio']}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(DEMO), action="append", help="train only this model (repeatable)")
    ap.add_argument("--minutes", type=float, default=55.0, help="wall-clock budget per model (teacher + trunk + training)")
    ap.add_argument("--tokens", type=int, default=None, help="cap on teacher tokens on disk per model")
    ap.add_argument("--mix", choices=sorted(data.MIXES), default=data.DEFAULT_MIX)
    ap.add_argument("--data", type=Path, default=None, help="teacher data directory (default: the cache, per model and mix)")
    ap.add_argument("--epochs", type=float, default=None)
    ap.add_argument("--init-shipped", action="store_true", help="continue from the shipped head instead of the base's last block")
    ap.add_argument("-o", "--output", type=Path, default=None, help="head to write (default: models/<model>.exit<N>.gguf)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-eval", action="store_true")
    args = ap.parse_args()
    for name in args.only or list(DEMO):
        run(name, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
