"""``eesd models list|pull|path|costs|requant``: the demo models of the registry and their weights."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from eesd_local.base.atomic import check_overwrite, write_text_atomic
from eesd_local.base.errors import EesdError
from eesd_local.base.params import MAX_THREADS, check_int, check_optional_int
from eesd_local.base.paths import cache_dir
from eesd_local.llama import catalog, costs, machine
from eesd_local.llama.catalog import VARIANTS, variant_path
from eesd_local.tools import registry
from eesd_local.tools.bench.prompts import heldout_texts
from eesd_local.tools.weights import MAX_COST_K, batch_costs, quality, requantize, tensor_types


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list and download the demo models")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION")
    msub.required = True
    pl = msub.add_parser("list", help="show known models and which are downloaded")
    pl.set_defaults(func=run_list)
    pp = msub.add_parser("pull", help="download, assemble and verify a registry model")
    pp.add_argument("names", nargs="+", metavar="NAME", help="registry name(s), see `eesd models list`")
    pp.add_argument("--variant", choices=VARIANTS, help="also build this requantised variant locally from the verified "
                    "download (use it as NAME:VARIANT, e.g. --model qwen2.5-coder-0.5b-instruct:q4_0)")
    pp.set_defaults(func=run_pull)
    pw = msub.add_parser("path", help="print the local path of a model (pulling it if needed)")
    pw.add_argument("name", metavar="NAME")
    pw.set_defaults(func=run_path)
    pc = msub.add_parser("costs", help="measure B(k), the decode time of a batch of k tokens relative to one token, "
                         "and keep it as this machine's cost profile",
                         description="Decode k = 1..K tokens after a 64-token prefix (the KV cache trimmed back each time) "
                         "and print the median time and B(k) = t(k)/t(1). Several models are measured interleaved. The "
                         "figures are kept as this machine's cost profile of each model (keyed by CPU, threads, llama.cpp "
                         "build and model file), which the engine reads to decide whether the exit head can pay here; "
                         "run it again to refresh them (the kernels' kept choices for this CPU are forgotten too, and "
                         "timed again as products come).")
    pc.add_argument("models", nargs="+", metavar="MODEL", help="registry name, NAME:VARIANT or GGUF path")
    pc.add_argument("--max-k", type=int, default=16, help="largest batch (default %(default)s)")
    pc.add_argument("--repeats", type=int, default=12, help="decodes per batch size; the median is reported (default %(default)s)")
    pc.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    pc.add_argument("--json", metavar="OUT", help="write the figures as JSON ('-': stdout)")
    pc.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    pc.set_defaults(func=run_costs)
    pr = msub.add_parser("requant", help="requantise a model to Q8_0, Q5_0 or Q4_0 (weights that verify cheaply on CPUs)",
                         description="Requantise MODEL with llama.cpp's llama_model_quantize (LM head at Q8_0) into the model "
                         "cache, then measure what it costs: top-1 agreement with MODEL over held-out text (teacher-forced) "
                         "and greedy answers on a few bench prompts.")
    pr.add_argument("model", metavar="MODEL", help="registry name or GGUF path")
    pr.add_argument("--type", dest="kind", choices=VARIANTS, required=True, help="weight type of the output")
    pr.add_argument("--output", "-o", help="output path (default: NAME.TYPE.gguf in the model cache)")
    pr.add_argument("--force", action="store_true", help="overwrite an existing output")
    pr.add_argument("--no-quality", dest="quality", action="store_false", help="skip the quality measurement")
    pr.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    pr.add_argument("--json", metavar="OUT", help="write the quality figures as JSON")
    pr.set_defaults(func=run_requant)


def run_list(args: argparse.Namespace) -> int:
    table = Table(title=f"models (cache: {registry.cache_dir('models')})")
    table.add_column("name", no_wrap=True)  # a name is what the user types: never cut
    for col in ("arch", "size", "present", "variants"):
        table.add_column(col, no_wrap=col != "variants", min_width=6 if col == "variants" else None)
    table.add_column("description", ratio=1)
    default = catalog.DEFAULT_MODEL.partition(catalog.VARIANT_SEP)[0]
    for spec in catalog.known_models().values():
        mark = "[green]yes[/]" if catalog.is_present(spec) else "no"
        variants = " ".join(f"{catalog.VARIANT_SEP}{k}" for k in catalog.present_variants(spec)) or "-"
        table.add_row(spec.name + ("\n(default)" if spec.name == default else ""), spec.arch,
                      f"{spec.size / 2**20:.0f} MiB", mark, variants, spec.description)
    Console().print(table)
    return 0


def pull_with_progress(name: str) -> str:
    """Pull ``name`` showing a progress bar on stderr; return the path."""
    spec = catalog.get_spec(name)
    if catalog.is_present(spec):
        return str(spec.path)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(f"pull {name}", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total)

        path = registry.pull(name, progress=progress)
    return str(path)


def run_pull(args: argparse.Namespace) -> int:
    for name in args.names:
        base, kind = catalog.split_variant(name)
        kind = kind or args.variant
        path = pull_with_progress(base)
        print(f"{base}: {path}", file=sys.stderr)
        if kind:
            print(f"building {base}{catalog.VARIANT_SEP}{kind} (requantising locally)...", file=sys.stderr)
            path = str(registry.pull_variant(base, kind))
            print(f"{base}{catalog.VARIANT_SEP}{kind}: {path}", file=sys.stderr)
    return 0


def _pull_base(name: str) -> None:
    base, _ = catalog.split_variant(name)
    if base in catalog.known_models():
        pull_with_progress(base)


def run_path(args: argparse.Namespace) -> int:
    _pull_base(args.name)
    print(registry.resolve_model(args.name))
    return 0


def run_costs(args: argparse.Namespace) -> int:
    check_int("--max-k", args.max_k, 1, MAX_COST_K, hint="measure batches up to the longest draft, e.g. --max-k 16")
    check_int("--repeats", args.repeats, 1, hint="e.g. --repeats 12")
    check_optional_int("--threads", args.threads, 1, MAX_THREADS, hint="leave it out to use every core")
    if args.json and args.json != "-":
        check_overwrite(Path(args.json), args.force)
    for name in args.models:
        _pull_base(name)
    paths = [registry.resolve_model(m) for m in args.models]
    err = Console(stderr=True)
    if "GGML_CPU_EXACT_CHOICE_FILE" not in os.environ:  # (a file the environment names is the user's to manage)
        machine.kernel_choice_path().unlink(missing_ok=True)  # timed again, in quiet, with the profile
    with err.status("measuring") as status:
        def progress(done: int, total: int, what: str) -> None:
            status.update(f"measuring {done}/{total}: {what}")

        tables = batch_costs(paths, range(1, args.max_k + 1), repeats=args.repeats, n_threads=args.threads, progress=progress)
    out = Console(stderr=args.json == "-")
    for name, t in zip(args.models, tables, strict=True):
        table = Table(title=f"{name}: B(k) = t(k)/t(1), {t.n_threads} threads, median of {t.repeats} after a {t.prefix}-token prefix")
        table.add_column("k", justify="right")
        table.add_column("t(k) ms", justify="right")
        table.add_column("B(k)", justify="right")
        table.add_column("B(k)/k", justify="right")
        for k, b in t.ratios.items():
            table.add_row(str(k), f"{t.ms[k]:.1f}", f"{b:.2f}", f"{b / k:.2f}")
        out.print(table)
    for path, t in zip(paths, tables, strict=True):  # the engine reads these (exit head on or off, B(k) known at once)
        if not costs.plausible(t.ratios) or not t.steady:
            why = "B(k) looks" if t.steady else "the timings of one batch size disagreed, as"
            err.print(f"[yellow]not kept as {path.name}'s cost profile: {why} disturbed by other work on this "
                      "machine; measure again when it is quiet[/]")
            continue
        kept = costs.keep(path, t.ms[1], t.ratios, n_threads=t.n_threads, repeats=t.repeats)
        err.print(f"kept as this machine's cost profile of {path.name}: {kept}")
    if args.json:
        text = json.dumps([dict(t.to_json(), name=n) for n, t in zip(args.models, tables, strict=True)], indent=1) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            write_text_atomic(args.json, text)
    return 0


def run_requant(args: argparse.Namespace) -> int:
    check_optional_int("--threads", args.threads, 1, MAX_THREADS, hint="leave it out to use every core")
    if args.json:  # checked before the work, not after it
        check_overwrite(Path(args.json), True)
    base, kind = catalog.split_variant(args.model)
    if kind is not None:
        raise EesdError(f"{args.model!r} is already a variant", hint=f"requantise the source: eesd models requant {base} --type {args.kind}")
    _pull_base(args.model)
    src = registry.resolve_model(args.model)
    if args.output:
        out = Path(args.output)
    elif args.model in catalog.known_models():
        out = catalog.variant_file(catalog.get_spec(args.model), args.kind)
    else:
        out = cache_dir("models") / variant_path(src, args.kind).name
    t0 = time.monotonic()
    requantize(src, out, args.kind, force=args.force, n_threads=args.threads)
    types = ", ".join(f"{n} {t}" for t, n in tensor_types(out).items())
    print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB; tensors: {types}) in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    if catalog.split_variant(f"{args.model}{catalog.VARIANT_SEP}{args.kind}")[1] and not args.output:
        print(f"use it as --model {args.model}{catalog.VARIANT_SEP}{args.kind}", file=sys.stderr)
    if not args.quality:
        return 0
    with Console(stderr=True).status("measuring quality against the source (teacher-forced agreement, greedy answers)"):
        q = quality(src, out, heldout_texts(), n_threads=args.threads)
    print(f"top-1 agreement with {src.name}: {q.agreement:.3f} over {q.n_tokens} teacher-forced tokens of held-out text")
    for a in q.answers:
        same = "identical" if a["identical"] else f"differs from token {a['first_divergence']}"
        print(f"  greedy answer {a['prompt']}: {a['tokens']} tokens, {same}")
    print(f"greedy answers identical to the source: {q.identical_answers} of {len(q.answers)}")
    if args.json:
        write_text_atomic(args.json, json.dumps(q.to_json(), indent=1) + "\n", force=True)
    return 0
