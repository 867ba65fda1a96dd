"""llama.cpp's RPC backend (issue 33), on 127.0.0.1 only, every wait bounded.

Without a model: addresses, the probe's answers to a silent server, a server of another protocol
version and a port where nothing listens. With the demo model and a real `eesd rpc-server`: greedy
output over RPC equals the local run's, speculation works over it, and a server killed mid-answer
ends that answer with an error (never a crash, never a token computed from zeros).
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

import eesd_local
from eesd_local.llama.rpc import PROTO, RpcError, parse_endpoints, probe

from .helpers import free_port

EESD = [sys.executable, "-m", "eesd_local.cli"]


class FakeServer:
    """A TCP server on 127.0.0.1 that answers the hello with ``answer`` (None: reads it, says nothing)."""

    def __init__(self, answer: bytes | None) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]
        self.answer = answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5)
            try:
                conn.recv(64)
                if self.answer is not None:
                    conn.sendall(self.answer)
                time.sleep(2)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


def _hello(major: int, minor: int, patch: int) -> bytes:
    return struct.pack("<Q", 4 + 24) + struct.pack("<BBBx", major, minor, patch) + bytes(24)


@pytest.mark.parametrize("bad", ["", "host", "host:", ":50052", "h:0", "h:65536", "h:port", "h:1,,"])
def test_addresses_are_checked(bad):
    with pytest.raises(RpcError):
        parse_endpoints(bad)


def test_addresses_parse():
    assert parse_endpoints("127.0.0.1:50052, [::1]:7") == ["127.0.0.1:50052", "::1:7"]


def test_nothing_listening_is_one_clear_error():
    # refused at once, said as such: waiting out the timeout would say "did not answer within"
    with pytest.raises(RpcError, match="nothing listens .*connection refused"):
        probe(f"127.0.0.1:{free_port()}", timeout=3.0)


def test_a_silent_server_times_out():
    srv = FakeServer(None)
    try:
        with pytest.raises(RpcError, match="did not answer"):
            probe(f"127.0.0.1:{srv.port}", timeout=0.5)
    finally:
        srv.close()


def test_another_protocol_version_is_refused():
    srv = FakeServer(_hello(PROTO[0] - 1, 0, 0))
    try:
        with pytest.raises(RpcError, match=rf"speaks RPC protocol {PROTO[0] - 1}\.0\.0"):
            probe(f"127.0.0.1:{srv.port}", timeout=3.0)
    finally:
        srv.close()


def test_not_an_rpc_server_is_refused():
    srv = FakeServer(struct.pack("<Q", 3) + b"abc")
    try:
        with pytest.raises(RpcError, match="is not an RPC server"):
            probe(f"127.0.0.1:{srv.port}", timeout=3.0)
    finally:
        srv.close()


def test_a_matching_version_passes():
    srv = FakeServer(_hello(PROTO[0], PROTO[1], 9))
    try:
        assert probe(f"127.0.0.1:{srv.port}", timeout=3.0) == (PROTO[0], PROTO[1], 9)
    finally:
        srv.close()


def test_rpc_server_warns_off_loopback():
    port = free_port()
    proc = subprocess.Popen([*EESD, "rpc-server", "--host", "0.0.0.0", "--port", str(port), "--threads", "1"],
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        assert first.startswith("eesd: warning: the RPC protocol has no authentication")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)


# --- with the demo model and a real rpc-server ------------------------------------------------


@pytest.fixture
def rpc_server() -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    proc = subprocess.Popen([*EESD, "rpc-server", "--port", str(port), "--threads", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ep = f"127.0.0.1:{port}"
    try:
        for _ in range(100):  # bounded: 20 s
            try:
                probe(ep, timeout=1.0)
                break
            except RpcError:
                assert proc.poll() is None, proc.stderr.read().decode()
                time.sleep(0.2)
        else:
            pytest.fail("eesd rpc-server did not start listening within 20 s")
        yield ep, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.model
def test_cli_nothing_listening(qwen05_path):
    res = subprocess.run([*EESD, "generate", "--model", str(qwen05_path), "--rpc", f"127.0.0.1:{free_port()}",
                          "--n-gpu-layers", "-1", "--prompt", "hi", "--max-tokens", "4"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("eesd: error:")]
    assert len(errors) == 1 and "nothing listens" in errors[0], res.stderr
    assert "Traceback" not in res.stderr


# prompts whose prefill is one batch of 17..64 tokens: the server (one batch) and the local exact path
# (one chunk of 64) run the same batch-invariant kernels, so the two runs' greedy texts must be
# byte-identical
PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain in two sentences what a hash map is and when to use one."]


def _answers(engine, n: int = 48) -> tuple[list[str], int]:
    out, rounds = [], 0
    for p in PROMPTS:
        toks = engine.tokenize(engine.apply_chat_template([{"role": "user", "content": p}]))
        assert 16 < len(toks) <= 64, len(toks)
        fin = engine.run(toks, max_tokens=n)
        out.append(fin.text)
        rounds += fin.stats.n_rounds
    return out, rounds


@pytest.mark.model
def test_rpc_greedy_equals_local(rpc_server, qwen05_path, monkeypatch):
    """The server holds the weights in plain CPU buffers: the local reference keeps them unrepacked
    too (EESD_EXTRA_BUFTS=0), so both run the same vec_dot kernels on the same bytes."""

    ep, _ = rpc_server
    monkeypatch.setenv("EESD_EXTRA_BUFTS", "0")
    with eesd_local.load(str(qwen05_path), drafter="none") as local:
        want, _ = _answers(local)
    for drafter in ("none", "lookup", "eesd"):
        with eesd_local.load(str(qwen05_path), drafter=drafter, rpc=[ep], n_gpu_layers=-1) as remote:
            assert remote.exact is False and "RPC servers" in remote.exact_note  # said, never claimed
            got, rounds = _answers(remote)
        assert got == want, drafter
        assert rounds > 0


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import eesd_local
    from eesd_local.base.errors import EesdError
    from eesd_local.speculative.events import TokenEvent
    path, ep, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    eng = eesd_local.load(path, drafter="lookup", rpc=[ep], n_gpu_layers=-1)
    toks = eng.tokenize(eng.apply_chat_template([{"role": "user", "content": "Count from 1 to 200, one number a line."}]))
    n = 0
    try:
        for ev in eng.generate(toks, max_tokens=400):
            if isinstance(ev, TokenEvent):
                n += 1
                if n == 4:
                    os.kill(pid, signal.SIGKILL)
        print("NO-ERROR", n)
    except EesdError as exc:
        print("ERROR", n, exc)
    try:
        list(eng.generate(toks, max_tokens=4))
        print("AGAIN-NO-ERROR")
    except EesdError as exc:
        print("AGAIN-ERROR", exc)
    eng.close()
    print("CLOSED")
""")


@pytest.mark.model
def test_server_killed_mid_answer(rpc_server, qwen05_path):
    ep, proc = rpc_server
    res = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(qwen05_path), ep, str(proc.pid)],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, EESD_LLAMA_LOG=""))
    out = res.stdout.splitlines()
    assert res.returncode == 0, res.stdout + res.stderr  # no abort, no crash
    assert proc.wait(timeout=10) == -signal.SIGKILL
    first = next(ln for ln in out if ln.startswith(("ERROR", "NO-ERROR")))
    assert first.startswith("ERROR") and "stopped answering" in first, out
    assert int(first.split()[1]) < 400
    i = next(i for i, ln in enumerate(out) if ln.startswith("AGAIN"))
    assert out[i].startswith("AGAIN-ERROR") and "stopped answering" in out[i], out
    assert out[i + 1] == "  hint: start the server again and load the model again", out  # it says it must be reopened
    assert out[-1] == "CLOSED"
