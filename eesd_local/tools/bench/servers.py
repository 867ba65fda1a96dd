"""Servers as benchmark peers: llama.cpp's own ``llama-server`` (plain and with each of its
speculative decoding types) and, end to end over HTTP, ``eesd serve`` beside it.

``llama-server`` is built by ``python scripts/llama_build.py tools`` from the same patched source
and with the same flags as the llama.cpp inside llama-cpp-python, into build/llama-tools/KEY/bin;
nothing is downloaded. Every server listens on 127.0.0.1 on a free port, with the benchmark's
model file, context, threads and GPU layers, one slot, flash attention off (as our contexts), and
answers greedy requests (temperature 0) of token ids. A ``llama-server`` peer is timed by the
server's own ``timings`` (the prompt, then the generation: ``predicted_per_second``, with
``draft_n`` and ``draft_n_accepted``), as our methods are timed from their first token; a
``serve:`` method is timed from outside, request to answer, for users of either server.

Every process this module starts is stopped at the end, Ctrl-C included (:func:`stop_all` runs
from the benchmark's ``finally`` and at exit); a server that fails to start, dies or answers an
error ends that peer's row with one line, and the run goes on.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import llama_cpp

from eesd_local.base.errors import EesdError
from eesd_local.base.paths import package_root
from eesd_local.llama.runtime import extra_bufts_allowed
from eesd_local.speculative.events import Stats
from eesd_local.tools.bench.methods import SERVER, MethodSpec, Sampling, Turn

# llama-server --spec-type values of the vendored llama.cpp that need nothing but the model (and,
# for draft-simple, a draft model); the others need a head the demo models do not ship
SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "draft-simple")
HEAD_SPEC_TYPES = {"draft-eagle3": "an EAGLE-3 head", "draft-mtp": "MTP layers", "draft-dflash": "a DFlash head",
                   "draft-dspark": "a DSpark head"}
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 600.0


class PeerFailed(Exception):
    """A peer that cannot run, or stopped running: its row says why in one line."""


_LIVE: list[subprocess.Popen] = []


def stop_all() -> None:
    """Stop every server this process started (its process group: nothing is left bound)."""
    while _LIVE:
        proc = _LIVE.pop()
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except (ProcessLookupError, PermissionError):
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


atexit.register(stop_all)


def tools_dir() -> Path | None:
    """Where ``scripts/llama_build.py tools`` put llama-server for the installed llama.cpp, if it did:
    EESD_LLAMA_TOOLS, else build/llama-tools/KEY/bin of this checkout, KEY from the install's record."""
    env = os.environ.get("EESD_LLAMA_TOOLS")
    if env:
        return Path(env)

    info = Path(llama_cpp.__file__).parent / "lib" / "eesd-build.json"
    try:
        key = json.loads(info.read_text())["key"]
    except (OSError, ValueError, KeyError):
        return None
    return package_root() / "build" / "llama-tools" / key / "bin"


def find_binary(name: str) -> Path:
    where = tools_dir()
    path = where / name if where else None
    if path is None or not path.is_file():
        raise PeerFailed(f"{name} is not built for this llama.cpp: run `python scripts/llama_build.py tools` "
                         "(builds it from the vendored source, about 6 minutes on 2 cores)")
    return path


def check_servers(specs: list[MethodSpec]) -> None:
    """The llama-server methods asked for (``--peers``, ``--http``, ``llama-server[:TYPE]`` in ``--methods``)
    can start: every --spec-type is one llama-server has, and llama-server is built; else one EesdError,
    before anything loads (a peer that fails later still ends its own row only)."""
    wanted = [s for s in specs if s.drafter == "server" or (s.drafter == "http" and s.http_server == SERVER)]
    known = SPEC_TYPES + tuple(HEAD_SPEC_TYPES)
    for s in wanted:
        if s.server_spec and s.server_spec not in known:
            raise EesdError(f"unknown llama-server --spec-type {s.server_spec!r} (method {s.name})",
                            hint=f"llama-server's spec types: {', '.join(known)}")
    if wanted:
        try:
            find_binary(SERVER)
        except PeerFailed:
            raise EesdError(f"{SERVER} is not built for this llama.cpp (the methods that run it: {', '.join(s.name for s in wanted)})",
                            hint="run `python scripts/llama_build.py tools` (builds it from the vendored source, about "
                                 "6 minutes on 2 cores), or leave out --peers/--http") from None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_T = TypeVar("_T")

