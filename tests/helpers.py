"""Helpers the test modules share: running ``eesd`` in a subprocess, its one-line errors, a free port, a
server that answers /health."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def eesd(*argv: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eesd_local.cli", *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    """The run failed with exit 2 and one `eesd: error:` line (plus at most a hint) holding every needle."""
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("eesd: error: ")]
    assert len(errors) == 1, r.stderr
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)
    return r.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """Until the server at ``url`` answers /health; fails with its log if it exits or takes longer."""
    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None and time.time() < deadline, log.read_text()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
