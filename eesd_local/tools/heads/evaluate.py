"""``eesd heads eval``: how often the draft (base blocks 0..N-1 + exit head) picks the full
model's own greedy token, per category, and the tokens per verification (tau) that implies.

The target's greedy answers are generated once per (model, prompts file) and cached (they are
teacher shards, see ``teacher.py``); then the draft model is run teacher-forced over
prompt + answer in llama.cpp, exactly as the engine runs it, and its argmax at each answer
position is compared with the target's token. tau(k) is computed from the actual runs of
agreement (greedy speculation with k drafted tokens accepts the run up to the first miss, plus
the target's own token), and from the i.i.d. formula (1 - a^(k+1)) / (1 - a).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from eesd_local.base.errors import EesdError
from eesd_local.base.paths import cache_dir
from eesd_local.gguf.headfile import build_draft, fingerprint
from eesd_local.gguf.reader import bytes_read_per_token
from eesd_local.llama.draftvocab import DRAFT_VOCAB
from eesd_local.llama.trunk import build_trunk
from eesd_local.tools.heads import shards, teacher
from eesd_local.tools.heads.data import Item
from eesd_local.tools.heads.draftvocab import draft_vocab

# decode time of a batch of b tokens relative to b = 1 on this 2-core CPU (design.md)
CPU_BATCH_COST = {1: 1.0, 2: 1.86, 4: 2.7, 5: 3.65, 8: 4.8, 16: 7.9}


def cpu_batch_cost(b: int) -> float:
    xs = sorted(CPU_BATCH_COST)
    return float(np.interp(b, xs, [CPU_BATCH_COST[x] for x in xs]))


def read_prompts(path: Path) -> list[Item]:
    path = Path(path)
    if not path.is_file():
        raise EesdError(f"prompts file not found: {path}", hint="pass a JSONL file with id, category and prompt or messages")
    items = []
    for ln, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise EesdError(f"{path}:{ln} is not valid JSON", hint="one JSON object per line") from None
        if "messages" in rec:
            msgs = tuple((m["role"], m["content"]) for m in rec["messages"])
        elif "prompt" in rec:
            msgs = (("user", rec["prompt"]),)
        else:
            raise EesdError(f"{path}:{ln} has neither 'prompt' nor 'messages'")
        items.append(Item(id=str(rec.get("id", ln)), category=str(rec.get("category", "all")), messages=msgs))
    if not items:
        raise EesdError(f"{path} holds no prompts")
    return items


def target_answers(model_path: Path, prompts_path: Path, *, max_new: int = 128, threads: int = 2, n_parallel: int = 8) -> Path:
    """Generate (once, cached) the target's greedy answers to the prompts; return the shard dir."""
    items = read_prompts(prompts_path)
    key = hashlib.sha256(Path(prompts_path).read_bytes() + f"|{max_new}".encode()).hexdigest()[:16]
    out = cache_dir("heads-eval") / fingerprint(model_path) / key
    have = teacher.done_ids(out) if out.exists() else set()
    if not all(it.id in have for it in items):
        cfg = teacher.TeacherConfig(n_parallel=n_parallel, max_new=max_new, threads=threads, max_prompt=1024, shard_tokens=10**9)
        teacher.run_teacher(model_path, items, out, cfg=cfg, raise_on_signal=True)  # no report from half the answers
    return out


def draft_agreement(draft_path: Path, answers_dir: Path, *, threads: int = 2, vocab: np.ndarray | None = None,
                    more_vocabs: Sequence[np.ndarray] = ()) -> list[dict]:
    """Per sequence: category and the boolean agreement of the draft's argmax on answer tokens;
    with ``vocab`` (the shared trunk's V') also ``agree_v``: the argmax over those rows only, which
    is what the V' head computes (its rows are the same rows of the same requantized LM head);
    ``agree_more``: the same over each of ``more_vocabs`` (other V' sizes, one pass of the draft)."""
    ctx = teacher.open_context(Path(draft_path), n_parallel=1, n_ctx_per_seq=2048, threads=threads)
    vocabs = ([] if vocab is None else [vocab]) + list(more_vocabs)
    out = []
    try:
        for shard in shards.shard_paths(answers_dir):
            with np.load(shard) as z:
                tokens, offsets, n_prompt, cats, ids = z["tokens"], z["offsets"], z["n_prompt"], z["categories"], z["ids"]
            for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
                seq = tokens[a:b].tolist()
                preds: list[list[np.ndarray]] = [[] for _ in range(1 + len(vocabs))]  # all rows, then each vocab
                ctx.clear_seq(0)
                for c in range(0, len(seq) - 1, ctx.n_batch):
                    chunk = seq[c : min(c + ctx.n_batch, len(seq) - 1)]
                    logits = ctx.decode_rows([(t, c + j, 0, True) for j, t in enumerate(chunk)])
                    preds[0].append(logits.argmax(-1))
                    for v, got in zip(vocabs, preds[1:]):
                        got.append(v[logits[:, v].argmax(-1)])
                p0 = int(n_prompt[i])
                # pred[j] predicts seq[j+1]
                agree = [np.concatenate(g)[p0 - 1 :] == np.asarray(seq[p0:]) for g in preds]
                rec = {"id": str(ids[i]), "category": str(cats[i]), "agree": agree[0]}
                if vocab is not None:
                    rec["agree_v"] = agree[1]
                if more_vocabs:
                    rec["agree_more"] = agree[len(agree) - len(more_vocabs) :]
                out.append(rec)
    finally:
        ctx.close()
    return out


