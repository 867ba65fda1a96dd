"""A later turn's time to the first token over HTTP: `eesd serve` against llama-server, one request at a time.

    EESD_LLAMA_TOOLS=build/llama-tools/KEY/bin .venv/bin/python scripts/turn_ttft.py eesd
    EESD_LLAMA_TOOLS=build/llama-tools/KEY/bin .venv/bin/python scripts/turn_ttft.py llama-server
    .venv/bin/python scripts/turn_ttft.py inproc    (the engine in this process: what HTTP adds is the difference)
    (options: --drafter for eesd serve, --answer N tokens of turn 1, --new N tokens the next turn adds, --reps)

Starts the server (llama-server as `eesd bench` starts it: stock kernels, --no-repack on an AMX CPU), then per
repeat sends turn 1 (a prompt of 1000 + 60 r tokens of this project's source, streamed, --answer tokens), and
turn 2: turn 1, its answer's text tokenized again, and --new tokens more; prints turn 2's seconds from the
request to the first streamed text, per repeat and their median. Run the two servers one after the other,
alternating, and compare medians: nothing else should run beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import eesd_local
from eesd_local.llama.catalog import resolve_model
from eesd_local.llama.runtime import Model
from eesd_local.speculative.engine import Engine
from eesd_local.speculative.events import TokenEvent
from eesd_local.tools.bench.servers import STOCK_ENV, ServerProcess, eesd_serve_argv, free_port, llama_server_argv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("server", choices=("eesd", "llama-server", "inproc"))
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--drafter", default="none")
    ap.add_argument("--answer", type=int, default=128)
    ap.add_argument("--new", type=int, default=30)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    path = resolve_model(args.model)
    if args.server == "inproc":
        with eesd_local.load(str(path), drafter=args.drafter, n_ctx=4096, n_threads=2) as eng:
            times = _turns(_engine_stream(eng), eng.model, args)
    else:
        times = _over_http(path, args)
    print(args.server, " ".join(f"{t:.3f}" for t in times), f"median {statistics.median(times):.3f} s")
    return 0


def _over_http(path: Path, args: argparse.Namespace) -> list[float]:
    port = free_port()
    if args.server == "eesd":
        argv = eesd_serve_argv(path, port, drafter=args.drafter, n_ctx=4096, n_threads=2)
        env = None
    else:
        argv = llama_server_argv(path, port, spec_type=None, draft_model=None, n_ctx=4096, n_threads=2, n_gpu_layers=0)
        env = {**os.environ, **STOCK_ENV}
    server = ServerProcess(argv, port, args.server, env=env)  # started and waited for (/health)

    def stream(prompt: list[int], n: int) -> tuple[float, str]:
        text, first, *_ = server.post_stream("/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                                  "stream": True})
        return first, text

    model = Model(str(path))  # the tokenizer (mapped, idle while the server works)
    try:
        return _turns(stream, model, args)
    finally:
        model.close()
        server.stop()


def _engine_stream(eng: Engine) -> Callable[[list[int], int], tuple[float, str]]:
    """The engine in this process, timed from the call to the first token's text (what HTTP adds is the difference)."""
    def stream(prompt: list[int], n: int) -> tuple[float, str]:
        t0 = time.perf_counter()
        first, parts = 0.0, []
        for ev in eng.generate(prompt, max_tokens=n, temperature=0.0):
            if isinstance(ev, TokenEvent) and ev.text:
                if not parts:
                    first = time.perf_counter() - t0
                parts.append(ev.text)
        return first, "".join(parts)

    return stream


def _turns(stream: Callable[[list[int], int], tuple[float, str]], model: Model, args: argparse.Namespace) -> list[float]:
    """Per repeat: turn 1, then turn 2 (turn 1, its answer's text tokenized again, --new tokens more); turn 2's
    seconds to its first text."""
    source = model.tokenize((Path(__file__).parents[1] / "eesd_local" / "server.py").read_text())
    stream(source[:64], 4)  # warm-up
    times = []
    for r in range(args.reps):
        turn1 = source[:1000 + 60 * r]
        _, answer = stream(turn1, args.answer)
        again = model.tokenize(answer, add_special=False) if answer else []
        first, _ = stream(turn1 + again + source[1000 + 60 * r:1000 + 60 * r + args.new], 4)
        times.append(first)
    return times


if __name__ == "__main__":
    sys.exit(main())
