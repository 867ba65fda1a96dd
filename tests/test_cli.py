"""`eesd generate` and `eesd models` as a user runs them: output, stats line, and one clean
error (exit code 2, no traceback) for each bad input."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp
import pytest

from eesd_local.api import load
from eesd_local.commands.options import ENGINE_FLAGS
from eesd_local.speculative.engine import EngineConfig

from .conftest import QWEN05

PROMPT = "Write a Python function that reverses a string."


def eesd(*args: str, env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "eesd_local.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_generate_equals_llama_cpp_python_greedy(qwen05_path):
    """Plain decoding through our runtime gives llama-cpp-python's own greedy text."""
    n = 48
    with load(QWEN05, drafter="none", n_ctx=1024, n_threads=2) as eng:
        for messages in ([{"role": "user", "content": PROMPT}], [{"role": "user", "content": "What is a closure?"}]):
            prompt = eng.apply_chat_template(messages)
            ours = eng.run(prompt, max_tokens=n)
            ref = llama_cpp.Llama(str(qwen05_path), n_ctx=1024, n_threads=2, verbose=False)
            theirs = ref.create_completion(prompt, max_tokens=ours.stats.n_generated, temperature=0.0)
            ref.close()
            assert ours.text == theirs["choices"][0]["text"]
            raw = eng.run("def fibonacci(n):", max_tokens=24)
            ref = llama_cpp.Llama(str(qwen05_path), n_ctx=1024, n_threads=2, verbose=False)
            assert raw.text == ref.create_completion("def fibonacci(n):", max_tokens=raw.stats.n_generated, temperature=0.0)["choices"][0]["text"]
            ref.close()


def test_generate_cli_by_name_and_by_path(qwen05_path):
    r = eesd("generate", "--model", QWEN05, "--chat", "--prompt", PROMPT, "--temp", "0", "--max-tokens", "40", "--drafter", "lookup")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # the greedy text itself differs between CPU kernels at near ties: not pinned
    assert "tok/s" in r.stderr and "drafter lookup" in r.stderr
    r2 = eesd("generate", "--model", str(qwen05_path), "--chat", "--prompt", PROMPT, "--temp", "0", "--max-tokens", "40", "--drafter", "lookup")
    assert r2.returncode == 0 and r2.stdout == r.stdout


def _clean_error(r: subprocess.CompletedProcess[str], *needles: str) -> subprocess.CompletedProcess[str]:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    before, sep, _ = r.stderr.partition("eesd: error:")
    assert sep, r.stderr
    # only a download's progress line or the note of which drafter runs may come before it
    assert all(line.startswith(("pull ", "drafter: ")) for line in before.splitlines()), r.stderr
    for n in needles:
        assert n in r.stderr
    return r


def test_bad_inputs_give_one_clean_error(tmp_path, qwen05_path):
    _clean_error(eesd("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "x"), "not found", "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_text("hello, not a model")
    _clean_error(eesd("generate", "--model", str(junk), "--prompt", "x"), "not a GGUF")
    _clean_error(eesd("generate", "--model", "qwen-9000", "--prompt", "x"), "unknown model", "qwen2.5-coder-0.5b-instruct")
    _clean_error(eesd("models", "pull", "qwen-9000"), "unknown model")
    _clean_error(eesd("generate", "--model", QWEN05, "--ctx", "64", "--prompt", "word " * 200), "context")
    _clean_error(eesd("generate", "--model", QWEN05, "--prompt", "x", "--temp", "-1"), "temperature")
    _clean_error(eesd("generate", "--model", QWEN05, "--prompt", "x", "--top-p", "0"), "top_p")
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    _clean_error(eesd("generate", "--model", QWEN05, "--prompt", "x", env={"EESD_HOME": str(blocker)}), "cache directory")


def test_engine_option_errors_are_one_line(qwen05_path):
    r = _clean_error(eesd("generate", "--model", QWEN05, "--prompt", "x", "--drafter", "lookup", "--draft-max", "1000"),
                     "does not fit", "--draft-max 511")
    r = _clean_error(eesd("generate", "--model", QWEN05, "--prompt", "x", "--draft-max", "0"), "draft_max")
    assert "--max-draft" not in r.stderr  # a flag that does not exist


def test_prompt_that_is_not_utf8(qwen05_path):
    r = subprocess.run([sys.executable, "-m", "eesd_local.cli", "generate", "--model", QWEN05, "-p", "-", "-n", "2"],
                       input=b"def f():\xff\xfe", capture_output=True, timeout=600)
    assert r.returncode == 2 and b"Traceback" not in r.stderr and b"UTF-8" in r.stderr, r.stderr


def test_a_full_context_is_said(qwen05_path):
    r = eesd("generate", "--model", QWEN05, "--n-ctx", "10", "-n", "32", "--prompt", "def f(a, b):", "--drafter", "none")
    assert r.returncode == 0, r.stderr
    assert "[context]" in r.stderr and "context of 10 tokens is full" in r.stderr and "--n-ctx" in r.stderr


def test_old_flag_spellings_still_work(qwen05_path):
    r = eesd("generate", "--model", QWEN05, "--ctx", "256", "--threads", "2", "--temp", "0", "-n", "2", "--prompt", "def f():")
    assert r.returncode == 0, r.stderr


def test_models_list_shows_presence(qwen05_path):
    r = eesd("models", "list")
    assert r.returncode == 0
    assert "qwen2.5-coder-0.5b" in r.stdout and "yes" in r.stdout


def test_interrupt_is_clean(qwen05_path, tmp_path):
    """Ctrl-C mid-answer: exit 130, no traceback, no file left behind."""
    proc = subprocess.Popen([sys.executable, "-m", "eesd_local.cli", "generate", "--model", QWEN05, "--prompt", "def f(x):",
                             "--max-tokens", "400", "--drafter", "lookup"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    assert proc.stdout is not None
    proc.stdout.read(1)  # wait for the first streamed character
    while time.time() < deadline and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err


@pytest.mark.parametrize("cmd", [["--help"], ["generate", "--help"], ["models", "--help"], ["serve", "--help"]])
def test_help(cmd):
    r = eesd(*cmd)
    assert r.returncode == 0 and "usage" in r.stdout


def test_no_half_written_model_after_failed_pull(tmp_path):
    home = tmp_path / "home"
    r = eesd("models", "pull", QWEN05, env={"EESD_HOME": str(home), "EESD_INDEX_URL": "http://127.0.0.1:9/simple"}, timeout=60)
    _clean_error(r, "package index")
    assert not any(p.suffix == ".gguf" for p in Path(home).rglob("*"))


def test_every_engine_option_is_a_flag():
    """The engine flags map one-to-one onto EngineConfig (but the controller's seed)."""

    assert set(ENGINE_FLAGS) == {f.name for f in dataclasses.fields(EngineConfig)} - {"seed"}


def test_a_command_imports_only_its_own_module():
    """`eesd generate` builds its parser without the HTTP server, the bench or the training stack (they
    cost ~0.3 s before its first token); help and a mistyped command still list every command."""
    code = (
        "import sys\n"
        "from eesd_local.cli import build_parser\n"
        "p = build_parser(['generate', '--chat'])\n"
        "print(sorted(m for m in ('eesd_local.server', 'fastapi', 'eesd_local.tools.bench.runner', 'torch')"
        " if m in sys.modules))\n"
        "print(len(build_parser([])._subparsers._group_actions[0].choices))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]", out
    from eesd_local.cli import COMMANDS  # noqa: PLC0415 - the names the full parser must list

    assert int(out[1]) == len(COMMANDS)
