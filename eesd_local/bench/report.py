"""From measured runs to the figures: per method and category, the JSON, the tables.

Rates are totals over the runs (tokens after the first / seconds after the first
token), not means of per-prompt rates; ``speedup`` is a method's rate over ``none``'s
on the same prompts of the same run. ``tau`` is tokens emitted per target
verification after the first token; ``draft_cost`` is the drafter's seconds per drafted
token relative to ``none``'s seconds per token. ``lossless`` (greedy only) is true when
every output equals plain decoding or each mismatch is a certified near tie;
``identical`` counts outputs equal token for token.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..events import Stats
from .runner import Results, Run, machine_info

ALL = "all"
REQUIRED_KEYS = ("tokens_per_s", "speedup", "tau", "acceptance_rate", "lossless", "n_prompts", "memory_overhead")


def _rate(runs: list[Run]) -> tuple[int, float]:
    n = sum(max(0, len(t.tokens) - 1) for r in runs for t in r.turns)
    secs = sum(t.t_decode for r in runs for t in r.turns)
    return n, secs


def _div(a: float, b: float) -> float | None:
    return a / b if b else None


def figures(res: Results, method: str, runs: list[Run], plain: dict[tuple[str, str, int], Run]) -> dict[str, Any]:
    """The figures of one method over ``runs`` (one category, or all of them)."""
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
    return {
        "tokens_per_s": _div(n_tok, secs),
        "speedup": 1.0 if method == "none" and runs else (tps_m / tps_r if tps_m and tps_r else None),
        "tau": _div(emitted, rounds),
        "acceptance_rate": _div(accepted, drafted),
        "lossless": (all(m["near_tie"] for m in mismatches) if runs else None) if greedy else None,
        "identical": len(runs) - len(mismatches) if greedy else None,
        "mismatches": mismatches,
        "n_prompts": len({(r.category, r.item) for r in runs}),
        "n_runs": len(runs),
        "n_generated": sum(len(t.tokens) for t in turns),
        "prefill_s": _div(sum(t.t_prefill for t in turns), len(turns)),
        "acceptance_by_position": [a / d if d else None for a, d in zip(a_at, d_at, strict=True)],
        "mean_draft_length": _div(drafted, rounds),
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
    cats = list(res.categories)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for method in res.methods:
        mine = [r for r in res.runs if r.method == method]
        out[method] = {c: figures(res, method, [r for r in mine if r.category == c], plain) for c in cats}
        if len(cats) > 1:
            out[method][ALL] = figures(res, method, mine, plain)
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
    }


# --- tables ---------------------------------------------------------------------------


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _lossless(fig: dict[str, Any]) -> str:
    if fig["lossless"] is None:
        return "-"
    mm = fig["mismatches"]
    if not mm:
        return "yes"
    ties = sum(m["near_tie"] for m in mm)
    return f"{'yes' if fig['lossless'] else 'NO'} ({len(mm)} diff, {ties} near-tie)"


def tables(res: Results, summary: dict[str, dict[str, dict[str, Any]]]) -> list[Any]:
    """One rich Table per category."""
    from rich.table import Table

    cats = [c for c in [*res.categories, ALL] if any(c in v for v in summary.values())]
    out = []
    for cat in cats:
        t = Table(title=f"{cat}", title_justify="left")
        for col in ("method", "tok/s", "speedup", "tau", "accept", "draft len", "draft cost", "prefill s", "lossless",
                    "+MB vs none", "prompts", "drafted by (share/acc)", "projected mem-bound speedup"):
            t.add_column(col, justify="left" if col in ("method", "lossless", "drafted by (share/acc)") else "right")
        for method, by_cat in summary.items():
            f = by_cat.get(cat)
            if f is None or not f["n_runs"]:
                continue
            t.add_row(method, _f(f["tokens_per_s"], ".2f"), _f(f["speedup"], ".2f"), _f(f["tau"], ".2f"),
                      _f(f["acceptance_rate"], ".0%"), _f(f["mean_draft_length"], ".2f"), _f(f["draft_cost"], ".2f"),
                      _f(f["prefill_s"], ".2f"), _lossless(f), _f(f["memory_overhead"] / 1e6, ".0f"), str(f["n_prompts"]),
                      _sources(f), _f(f.get("projected_memory_bound_speedup"), ".2f"))
        out.append(t)
    return out


def markdown(res: Results, summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The same tables as Markdown (for BENCHMARKS.md)."""
    lines = []
    cats = [c for c in [*res.categories, ALL] if any(c in v for v in summary.values())]
    for cat in cats:
        lines += [f"**{cat}**", "",
                  "| method | tok/s | speedup | tau | accept | draft len | draft cost | prefill s | lossless | +MB vs none | prompts "
                  "| drafted by (share/acc) | projected mem-bound speedup |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|"]
        for method, by_cat in summary.items():
            f = by_cat.get(cat)
            if f is None or not f["n_runs"]:
                continue
            lines.append(f"| {method} | {_f(f['tokens_per_s'], '.2f')} | {_f(f['speedup'], '.2f')} | {_f(f['tau'], '.2f')} | "
                         f"{_f(f['acceptance_rate'], '.0%')} | {_f(f['mean_draft_length'], '.2f')} | {_f(f['draft_cost'], '.2f')} | "
                         f"{_f(f['prefill_s'], '.2f')} | {_lossless(f)} | {_f(f['memory_overhead'] / 1e6, '.0f')} | {f['n_prompts']} | "
                         f"{_sources(f)} | {_f(f.get('projected_memory_bound_speedup'), '.2f')} |")
        lines.append("")
    for name, info in res.methods.items():
        growth = "-" if info.rss_growth_bytes is None else f"{info.rss_growth_bytes / 1e6:.0f} MB"
        lines.append(f"- `{name}`: drafter {info.drafter}, controller {info.controller}, model {info.model_bytes / 1e6:.0f} MB, "
                     f"RSS added by loading and warm-up {growth}")
    if res.peak_rss_bytes:
        lines.append(f"- process peak RSS {res.peak_rss_bytes / 1e9:.2f} GB, every method loaded in one process")
    return "\n".join(lines) + "\n"
