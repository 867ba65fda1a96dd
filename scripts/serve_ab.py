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

`--turns` times the later turns of multi-turn chats instead (the bench's edits, rework and agent sets): each
round every server gets turn 1 with a new prefix, then each later turn after it, one token answered a turn, the
assistant's earlier turns the same text for every server (this process's greedy 64-token answer to the first
round's conversation), so every server prefills the same tokens (that answer and the new message) after the same
cached prefix; the table gives each later turn's time to the first token.

usage: python scripts/serve_ab.py [--model qwen2.5-coder-0.5b-instruct] [--drafter none] [--rounds 3]
                                  [--max-tokens 128] [--cold] [--inproc] [--turns]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import eesd_local  # noqa: E402
from eesd_local.llama.catalog import resolve_model  # noqa: E402
from eesd_local.tools.bench.methods import EngineMethod, Sampling, parse_methods  # noqa: E402
from eesd_local.tools.bench.prompts import agent_set, chat_set, code_set, edits_set, rework_set  # noqa: E402
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
    ap.add_argument("--turns", action="store_true", help="time the later turns of multi-turn chats (see above)")
    args = ap.parse_args()
    model = Path(resolve_model(args.model))
    if args.turns:
        return later_turns(args, model)

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

    peers = make_peers(args, model)
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


ANSWER = 64  # tokens of each earlier answer in --turns


def make_peers(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """`eesd serve` with ``--drafter``, plain llama-server, and with ``--inproc`` the engine in this process."""
    def http(method: str) -> HttpPeer:
        return HttpPeer(parse_methods(method)[-1], model, n_ctx=4096, n_threads=2, n_gpu_layers=0, draft_model=None,
                        draft_max=8)

    peers: dict[str, Any] = {f"eesd serve --drafter {args.drafter}": http(f"serve:eesd:{args.drafter}"),
                             "llama-server": http("serve:llama-server")}
    if args.inproc:
        engine = eesd_local.load(str(model), drafter=args.drafter, n_ctx=4096, draft_max=8)
        peers["in process"] = EngineMethod(parse_methods(args.drafter)[-1], engine)
    return peers


def later_turns(args: argparse.Namespace, model: Path) -> int:
    """Each round, every server: turn 1 (a new prefix), then the later turns, one token each; the time to the first
    token of each later turn, by kind."""
    items = [s()[0] for s in (edits_set, rework_set, agent_set)]
    with eesd_local.load(str(model), drafter="none") as eng:
        answers = {}  # (item, turn): this engine's greedy answer to the conversation's first round, ANSWER tokens

        def conversation(item, r):
            """Token lists of each turn's prompt, the assistant's earlier turns the answers of round 0's."""
            msgs, out = [], []
            for t, text in enumerate(item.turns):
                msgs.append({"role": "user", "content": f"({r + 1}) {text}" if t == 0 else text})
                out.append(eng.tokenize(eng.apply_chat_template(msgs)))
                if (item.id, t) not in answers:
                    answers[item.id, t] = eng.create_completion(out[-1], max_tokens=ANSWER, temperature=0.0)["choices"][0]["text"]
                msgs.append({"role": "assistant", "content": answers[item.id, t]})
            return out
        convs = [(it.category, [conversation(it, r) for r in range(args.rounds + 1)]) for it in items]
    peers = make_peers(args, model)
    one = Sampling(max_tokens=1, temperature=0.0, top_k=0, top_p=1.0, seed=None)
    res: dict[str, list[tuple[str, int, float]]] = {name: [] for name in peers}  # (kind, turn, seconds to the first token)
    try:
        for peer in peers.values():  # warm-up: a conversation none of the rounds sends
            for prompt in convs[0][1][args.rounds]:
                peer.generate(prompt, one)
        names = list(peers)
        for r in range(args.rounds):
            for i, (kind, per_round) in enumerate(convs):
                for name in run_order(names, r, i):
                    for t, prompt in enumerate(per_round[r]):
                        turn = peers[name].generate(prompt, one)
                        if t:
                            res[name].append((kind, t + 1, turn.t_prefill))
    finally:
        for peer in peers.values():
            peer.close()
    keys = [(kind, t) for kind, per_round in convs for t in range(2, len(per_round[0]) + 1)]
    print(f"seconds to the first token of a later turn, median of {args.rounds} rounds")
    print(f"{'turn':14s} " + " ".join(f"{n[:24]:>24s}" for n in peers) + "  ratio to llama-server")
    for kind, t in keys:
        med = {n: statistics.median(f for k, tt, f in res[n] if (k, tt) == (kind, t)) for n in peers}
        print(f"{kind + ' ' + str(t):14s} " + " ".join(f"{med[n]:24.3f}" for n in peers) + "  "
              + " ".join(f"{med[n] / med['llama-server']:.3f}" for n in peers if n != "llama-server"))
    for name in peers:
        if name != "llama-server":
            tot = sum(f for *_, f in res[name]) / sum(f for *_, f in res["llama-server"])
            print(f"{name}: later turns' time to the first token, all rounds, {tot:.3f} of llama-server's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
