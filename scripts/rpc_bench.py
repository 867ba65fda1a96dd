"""Speculation over llama.cpp's RPC backend on this one machine, with and without added latency.

An `eesd rpc-server` on 127.0.0.1 holds every layer of the target (`--n-gpu-layers -1`); `eesd bench`
runs the methods against it, once straight and once through a relay that holds every chunk of
bytes for D ms in each direction (a round trip of 2D ms plus the relay's own): what a network adds.
The kernel's `tc netem` would be the usual tool (a network namespace with a delay on its loopback);
where it is available (root and the sch_netem module) pass --netem to use it instead of the relay.

    python scripts/rpc_bench.py [--model M] [--delays 0,1,5] [--methods none,lookup,auto,eesd]
                                [--prompts code,chat,rewrite] [--n-prompts 2] [--max-tokens 64] [--out DIR]

Writes DIR/rpc-D.json per delay (the bench's JSON) and prints one Markdown table: per delay, the
plain tokens/s over RPC, each method's speedup and tau, and B(2), B(4), B(8) over RPC.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

EESD = [sys.executable, "-m", "eesd_local.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the delay relay ----------------------------------------------------------------------------


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Forward bytes in order, each chunk no earlier than ``delay`` seconds after it arrived."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def pump() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    task = asyncio.create_task(pump())
    try:
        while True:
            data = await reader.read(1 << 16)
            await queue.put((time.monotonic() + delay, data))
            if not data:
                break
    finally:
        await task


async def _relay(listen_port: int, target_port: int, delay_ms: float) -> None:
    delay = delay_ms / 1000.0

    async def handle(r1: asyncio.StreamReader, w1: asyncio.StreamWriter) -> None:
        r2, w2 = await asyncio.open_connection("127.0.0.1", target_port)
        for w in (w1, w2):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(_pipe(r1, w2, delay), _pipe(r2, w1, delay), return_exceptions=True)

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    async with server:
        await server.serve_forever()


def relay_main(listen_port: int, target_port: int, delay_ms: float) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        asyncio.run(_relay(listen_port, target_port, delay_ms))
    except KeyboardInterrupt:
        pass  # stopped by the bench


# --- the runs -----------------------------------------------------------------------------------


def wait_listening(port: int, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited ({proc.returncode}) before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{what} did not listen within {timeout:.0f} s")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--delays", default="0,1,5", help="one-way added delay in ms, comma-separated (default %(default)s)")
    ap.add_argument("--methods", default="none,lookup,auto,eesd")
    ap.add_argument("--prompts", default="code,chat,rewrite")
    ap.add_argument("--n-prompts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="the rpc-server's threads (default %(default)s)")
    ap.add_argument("--out", default="benchmarks/rpc", help="folder for the JSON (default %(default)s)")
    ap.add_argument("--relay", nargs=3, metavar=("LISTEN", "TARGET", "DELAY_MS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.relay:
        relay_main(int(args.relay[0]), int(args.relay[1]), float(args.relay[2]))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = subprocess.Popen([*EESD, "rpc-server", "--port", str(port), "--threads", str(args.threads)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # it logs every connection
    rows = []
    try:
        wait_listening(port, server, "eesd rpc-server")
        for d in [float(x) for x in args.delays.split(",")]:
            relay = None
            target = port
            if d > 0:
                target = free_port()
                relay = subprocess.Popen([sys.executable, __file__, "--relay", str(target), str(port), str(d)])
                wait_listening(target, relay, "the delay relay")
            js = out / f"rpc-{d:g}ms.json"
            cmd = [*EESD, "bench", "--model", args.model, "--prompts", args.prompts, "--n-prompts", str(args.n_prompts),
                   "--max-tokens", str(args.max_tokens), "--methods", args.methods, "--rpc", f"127.0.0.1:{target}",
                   "--n-gpu-layers", "-1", "--cost-repeats", "3", "--json", str(js), "--force"]
            print(f"==> added delay {d:g} ms each way: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
            try:
                res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            finally:
                stop(relay)
            if res.returncode != 0 or not js.exists():
                print(f"bench failed at {d:g} ms (exit {res.returncode})", file=sys.stderr)
                continue
            rows.append((d, json.loads(js.read_text())))
    finally:
        stop(server)
    print(table(rows, args))
    return 0


def table(rows: list[tuple[float, dict]], args: argparse.Namespace) -> str:
    methods = [m for m in args.methods.split(",") if m != "none"]
    head = ["added delay (each way)", "plain tok/s over RPC", "B(2)", "B(4)", "B(8)"] + [f"{m}: speedup (tau)" for m in methods]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d, res in rows:
        every = {m: v.get("all", {}) for m, v in res.get("methods", {}).items()}
        bk = (res.get("batch_costs") or {}).get("B", {})
        cells = [f"{d:g} ms", f"{every.get('none', {}).get('tokens_per_s', float('nan')):.1f}"]
        cells += [f"{bk.get(str(k), float('nan')):.2f}" for k in (2, 4, 8)]
        for m in methods:
            a = every.get(m)
            cells.append(f"{a['speedup']:.2f} ({a['tau']:.2f})" if a and a.get("speedup") is not None else "failed")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
