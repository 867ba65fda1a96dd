"""Replay prompt-lookup rounds over recorded greedy answers: tune the controller without the noise.

Greedy speculative decoding emits exactly plain decoding's tokens (but at near ties), so what a
lookup draft proposes and how much of it the target accepts at every point of an answer follows
from the prompt and `none`'s answer alone. What a round costs follows from the model's decode
time by batch size, B(b). So a recorded answer replays any controller, round by round, with the
real controller code (the same Numba kernels the engine calls) and the real lookup drafter,
timed by the measured B(b) table plus noise: thousands of requests a minute, no timing noise in
the verdict, and the same tokens as the engine's rounds.

    python scripts/lookup_replay.py collect -o /tmp/tune.json --sets chat,code,rewrite --n-prompts 4
    python scripts/lookup_replay.py collect -o /tmp/held.json --sets chat,code,rewrite --n-prompts 4 --held-out 6
    python scripts/lookup_replay.py replay /tmp/tune.json [--controller cost-ts:no-hindsight] [--seeds 3]
    python scripts/lookup_replay.py best /tmp/tune.json

``collect`` runs `none` on each prompt (the answer) and measures B(b) (weights.batch_costs);
``--held-out N`` takes N prompts per category that `eesd bench --n-prompts 4` does not use.
``replay`` prints each category's replayed speedup over plain decoding (lookup, the default
controller learning in hindsight as the engine does, requests in the order given, one controller
across them as in `eesd bench`), and what rounds drafting 1, 2, 3+ tokens saved or lost.
``best`` prints, per category, the best fixed rule in hindsight (draft k4 tokens after a 4-gram
match, k3 after a 3-gram, k2 after a 2-gram): what a controller that knew the category could get.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # tests.reference

from eesd_local.base.defaults import DRAFT_MAX  # noqa: E402
from eesd_local.llama import costs, native  # noqa: E402
from eesd_local.speculative.controllers import make_controller  # noqa: E402
from eesd_local.speculative.drafters.base import Offer  # noqa: E402
from eesd_local.speculative.engine import Engine, EngineConfig  # noqa: E402
from eesd_local.speculative.events import TokenEvent  # noqa: E402
from eesd_local.tools.bench.prompts import load_prompts, spread  # noqa: E402
from eesd_local.tools.registry import resolve_model  # noqa: E402
from eesd_local.tools.weights import batch_costs  # noqa: E402
from tests.reference import Hindsight, round_limit  # noqa: E402


class LookupDrafter:
    """Prompt lookup as the round loop runs it (the extension's lookup), with the offers it makes."""

    def __init__(self, ngram_max: int = 4) -> None:
        self.ngram_max = ngram_max

    def begin(self, prompt: list[int]) -> None:
        pass

    def lookup(self, history: list[int], max_n: int) -> tuple[list[int], int]:
        cont, n, _ = native.require().lookup(history, 1, self.ngram_max, max_n)
        return list(cont), n

    def offer(self, history: list[int], max_n: int) -> Offer:
        nat = native.require()
        cont, n, match = nat.lookup(history, 1, self.ngram_max, max_n)
        if match < nat.LOOKUP_MIN_MATCH:  # as the round loop: no offer on a match shorter than this
            cont = []
        conf = nat.match_confidence(n, self.ngram_max) if cont else 0.0
        return Offer(len(cont), conf, tokens=tuple(cont), match=match if cont else 0)


def collect(args: argparse.Namespace) -> None:
    items = []
    for s in args.sets.split(","):
        if not s:
            continue
        by_cat = collections.defaultdict(list)
        for it in load_prompts(s):
            by_cat[it.category].append(it)
        for g in by_cat.values():
            picked = spread(g, args.n_prompts)
            if args.held_out:  # the prompts `eesd bench --n-prompts N` does not use, evenly spaced
                rest = [it for it in g if it not in picked]
                picked = spread(rest, args.held_out)
            items += picked
    for f in args.prompts or []:
        items += load_prompts(f)
    traces = []
    with Engine(EngineConfig(model=args.model, drafter="none")) as eng:
        t0 = time.perf_counter()
        for i, it in enumerate(items):
            if it.messages:
                prompt = eng.apply_chat_template([{"role": r, "content": c} for r, c in it.messages])
            elif it.turns:
                prompt = eng.apply_chat_template([{"role": "user", "content": it.turns[0]}])
            else:
                prompt = it.prompt
            ptoks = eng.tokenize(prompt) if isinstance(prompt, str) else prompt
            out = [ev.token for ev in eng.generate(ptoks, max_tokens=args.max_tokens) if isinstance(ev, TokenEvent)]
            traces.append({"id": it.id, "category": it.category, "prompt": ptoks, "answer": out})
            print(f"{i + 1}/{len(items)} {it.category}/{it.id}: {len(out)} tokens ({time.perf_counter() - t0:.0f} s)", flush=True)
    table = batch_costs([str(resolve_model(args.model))], sorted(set(range(1, 10)) | set(costs.KS)), repeats=args.cost_repeats)[0]
    print("B(b) ms:", {k: round(v, 2) for k, v in table.ms.items()})
    with open(args.output, "w") as f:
        json.dump({"model": args.model, "batch_ms": table.ms, "traces": traces}, f)


def replay_one(ctl, drafter, prompt: list[int], answer: list[int], bms: dict[int, float], rng: np.random.Generator,
               draft_max: int, noise: float, stats: collections.Counter, hs=None) -> float:
    """Seconds the answer takes under lookup rounds (plain decoding: len(answer) * B(1))."""
    ctl.begin_request()
    drafter.begin(prompt)
    if hs is not None:
        hs.clear()
    history = list(prompt) + answer[:1]  # the prefill's logits gave the first token
    j = 1
    t = 0.0
    n = len(answer)
    while j < n:
        left = n - j
        max_n = round_limit(draft_max, left, 10**6)
        if hs is not None:
            hs.see(history)
        offer = drafter.offer(history, max_n)
        if hs is not None:
            hs.add(len(history), offer.tokens, offer.match)
        ctl.begin_round(offer.n, offer.confidence, offer.behind, offer.match)
        cont, ng = drafter.lookup(history, max_n) if offer.n else ([], 0)
        k = 0
        confs = []
        conf = ng / (drafter.ngram_max + 1.0)
        while k < len(cont) and ctl.draft_more(k, 1.0 if k == 0 else conf):
            k += 1
            confs.append(conf)
        bonus = k == 0 or not ctl.no_bonus()
        rows = k + 1 if bonus else k
        m = 0
        while m < k and cont[m] == answer[j + m]:
            m += 1
        emitted = m + 1 if (bonus or m < k) else m
        emitted = min(emitted, left)
        tv = bms[rows] * (1.0 + noise * rng.standard_normal()) / 1e3
        td = 2e-6
        t += tv + td
        ctl.end_round(np.asarray(confs, dtype=np.float64), m, td, tv)
        stats["rounds"] += 1
        stats["drafted"] += k
        stats["accepted"] += m
        stats[f"k{min(k, 3)}"] += 1
        # time saved against plain decoding of the same tokens, by kind of round (negative: a loss)
        stats[f"save_k{min(k, 3)}"] += emitted * bms[1] / 1e3 - tv - td
        history += answer[j:j + emitted]
        j += emitted
    return t


def replay(args: argparse.Namespace) -> None:
    data = json.load(open(args.traces))
    measured = {int(k): v for k, v in data["batch_ms"].items()}
    if args.costs:  # a kept cost profile (~/.cache/eesd-local/costs/*.json): B(b) as measured on a quiet machine
        kept = json.load(open(args.costs))
        measured = {int(k): kept["t1_ms"] * v for k, v in kept["bk"].items()}
    prof = costs.CostProfile(measured[1], {k: v / measured[1] for k, v in measured.items()}, {})
    bms = {b: measured[1] * prof.b(b) for b in range(1, args.draft_max + 2)}  # between measured sizes: the line
    traces = data["traces"]
    if args.category:
        traces = [t for t in traces if t["category"].startswith(args.category)]
    per_cat: dict[str, list[float]] = collections.defaultdict(list)
    plain_cat: dict[str, list[float]] = collections.defaultdict(list)
    stats: collections.Counter = collections.Counter()
    save_cat: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for seed in range(args.seeds):
        rng = np.random.default_rng(seed)
        ctl = make_controller(args.controller, max_draft=args.draft_max, seed=seed)
        drafter = LookupDrafter(ngram_max=args.ngram_max)
        hs = None
        if ctl.learn_in_hindsight(True):  # as the engine's round loops do for a drafter with free offers

            hs = Hindsight(ctl)
        # warm-up as the bench does: a short request teaches the controller this machine's costs
        order = list(range(len(traces)))
        if args.shuffle:
            rng.shuffle(order)
        warm = traces[0]
        replay_one(ctl, drafter, warm["prompt"], warm["answer"][:16], bms, rng, args.draft_max, args.noise, collections.Counter(), hs)
        for i in order:
            tr = traces[i]
            if len(tr["answer"]) < 2:
                continue
            cs = collections.Counter()
            t = replay_one(ctl, drafter, tr["prompt"], tr["answer"], bms, rng, args.draft_max, args.noise, cs, hs)
            stats.update(cs)
            save_cat[tr["category"]].update(cs)
            per_cat[tr["category"]].append(t)
            plain_cat[tr["category"]].append((len(tr["answer"]) - 1) * bms[1] / 1e3)  # the first token came with the prefill
    cats = sorted(per_cat)
    print("B(b)/B(1):", " ".join(f"{b}:{bms[b] / bms[1]:.2f}" for b in sorted(bms)))
    print(f"{'category':<16} {'speedup':>8}   share of plain time saved by rounds drafting k = 1 / 2 / 3+")
    tot_s = tot_p = 0.0
    worst = 9.0
    for c in cats:
        s, p = sum(per_cat[c]), sum(plain_cat[c])
        tot_s += s
        tot_p += p
        worst = min(worst, p / s)
        sc = save_cat[c]
        print(f"{c:<16} {p / s:8.3f}   " + " ".join(f"{sc[f'save_k{j}'] / p:+.3f}" for j in (1, 2, 3)))
    print(f"{'all':<16} {tot_p / tot_s:8.3f}   worst {worst:.3f}")
    r = stats["rounds"]
    print(f"rounds {r}: drafted/round {stats['drafted'] / r:.3f}, accepted {stats['accepted'] / max(1, stats['drafted']):.3f}, "
          f"k=0 {stats['k0'] / r:.3f} k=1 {stats['k1'] / r:.3f} k=2 {stats['k2'] / r:.3f} k>=3 {stats['k3'] / r:.3f}")


def best(args: argparse.Namespace) -> None:
    """The best fixed rule per category, in hindsight (no noise, no learning)."""
    data = json.load(open(args.traces))
    rel = {int(k): v / data["batch_ms"]["1"] for k, v in data["batch_ms"].items()}

    def rate(trs, rule: dict[int, int]) -> float:
        cost = n_out = 0.0
        for tr in trs:
            d = LookupDrafter()
            d.begin(tr["prompt"])
            ans = tr["answer"]
            hist = list(tr["prompt"]) + ans[:1]
            j = 1
            while j < len(ans):
                left = len(ans) - j
                cont, ng = d.lookup(hist, min(8, left - 1))
                k = min(rule.get(ng, 0), len(cont))
                m = 0
                while m < k and cont[m] == ans[j + m]:
                    m += 1
                c, e = (rel[1], 1) if k == 1 else (rel[k + 1], m + 1)  # one token: a probe without the bonus
                e = min(e, left)
                cost += c
                n_out += e
                hist += ans[j:j + e]
                j += e
        return n_out / cost

    cats: dict[str, list] = collections.defaultdict(list)
    for tr in data["traces"]:
        cats[tr["category"]].append(tr)
    print(f"{'category':<16} {'best':>6}  (k4, k3, k2)")
    for c, trs in sorted(cats.items()):
        top = max(((rate(trs, {4: a, 3: b, 2: g}), (a, b, g)) for a in (0, 2, 3, 4, 6, 8) for b in (0, 2, 3, 4, 8)
                   for g in (0, 2, 3)), key=lambda x: x[0])
        print(f"{c:<16} {top[0]:6.3f}  {top[1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("-o", "--output", required=True)
    c.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    c.add_argument("--sets", default="chat,code,rewrite")
    c.add_argument("--prompts", action="append", help="a JSONL prompt file (repeatable)")
    c.add_argument("--n-prompts", type=int, default=6)
    c.add_argument("--held-out", type=int, default=0,
                   help="instead take this many prompts per category from those --n-prompts does not pick")
    c.add_argument("--max-tokens", type=int, default=128)
    c.add_argument("--cost-repeats", type=int, default=12)
    r = sub.add_parser("replay")
    r.add_argument("traces")
    r.add_argument("--controller", default="cost-ts")
    r.add_argument("--draft-max", type=int, default=DRAFT_MAX)
    r.add_argument("--seeds", type=int, default=3)
    r.add_argument("--noise", type=float, default=0.05)
    r.add_argument("--category", default="")
    r.add_argument("--shuffle", action="store_true")
    r.add_argument("--ngram-max", type=int, default=4)
    r.add_argument("--costs", help="price rounds by this kept cost profile's B(b) instead of the traces' own")
    b = sub.add_parser("best")
    b.add_argument("traces")
    args = ap.parse_args()
    {"collect": collect, "replay": replay, "best": best}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
