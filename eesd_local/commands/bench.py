"""``eesd bench``: every method side by side on the same prompts, in one process.

Tables go to stdout, the progress bar to stderr; ``--json`` and ``--plots`` write the
figures for other tools. Ctrl-C stops the run and reports what was measured so far.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from eesd_local.base.atomic import check_overwrite, write_text_atomic
from eesd_local.base.defaults import BENCH_MAX_TOKENS, BENCH_SEED, DRAFT_MAX, N_CTX, TEMPERATURE, TOP_K, TOP_P
from eesd_local.base.errors import EesdError
from eesd_local.base.interrupts import terminate_as_interrupt
from eesd_local.commands.models import pull_with_progress
from eesd_local.commands.options import endpoints_arg
from eesd_local.llama.catalog import DEFAULT_MODEL, known_models
from eesd_local.tools.bench import report
from eesd_local.tools.bench.methods import METHOD_HELP, parse_methods
from eesd_local.tools.bench.plots import PLOTS, write_plots
from eesd_local.tools.bench.prompts import BUILTIN_SETS
from eesd_local.tools.bench.runner import BenchConfig, run_bench
from eesd_local.tools.bench.servers import SPEC_TYPES, check_servers

# flag -> BenchConfig field (the argparse dest), in the order the command line is written back
_FLAGS = (
    ("--model", "model"), ("--head", "head"), ("--draft-model", "draft_model"), ("--prompts", "prompts"),
    ("--category", "categories"), ("--n-prompts", "n_prompts"), ("--methods", "methods"), ("--controller", "controller"),
    ("--max-tokens", "max_tokens"), ("--temperature", "temperature"), ("--top-k", "top_k"), ("--top-p", "top_p"), ("--seed", "seed"),
    ("--repeats", "repeats"), ("--warmup-tokens", "warmup_tokens"), ("--draft-max", "draft_max"), ("--n-ctx", "n_ctx"),
    ("--n-gpu-layers", "n_gpu_layers"), ("--n-threads", "n_threads"), ("--cost-repeats", "cost_repeats"), ("--rpc", "rpc"),
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark methods side by side: speed, acceptance, losslessness, memory",
        description="Run prompts x methods interleaved in one process after a warm-up and report, per method and "
        "category, tokens/s, speedup vs plain decoding, tau, acceptance, draft cost, memory and whether greedy "
        "output equals plain decoding.",
    )
    p.add_argument("--model", "-m", default=DEFAULT_MODEL, help=f"registry name or GGUF path (default {DEFAULT_MODEL})")
    p.add_argument("--head", help="exit-head GGUF for the eesd methods (default: the shipped head for the model)")
    p.add_argument("--draft-model", help="draft model for draft-model (default: qwen2.5-coder-0.5b-instruct for the 1.5B)")
    p.add_argument("--prompts", required=True, metavar="SETS",
                   help=f"a JSONL file or a built-in set ({', '.join(BUILTIN_SETS)}); several comma-separated")
    p.add_argument("--category", dest="categories", nargs="+", action="extend", metavar="C", help="only these categories")
    p.add_argument("--n-prompts", type=int, default=20, metavar="N",
                   help="prompts per category, evenly spaced over the set (default 20; 0: all)")
    p.add_argument("--methods", default="none,eesd,lookup", metavar="LIST", help=f"comma-separated: {METHOD_HELP} (default %(default)s)")
    p.add_argument("--controller", help="controller of the eesd/lookup/draft-model/hierarchical methods (default: the engine's)")
    p.add_argument("--max-tokens", "-n", type=int, default=BENCH_MAX_TOKENS,
                   help="tokens generated per prompt (per turn; default %(default)s)")
    p.add_argument("--temperature", "--temp", type=float, default=TEMPERATURE,
                   help=f"temperature (default {TEMPERATURE:g}: greedy, where losslessness is checked)")
    p.add_argument("--top-k", type=int, default=TOP_K)
    p.add_argument("--top-p", type=float, default=TOP_P)
    p.add_argument("--seed", type=int, default=BENCH_SEED, help="base seed for sampling (default %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="passes over the prompts; a prompt counts its median pass (default 1; 3 for figures per kind)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens of one warm-up generation per method (default 16; 0: none)")
    p.add_argument("--draft-max", type=int, default=DRAFT_MAX, help="most tokens drafted per round (default %(default)s)")
    p.add_argument("--n-ctx", "--ctx", type=int, default=N_CTX, help="context size of every method (default 4096)")
    p.add_argument("--n-gpu-layers", type=int, default=0, help="layers to offload to the GPU (-1: all)")
    p.add_argument("--n-threads", "--threads", type=int, default=None, help="CPU threads of every method (default: all cores)")
    p.add_argument("--rpc", type=endpoints_arg, default=(), metavar="HOST:PORT[,HOST:PORT...]",
                   help="llama.cpp RPC servers (eesd rpc-server) holding the layers --n-gpu-layers offloads, for every "
                        "method (llama-server peers included); B(k) is then measured over RPC too")
    p.add_argument("--cost-repeats", type=int, default=5, metavar="N",
                   help="decodes per batch size k (1..8, 16) for the model's B(k), reported beside the speedups (default 5; 0: skip)")
    p.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots (speedup, acceptance by position, draft length)")
    p.add_argument("--markdown", metavar="OUT.md", help="write the tables as Markdown")
    p.add_argument("--force", action="store_true", help="overwrite existing output files")
    p.add_argument("--peers", nargs="?", const="all", metavar="TYPES",
                   help="add llama.cpp's llama-server as peers: plain and with each --spec-type in TYPES (comma-separated; "
                        "default all: " + ",".join(SPEC_TYPES) + "), built by `python scripts/llama_build.py tools`")
    p.add_argument("--http", nargs="?", const="none,auto", metavar="DRAFTERS",
                   help="add servers timed end to end over HTTP: llama-server (plain and ngram-mod) and eesd serve with "
                        "each drafter in DRAFTERS (default none,auto)")
    p.add_argument("--require-exact", action="store_true",
                   help="exit 1 unless every method claims exactness and its greedy output is byte-identical to plain decoding's")
    p.set_defaults(func=run)


def bench_config(args: argparse.Namespace) -> BenchConfig:
    cfg = BenchConfig(**{field: getattr(args, field) for _, field in _FLAGS})
    extra = []
    if getattr(args, "peers", None):
        kinds = SPEC_TYPES if args.peers == "all" else [k.strip() for k in args.peers.split(",") if k.strip()]
        extra += ["llama-server", *(f"llama-server:{k}" for k in kinds)]
    if getattr(args, "http", None):
        extra += ["serve:llama-server", "serve:llama-server:ngram-mod",
                  *(f"serve:eesd:{d.strip()}" for d in args.http.split(",") if d.strip())]
    if extra:
        have = [m.strip() for m in cfg.methods.split(",")]
        cfg.methods = ",".join(have + [m for m in extra if m not in have])
    return cfg


def command_line(cfg: BenchConfig, args: argparse.Namespace) -> str:
    """The exact command, written back from the parsed options (defaults included)."""
    words = ["eesd", "bench"]
    for flag, field in _FLAGS:
        value = getattr(cfg, field)
        if value is None:
            continue
        if isinstance(value, tuple):  # --rpc
            if value:
                words += [flag, ",".join(value)]
        elif isinstance(value, list):
            words += [flag, *value]
        else:
            words += [flag, str(value)]
    for flag, value in (("--json", args.json), ("--plots", args.plots), ("--markdown", args.markdown)):
        if value:
            words += [flag, value]
    return shlex.join(words)


def _check_outputs(args: argparse.Namespace) -> None:
    for out in (args.json, args.markdown):
        if out:
            check_overwrite(Path(out), args.force)
    if args.plots:
        for name in PLOTS:
            check_overwrite(Path(args.plots) / name, args.force)


def run(args: argparse.Namespace) -> int:
    cfg = bench_config(args)
    if cfg.n_prompts < 0:
        raise EesdError(f"--n-prompts must be 0 (all) or more, got {cfg.n_prompts}")
    if args.require_exact and cfg.temperature != 0:  # sampled outputs are never compared: nothing would be checked
        raise EesdError(f"--require-exact compares greedy output with plain decoding's, and --temperature {cfg.temperature:g} "
                        "samples", hint="drop --temperature (0, greedy, is the default) or --require-exact")
    check_servers(parse_methods(cfg.methods, cfg.controller))  # before a model is pulled or loads
    _check_outputs(args)
    for name in (cfg.model, cfg.draft_model):
        if name and name in known_models():
            pull_with_progress(name)
    err = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("elapsed"),
               TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("bench", total=None)

        started: list[float] = []

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what[:60])
            if not started and "·" in what:  # the first measured run starts
                started.append(time.monotonic())
            if err.is_terminal or not what.endswith(" done"):
                return
            # a log instead of a terminal: one line per finished prompt, with the time left
            spent = time.monotonic() - started[0]
            left = spent / max(done, 1) * (total - done)
            err.print(f"{done}/{total} runs ({what}), {spent / 60:.1f} min so far, about {left / 60:.1f} min left", highlight=False)

        with terminate_as_interrupt():  # a plain `kill` stops it as Ctrl-C does: servers stopped, what was measured kept
            res = run_bench(cfg, progress)
    summary = report.summarize(res)
    out = Console() if sys.stdout.isatty() else Console(width=160)  # a file or pipe gets whole tables
    if not res.complete:
        err.print(f"[bold]interrupted[/bold]: {len(res.runs)} of {res.n_planned} runs measured (prompts every method "
                  "finished); the figures cover those.")
    for table in report.tables(res, summary):
        out.print(table)
    peers = report.peers_rows(res, summary)
    if peers is not None:
        head, rows = peers
        t = Table(title="tokens/s over plain llama-server's (serve: rows over serve:llama-server's)", title_justify="left")
        for col in head:
            t.add_column(col, justify="left" if col in ("method", "identical to plain") else "right")
        for row in rows:
            t.add_row(*row)
        out.print(t)
    for name, why in res.failures.items():
        err.print(f"[bold]{name}[/bold] did not run: {why}", highlight=False)
    if res.batch_costs:
        b = res.batch_costs["B"]
        out.print(f"B(k) of the model (decode of k tokens / one token, t(1) {res.batch_costs['t1_ms']:.1f} ms, median of "
                  f"{res.batch_costs['repeats']}): " + "  ".join(f"B{k} {v:.2f}" for k, v in b.items() if k != "1"))
    if res.peak_rss_bytes:
        out.print(f"process peak RSS {res.peak_rss_bytes / 1e9:.2f} GB (all methods loaded in this process)")
    for name, info in res.methods.items():
        out.print(f"  {name}: drafter {info.drafter}, controller {info.controller}, model {info.model_bytes / 1e6:.0f} MB")
    command = command_line(cfg, args)
    if args.json:
        # a NumPy scalar that slipped into the figures is written as its number, not lost with the run
        write_text_atomic(args.json, json.dumps(report.to_json(res, command), indent=1,
                                                default=lambda o: o.item() if hasattr(o, "item") else str(o)) + "\n")
        err.print(f"wrote {args.json}")
    if args.markdown:
        write_text_atomic(args.markdown, f"`{command}`\n\n" + report.markdown(res, summary))
        err.print(f"wrote {args.markdown}")
    if args.plots and res.runs:
        for path in write_plots(res, summary, Path(args.plots), Path(res.model_path).stem):
            err.print(f"wrote {path}")
    if not res.complete:
        return res.exit_code or 130
    if args.require_exact:
        failures = report.exactness_failures(res, summary)
        for line in failures:
            err.print(f"eesd: not exact: {line}", highlight=False)
        if failures:
            return 1
    return 0
