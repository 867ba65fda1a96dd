"""PNG plots of a benchmark: speedup per category and method, acceptance by draft
position, and draft length over the run (what the controller chose, round by round)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from eesd_local.base.atomic import atomic_path
from eesd_local.base.errors import EesdError
from eesd_local.tools.bench.runner import Results

PLOTS = ("speedup.png", "acceptance_by_position.png", "draft_length.png")


def _pyplot() -> Any:
    try:
        import matplotlib  # noqa: PLC0415 - matplotlib: optional (train extra), only for plots
    except ImportError:
        raise EesdError("--plots needs matplotlib", hint="pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - matplotlib: optional (train extra), only for plots

    return plt


def _save(fig: Any, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")


def write_plots(res: Results, summary: dict[str, dict[str, dict[str, Any]]], out_dir: Path, title: str) -> list[Path]:
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    methods = [m for m in summary if m != "none"]
    cats = [c for c in [*res.categories, "all"] if any(c in v for v in summary.values())]
    paths = []

    # speedup: one group of bars per category, one bar per method; 1.0 is plain decoding
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) * max(1, len(methods))), 4))
    width = 0.8 / max(1, len(methods))
    x = np.arange(len(cats))
    for j, m in enumerate(methods):
        ys = [summary[m].get(c, {}).get("speedup") or 0.0 for c in cats]
        bars = ax.bar(x + (j - (len(methods) - 1) / 2) * width, ys, width, label=m)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(x, cats)
    ax.set_ylabel("speedup vs none (tokens/s ratio)")
    ax.set_title(f"{title}: speedup")
    if methods:
        ax.legend(fontsize=8)
    paths.append(out_dir / PLOTS[0])
    _save(fig, paths[-1])
    plt.close(fig)

    # acceptance rate at each draft position, over all categories
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        key = "all" if "all" in summary[m] else cats[0]
        acc = summary[m].get(key, {}).get("acceptance_by_position") or []
        pts = [(i + 1, a) for i, a in enumerate(acc) if a is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=m)
    ax.set_xlabel("position in the draft")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{title}: acceptance by draft position")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    paths.append(out_dir / PLOTS[1])
    _save(fig, paths[-1])
    plt.close(fig)

    # draft length per round in run order (rolling mean): how the controller adapts
    fig, ax = plt.subplots(figsize=(8, 4))
    for m in methods:
        lengths = [d for r in res.runs if r.method == m for t in r.turns for d in t.rounds.draft_lengths]
        if not lengths or not any(lengths):
            continue
        y = np.asarray(lengths, dtype=float)
        w = max(1, min(25, len(y) // 10))
        smooth = np.convolve(y, np.ones(w) / w, mode="valid")
        ax.plot(np.arange(len(smooth)) + w, smooth, label=f"{m} (mean of {w})", linewidth=1)
    ax.set_xlabel("round (in run order, all prompts)")
    ax.set_ylabel("tokens drafted")
    ax.set_title(f"{title}: draft length over time")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    paths.append(out_dir / PLOTS[2])
    _save(fig, paths[-1])
    plt.close(fig)
    return paths
