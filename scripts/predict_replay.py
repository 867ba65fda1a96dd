"""Predicted outputs on a given CPU: would longer drafts or another realignment rule pay?

A prediction's drafts are free to propose; what limits them is what a verify of k rows costs (B(k)) and
where the answer leaves the prediction. Two questions, two ways to answer them:

    python scripts/predict_replay.py lengths [--controllers default,fixed:7,fixed:15,fixed:31] [--items 0,2]
    python scripts/predict_replay.py collect -o /tmp/pred.json [--start 5 --step 17 --n 8]
    python scripts/predict_replay.py replay /tmp/pred.json

``lengths`` runs `auto` with each controller on the first turn of built-in ``predict`` conversations
(their prediction sent), twice each (the second time the prompt is cached and the earlier answer is in the
store: nearly all of it copies), and prints the decode rate: fixed draft lengths against the default plan
on the real engine. ``collect`` records greedy answers (plain decoding) of whole ``predict`` conversations,
three turns each, with each turn's prediction, as token ids. ``replay`` replays realignment rules over them
without the model: each round proposes the prediction's continuation (if the rule finds one), drafts up
to K tokens of it, keeps the common prefix with the recorded answer and emits one more; a round of b rows
costs B(b) decodes, from this CPU's kind of profile (`cpu`: B(k) as measured on a 2-core EPYC without
AVX-512, BENCHMARKS.md) or a flat one (`flat`: a memory-bound device, B(k) ~ 1). The rules: realign on
a match of at least N tokens of the answer's end (the round's own search, native/verify.hpp reference_at;
the engine realigns on N = 3, native/rounds.hpp REF_MIN_MATCH), and "window": the engine's rule, and
where it finds nothing the answer's last token looked for just ahead of where the prediction was expected
(a changed stretch of the same length), drafting K1 tokens from there. Fixed draft lengths stand in for the controller's plan: compare rules, not figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import eesd_local  # noqa: E402
from eesd_local.llama import native  # noqa: E402
from eesd_local.speculative.events import TokenEvent  # noqa: E402
from eesd_local.tools.bench.prompts import predict_set, prediction_for  # noqa: E402

MODEL = "qwen2.5-coder-0.5b-instruct"
MATCH_CAP = 64  # matches measured up to this many tokens (native/verify.hpp MATCH_CAP)
NATIVE = native.require()  # the round's own realignment (native/verify.hpp reference_at)
# B(b) of the 0.5B on the 2-core EPYC without AVX-512 (BENCHMARKS.md, its section's part 1; 6, 7, 9 interpolated)
CPU_B = {1: 1.0, 2: 1.46, 3: 1.89, 4: 2.39, 5: 2.94, 6: 3.4, 7: 3.9, 8: 4.36, 9: 4.9, 16: 8.6, 17: 9.1}


def lengths(args: argparse.Namespace) -> None:
    items = [predict_set()[int(i)] for i in args.items.split(",")]
    for ctl in args.controllers.split(","):
        kw = {} if ctl == "default" else {"controller": ctl}
        with eesd_local.load(args.model, drafter="auto", n_ctx=4096, draft_max=64, **kw) as eng:
            for rep in range(2):
                for it in items:
                    toks = eng.tokenize(eng.apply_chat_template([{"role": "user", "content": it.turns[0]}]))
                    st = eng.run(toks, max_tokens=args.max_tokens, prediction=prediction_for(it, 0, "")).stats
                    print(f"{ctl:10s} pass {rep + 1} {it.id:32s} rounds {st.n_rounds:3d} drafted {st.n_drafted:3d} "
                          f"kept {st.n_accepted:3d} decode {st.n_generated / st.t_decode:6.2f} tok/s", flush=True)


def collect(args: argparse.Namespace) -> None:
    items = predict_set()[args.start::args.step][: args.n]
    out = []
    with eesd_local.load(args.model, drafter="none", n_ctx=4096) as eng:
        for it in items:
            msgs: list[dict[str, str]] = []
            prev = ""
            for t, turn in enumerate(it.turns):
                msgs.append({"role": "user", "content": turn})
                pred = prediction_for(it, t, prev)
                toks, text = [], []
                for ev in eng.generate(eng.tokenize(eng.apply_chat_template(msgs)), max_tokens=args.max_tokens):
                    if isinstance(ev, TokenEvent):
                        toks.append(ev.token)
                        text.append(ev.text)
                prev = "".join(text)
                msgs.append({"role": "assistant", "content": prev})
                out.append({"id": it.id, "turn": t, "answer": toks,
                            "prediction": eng.model.tokenize(pred, add_special=False, parse_special=False) if pred else []})
                print(it.id, "turn", t + 1, len(toks), "tokens", flush=True)
    Path(args.out).write_text(json.dumps(out))
    print("wrote", args.out)


def _cost(b: int, kind: str) -> float:
    if kind == "flat":
        return 1.0 + 0.02 * (b - 1)
    return CPU_B.get(b, 0.54 * b)


def _replay(a: list[int], r: list[int], kind: str, *, k: int, min_match: int, window: int = 0, k1: int = 0) -> float:
    """Decodes' worth of time the answer a takes with prediction r under one rule."""
    i, cost, expect, expect_at = 0, 0.0, 0, 0
    while i < len(a):
        h = a[:i]
        want = expect + (i - expect_at)
        at, n_draft = NATIVE.reference_at(h, i, r, want, min_match, MATCH_CAP)[0], k
        if at < 0 and window and i:
            at = next((e + 1 for e in range(max(0, want - 1), min(len(r) - 1, want + window)) if r[e] == h[-1]), -1)
            n_draft = k1
        prop = []
        if at >= 0:
            expect, expect_at = at, i
            prop = r[at: at + n_draft]
        m = 0
        while m < len(prop) and i + m < len(a) and prop[m] == a[i + m]:
            m += 1
        cost += _cost(len(prop) + 1, kind)
        i += m + 1
    return cost


def replay(args: argparse.Namespace) -> None:
    data = [d for d in json.loads(Path(args.file).read_text()) if d["prediction"]]
    n = sum(len(d["answer"]) for d in data)
    print(f"{len(data)} turns, {n} answer tokens; speedup over plain decoding (replayed):")
    rules = [(f"realign on >= {mm} tokens, draft {k}", dict(k=k, min_match=mm)) for mm in (2, 3, 4, 6) for k in (7, 15)]
    rules += [(f"the engine's rule + window 8, draft 7 / {k1}", dict(k=7, min_match=3, window=8, k1=k1)) for k1 in (1, 3, 7)]
    for name, kw in rules:
        cells = [f"{kind} {n / sum(_replay(d['answer'], d['prediction'], kind, **kw) for d in data):.3f}" for kind in ("cpu", "flat")]
        print(f"  {name:44s} {'  '.join(cells)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("lengths")
    p.add_argument("--controllers", default="default,fixed:7,fixed:15,fixed:31")
    p.add_argument("--items", default="0,2", help="indices into the built-in predict set")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--model", default=MODEL)
    p.set_defaults(fn=lengths)
    p = sub.add_parser("collect")
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--start", type=int, default=5)
    p.add_argument("--step", type=int, default=17)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--model", default=MODEL)
    p.set_defaults(fn=collect)
    p = sub.add_parser("replay")
    p.add_argument("file")
    p.set_defaults(fn=replay)
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
