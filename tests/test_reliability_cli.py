"""Issue #45: never wrong, round three (the command line's share).

A corpus folder that cannot be written fails before the model loads, and Ctrl-C leaves a corpus that
checks clean; every command names its model with --model/-m; a chat on a model without a template says
which template it used; a head that can never pay says so; an edited cost profile is measured again; the
bench's llama-server peers and --require-exact fail in one line; a 50,000-character prompt on the command
line works. Fast tests use the tiny synthetic GGUF; the demo model comes in where the path needs it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

import eesd_local
from eesd_chat.app import build_parser as chat_parser
from eesd_local import cli
from eesd_local.base.errors import EesdError
from eesd_local.gguf.tiny import write_tiny_gguf
from eesd_local.llama import costs
from eesd_local.llama.catalog import DEFAULT_MODEL
from eesd_local.speculative import chat, drafters
from eesd_local.speculative.engine import EngineConfig
from eesd_local.tools.bench.methods import EngineMethod
from eesd_local.tools.heads import corpus

from .conftest import QWEN05
from .helpers import eesd, one_line_error, wait_healthy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_vocab=300, n_ctx=4096)


def demo_home(tmp_path: Path, qwen05_path: Path) -> Path:
    """An EESD_HOME that holds the demo model (a link to the user's copy) and nothing else."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / qwen05_path.name).symlink_to(qwen05_path)
    return home


# --- 1. the corpus folder is checked first; Ctrl-C leaves it clean ----------------------------------------------


@pytest.mark.parametrize("where", ["/proc/x", "under-a-file"])
def test_corpus_grow_refuses_a_folder_it_cannot_write_before_loading(tiny, isolated_home, tmp_path, where):
    """It loaded the model, ran its --minutes and said "the corpus: 0 tokens, 0.00 MB in /proc/x", exit 0."""
    if where == "under-a-file":
        (tmp_path / "a-file").write_text("x")
        where = str(tmp_path / "a-file" / "corpus")
    r = eesd("heads", "corpus", "grow", "--model", str(tiny), "--corpus", where, "--minutes", "0.1")
    err = one_line_error(r, f"cannot write the corpus folder {where}", "--corpus")
    assert "growing" not in err and "the corpus:" not in err  # refused before the model loaded


def test_corpus_grow_checks_the_folder_before_the_model_loads(tiny, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model loaded before the folder was checked")

    monkeypatch.setattr(corpus, "open_context", no_load)
    with pytest.raises(EesdError, match="cannot write the corpus folder /proc/x"):
        corpus.grow(tiny, Path("/proc/x"), minutes=0.1)


@pytest.mark.model
@pytest.mark.parametrize("after", [0.0, 10.0], ids=["while-loading", "while-answering"])
def test_ctrl_c_during_corpus_grow_leaves_a_clean_corpus(qwen05_path, tmp_path, after):
    """SIGINT at any point: exit 130, and `corpus info` checks the folder clean (no damaged shard, no temporary
    file). Interrupted before its first answer, the run left no folder at all and `corpus info` said "no corpus"."""
    home = demo_home(tmp_path, qwen05_path)
    folder = tmp_path / "corpus"
    env = {**os.environ, "EESD_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "eesd_local.cli", "heads", "corpus", "grow", "--model", QWEN05, "--corpus",
                             str(folder), "--n-parallel", "4", "--max-new", "8", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 5
    while not folder.exists() and time.monotonic() < deadline:  # it has written something, or a few seconds passed
        time.sleep(0.05)
    time.sleep(after)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, err[-3000:])
    info = subprocess.run([sys.executable, "-m", "eesd_local.cli", "heads", "corpus", "info", "--model", QWEN05, "--corpus",
                           str(folder), "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert info.returncode == 0, info.stderr
    (st,) = json.loads(info.stdout)
    assert st["skipped"] == [] and st["duplicates"] == 0 and st["fingerprint_checked"], st
    assert [p.name for p in folder.iterdir() if not corpus._SHARD_NAME.match(p.name)] == []  # no temporary file left


# --- 2. one way to name the model --------------------------------------------------------------------------------


def _eesd_args(*argv: str):
    return cli.build_parser(list(argv)).parse_args(list(argv))


@pytest.mark.parametrize("command, rest", [
    ("generate", ["-p", "hi"]), ("serve", []), ("bench", ["--prompts", "code"]), ("eesd-chat", []),
])
@pytest.mark.parametrize("flag", ["--model", "-m"])
def test_every_command_takes_dash_dash_model(command, rest, flag):
    """`eesd serve --model NAME` and `eesd-chat --model PATH` were "unrecognized arguments"."""
    argv = [flag, "some/model.gguf", *rest]
    args = chat_parser().parse_args(argv) if command == "eesd-chat" else _eesd_args(command, *argv)
    assert args.model == "some/model.gguf"


@pytest.mark.parametrize("command", ["serve", "eesd-chat"])
def test_the_positional_model_stays_and_naming_two_is_an_error(command, capsys):
    def parse(*argv: str):
        return chat_parser().parse_args(list(argv)) if command == "eesd-chat" else _eesd_args(command, *argv)

    assert parse("a.gguf").model == "a.gguf"
    assert parse("a.gguf", "--model", "a.gguf").model == "a.gguf"  # the same model twice: no harm
    assert parse().model == parse("--n-ctx", "512").model == DEFAULT_MODEL
    with pytest.raises(SystemExit) as exc:
        parse("a.gguf", "-m", "b.gguf")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "the model is named twice: MODEL a.gguf and -m b.gguf" in err and "Traceback" not in err


def test_load_takes_the_model_as_a_keyword(tiny):
    with eesd_local.load(model=tiny, drafter="lookup", n_ctx=256, n_threads=1) as llm:
        assert llm.model_path == tiny
        assert llm.create_completion("hello", max_tokens=2)["usage"]["completion_tokens"] == 2


# --- 3. a chat on a model without a template says which template it used -----------------------------------------


def test_generate_chat_without_a_template_says_so_once(tiny, isolated_home):
    r = eesd("generate", "--model", str(tiny), "--drafter", "lookup", "-p", "hi", "--chat", "-n", "2")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "no chat template" in line]
    assert len(lines) == 1 and "ChatML" in lines[0] and "plain text to this model" in lines[0], r.stderr
    plain = eesd("generate", "--model", str(tiny), "--drafter", "lookup", "-p", "hi", "-n", "2")  # no --chat: no template
    assert plain.returncode == 0 and "chat template" not in plain.stderr, plain.stderr


def test_the_api_notes_the_fallback_template_in_speculation(tiny, monkeypatch):
    with eesd_local.load(tiny, drafter="lookup", n_ctx=512, n_threads=1) as llm:
        msgs = [{"role": "user", "content": "hi"}]
        note = llm.create_chat_completion(msgs, max_tokens=2)["speculation"]["note"]
        assert note.startswith("the model has no chat template") and "ChatML" in note
        last = list(llm.create_chat_completion(msgs, max_tokens=2, stream=True))[-1]
        assert last["speculation"]["note"] == note
        assert "note" not in llm.create_completion("hi", max_tokens=2)["speculation"]  # no chat, no template
        monkeypatch.setattr(llm.model, "chat_template", lambda: chat.CHATML)  # a model that has its own
        assert "note" not in llm.create_chat_completion(msgs, max_tokens=2)["speculation"]


def test_the_server_notes_the_fallback_template(tiny, tmp_path):
    """And `eesd serve --model PATH` serves (it was "unrecognized arguments")."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "eesd_local.cli", "serve", "--model", str(tiny), "--port", str(port),
                             "--drafter", "lookup", "--n-ctx", "512", "--n-threads", "1", "--log-level", "warning"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "EESD_HOME": str(tmp_path / "h")})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, 120)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and "no chat template" in r.json()["speculation"]["note"], r.text
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and "note" not in r.json()["speculation"], r.text
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()


# --- 4. a head that can never pay says so -----------------------------------------------------------------------


def test_a_head_that_never_pays_names_no_impossible_acceptance():
    """Every batch as dear as its tokens one by one: the line said "needs acceptance > 1.25"."""
    prof = costs.CostProfile(20.0, {k: float(k) for k in costs.KS}, {})
    v = costs.head_verdict(prof, agreement=0.6, exit_layer=5, n_layer=24, k_max=8)
    assert not v.pays and v.note.startswith("exit head: off, never pays on this machine: B(2)=2.00")
    assert "needs acceptance" not in v.note and "1.25" not in v.note, v.note
    some = costs.CostProfile(20.0, {k: (1.0 if k == 1 else 1.9 + 0.5 * (k - 2)) for k in costs.KS}, {})
    assert "needs acceptance > 0.9" in costs.head_verdict(some, agreement=0.6, exit_layer=5, n_layer=24, k_max=8).note


def test_the_drafter_line_says_a_disturbed_measurement_once(tiny, monkeypatch):
    """The note of a measurement taken under other work came twice in one drafter line."""
    prof = costs.CostProfile(600.0, {1: 1.0, 2: 0.13}, {}, note="this machine's batch costs could not be measured",
                             plausible=False)
    monkeypatch.setattr(drafters, "resolve_head", lambda spec: Path(spec))
    monkeypatch.setattr(drafters.headfile, "read_head_info", lambda head: {"agreement": {"all": 0.6}, "exit_layer": 5,
                                                                            "base_n_layer": 24})
    monkeypatch.setattr(costs, "profile", lambda model, **kw: prof)
    _, verdict = drafters.auto_head(EngineConfig(model=str(tiny), drafter="auto", head="head.gguf"), tiny, model=object())
    assert verdict is not None and verdict.note.count("could not be measured") == 1, verdict.note


# --- 5a. an edited or damaged cost profile is measured again ------------------------------------------------------


def _edit_figure(d: dict) -> str:
    d["bk"]["2"] = 1.05  # plausible, and a head then looks as if it could pay
    return json.dumps(d)


def _huge_number(d: dict) -> str:
    return json.dumps(d).replace('"t1_ms": 20.0', '"t1_ms": 1' + "0" * 400)


@pytest.mark.parametrize("damage, needle", [
    (_edit_figure, "damaged or was edited"),  # was used as if measured
    (_huge_number, "damaged"),  # OverflowError: a crash
    (lambda d: "[" * 100_000 + "]" * 100_000, "damaged"),  # RecursionError: a crash
], ids=["edited", "huge-number", "deeply-nested"])
def test_an_edited_or_damaged_cost_profile_is_measured_again(fake, damage, needle):
    model, calls = fake
    costs.profile(model, n_threads=2)
    path = costs.profile_path(costs.fingerprint(model.path, n_threads=2))
    path.write_text(damage(json.loads(path.read_text())))
    prof = costs.profile(model, n_threads=2)
    assert calls == [2, 2] and needle in prof.note and "measured again" in prof.note and len(prof.note) < 400, prof.note
    assert prof.bk[2] == pytest.approx(1.8)  # the measured figure, not the edited one
    again = costs.profile(model, n_threads=2)
    assert calls == [2, 2] and again.note == ""  # kept again, whole


def test_a_profile_kept_before_the_checksum_is_still_read(fake):
    model, calls = fake
    costs.profile(model, n_threads=2)
    path = costs.profile_path(costs.fingerprint(model.path, n_threads=2))
    d = json.loads(path.read_text())
    del d["sha256"]
    path.write_text(json.dumps(d))
    assert costs.profile(model, n_threads=2).note == "" and calls == [2]


# --- 5b, 5c. the bench's peers and --require-exact -----------------------------------------------------------------

BENCH = ("bench", "--prompts", "code", "--n-prompts", "1", "--max-tokens", "2", "--methods", "none", "--cost-repeats", "0",
         "--warmup-tokens", "0", "--n-ctx", "2048")


@pytest.mark.parametrize("flags, env, needles", [
    (["--peers", "bogus"], {}, ["unknown llama-server --spec-type 'bogus'", "ngram-mod"]),
    (["--peers", "ngram-mod,bogus"], {}, ["unknown llama-server --spec-type 'bogus'"]),
    (["--peers"], {"EESD_LLAMA_TOOLS": "/nonexistent/llama-tools"}, ["llama-server is not built", "llama_build.py tools"]),
    (["--peers", "ngram-mod"], {"EESD_LLAMA_TOOLS": "/nonexistent/llama-tools"}, ["llama-server:ngram-mod"]),
    (["--http"], {"EESD_LLAMA_TOOLS": "/nonexistent/llama-tools"}, ["serve:llama-server"]),
], ids=["unknown-type", "one-unknown", "not-built", "not-built-one", "http-not-built"])
def test_bench_peers_that_cannot_run_fail_in_one_line(tiny, isolated_home, flags, env, needles):
    """They ran the benchmark and exited 0, each peer's row saying "did not run"."""
    r = eesd(*BENCH, "--model", str(tiny), *flags, env=env)
    one_line_error(r, *needles)
    assert r.stdout == ""  # nothing ran


def test_require_exact_with_sampling_is_an_error(tiny, isolated_home):
    """Sampled outputs are never compared: --require-exact passed, having checked nothing."""
    r = eesd(*BENCH, "--model", str(tiny), "--require-exact", "--temperature", "0.7")
    one_line_error(r, "--require-exact compares greedy output", "--temperature 0.7")
    assert r.stdout == ""


def test_require_exact_names_a_method_that_is_not_exact(tiny, isolated_home, monkeypatch, capsys):
    init = EngineMethod.__init__

    def lookup_not_exact(self, spec, engine):
        init(self, spec, engine)
        self.exact = self.exact and spec.name != "lookup"

    monkeypatch.setattr(EngineMethod, "__init__", lookup_not_exact)
    argv = [*BENCH[:8], "none,lookup", *BENCH[9:], "--model", str(tiny), "--n-threads", "1"]
    args = _eesd_args(*argv)
    assert args.func(args) == 0 and "not exact" not in capsys.readouterr().err
    args = _eesd_args(*argv, "--require-exact")
    assert args.func(args) == 1
    assert "eesd: not exact: lookup: exactness is not claimed here" in capsys.readouterr().err


# --- 5d. a 50,000-character prompt on the command line -----------------------------------------------------------


@pytest.mark.model
def test_a_50000_character_prompt_on_the_command_line(qwen05_path, tmp_path):
    home = demo_home(tmp_path, qwen05_path)
    head = "def add(a, b):\n    return a + b\n\n# the next function\n"
    long_prompt = head + ("#" * 79 + "\n") * ((50_000 - len(head)) // 80)
    long_prompt += "#" * (50_000 - len(long_prompt) - 1) + "\n"
    assert len(long_prompt) == 50_000
    r = eesd("generate", "--model", QWEN05, "--drafter", "lookup", "-n", "4", "-p", long_prompt, env={"EESD_HOME": str(home)},
             timeout=600)
    assert r.returncode == 0 and "[length] 4 tokens" in r.stderr, r.stderr[-3000:]
    dense = ("def add(a, b):\n    return a + b\n\n" * 2000)[:50_000]  # ~18,000 tokens: more than the default context
    r = eesd("generate", "--model", QWEN05, "--drafter", "lookup", "-n", "4", "-p", dense, env={"EESD_HOME": str(home)})
    one_line_error(r, "tokens but the context holds 4096", "--n-ctx")


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_stops_the_bench_as_ctrl_c_does(tiny, isolated_home, tmp_path):
    """A plain `kill` of `eesd bench` left its `eesd serve` peers running (they have their own process group) and
    wrote nothing: now it stops like Ctrl-C, the servers with it, what was measured written, exit 143."""
    out, log = tmp_path / "out.json", tmp_path / "err.log"
    argv = [sys.executable, "-m", "eesd_local.cli", "bench", "--model", str(tiny), "--prompts", "code", "--n-prompts", "0",
            "--methods", "none,serve:eesd:none", "--max-tokens", "16", "--repeats", "50", "--warmup-tokens", "0",
            "--cost-repeats", "0", "--n-ctx", "2048", "--json", str(out)]
    with log.open("w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
    servers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while " runs (" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # a line a finished prompt: both methods have run once
        assert proc.poll() is None, log.read_text()[-2000:]
        servers = [p for p in psutil.Process(proc.pid).children() if "serve" in p.cmdline()]
        assert servers, "no eesd serve peer was running"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        for _ in range(50):
            if not any(_alive(p) for p in servers):
                break
            time.sleep(0.2)
        left = [p for p in servers if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in servers:  # never left running, whatever failed
            if _alive(p):
                p.kill()
    assert rc == 143, log.read_text()[-2000:]
    assert not left, "the bench's eesd serve outlived it"
    data = json.loads(out.read_text())
    assert data["run"]["complete"] is False and data["run"]["runs_done"] >= 2
    assert "interrupted" in log.read_text() and "Traceback" not in log.read_text()
