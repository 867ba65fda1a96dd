"""Later turns of the built-in multi-turn sets over HTTP: `eesd serve` against llama-server, time to the first token.

    EESD_LLAMA_TOOLS=build/llama-tools/KEY/bin .venv/bin/python scripts/turns_probe.py --model qwen2.5-coder-1.5b-instruct
    (options: --sets edits,rework; --n items a set; --answer N tokens of each answer kept as history; --runs N;
     --drafter for eesd serve; --log FILE appends what is printed)

The conversations are built once, in this process, by plain greedy decoding (each turn's answer of up to --answer
tokens, its text as the next turn's history, as `eesd bench` keeps a method's own answers). Then each run starts
both servers in turn (order alternating run by run; llama-server as `eesd bench` starts it: stock kernels,
`--no-repack` on an AMX CPU, `cache_prompt` on), warms each with one request, and sends every turn of every item
as a token prompt to the streamed `/v1/completions`, greedy, --answer tokens asked (so the server decodes the
answer itself, as in a chat, and holds it in its cache when the next turn comes): a later turn's time to its first
chunk is what a client waits for there (the prompt's new tokens, the prefix reused). It prints each later turn's
seconds and their sum per server and run. Nothing else should run beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import eesd_local
from eesd_local.llama.catalog import resolve_model
from eesd_local.tools.bench.prompts import load_prompts
from eesd_local.tools.bench.servers import STOCK_ENV, ServerProcess, eesd_serve_argv, free_port, llama_server_argv


def _conversations(path: Path, sets: str, n: int, answer: int) -> list[tuple[str, list[list[int]]]]:
    """Each multi-turn item's prompt tokens per turn, the history being plain decoding's answers."""
    out = []
    with eesd_local.load(str(path), drafter="none", n_ctx=4096, n_threads=2) as eng:
        for item in load_prompts(sets, n_per_category=n):
            if not item.turns or item.n_turns < 2:
                continue
            history: list[dict[str, str]] = []
            prompts = []
            for user in item.turns:
                history.append({"role": "user", "content": user})
                prompt = eng.tokenize(eng.apply_chat_template(history))
                prompts.append(prompt)
                text = "".join(getattr(ev, "text", "") or "" for ev in eng.generate(prompt, max_tokens=answer,
                                                                                     temperature=0.0))
                history.append({"role": "assistant", "content": text})
            out.append((item.id, prompts))
    return out


def _server(which: str, path: Path, drafter: str) -> ServerProcess:
    port = free_port()
    if which == "eesd":
        argv = eesd_serve_argv(path, port, drafter=drafter, n_ctx=4096, n_threads=2)
        return ServerProcess(argv, port, "eesd serve")
    argv = llama_server_argv(path, port, spec_type=None, draft_model=None, n_ctx=4096, n_threads=2, n_gpu_layers=0)
    return ServerProcess(argv, port, "llama-server", env={**os.environ, **STOCK_ENV})


def _first(server: ServerProcess, prompt: list[int], answer: int) -> float:
    """Seconds from the request to the first chunk with text."""
    _, first, *_ = server.post_stream("/v1/completions", {"prompt": prompt, "max_tokens": answer, "temperature": 0,
                                                          "stream": True})
    return first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--sets", default="edits,rework")
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--answer", type=int, default=96)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--drafter", default="none")
    ap.add_argument("--log", type=Path)
    args = ap.parse_args()
    path = resolve_model(args.model)

    def say(line: str) -> None:
        print(line, flush=True)
        if args.log:
            with args.log.open("a") as f:
                f.write(line + "\n")

    convs = _conversations(path, args.sets, args.n, args.answer)
    say(f"# {path.name}: {len(convs)} conversations, "
        + ", ".join(f"{cid} {'/'.join(str(len(p)) for p in ps)} tokens" for cid, ps in convs))
    sums: dict[str, list[float]] = {"eesd": [], "llama-server": []}
    for run in range(args.runs):
        order = ["eesd", "llama-server"] if run % 2 == 0 else ["llama-server", "eesd"]
        for which in order:
            server = _server(which, path, args.drafter)
            try:
                _first(server, convs[0][1][0][:32], 4)  # warm-up
                later = []
                for _, prompts in convs:
                    times = [_first(server, p, args.answer) for p in prompts]
                    later += times[1:]
            finally:
                server.stop()
            sums[which].append(sum(later))
            say(f"run {run + 1} {which:12s} later turns " + " ".join(f"{t:.3f}" for t in later)
                + f"  sum {sum(later):.3f} s")
    say("sums: " + "; ".join(f"{k} " + " / ".join(f"{s:.3f}" for s in v) for k, v in sums.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
