"""One-token decodes at a short and at long contexts, this build's exact kernels beside llama.cpp's stock ones.

A decode's attention products grow with the context (K*Q: one row against every cached key; V*KQ: a row as long
as the context), so a kernel that is level with stock at 64 tokens can fall behind at 2,048: that is what this
shows, where `scripts/exact_ab.py` decodes after 40 tokens. Each build runs in its own process (the kernels are
chosen once a process, GGML_CPU_EXACT_ROWS=0 for stock), alternating, `--passes` times; per context the best of
three runs of 24 decodes after the prompt was prefilled in 64-token chunks. Kernel choices are timed afresh
(GGML_CPU_EXACT_CHOICE_FILE empty). Run it alone: on 2 cores anything beside it moves the figures.

usage: python scripts/decode_at_context.py MODEL.gguf [--contexts 64,1024,2048] [--passes 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from eesd_local.llama.runtime import Context, ContextParams, Model

TEXT = ("Write a Python class for a bounded LRU cache with get, put and delete; explain the design, its complexity "
        "and how to test it. ") * 160


def worker(model_path: str, contexts: list[int], threads: int) -> dict[int, float]:
    model = Model(model_path)
    ctx = Context(model, ContextParams(n_ctx=max(contexts) + 128, n_threads=threads))
    toks = model.tokenize(TEXT)
    if len(toks) < max(contexts):
        raise SystemExit(f"the text has {len(toks)} tokens, fewer than {max(contexts)}")
    out = {}
    for n in contexts:
        ctx.clear()
        for s in range(0, n, 64):
            ctx.decode(toks[s:min(n, s + 64)], n_logits=1 if s + 64 >= n else 0)
        t = int(ctx.logits().argmax())
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(24):
                ctx.decode([t])
                t = int(ctx.logits().argmax())
            best = min(best, (time.perf_counter() - t0) / 24)
        out[n] = best * 1e3
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--contexts", default="64,1024,2048")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.worker:
        print(json.dumps(worker(args.model, contexts, args.threads)))
        return 0
    runs: dict[str, list[dict[int, float]]] = {"exact": [], "stock": []}
    for p in range(args.passes):
        for name in (("exact", "stock") if p % 2 == 0 else ("stock", "exact")):
            env = dict(os.environ, GGML_CPU_EXACT_CHOICE_FILE="")
            if name == "stock":
                env["GGML_CPU_EXACT_ROWS"] = "0"
            res = subprocess.run([sys.executable, __file__, args.model, "--contexts", args.contexts, "--threads",
                                  str(args.threads), "--worker"], capture_output=True, text=True, env=env, check=True)
            runs[name].append({int(k): v for k, v in json.loads(res.stdout.splitlines()[-1]).items()})
    print(f"{os.path.basename(args.model)}, {args.threads} threads, {args.passes} passes: ms a token (median of the passes),"
          " exact over stock per pass")
    print("| context | exact ms | stock ms | exact / stock, each pass |")
    print("|---:|---:|---:|---|")
    for n in contexts:
        e = [r[n] for r in runs["exact"]]
        s = [r[n] for r in runs["stock"]]
        ratios = ", ".join(f"{a / b:.2f}" for a, b in zip(e, s, strict=True))
        print(f"| {n} | {statistics.median(e):.2f} | {statistics.median(s):.2f} | {ratios} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
