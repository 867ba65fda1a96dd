"""Two builds of llama.cpp side by side: prefill, plain decode and B(k), measured interleaved.

Each pass starts one worker process per build (llama-cpp-python loads the libllama that
LLAMA_CPP_LIB_PATH names) and alternates which goes first, so that load on a shared machine
falls on both alike. A worker measures, on one model with the engine's context settings:
- prefill tokens/s of prompts of 512, 64 and 12 tokens (logits for the last row only), and of the
  512 tokens decoded in chunks of 64 (how the engine decodes a prompt where output is exact);
- plain decode tokens/s (one token per decode, 96 tokens);
- B(k), the time of a batch of k tokens over one token, k = 1..64 (medians of 7, of 3 from 24 up);
- whether every row of a 96-token greedy continuation is bit-identical decoded one token at a
  time and in batches of 2..95.

usage: python scripts/exact_ab.py MODEL.gguf --build before=LIBDIR --build after=LIBDIR [--passes 3]
       (a LIBDIR holds libllama.so; `default` means the one llama-cpp-python installed)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from eesd_local.llama.runtime import Context, ContextParams, Model

KS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
IDENT_KS = (2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 95)


def worker(model_path: str, threads: int) -> dict:
    model = Model(model_path)
    ctx = Context(model, ContextParams(n_ctx=2048, n_threads=threads))
    text = ("Write a Python class for a bounded LRU cache with get, put and delete; explain the design, "
            "its complexity and how to test it. ") * 40
    toks = model.tokenize(text)
    out: dict = {}

    def prefill(n: int, reps: int) -> float:
        best = float("inf")
        for _ in range(reps):
            ctx.clear()
            t0 = time.perf_counter()
            ctx.decode(toks[:n])
            best = min(best, time.perf_counter() - t0)
        return n / best

    out["prefill_512"] = prefill(512, 3)
    best = float("inf")  # the same 512 tokens as the engine decodes a prompt where output is exact: chunks of 64
    for _ in range(3):
        ctx.clear()
        t0 = time.perf_counter()
        for s in range(0, 512, 64):
            ctx.decode(toks[s:s + 64], n_logits=1 if s == 448 else 0)
        best = min(best, time.perf_counter() - t0)
    out["prefill_512_in_64s"] = 512 / best
    out["prefill_64"] = prefill(64, 5)
    out["prefill_12"] = prefill(12, 7)

    ctx.clear()
    ctx.decode(toks[:40])
    cont = []
    t0 = time.perf_counter()
    for _ in range(96):
        t = int(ctx.logits().argmax())
        cont.append(t)
        ctx.decode([t])
    out["decode_tok_s"] = 96 / (time.perf_counter() - t0)

    base = 40 + 24

    def t_of(k: int, reps: int = 7) -> float:
        ts = []
        for _ in range(reps):
            ctx.trim(base)
            t0 = time.perf_counter()
            ctx.decode(cont[24:24 + k], n_logits=k)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    ctx.trim(40)
    ctx.decode(cont[:24])
    t1 = t_of(1)
    out["t1_ms"] = t1 * 1e3
    out["B"] = {k: t_of(k, 7 if k < 24 else 3) / t1 for k in KS}

    ctx.clear()
    ctx.decode(toks[:40])
    single = []
    for t in cont:
        single.append(ctx.logits().copy())
        ctx.decode([t])
    ident = {}
    for k in IDENT_KS:
        ctx.clear()
        ctx.decode(toks[:40])
        rows = [ctx.logits().copy()]
        for i in range(0, len(cont) - 1, k):
            chunk = cont[i:min(i + k, len(cont) - 1)]
            ctx.decode(chunk, n_logits=len(chunk))
            rows += [ctx.logits(j).copy() for j in range(len(chunk))]
        same = sum(bool(np.array_equal(a, b)) for a, b in zip(single, rows, strict=True))
        ident[k] = f"{same}/{len(single)}"
    out["rows_identical"] = ident
    ctx.close()
    model.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--build", action="append", required=True, help="NAME=LIBDIR[?VAR=VALUE&...] (LIBDIR 'default': the installed one; VARs: its worker's environment)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write every pass's figures here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.threads)))
        return
    builds = [b.split("=", 1) for b in args.build]
    runs: dict[str, list[dict]] = {name: [] for name, _ in builds}
    for p in range(args.passes):
        order = builds if p % 2 == 0 else builds[::-1]
        for name, lib in order:
            env = dict(os.environ)
            lib, _, extra = lib.partition("?")  # LIBDIR?VAR=VALUE&VAR=VALUE: environment of that build's worker
            env.update(kv.split("=", 1) for kv in extra.split("&") if kv)
            if lib != "default":
                env["LLAMA_CPP_LIB_PATH"] = lib
            res = subprocess.run([sys.executable, __file__, args.model, "--build", "x=y", "--worker", "--threads",
                                  str(args.threads)], env=env, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"pass {p + 1} {name}: done", file=sys.stderr)
    med = {}
    for name, rs in runs.items():
        m = {key: statistics.median(r[key] for r in rs) for key in ("prefill_512", "prefill_512_in_64s", "prefill_64", "prefill_12", "decode_tok_s", "t1_ms")}
        m["B"] = {k: statistics.median(r["B"][k] for r in rs) for k in rs[0]["B"]}
        m["rows_identical"] = rs[-1]["rows_identical"]
        med[name] = m
    print("| build | prefill 512 tok/s | 512 in chunks of 64 | prefill 64 | prefill 12 | decode tok/s | " + " | ".join(f"B{k}" for k in KS[1:])
          + " | rows identical to one-token decodes, by batch size |")
    print("|---" * (7 + len(KS)) + "|")
    for name, m in med.items():
        ident = ", ".join(f"{k}: {v}" for k, v in m["rows_identical"].items())
        print(f"| {name} | {m['prefill_512']:.0f} | {m['prefill_512_in_64s']:.0f} | {m['prefill_64']:.0f} | {m['prefill_12']:.0f} | {m['decode_tok_s']:.1f} | "
              + " | ".join(f"{m['B'][str(k)]:.2f}" for k in KS[1:]) + f" | {ident} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"passes": runs, "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