def _post(url: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")[:200]
        raise PeerFailed(f"answered HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        raise PeerFailed(f"no answer: {getattr(exc, 'reason', exc)}") from None


def _post_stream(url: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> tuple[str, float, int, int | None, str]:
    """An OpenAI-style streamed completion: (text, seconds to the first chunk that carries text, chunks that
    carried text, completion tokens from the final usage chunk or None where the server sends none, the
    finish reason)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    parts: list[str] = []
    first = 0.0
    usage = None
    finish = ""
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = int(obj["usage"].get("completion_tokens") or 0) or None
                for ch in obj.get("choices") or []:
                    finish = ch.get("finish_reason") or finish
                    piece = ch.get("text") or ""
                    if piece:
                        if not parts:
                            first = time.perf_counter() - t0
                        parts.append(piece)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")[:200]
        raise PeerFailed(f"answered HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError, TimeoutError, json.JSONDecodeError) as exc:
        raise PeerFailed(f"no answer: {getattr(exc, 'reason', exc)}") from None
    return "".join(parts), first, len(parts), usage, finish


def answer_tokens(server: str, usage: int | None, chunks: int, finish: str) -> int:
    """The tokens of a streamed answer's text, counted alike for every server. llama-server's
    ``completion_tokens`` counts the end-of-generation token that ended an answer (14 for a 13-token answer;
    the bench sends no stop strings, so its finish "stop" is that token), ``eesd serve``'s does not: counted
    as sent, llama-server's end-to-end rate would gain 1/n on every answer shorter than max_tokens (8% on a
    13-token chat answer). Without usage, llama-server's chunks (one a token)."""
    if usage is None:
        return chunks
    if server == "llama-server" and finish == "stop" and usage > 1:
        return usage - 1
    return usage


class ServerProcess:
    """A server on 127.0.0.1: started, waited for (``/health``), stopped."""

    def __init__(self, argv: list[str], port: int, what: str, env: dict[str, str] | None = None) -> None:
        self.port, self.what = port, what
        self.log = tempfile.NamedTemporaryFile(prefix="eesd-peer-", suffix=".log", delete=False)
        # a process group of its own: stop_all reaches it and whatever it started, Ctrl-C at the
        # terminal does not (the benchmark stops it in order)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env)
        _LIVE.append(self.proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise PeerFailed(f"{what} exited with code {self.proc.returncode} while starting: {self.last_line()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise PeerFailed(f"{what} did not answer /health within {START_TIMEOUT_S:.0f} s: {self.last_line()}")
            time.sleep(0.25)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def last_line(self) -> str:
        try:
            lines = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return lines[-1][:200] if lines else "(it printed nothing)"

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(_post, path, body)

    def post_stream(self, path: str, body: dict[str, Any]) -> tuple[str, float, int, int | None, str]:
        return self._call(_post_stream, path, body)

    def _call(self, send: Callable[[str, dict[str, Any]], _T], path: str, body: dict[str, Any]) -> _T:
        """``send`` the request to this server; a failure names the server (and its exit, if it died)."""
        if self.proc.poll() is not None:
            raise PeerFailed(f"{self.what} exited with code {self.proc.returncode}: {self.last_line()}")
        try:
            return send(self.url + path, body)
        except PeerFailed as exc:
            dead = f" (it exited with code {self.proc.returncode}: {self.last_line()})" if self.proc.poll() is not None else ""
            raise PeerFailed(f"{self.what} {exc}{dead}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, PermissionError):
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc in _LIVE:
            _LIVE.remove(self.proc)
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


# llama-server as users install it: llama.cpp's own kernel choice. The tools the set-up builds share the
# patched ggml (their libraries are the engine's); GGML_CPU_EXACT_ROWS=0 turns the patch off in the peer's
# process only, so every peer row is measured with stock kernels (and labelled so)
STOCK_ENV = {"GGML_CPU_EXACT_ROWS": "0"}
STOCK = " (stock kernels)"


def llama_server_argv(model_path: Path, port: int, *, spec_type: str | None, draft_model: Path | None, n_ctx: int,
                      n_threads: int, n_gpu_layers: int, rpc: tuple[str, ...] = ()) -> list[str]:
    argv = [str(find_binary("llama-server")), "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port),
            "-c", str(n_ctx), "-t", str(n_threads), "-tb", str(n_threads), "-np", "1", "-fa", "off",
            "-ngl", str(n_gpu_layers), "--no-webui"]
    if not extra_bufts_allowed():
        # the engine's rule (runtime.extra_bufts_allowed): on a CPU with AMX llama.cpp repacks the weights into its
        # AMX buffers, whose matmul crashes on some virtual machines (llama-server exits with SIGSEGV while it
        # starts), so both run the ordinary AVX-512 kernels there
        argv += ["--no-repack"]
    if rpc:
        argv += ["--rpc", ",".join(rpc)]
    if spec_type:
        argv += ["--spec-type", spec_type]
    if draft_model is not None:
        argv += ["-md", str(draft_model), "-ngld", str(n_gpu_layers)]
    return argv


def eesd_serve_argv(model_path: Path, port: int, *, drafter: str, n_ctx: int, n_threads: int, n_gpu_layers: int = 0,
                    draft_max: int | None = None, draft_model: Path | None = None, rpc: tuple[str, ...] = ()) -> list[str]:
    """``eesd serve`` as the peers are started: this interpreter, 127.0.0.1, warnings only (the one place
    the benchmark and the probe scripts build its command line)."""
    argv = [sys.executable, "-m", "eesd_local.cli", "serve", str(model_path), "--host", "127.0.0.1", "--port", str(port),
            "--drafter", drafter, "--n-ctx", str(n_ctx), "--n-threads", str(n_threads), "--n-gpu-layers", str(n_gpu_layers),
            "--log-level", "warning"]
    if draft_max is not None:
        argv += ["--draft-max", str(draft_max)]
    if draft_model is not None:
        argv += ["--draft-model", str(draft_model)]
    if rpc:
        argv += ["--rpc", ",".join(rpc)]
    return argv


def peer_unusable(spec_type: str, draft_model: str | None) -> str | None:
    """Why llama-server cannot run this spec type on the benchmark's model (None: it can)."""
    if spec_type in HEAD_SPEC_TYPES:
        return f"--spec-type {spec_type} needs {HEAD_SPEC_TYPES[spec_type]}, which the model does not ship"
    if spec_type == "draft-simple" and not draft_model:
        return "--spec-type draft-simple needs a draft model of the same vocabulary (--draft-model)"
    if spec_type not in SPEC_TYPES:
        return f"unknown --spec-type {spec_type!r} (llama-server's: {', '.join(SPEC_TYPES + tuple(HEAD_SPEC_TYPES))})"
    return None


class _ServerPeer:
    """A method that is a server process, started from ``_argv(port)`` with ``_env``."""

    _argv: Callable[[int], list[str]]
    _env: dict[str, str] | None
    drafter: str
    server: ServerProcess

    def _start(self) -> ServerProcess:
        port = free_port()
        return ServerProcess(self._argv(port), port, self.drafter, env=self._env)

    def fresh(self) -> None:
        """A new server process, as for the first pass over the prompts: what the last one kept across
        requests (its prompt cache, ngram-mod's pool of n-grams, eesd's store of earlier answers) is gone,
        so a repeat measures the same requests again rather than answers recalled from the pass before."""
        self.server.stop()
        self.server = self._start()

    def close(self) -> None:
        self.server.stop()


class LlamaServerPeer(_ServerPeer):
    """llama-server, plain or with one --spec-type, timed by its own ``timings``."""

    def __init__(self, spec: MethodSpec, model_path: Path, *, n_ctx: int, n_threads: int, n_gpu_layers: int,
                 draft_model: Path | None, rpc: tuple[str, ...] = ()) -> None:
        self.spec = spec
        self.exact = False
        kind = spec.server_spec
        self.drafter = (f"llama-server --spec-type {kind}" if kind else "llama-server") + STOCK
        self.controller = "-"
        why = peer_unusable(kind, str(draft_model) if draft_model else None) if kind else None
        if why:
            raise PeerFailed(why)
        self._argv = lambda port: llama_server_argv(model_path, port, spec_type=kind or None,
                                                    draft_model=draft_model if kind == "draft-simple" else None,
                                                    n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, rpc=rpc)
        self._env = {**os.environ, **STOCK_ENV}
        self.server = self._start()
        self.model_bytes = model_path.stat().st_size + (draft_model.stat().st_size if kind == "draft-simple" and draft_model else 0)

    def generate(self, prompt: list[int], s: Sampling, *, prediction: str | None = None) -> Turn:
        # (llama-server has no predicted outputs: a prediction is not sent)
        body = {"prompt": prompt, "n_predict": s.max_tokens, "temperature": s.temperature, "top_k": s.top_k,
                "top_p": s.top_p, "min_p": 0.0, "repeat_penalty": 1.0, "cache_prompt": True, "return_tokens": True,
                "stream": False}
        if s.seed is not None:
            body["seed"] = s.seed
        out = self.server.post("/completion", body)
        tokens = [int(t) for t in out.get("tokens") or []]
        tm = out.get("timings") or {}
        n = len(tokens)
        # predicted_ms runs from the first token to the last (the server's predicted_per_second is
        # (n - 1) over it): our methods' rate over the same span
        turn = Turn(tokens, out.get("content", ""), float(tm.get("prompt_ms") or 0.0) / 1e3,
                    float(tm.get("predicted_ms") or 0.0) / 1e3)
        st = Stats(n_generated=n)
        drafted, accepted = int(tm.get("draft_n") or 0), int(tm.get("draft_n_accepted") or 0)
        # the server reports totals only: its rounds are the target's decodes after the first token,
        # one per emitted token that was not an accepted draft
        st.n_rounds = max(0, n - 1 - accepted)
        st.n_emitted = max(0, n - 1)
        st.n_drafted, st.n_accepted = drafted, accepted
        if drafted:
            st.by_source[self.spec.server_spec or "llama-server"] = [0, drafted, accepted]
        turn.rounds = st
        return turn



class HttpPeer(_ServerPeer):
    """A server timed end to end through HTTP (``/v1/completions``, greedy, token-id prompt):
    ``eesd serve`` with one drafter, or llama-server, as a client sees them."""

    def __init__(self, spec: MethodSpec, model_path: Path, *, n_ctx: int, n_threads: int, n_gpu_layers: int,
                 draft_model: Path | None, draft_max: int, rpc: tuple[str, ...] = ()) -> None:
        self.spec = spec
        self.exact = False
        self.controller = "-"
        kind = spec.http_server
        if kind == "llama-server":
            self._argv = lambda port: llama_server_argv(model_path, port, spec_type=spec.server_spec or None,
                                                        draft_model=draft_model if spec.server_spec == "draft-simple" else None,
                                                        n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, rpc=rpc)
            self.drafter = "llama-server" + (f" --spec-type {spec.server_spec}" if spec.server_spec else "") + STOCK
            self._env = {**os.environ, **STOCK_ENV}
        else:
            self._env = None
            drafter = spec.server_spec or "auto"

            self._argv = lambda port: eesd_serve_argv(model_path, port, drafter=drafter, n_ctx=n_ctx, n_threads=n_threads,
                                                      n_gpu_layers=n_gpu_layers, draft_max=draft_max, rpc=rpc,
                                                      draft_model=draft_model if drafter == "draft-model" else None)
            self.drafter = f"eesd serve --drafter {drafter}"
        self.server = self._start()
        self.model_bytes = model_path.stat().st_size

    def generate(self, prompt: list[int], s: Sampling, *, prediction: str | None = None) -> Turn:
        # streamed, as an editor or a chat client asks: the first chunk with text times the first token
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": s.max_tokens, "temperature": s.temperature,
                                "top_p": s.top_p, "stream": True, "stream_options": {"include_usage": True}}
        if prediction is not None and self.spec.http_server == "eesd":  # llama-server has no such field
            body["prediction"] = {"type": "content", "content": prediction}
        if s.top_k:
            body["top_k"] = s.top_k
        if s.seed is not None:
            body["seed"] = s.seed
        t0 = time.perf_counter()
        text, first, chunks, usage, finish = self.server.post_stream("/v1/completions", body)
        wall = time.perf_counter() - t0
        n = answer_tokens(self.spec.http_server, usage, chunks, finish)
        # end to end: every token over the whole request (prompt included), as a client waits for it
        return Turn([], text, first, wall * (n - 1) / n if n > 1 else 0.0, count=n)

