"""``eesd rpc-server``: llama.cpp's RPC server, so that another machine's eesd can keep layers here."""

from __future__ import annotations

import argparse
import sys
import threading

from eesd_local.base.errors import EesdError
from eesd_local.base.params import MAX_THREADS, check_int
from eesd_local.llama.rpc import UNSAFE, cache_folder, is_loopback, listen_address, port_in_use, serve
from eesd_local.llama.runtime import default_threads


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
    # before llama.cpp starts: its server says only "Failed to create server socket" for a bad host or a
    # port in use, and writes no word when it cannot keep the cache it was given
    address = listen_address(args.host, args.port)
    cache = None if args.cache is None else cache_folder(args.cache)
    if not is_loopback(address):
        print("eesd: warning: " + UNSAFE.format(where=f"{args.host}:{args.port}"), file=sys.stderr)
    # the server runs in llama.cpp until the process ends: a thread of its own, so Ctrl-C reaches Python
    done = threading.Event()
    failed: list[EesdError] = []

    def work() -> None:
        try:
            serve(address, args.port, threads, cache_dir=cache)
        except EesdError as exc:  # no RPC backend, no device: said by the main thread, as any other error
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=work, name="rpc-server", daemon=True).start()
    shown = args.host if address == args.host else f"{args.host} ({address})"
    print(f"eesd rpc-server: listening on {shown}:{args.port} ({threads} threads); Ctrl-C stops it", file=sys.stderr)
    while not done.wait(0.5):
        pass
    if failed:
        raise failed[0]
    if port_in_use(address, args.port):  # another program took the port between the check and llama.cpp's bind
        raise EesdError(f"the server stopped: {args.host}:{args.port} is in use",
                        hint="another program listens there: stop it or pick another --port")
    raise EesdError("the server stopped (llama.cpp's message above says why)")
