"""``eesd models list|pull``: the demo models of the registry."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from .. import registry


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list and download the demo models")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION")
    msub.required = True
    pl = msub.add_parser("list", help="show known models and which are downloaded")
    pl.set_defaults(func=run_list)
    pp = msub.add_parser("pull", help="download, assemble and verify a registry model")
    pp.add_argument("names", nargs="+", metavar="NAME", help="registry name(s), see `eesd models list`")
    pp.set_defaults(func=run_pull)
    pw = msub.add_parser("path", help="print the local path of a model (pulling it if needed)")
    pw.add_argument("name", metavar="NAME")
    pw.set_defaults(func=run_path)


def run_list(args: argparse.Namespace) -> int:
    table = Table(title=f"models (cache: {registry.cache_dir('models')})")
    for col in ("name", "arch", "size", "present", "description"):
        table.add_column(col)
    for spec in registry.known_models().values():
        mark = "[green]yes[/]" if registry.is_present(spec) else "no"
        table.add_row(spec.name + (" (default)" if spec.name == registry.DEFAULT_MODEL else ""), spec.arch,
                      f"{spec.size / 2**20:.0f} MiB", mark, spec.description)
    Console().print(table)
    return 0


def pull_with_progress(name: str) -> str:
    """Pull ``name`` showing a progress bar on stderr; return the path."""
    spec = registry.get_spec(name)
    if registry.is_present(spec):
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
        path = pull_with_progress(name)
        print(f"{name}: {path}", file=sys.stderr)
    return 0


def run_path(args: argparse.Namespace) -> int:
    if args.name in registry.known_models():
        pull_with_progress(args.name)
    print(registry.resolve_model(args.name))
    return 0
