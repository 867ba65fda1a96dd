"""What ``eesd serve`` costs over calling the engine directly: requests per minute and tokens/s.

    .venv/bin/python scripts/server_overhead.py                       # 10 requests of 64 tokens, greedy, lookup
    .venv/bin/python scripts/server_overhead.py --requests 20 --drafter eesd

The server runs as ``eesd serve`` in a subprocess on a free port; the engine runs in this
process with the same settings. Requests alternate (one direct, one through the server, each
first every other time), so machine noise hits both alike; one warm-up request each is not
counted. Outside the decode loop is the prefill plus, for the server, HTTP, JSON and the queue.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the idle side sleeps instead of spinning

import httpx  # noqa: E402

import eesd_local  # noqa: E402

PROMPTS = ["def factorial(n):", "def add(a, b):", "def gcd(a, b):", "class Stack:", "def is_prime(n):",
           "# reverse a string\ndef reverse(s):", "def mean(xs):", "SELECT name FROM", "def square(x):", "for i in range(10):"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--drafter", default="lookup")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--n-threads", type=int, default=None)
    ap.add_argument("--stream", action="store_true", help="the server streams its answer (server-sent events), as editors ask")
    args = ap.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    threads = ["--n-threads", str(args.n_threads)] if args.n_threads else []
    server = subprocess.Popen([sys.executable, "-m", "eesd_local.cli", "serve", args.model, "--port", str(port),
                               "--drafter", args.drafter, "--log-level", "warning", *threads], env=env)
    try:
        with eesd_local.load(args.model, drafter=args.drafter, n_threads=args.n_threads) as engine, httpx.Client() as http:
            while True:
                assert server.poll() is None, "the server exited"
                try:
                    if http.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.5)

            def direct(prompt: str) -> tuple[str, int, float]:
                fin = engine.run(prompt, max_tokens=args.max_tokens, temperature=0.0)
                return fin.text, fin.stats.n_generated, fin.stats.t_decode

            def served(prompt: str) -> tuple[str, int, float]:
                body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
                if not args.stream:
                    r = http.post(url + "/v1/completions", timeout=600, json=body)
                    r.raise_for_status()
                    out = r.json()
                    n, spec = out["usage"]["completion_tokens"], out["speculation"]
                    return out["choices"][0]["text"], n, n / spec["tokens_per_s"]
                body.update(stream=True, stream_options={"include_usage": True})
                parts, last = [], {}
                with http.stream("POST", url + "/v1/completions", timeout=600, json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            last = json.loads(line[6:])
                            parts.extend(c.get("text", "") for c in last.get("choices") or [])
                n, spec = last["usage"]["completion_tokens"], last["speculation"]
                return "".join(parts), n, n / spec["tokens_per_s"]

            direct(PROMPTS[-1])
            served(PROMPTS[-1])
            totals = {"engine": [0.0, 0, 0.0], "server": [0.0, 0, 0.0]}  # wall seconds, tokens, decode-loop seconds
            same = 0
            for i in range(args.requests):
                prompt = PROMPTS[i % len(PROMPTS)]
                texts = {}
                pair = (("engine", direct), ("server", served))
                for name, call in pair if i % 2 == 0 else pair[::-1]:  # each goes first every other time
                    t = time.perf_counter()
                    text, n, inside = call(prompt)
                    totals[name][0] += time.perf_counter() - t
                    totals[name][1] += n
                    totals[name][2] += inside
                    texts[name] = text
                same += texts["engine"] == texts["server"]
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)

    rates = {}
    for name, (seconds, tokens, inside) in totals.items():
        rates[name] = (60 * args.requests / seconds, tokens / seconds)
        print(f"{name:7s} {args.requests} requests, {tokens} tokens in {seconds:.2f} s: "
              f"{rates[name][0]:.1f} requests/min, {rates[name][1]:.1f} tokens/s ({inside:.2f} s of it in the decode loop, "
              f"{1e3 * (seconds - inside) / args.requests:.0f} ms per request outside it)")
    print(f"server/engine: requests/min {rates['server'][0] / rates['engine'][0]:.3f}, "
          f"tokens/s {rates['server'][1] / rates['engine'][1]:.3f} "
          f"(drafter {args.drafter}, {args.max_tokens} tokens, greedy; same text {same}/{args.requests})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
