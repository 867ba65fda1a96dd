"""``eesd serve``: an OpenAI-compatible HTTP server (``/v1/completions``, ``/v1/chat/completions``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eesd_local.api import load
from eesd_local.base.params import check_int
from eesd_local.commands.options import add_engine_args, engine_config
from eesd_local.server import listen_socket, serve


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(p, positional_model=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default %(default)s)")
    p.add_argument("--queue", type=int, default=8,
                   help="requests that may wait while one runs; more get 429 (default %(default)s)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_int("queue", args.queue, 0, hint="requests that may wait while one runs, e.g. --queue 8")
    sock = listen_socket(args.host, args.port)  # before the model loads: a bad address fails at once
    try:
        config = engine_config(args)
        path = Path(args.model)
        model_id = path.stem if path.suffix == ".gguf" else args.model  # a registry name, or the GGUF's file name
        with load(**vars(config)) as engine:
            print(engine.drafter_note, file=sys.stderr)
            print(f"eesd: serving {model_id} on http://{args.host}:{args.port}/v1 (Ctrl-C stops)", file=sys.stderr)
            serve(engine, model_id=model_id, aliases=(args.model, engine.model_path.name, engine.model_path.stem),
                  host=args.host, port=args.port, queue_max=args.queue, log_level=args.log_level, sock=sock)
    finally:
        sock.close()
    return 0
