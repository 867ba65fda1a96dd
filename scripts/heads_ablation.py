"""Exit-head data and recipe ablation: what each kind of teacher data buys per CPU-minute.

For each training mix (eesd_local.tools.heads.data.MIXES) the teacher runs the same wall-clock budget
from an empty data directory of its own; then trunk states, training (same recipe) and
`eesd heads eval` on models/eval_prompts.jsonl. Recipe variants are trained on one arm's data.
Every stage is cached under $EESD_HOME/heads-ablation/<model fingerprint>/, so a rerun (or an
interrupted run) continues where it stopped. Writes a JSON record and a markdown table.

    python scripts/heads_ablation.py --model qwen2.5-coder-0.5b-instruct --teacher-minutes 7 \\
        --mixes own,forced,own+forced --variants vprime --json benchmarks/heads-ablation.json \\
        --markdown benchmarks/heads-ablation.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from eesd_local.base.paths import cache_dir, models_dir
from eesd_local.gguf.headfile import fingerprint
from eesd_local.tools.heads import data, evaluate, teacher, train
from eesd_local.tools.registry import resolve_model

VARIANTS = {
    "base": {},  # the default recipe: full-vocabulary sampled softmax, 3 epochs, lr 3e-4
    "vprime": {"draft_vocab": 32768},  # softmax over the shared trunk's V'
    "epochs2": {"epochs": 2.0},
    "lr1e-3": {"lr": 1e-3},
    "init-next": {"init_from": "N"},  # the exit block starts as base block N (the one it replaces) instead of the last
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_arm(model: Path, root: Path, mix: str, minutes: float, n: int, variants: list[str], threads: int) -> list[dict]:
    ddir = root / mix
    meta_path = ddir / "teacher.json"
    ddir.mkdir(parents=True, exist_ok=True)
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
    else:
        log(f"{mix}: teacher for {minutes} min")
        cfg = teacher.TeacherConfig(n_parallel=16, threads=threads)
        t0 = time.time()
        tokens = teacher.run_teacher(model, data.mix_items(mix), ddir, cfg=cfg, time_limit_s=minutes * 60)
        wall = time.time() - t0
        meta = {"tokens": tokens, "teacher_s": round(wall, 1), "teacher_tok_s": round(tokens / wall, 1)}
        meta_path.write_text(json.dumps(meta))
    log(f"{mix}: {meta}")
    t0 = time.time()
    train.cache_trunk_states(model, ddir, (n,), threads=threads, progress=log)
    trunk_s = meta.setdefault("trunk_s", round(time.time() - t0, 1))
    meta_path.write_text(json.dumps(meta))
    rows = []
    for v in variants:
        head = ddir / f"head-{v}.gguf"
        res_path = ddir / f"result-{v}.json"
        if res_path.exists():
            rows.append(json.loads(res_path.read_text()))
            continue
        opts = {k: (n if val == "N" else val) for k, val in VARIANTS[v].items()}
        cfg = train.TrainConfig(exit_layer=n, threads=threads, **opts)
        t0 = time.time()
        summary = train.train_head(
            model, ddir, head, cfg, ckpt_path=ddir / f"head-{v}.ckpt", log=log, use_bar=False, force=True
        )
        train_s = time.time() - t0
        rep = evaluate.evaluate(model, head, models_dir() / "eval_prompts.jsonl", threads=threads, measure=False)
        cats = rep["categories"]
        minutes_total = (meta["teacher_s"] + trunk_s + train_s) / 60
        row = {
            "mix": mix,
            "variant": v,
            "teacher_tokens": meta["tokens"],
            "teacher_tok_s": meta["teacher_tok_s"],
            "teacher_min": round(meta["teacher_s"] / 60, 1),
            "trunk_min": round(trunk_s / 60, 1),
            "train_min": round(train_s / 60, 1),
            "total_min": round(minutes_total, 1),
            "train_heldout": summary["agreement"],
            **{f"{c}": cats[c]["agreement"] for c in ("code", "chat", "all") if c in cats},
            **{f"{c}_vprime": cats[c]["agreement_vprime"] for c in ("code", "chat", "all") if c in cats},
        }
        res_path.write_text(json.dumps(row))
        log(json.dumps(row))
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--exit-layer", type=int, default=6)
    ap.add_argument("--teacher-minutes", type=float, default=7.0)
    ap.add_argument("--mixes", default="own,forced,own+forced")
    ap.add_argument("--variants", default="vprime", help="recipe variants trained on the last mix's data, besides 'base'")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args()
    model = resolve_model(args.model)
    root = cache_dir("heads-ablation") / fingerprint(model)[:16] / f"t{args.teacher_minutes:g}"
    mixes = [m for m in args.mixes.split(",") if m]
    extra = [v for v in args.variants.split(",") if v and v != "base"]
    rows: list[dict] = []
    for i, mix in enumerate(mixes):
        variants = ["base"] + (extra if i == len(mixes) - 1 else [])
        rows += run_arm(model, root, mix, args.teacher_minutes, args.exit_layer, variants, args.threads)
    cols = ["mix", "variant", "teacher_tokens", "teacher_tok_s", "teacher_min", "trunk_min", "train_min", "total_min",
            "code", "chat", "all", "code_vprime", "chat_vprime"]
    lines = ["| " + " | ".join(cols) + " | all per CPU-min |", "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + f" | {r['all'] / r['total_min']:.4f} |")
    table = "\n".join(lines)
    print(table)
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
