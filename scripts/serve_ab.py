"""`eesd serve` beside llama-server over HTTP, request by request (issue 42): time to the first streamed
token, streamed decode tok/s and end-to-end tok/s per prompt kind, the servers' turns alternating.

One prompt of each chat kind and one code request, sent `--rounds` times in turn to every server (in the
bench's order: rotated from request to request, backwards every other round), greedy, streamed. By default a
prompt comes back unchanged in every round, as a conversation that a server sees again among others (what its
prompt cache is for); with
`--cold` each round puts a new prefix on the user's message, so that every prefill starts after the shared
system prompt. llama-server runs with its stock kernels (GGML_CPU_EXACT_ROWS=0, as users install it) from
EESD_LLAMA_TOOLS or build/llama-tools (`python scripts/llama_build.py tools`); `--inproc` adds the engine in
this process (no HTTP) as a third column. Medians over the rounds.

usage: python scripts/serve_ab.py [--model qwen2.5-coder-0.5b-instruct] [--drafter none] [--rounds 3]
                                  [--max-tokens 128] [--cold] [--inproc]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import eesd_local  # noqa: E402
from eesd_local.llama.catalog import resolve_model  # noqa: E402
from eesd_local.tools.bench.methods import EngineMethod, Sampling, parse_methods  # noqa: E402
from eesd_local.tools.bench.prompts import chat_set, code_set  # noqa: E402
from eesd_local.tools.bench.runner import run_order  # noqa: E402
from eesd_local.tools.bench.servers import HttpPeer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--drafter", default="none", help="eesd serve's drafter (default none: plain decoding)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cold", action="store_true", help="a new prefix on the user's message every round")
    ap.add_argument("--inproc", action="store_true", help="the engine in this process too")
    args = ap.parse_args()
    model = Path(resolve_model(args.model))

    with eesd_local.load(str(model), drafter="none") as eng:
        def tokens(messages, r):
            msgs = [{"role": m, "content": f"({r + 1}) {c}" if args.cold and m == "user" else c} for m, c in messages]
            return eng.tokenize(eng.apply_chat_template(msgs))
        seen, prompts = set(), []
        for item in chat_set():
            if item.category not in seen:
                seen.add(item.category)
                prompts.append((item.category, [tokens(item.messages, r) for r in range(args.rounds + 1)]))
        prompts.append(("code", [tokens(code_set()[0].messages, r) for r in range(args.rounds + 1)]))

    def http(method: str) -> HttpPeer:
        return HttpPeer(parse_methods(method)[-1], model, n_ctx=4096, n_threads=2, n_gpu_layers=0, draft_model=None,
                        draft_max=8)

    peers = {f"eesd serve --drafter {args.drafter}": http(f"serve:eesd:{args.drafter}"),
             "llama-server": http("serve:llama-server")}
    if args.inproc:
        engine = eesd_local.load(str(model), drafter=args.drafter, n_ctx=4096, draft_max=8)
        peers["in process"] = EngineMethod(parse_methods(args.drafter)[-1], engine)
    s = Sampling(max_tokens=args.max_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=None)
    res = {name: [] for name in peers}  # (kind, tokens, seconds, first-token seconds)
    try:
        for peer in peers.values():  # warm-up (with --cold, a prompt none of the rounds sends)
            peer.generate(prompts[0][1][args.rounds], s)
        names = list(peers)
        for r in range(args.rounds):
            for i, (kind, per_round) in enumerate(prompts):
                for name in run_order(names, r, i):  # the bench's order: rotated, backwards every other pass
                    t0 = time.perf_counter()
                    turn = peers[name].generate(per_round[r], s)
                    res[name].append((kind, turn.n, time.perf_counter() - t0, turn.t_prefill))
    finally:
        for peer in peers.values():
            peer.close()

    def row(name: str, kind: str | None) -> str:
        got = [x for x in res[name] if kind is None or x[0] == kind]
        e2e = statistics.median(n / t for _, n, t, _ in got)
        dec = statistics.median((n - 1) / (t - f) for _, n, t, f in got if n > 1 and t > f)
        ttft = statistics.median(f for *_, f in got)
        return f"{e2e:6.1f} {dec:6.1f} {ttft:6.3f}"

    print(f"{'kind':14s} " + " | ".join(f"{n[:22]:>22s}" for n in peers))
    print(f"{'':14s} " + " | ".join(f"{'e2e':>8s}{'dec':>7s}{'ttft':>7s}" for _ in peers))
    for kind, _ in prompts + [("all", None)]:
        print(f"{kind:14s} " + " | ".join(f"{row(n, None if kind == 'all' else kind):>22s}" for n in peers))
    base = "llama-server"
    for name in peers:
        if name != base:
            tot = sum(n for _, n, _, _ in res[name]) / sum(t for _, _, t, _ in res[name])
            ref = sum(n for _, n, _, _ in res[base]) / sum(t for _, _, t, _ in res[base])
            print(f"{name}: {tot:.2f} tok/s end to end over every request, {tot / ref:.3f} of llama-server's {ref:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