def tau_from_runs(agree: np.ndarray, k: int) -> float:
    """Tokens per verification for greedy speculation with k drafted tokens, from the real runs."""
    p, rounds, n = 0, 0, len(agree)
    while p < n:
        run = 0
        while run < k and p + run < n and agree[p + run]:
            run += 1
        p += run + 1
        rounds += 1
    return n / max(rounds, 1)


def tau_iid(a: float, k: int) -> float:
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def measure_cost(model_path: Path, draft_path: Path, *, threads: int = 2, reps: int = 5) -> float:
    """Draft cost per token / target cost per token (single-token decodes after a 32-token prefix)."""
    ctxs = [teacher.open_context(Path(p), n_parallel=1, n_ctx_per_seq=256, threads=threads) for p in (model_path, draft_path)]
    try:
        toks = ctxs[0].model.tokenize(
            "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 3,
            add_special=False,
        )[:48]
        times: list[list[float]] = [[], []]
        for _ in range(reps):
            for ctx, tl in zip(ctxs, times):
                ctx.clear_seq(0)
                ctx.decode_rows([(t, i, 0, True) for i, t in enumerate(toks[:32])])
                for j in range(8):
                    t0 = time.perf_counter()
                    ctx.decode_rows([(toks[32 + j], 32 + j, 0, True)])
                    tl.append(time.perf_counter() - t0)
        # the machine is shared: the lower quartile is the least disturbed estimate
        q = [float(np.percentile(t, 25)) for t in times]
        return q[1] / q[0]
    finally:
        for ctx in ctxs:
            ctx.close()


MEMORY_BOUND_FORMULA = (
    "tau_V'(k) / (1 + k * s): a verify of k+1 tokens reads the target's weights once (1); a draft step of the shared "
    "trunk reads s = (blocks 0..N-1 + the exit block + the V' rows of the LM head) / the target's bytes per token; "
    "tau_V'(k) = mean over answers of the tokens a round emits with k drafted, from the runs of the V' draft's "
    "agreement. The verify reuses the drafted rows' trunk states (compute saved), but the last drafted row still "
    "needs its trunk pass, so in bytes the trunk is paid once per draft step")


def memory_bound_speedup(runs: list[np.ndarray], share: float) -> dict[int, float]:
    """MEMORY_BOUND_FORMULA for k = 1..8, from the V' draft's agreement runs of each answer and s = ``share``."""
    taus = {k: statistics.mean(tau_from_runs(x, k) for x in runs if len(x)) for k in range(1, 9)}
    return {k: round(taus[k] / (1.0 + k * share), 3) for k in taus}


def memory_bound_share(model_path: Path, head_path: Path, vocab: np.ndarray) -> float:
    """s of MEMORY_BOUND_FORMULA: the shared trunk's bytes per draft step over the target's per token."""
    trunk = build_trunk(model_path, head_path, vocab)
    return bytes_read_per_token(trunk) / max(1, bytes_read_per_token(model_path))


def evaluate(
    model_path: Path,
    head_path: Path,
    prompts_path: Path,
    *,
    max_new: int = 128,
    threads: int = 2,
    cost: float | None = None,
    measure: bool = True,
    vocab_size: int | None = None,
) -> dict:
    answers = target_answers(model_path, prompts_path, max_new=max_new, threads=threads)
    draft = build_draft(model_path, head_path)
    vocab = draft_vocab(model_path, vocab_size or DRAFT_VOCAB).astype(np.int64)
    per_seq = draft_agreement(draft, answers, threads=threads, vocab=vocab)
    share = memory_bound_share(model_path, head_path, vocab)
    cats: dict[str, list[np.ndarray]] = {}
    cats_v: dict[str, list[np.ndarray]] = {}
    for r in per_seq:
        for key in (r["category"], "all"):
            cats.setdefault(key, []).append(r["agree"])
            cats_v.setdefault(key, []).append(r["agree_v"])
    if cost is None and measure:
        cost = measure_cost(model_path, draft, threads=threads)
    report: dict = {
        "model": str(model_path),
        "head": str(head_path),
        "draft": str(draft),
        "prompts": str(prompts_path),
        "cost_ratio": cost,
        "draft_vocab": int(len(vocab)),
        "memory_bound_share": round(share, 4),
        "memory_bound_formula": MEMORY_BOUND_FORMULA,
        "categories": {},
    }
    for cat, arrs in cats.items():
        a = float(np.mean(np.concatenate(arrs))) if arrs else 0.0
        taus = {k: round(statistics.mean(tau_from_runs(x, k) for x in arrs if len(x)), 3) for k in range(1, 9)}
        entry = {
            "sequences": len(arrs),
            "tokens": int(sum(len(x) for x in arrs)),
            "agreement": round(a, 4),
            # the shared trunk's head over V' (the draft cannot propose a token outside it)
            "agreement_vprime": round(float(np.mean(np.concatenate(cats_v[cat]))), 4) if cats_v[cat] else 0.0,
            "tau_runs": taus,
            "tau_iid": {k: round(tau_iid(a, k), 3) for k in range(1, 9)},
        }
        mb = memory_bound_speedup(cats_v[cat], share)
        entry["speedup_memory_bound"] = mb  # PROJECTION (formula above), not a measurement
        entry["best_k_memory_bound"] = max(mb, key=lambda k: mb[k])
        if cost is not None:
            entry["speedup_gpu_like"] = {k: round(taus[k] / (k * cost + 1.0), 3) for k in range(1, 9)}
            entry["speedup_cpu"] = {k: round(taus[k] / (k * cost + cpu_batch_cost(k + 1)), 3) for k in range(1, 9)}
        report["categories"][cat] = entry
    return report
