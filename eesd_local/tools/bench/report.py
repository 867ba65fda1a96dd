"""From measured runs to the figures: per method and category, the JSON, the tables.

Rates are totals over the prompts (tokens after the first / seconds after the first
token), not means of per-prompt rates; a prompt run several times (``--repeats``) counts
its median run, so a burst of noise on a shared machine moves no figure by itself; ``speedup`` is a method's rate over ``none``'s
on the same prompts of the same run. ``tau`` is tokens emitted per target
verification after the first token; ``draft_cost`` is the drafter's seconds per drafted
token relative to ``none``'s seconds per token. ``identical`` (greedy only) counts outputs
equal to plain decoding's token for token; ``exact`` is whether the method claims they all are
(runtime.exactness); ``lossless`` is true when they all are where exactness is claimed, or where
it is not, when each difference is a near tie of the target's two best logits.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from rich.table import Table

from eesd_local.speculative.events import Stats
from eesd_local.tools.bench.runner import Results, Run, machine_info, same_output

ALL = "all"
REQUIRED_KEYS = ("tokens_per_s", "speedup", "tau", "acceptance_rate", "lossless", "n_prompts", "memory_overhead")


def _run_rate(run: Run) -> tuple[int, float]:
    return sum(max(0, t.n - 1) for t in run.turns), sum(t.t_decode for t in run.turns)


def _rate(runs: list[Run]) -> tuple[float, float]:
    """Tokens and seconds after the first token, summed over the prompts; a prompt run several times
    (``--repeats``) counts its median run (by seconds a token; the mean of the middle two for an even
    count), so one run that a burst of machine noise slowed does not move a prompt's figure."""
    by_prompt: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in runs:
        by_prompt.setdefault((r.category, r.item), []).append(_run_rate(r))
    n_sum, secs_sum = 0.0, 0.0
    for rates in by_prompt.values():
        rates.sort(key=lambda ns: ns[1] / ns[0] if ns[0] else ns[1])
        mid = rates[(len(rates) - 1) // 2: len(rates) // 2 + 1]
        n_sum += sum(n for n, _ in mid) / len(mid)
        secs_sum += sum(secs for _, secs in mid) / len(mid)
    return n_sum, secs_sum


def _div(a: float, b: float) -> float | None:
    return a / b if b else None


def _vs(runs: list[Run], ref_runs: dict[tuple[str, str, int], Run], *, alike: bool) -> tuple[float | None, int]:
    """This method's rate over the reference's on the prompts both ran, and how many prompts were left out
    because the two did other work. With ``alike`` (greedy runs) a prompt counts only where both did the same
    work (:func:`same_work`): an answer of another length is other work, and end to end its rate is mostly its
    prompt's prefill (llama-server's stock kernels broke a near tie at a chat answer's first token into a 13-token
    refusal where ours wrote 96 tokens: its rate came out a third of ours on the same prompt)."""
    paired = [r for r in runs if (r.category, r.item, r.repeat) in ref_runs]
    differ = set()
    if alike:
        differ = {(r.category, r.item) for r in paired if not same_work(r, ref_runs[(r.category, r.item, r.repeat)])}
        paired = [r for r in paired if (r.category, r.item) not in differ]
    a, b = _div(*_rate(paired)), _div(*_rate([ref_runs[(r.category, r.item, r.repeat)] for r in paired]))
    return (a / b if a and b else None), len(differ)


def same_work(run: Run, ref: Run) -> bool:
    """Both answered the same, or turn by turn after prompts of the same length with answers of the same length:
    two kernels that break a near tie otherwise write other text of the same size, and a decode's cost is its
    token counts' (a later turn re-sends the earlier answers, so a longer one there makes its prompt longer)."""
    if same_output(run, ref):
        return True
    return len(run.turns) == len(ref.turns) and len(run.prompts) == len(ref.prompts) and all(
        len(p) == len(q) and a.n == b.n for p, q, a, b in zip(run.prompts, ref.prompts, run.turns, ref.turns, strict=True))


def figures(res: Results, method: str, runs: list[Run], plain: dict[tuple[str, str, int], Run],
            servers: dict[str, dict[tuple[str, str, int], Run]] | None = None) -> dict[str, Any]:
    """The figures of one method over ``runs`` (one category, or all of them); ``servers``: the runs of
    plain ``llama-server`` and ``serve:llama-server`` where they ran, the references of ``vs_llama_server``."""
    info = res.methods[method]
    base = res.methods["none"]
    turns = [t for r in runs for t in r.turns]
    n_tok, secs = _rate(runs)
    paired = [r for r in runs if (r.category, r.item, r.repeat) in plain]
    ref = [plain[(r.category, r.item, r.repeat)] for r in paired]
    m_rate, r_rate = _rate(paired), _rate(ref)
    tps_m, tps_r = _div(*m_rate), _div(*r_rate)
    total = Stats()
    for t in turns:
        total.add(t.rounds)
    rounds, drafted, accepted, emitted, t_draft = total.n_rounds, total.n_drafted, total.n_accepted, total.n_emitted, total.t_draft
    d_at, a_at = total.drafted_at, total.accepted_at
    per_target_token = _div(r_rate[1], r_rate[0])  # none's seconds per token on these prompts
    draft_cost = None
    if drafted and per_target_token:
        draft_cost = (t_draft / drafted) / per_target_token
    greedy = res.config.temperature == 0
    mismatches = [asdict(r.mismatch) for r in runs if r.mismatch is not None]
    vs = _vs(runs, (servers or {}).get("serve:llama-server" if method.startswith("serve:") else "llama-server", {}), alike=greedy)
    return {
        "tokens_per_s": _div(n_tok, secs),
        "speedup": 1.0 if method == "none" and runs else (tps_m / tps_r if tps_m and tps_r else None),
        "tau": _div(emitted, rounds),
        "acceptance_rate": _div(accepted, drafted),
        "exact": info.exact,
        "lossless": (not mismatches if info.exact else all(m["near_tie"] for m in mismatches)) if greedy and runs else None,
        "identical": (len(runs) - len(mismatches) if not info.peer
                      else sum(bool(r.same_as_plain) for r in runs) if any(r.same_as_plain is not None for r in runs)
                      else None) if greedy else None,
        # tokens/s over plain llama-server's on the same prompts (over serve:llama-server's for serve: methods), greedy
        # runs on the prompts where both did the same work (same_work); and how many prompts were left out for other work
        "vs_llama_server": vs[0],
        "vs_llama_server_differ": vs[1],
        "mismatches": mismatches,
        "n_prompts": len({(r.category, r.item) for r in runs}),
        "n_runs": len(runs),
        "n_generated": sum(t.n for t in turns),
        "prefill_s": _div(sum(t.t_prefill for t in turns), len(turns)),
        # time to the first token by turn (a multi-turn item re-sends its conversation: later turns can reuse it)
        "prefill_s_by_turn": _by_turn(runs),
        "acceptance_by_position": [a / d if d else None for a, d in zip(a_at, d_at, strict=True)],
        "mean_draft_length": _div(drafted, rounds),
        # rounds by tokens drafted (DRAFT_BUCKETS) and the longest draft: how far drafts follow the matches
        "draft_lengths": draft_histogram([d for t in turns for d in t.rounds.draft_lengths]),
        "draft_cost": draft_cost,
        # shared trunk: the part of a drafted token's cost beyond the trunk's (exit block + draft head),
        # the whole draft cost less the trunk's timed share of a target token
        "draft_cost_beyond_trunk": (draft_cost - info.trunk_share
                                    if draft_cost is not None and info.trunk_share is not None
                                    and not total.by_source.get("lookup", (0, 0, 0))[1] else None),
        "trunk_share": info.trunk_share,
        "model_bytes": info.model_bytes,
        "memory_overhead": info.model_bytes - base.model_bytes,
        "rss_growth_bytes": info.rss_growth_bytes,
        "drafter": info.drafter,
        "controller": info.controller,
        # PROJECTION, not a measurement: the speedup these rounds would give on a memory-bound device,
        # where verifying k+1 tokens costs one target step and a drafted token its share of the weights read
        "projected_memory_bound_speedup": projected_speedup(total, info.draft_share) if runs else None,
        # which source drafted (auto chooses per round): rounds, tokens drafted, accepted, acceptance
        "sources": {src: {"rounds": r, "drafted": d, "accepted": a, "acceptance_rate": _div(a, d)}
                    for src, (r, d, a) in sorted(total.by_source.items())},
    }


def _by_turn(runs: list[Run]) -> list[float | None]:
    """Mean seconds to the first token of each turn (turn 1, 2, ..) over the prompts, each prompt's the median
    over its repeats; [] for single-turn items and for methods timed end to end only (a server over HTTP
    without streaming)."""
    n = max((len(r.turns) for r in runs), default=0)
    if n < 2:
        return []
    out: list[float | None] = []
    for i in range(n):
        by_prompt: dict[tuple[str, str], list[float]] = {}
        for r in runs:
            if len(r.turns) > i and r.turns[i].t_prefill > 0.0:
                by_prompt.setdefault((r.category, r.item), []).append(r.turns[i].t_prefill)
        ts = [statistics.median(v) for v in by_prompt.values()]
        out.append(sum(ts) / len(ts) if ts else None)
    return out


def turns_markdown(summary: dict[str, dict[str, dict[str, Any]]], categories: list[str]) -> str:
    """Per multi-turn kind and method: seconds to the first token of each turn."""
    lines: list[str] = []
    for c in categories:
        rows = [(m, by_cat[c]["prefill_s_by_turn"]) for m, by_cat in summary.items()
                if c in by_cat and any(x is not None for x in by_cat[c].get("prefill_s_by_turn") or [])]
        if not rows:
            continue
        n = max(len(v) for _, v in rows)
        if not lines:
            lines = ["**seconds to the first token, by turn** (multi-turn kinds)", ""]
        lines += [f"| {c}: method | " + " | ".join(f"turn {i + 1}" for i in range(n)) + " |", "|---" + "|---:" * n + "|"]
        lines += [f"| {m} | " + " | ".join(_f(x, ".2f") for x in v) + " |" for m, v in rows]
        lines.append("")
    return "\n".join(lines) + "\n" if lines else ""


DRAFT_BUCKETS = ((0, 0), (1, 3), (4, 8), (9, 16), (17, 32), (33, 1 << 30))


def _bucket_name(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}+" if hi >= 1 << 30 else f"{lo}-{hi}"


def draft_histogram(lengths: list[int]) -> dict[str, Any]:
    """Rounds by tokens drafted, in DRAFT_BUCKETS ("0", "1-3", .., "33+"), and the longest draft."""
    counts = {_bucket_name(lo, hi): sum(lo <= d <= hi for d in lengths) for lo, hi in DRAFT_BUCKETS}
    return {"rounds": counts, "longest": max(lengths, default=0)}


def draft_lengths_markdown(summary: dict[str, dict[str, dict[str, Any]]], categories: list[str]) -> str:
    """Per method and kind: the share of rounds that drafted 0, 1-3, .. tokens, and the longest draft."""
    names = [_bucket_name(lo, hi) for lo, hi in DRAFT_BUCKETS]
    lines: list[str] = []
    for method, by_cat in summary.items():
        rows = [(c, by_cat[c]["draft_lengths"]) for c in categories if c in by_cat and by_cat[c].get("draft_lengths")]
        if not any(h["longest"] for _, h in rows):
            continue
        if not lines:
            lines = ["**rounds by tokens drafted** (share of the rounds; longest draft)", "",
                     "| method | kind | " + " | ".join(names) + " | longest |", "|---|---" + "|---:" * (len(names) + 1) + "|"]
        for c, h in rows:
            n = sum(h["rounds"].values()) or 1
            lines.append(f"| {method} | {c} | " + " | ".join(f"{h['rounds'][b] / n:.0%}" for b in names) + f" | {h['longest']} |")
    return "\n".join(lines) + "\n" if lines else ""


def projected_speedup(stats: Stats, draft_share: dict[str, float]) -> float | None:
    """tokens emitted / (rounds + sum over sources of tokens drafted x the source's draft share):
    every verify costs one target step whatever its batch, every drafted token the bytes its draft
    step reads over a target step's (0 for prompt lookup). Plain decoding projects to 1.00."""
    if not stats.n_rounds:
        return None
    steps = stats.n_rounds + sum(d * draft_share.get(src, 0.0) for src, (_, d, _) in stats.by_source.items())
    return stats.n_emitted / steps


def _sources(fig: dict[str, Any]) -> str:
    """Each drafting source's share of the drafted tokens and its acceptance, e.g. "lookup 97%/88%"."""
    srcs = fig.get("sources") or {}
    total = sum(v["drafted"] for v in srcs.values())
    if not total:
        return "-"
    return ", ".join(f"{k} {v['drafted'] / total:.0%}/{_f(v['acceptance_rate'], '.0%')}"
                     for k, v in sorted(srcs.items(), key=lambda kv: -kv[1]["drafted"]))


def summarize(res: Results) -> dict[str, dict[str, dict[str, Any]]]:
    """method -> category (plus "all" when there are several) -> figures."""
    plain = {(r.category, r.item, r.repeat): r for r in res.runs if r.method == "none"}
    servers: dict[str, dict[tuple[str, str, int], Run]] = {
        name: {(r.category, r.item, r.repeat): r for r in res.runs if r.method == name}
               for name in ("llama-server", "serve:llama-server") if name in res.methods}
    cats = list(res.categories)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for method in res.methods:
        mine = [r for r in res.runs if r.method == method]
        out[method] = {c: figures(res, method, [r for r in mine if r.category == c], plain, servers) for c in cats}
        if len(cats) > 1:
            out[method][ALL] = figures(res, method, mine, plain, servers)
    return out


def to_json(res: Results, command: str) -> dict[str, Any]:
    cfg = res.config
    return {
        "model": cfg.model,
        "machine": machine_info(cfg, res.n_threads),
        "methods": summarize(res),
        "batch_costs": res.batch_costs,  # B(k) of the model's weights on this machine (weights.batch_costs)
        "run": {
            "command": command,
            "date": res.started,
            "model_path": res.model_path,
            "prompts": cfg.prompts,
            "categories": res.categories,
            "n_prompts_per_category": cfg.n_prompts,
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            "top_k": cfg.top_k,
            "top_p": cfg.top_p,
            "repeats": cfg.repeats,
            "draft_max": cfg.draft_max,
            "n_ctx": cfg.n_ctx,
            "complete": res.complete,
            "runs_done": len(res.runs),
            "runs_planned": res.n_planned,
            "peak_rss_bytes": res.peak_rss_bytes,
        },
        "failures": dict(res.failures),
    }


# --- tables ---------------------------------------------------------------------------


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _identical(fig: dict[str, Any]) -> str:
    """"12/12", or where some differ "10/12 NOT EXACT" (exactness claimed) or "10/12 (2 near-tie)"."""
    if fig["identical"] is None:
        return "-"
    text = f"{fig['identical']}/{fig['n_runs']}"
    mm = fig["mismatches"]
    if mm:
        text += " NOT EXACT" if fig["exact"] else f" ({sum(m['near_tie'] for m in mm)} near-tie)"
    return text


def exactness_failures(res: Results, summary: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """One line per method of ours whose greedy output is not byte-identical to plain decoding's, or not claimed to be."""
    out = []
    for method, by_cat in summary.items():
        if method == "none" or res.config.temperature != 0 or res.methods[method].peer:
            continue
        f = by_cat.get(ALL) or next(iter(by_cat.values()))
        if not res.methods[method].exact:
            out.append(f"{method}: exactness is not claimed here")
        elif f["mismatches"]:
            first = f["mismatches"][0]
            out.append(f"{method}: {len(f['mismatches'])} of {f['n_runs']} outputs differ from plain decoding "
                       f"(first: {first['item']}, token {first['index']})")
    return out


def tables(res: Results, summary: dict[str, dict[str, dict[str, Any]]]) -> list[Any]:
    """One rich Table per category."""
    cats = [c for c in [*res.categories, ALL] if any(c in v for v in summary.values())]
    out = []
    for cat in cats:
        t = Table(title=f"{cat}", title_justify="left")
        for col in ("method", "tok/s", "speedup", "tau", "accept", "draft len", "draft cost", "prefill s", "identical to none",
                    "+MB vs none", "prompts", "drafted by (share/acc)", "projected mem-bound speedup"):
            t.add_column(col, justify="left" if col in ("method", "identical to none", "drafted by (share/acc)") else "right")
        for method, by_cat in summary.items():
            f = by_cat.get(cat)
            if f is None or not f["n_runs"]:
                continue
            t.add_row(method, _f(f["tokens_per_s"], ".2f"), _f(f["speedup"], ".2f"), _f(f["tau"], ".2f"),
                      _f(f["acceptance_rate"], ".0%"), _f(f["mean_draft_length"], ".2f"), _f(f["draft_cost"], ".2f"),
                      _f(f["prefill_s"], ".2f"), _identical(f), _f(f["memory_overhead"] / 1e6, ".0f"), str(f["n_prompts"]),
                      _sources(f), _f(f.get("projected_memory_bound_speedup"), ".2f"))
        out.append(t)
    return out


def markdown(res: Results, summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The same tables as Markdown (for BENCHMARKS.md)."""
    peers = peers_markdown(res, summary)
    lines = [peers] if peers else []
    cats = [c for c in [*res.categories, ALL] if any(c in v for v in summary.values())]
    for cat in cats:
        lines += [f"**{cat}**", "",
                  "| method | tok/s | speedup | tau | accept | draft len | draft cost | prefill s | identical to none | +MB vs none | prompts "
                  "| drafted by (share/acc) | projected mem-bound speedup |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|"]
        for method, by_cat in summary.items():
            f = by_cat.get(cat)
            if f is None or not f["n_runs"]:
                continue
            lines.append(f"| {method} | {_f(f['tokens_per_s'], '.2f')} | {_f(f['speedup'], '.2f')} | {_f(f['tau'], '.2f')} | "
                         f"{_f(f['acceptance_rate'], '.0%')} | {_f(f['mean_draft_length'], '.2f')} | {_f(f['draft_cost'], '.2f')} | "
                         f"{_f(f['prefill_s'], '.2f')} | {_identical(f)} | {_f(f['memory_overhead'] / 1e6, '.0f')} | {f['n_prompts']} | "
                         f"{_sources(f)} | {_f(f.get('projected_memory_bound_speedup'), '.2f')} |")
        lines.append("")
    for extra in (draft_lengths_markdown(summary, cats), turns_markdown(summary, cats)):
        if extra:
            lines += [extra]
    for name, info in res.methods.items():
        growth = "-" if info.rss_growth_bytes is None else f"{info.rss_growth_bytes / 1e6:.0f} MB"
        lines.append(f"- `{name}`: drafter {info.drafter}, controller {info.controller}, model {info.model_bytes / 1e6:.0f} MB, "
                     f"RSS added by loading and warm-up {growth}")
    if res.peak_rss_bytes:
        lines.append(f"- process peak RSS {res.peak_rss_bytes / 1e9:.2f} GB, every method loaded in one process")
    return "\n".join(lines) + "\n"


def peers_rows(res: Results, summary: dict[str, dict[str, dict[str, Any]]]) -> tuple[list[str], list[list[str]]] | None:
    """The peers table: one row per method (llama.cpp's, llama-cpp-python's, ours), one column per prompt
    kind: tokens/s over plain llama-server's on the same prompts; then acceptance, tau, identical to its
    plain reference (llama-server's own for its spec types, ``none`` for ours). None without llama-server.
    A ratio marked * leaves out prompts where the two did other work (same_work); "differ" where every prompt did."""
    if not {"llama-server", "serve:llama-server"} & set(res.methods) and not any(
            m.startswith(("llama-server", "serve:llama-server")) for m in res.failures):
        return None
    cats = [c for c in [*res.categories, ALL] if any(c in v for v in summary.values())]
    head = ["method", *cats, "accept", "tau", "identical to plain"]
    rows = []
    for method, by_cat in summary.items():
        f_all = by_cat.get(ALL) or next(iter(by_cat.values()))
        rows.append([method, *[_vs_cell(by_cat.get(c) or {}) for c in cats],
                     _f(f_all["acceptance_rate"], ".0%"), _f(f_all["tau"], ".2f"), _identical(f_all)])
    for method, why in res.failures.items():
        rows.append([method, *["-"] * len(cats), "-", "-", f"did not run: {why}"])
    return head, rows


def _vs_cell(fig: dict[str, Any]) -> str:
    ratio, differ = fig.get("vs_llama_server"), fig.get("vs_llama_server_differ") or 0
    if ratio is None:
        return "differ" if differ else "-"
    return f"{ratio:.2f}" + ("*" if differ else "")


def peers_markdown(res: Results, summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    got = peers_rows(res, summary)
    if got is None:
        return ""
    head, rows = got
    lines = ["**tokens/s over plain llama-server's, by prompt kind** (serve: rows over serve:llama-server's)", "",
             "| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 2) + "|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if any("*" in cell or cell == "differ" for r in rows for cell in r[1:-3]):
        lines += ["", "Greedy runs compare like with like: a prompt where the two did other work (an answer of another "
                  "length, or after a prompt of another length) is left out of that ratio (*: some prompts of the kind "
                  "were; differ: all were)."]
    return "\n".join(lines) + "\n"
