"""``eesd rpc-server``: llama.cpp's RPC server, so that another machine's eesd can keep layers here."""

from __future__ import annotations

import argparse
import sys
import threading

from eesd_local.llama.rpc import UNSAFE, is_loopback, serve
from eesd_local.llama.runtime import default_threads
from eesd_local.params import MAX_THREADS, check_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rpc-server", help="serve this machine's CPU (or GPUs) to other machines' eesd over llama.cpp's RPC",
                       description="Start llama.cpp's RPC server on this machine. Clients pass --rpc HOST:PORT and "
                       "--n-gpu-layers N to keep N of a model's layers here. " + UNSAFE.format(where="the port") + ".")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default %(default)s; another address lets the network in: see above)")
    p.add_argument("--port", type=int, default=50052, help="port to listen on (default %(default)s)")
    p.add_argument("--threads", "--n-threads", dest="threads", type=int, default=None,
                   help="CPU threads for the layers held here (default: all cores)")
    p.add_argument("--cache", metavar="DIR", help="a directory where the server keeps tensors it was sent, to skip "
                   "sending them again on the next load")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_int("port", args.port, 1, 65535, hint="e.g. --port 50052")
    threads = default_threads() if args.threads is None else check_int("threads", args.threads, 1, MAX_THREADS)
    if not is_loopback(args.host):
        print("eesd: warning: " + UNSAFE.format(where=f"{args.host}:{args.port}"), file=sys.stderr)
    # the server runs in llama.cpp until the process ends: a thread of its own, so Ctrl-C reaches Python
    done = threading.Event()

    def work() -> None:
        try:
            serve(args.host, args.port, threads, cache_dir=args.cache)
        finally:
            done.set()

    threading.Thread(target=work, name="rpc-server", daemon=True).start()
    print(f"eesd rpc-server: listening on {args.host}:{args.port} ({threads} threads); Ctrl-C stops it", file=sys.stderr)
    while not done.wait(0.5):
        pass
    print("eesd rpc-server: the server stopped (the address may be taken)", file=sys.stderr)
    return 2
