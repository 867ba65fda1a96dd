"""``eesd convert HF_DIR -o OUT.gguf``: a Hugging Face checkpoint (and an exit head) to GGUF."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from eesd_local.tools.convert import OUTTYPES, convert, default_head_out


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert a Hugging Face Llama/Qwen2 checkpoint (and an exit head) to GGUF",
        description="Convert a Hugging Face Llama- or Qwen2-family checkpoint (config.json, *.safetensors, "
        "tokenizer.json) to a GGUF file llama.cpp loads.",
    )
    p.add_argument("hf_dir", metavar="HF_DIR", help="directory of the Hugging Face checkpoint")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf", help="the GGUF file to write")
    p.add_argument("--head", metavar="HEAD", help="exit head in HF naming: a .safetensors file (+ .json beside it) or their directory")
    p.add_argument("--head-out", metavar="HEAD.gguf", help="where to write the converted head (default: OUT.head.gguf)")
    p.add_argument("--outtype", choices=list(OUTTYPES), default="f16", help="type of the 2-D weights; norms and biases stay f32 (default: f16)")
    p.add_argument("--force", action="store_true", help="overwrite existing output files")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with Progress(
        TextColumn("[bold]converting"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("", total=None)

        def progress(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, description=name)

        out = convert(args.hf_dir, args.output, head=args.head, head_out=args.head_out, outtype=args.outtype, force=args.force, progress=progress)
    print(f"wrote {out}")
    if args.head:
        print(f"wrote {args.head_out or default_head_out(out)}")
    return 0
