"""Issue #14: the engine never answers wrong and never takes the process down.

Damaged files give one EesdError (fuzzed GGUF readers), a killed write leaves nothing behind
for long, Ctrl-C at any moment exits 130 without a traceback, and each bad input names itself.
Fast: the tiny synthetic GGUF stands in wherever a real model is not needed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from eesd_local import cli
from eesd_local.base.atomic import atomic_path, remove_stale_temps, write_text_atomic
from eesd_local.base.errors import EesdError
from eesd_local.base.interrupts import keep_interrupts
from eesd_local.base.paths import models_dir
from eesd_local.gguf import headfile
from eesd_local.gguf import reader as ggufread
from eesd_local.gguf.check import check_gguf
from eesd_local.gguf.tiny import write_tiny_gguf
from eesd_local.llama import catalog
from eesd_local.llama.runtime import Context, ContextParams, Model
from eesd_local.speculative.drafters import resolve_head
from eesd_local.tools import registry

SHIPPED_HEAD = models_dir() / "qwen2.5-coder-0.5b-instruct.exit6.gguf"
FUZZ_N = int(os.environ.get("EESD_FUZZ_N", "200"))  # cases per file; CI runs the default, more by hand
FUZZ_SEED = int(os.environ.get("EESD_FUZZ_SEED", "14"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_vocab=300, n_ctx=16384)


# --- fuzzing the GGUF and head readers ------------------------------------------------------


def mutants(data: bytes, header_end: int, n: int, seed: int):
    """``n`` damaged copies of ``data``: (label, bytes). Half truncations, half byte flips;
    most land in the header (metadata and tensor infos), where the reader's decisions are."""
    rng = random.Random(seed)
    for i in range(n):
        if i % 2 == 0:
            cut = rng.randrange(header_end + 64) if rng.random() < 0.8 else rng.randrange(len(data))
            yield f"truncate@{cut}", data[:cut]
        else:
            buf = bytearray(data)
            spots = []
            for _ in range(rng.choice((1, 1, 2, 4, 8))):
                at = rng.randrange(4, header_end)  # the magic is checked first; flips there are dull
                buf[at] ^= rng.choice((0x01, 0x80, 0xFF, rng.randrange(1, 256)))
                spots.append(at)
            yield f"flip@{','.join(map(str, spots))}", bytes(buf)


def parse_all(path: Path, head: bool) -> str:
    """Every Python reader over ``path``: 'ok' or 'EesdError'; anything else escapes (a bug)."""
    try:
        check_gguf(path, what="head" if head else "model")
        ggufread.read_header(path, keep_strings=("tokenizer.ggml.tokens",))
        if head:
            headfile.read_head_info(path)
            headfile.head_tensors(path)
        else:
            headfile.model_info(path)
    except EesdError as exc:
        assert exc.message and "\n" not in exc.message
        return "EesdError"
    return "ok"


@pytest.mark.parametrize("which", ["head", "tiny"])
def test_fuzzed_gguf_gives_eesd_error_or_a_valid_load(which, tiny, tmp_path, isolated_home):
    src = SHIPPED_HEAD if which == "head" else tiny
    data = src.read_bytes()
    header_end = ggufread.read_header(src).data_offset
    target = tmp_path / f"fuzz-{which}.gguf"
    outcomes: dict[str, int] = {}
    for label, blob in mutants(data, header_end, FUZZ_N, FUZZ_SEED):
        target.write_bytes(blob)
        try:
            got = parse_all(target, head=which == "head")
        except Exception as exc:  # the label and seed reproduce it
            raise AssertionError(f"{which} {label} (EESD_FUZZ_SEED={FUZZ_SEED}): {type(exc).__name__}: {exc}") from exc
        outcomes[got] = outcomes.get(got, 0) + 1
    assert outcomes.get("EesdError", 0) > FUZZ_N // 4, outcomes  # the damage is seen, not waved through


LOAD_BATCH = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from eesd_local.base.errors import EesdError
    from eesd_local.llama.runtime import Context, ContextParams, Model
    for path in map(Path, json.loads(sys.argv[1])):
        print("case", path.name, flush=True)
        try:
            model = Model(path)  # checks the file before llama.cpp reads it
            ctx = Context(model, ContextParams(n_ctx=64, n_batch=64, n_threads=1))
            ctx.decode(model.tokenize("hello"), n_logits=1)
            ctx.close()
            model.close()
            print("ok", flush=True)
        except EesdError as exc:
            print("EesdError", exc.message, flush=True)
""")


def load_in_subprocess(paths: list[str]) -> list[str]:
    """LOAD_BATCH over ``paths`` in a child process: 'ok' or 'EesdError' per file; an abort or a
    segfault fails the calling test (naming the file) instead of killing the test run."""
    r = subprocess.run([sys.executable, "-c", LOAD_BATCH, json.dumps(paths)], capture_output=True, text=True, timeout=600)
    lines = r.stdout.splitlines()
    last = next((line for line in reversed(lines) if line.startswith("case ")), "none")
    assert r.returncode == 0, f"died at {last} (rc {r.returncode}): {r.stderr[-2000:]}"
    results = [line.split()[0] for line in lines if not line.startswith("case ")]
    assert len(results) == len(paths) and set(results) <= {"ok", "EesdError"}
    return results


def test_fuzzed_gguf_never_crashes_llama_cpp(tiny, tmp_path, isolated_home):
    """The damaged files that reach llama.cpp (through check_gguf) load or fail cleanly."""
    data = tiny.read_bytes()
    header_end = ggufread.read_header(tiny).data_offset
    paths = []
    for i, (_, blob) in enumerate(mutants(data, header_end, max(40, FUZZ_N // 3), FUZZ_SEED + 1)):
        p = tmp_path / f"case{i:04d}.gguf"
        p.write_bytes(blob)
        paths.append(str(p))
    assert "EesdError" in load_in_subprocess(paths)


def test_extreme_hyperparameters_never_crash_llama_cpp(tiny, tmp_path, isolated_home):
    """Every numeric metadata value of the model set to 0, 1, -1, huge or NaN: llama.cpp asserts
    (aborting the process) on some, e.g. block_count 0 and a negative or NaN norm epsilon."""
    h = ggufread.read_header(tiny)
    data = tiny.read_bytes()
    extremes = {"<I": (0, 1, 2**31 - 1, 2**32 - 1), "<i": (0, -1, 2**31 - 1), "<Q": (0, 1, 2**64 - 1),
                "<q": (0, -1), "<f": (0.0, -1.0, float("nan"), 1e30)}
    paths, at = [], 24  # magic, version, n_tensors, n_kv
    for key, raw in h.kv_raw.items():
        n = struct.unpack_from("<Q", raw)[0]
        fmt = ggufread._SCALAR.get(struct.unpack_from("<I", raw, 8 + n)[0])
        for value in extremes.get(fmt, ()):
            blob = bytearray(data)
            struct.pack_into(fmt, blob, at + 8 + n + 4, value)
            p = tmp_path / f"{key}={value}.gguf"
            p.write_bytes(blob)
            paths.append(str(p))
        at += len(raw)
    assert len(paths) > 30
    results = load_in_subprocess(paths)
    assert "ok" in results and "EesdError" in results


def test_damaged_byte_token_is_refused_before_llama_cpp(tiny, tmp_path):
    """llama.cpp looks "<0x81>" up with unordered_map::at when it tokenizes "▁" (E2 96 81): a flipped
    byte token made it throw an uncaught C++ exception, which aborts the process."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(tiny.read_bytes().replace(b"<0x81>", b"=0x81>", 1))
    with pytest.raises(EesdError, match="byte tokens missing or malformed"):
        check_gguf(bad)


def test_truncated_model_is_refused_before_llama_cpp(tiny, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 2])
    with pytest.raises(EesdError, match="truncated"):
        check_gguf(cut)


# --- stale temporary files ------------------------------------------------------------------


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has this id (until the kernel reuses it)


def test_next_write_removes_temp_files_of_dead_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("EESD_HOME", str(tmp_path))  # a folder of the cache: every stale temp there goes
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = tmp_path / f".model.gguf.tmp-{dead_pid()}"
        stale.write_bytes(b"half a model")
        busy = tmp_path / f".other.gguf.tmp-{live.pid}"  # another process building a file right now
        busy.write_bytes(b"in progress")
        mine = tmp_path / f".mine.tmp-{os.getpid()}"
        mine.write_bytes(b"ours")
        unrelated = tmp_path / "notes.tmp-12"  # not hidden: not a name atomic_path writes
        unrelated.write_text("keep")
        write_text_atomic(tmp_path / "index.json", "{}")
        assert not stale.exists()
        assert busy.exists() and mine.exists() and unrelated.exists()
        assert (tmp_path / "index.json").read_text() == "{}"
    finally:
        live.kill()
        live.wait()
    assert remove_stale_temps(tmp_path) == [busy]  # its process is gone now


def test_outside_the_cache_only_temps_of_the_same_output_go(tmp_path, isolated_home):
    dead = dead_pid()
    ours, other = tmp_path / f".chat.md.tmp-{dead}", tmp_path / f".notes.txt.tmp-{dead}"  # a user's folder
    ours.write_text("x")
    other.write_text("another tool's, maybe")
    write_text_atomic(tmp_path / "chat.md", "# chat")
    assert not ours.exists() and other.exists()


def test_a_write_in_progress_survives_another_write(tmp_path):
    with atomic_path(tmp_path / "a.gguf") as tmp_a:
        tmp_a.write_bytes(b"a")
        write_text_atomic(tmp_path / "b.json", "b")  # the sweep runs, and leaves our own file alone
        assert tmp_a.exists()
    assert (tmp_path / "a.gguf").read_bytes() == b"a"


def test_a_pull_killed_while_assembling_is_cleaned_up_by_the_next_run(tmp_path, isolated_home):
    models = isolated_home / "models"
    code = textwrap.dedent(f"""
        import os, sys, time
        from eesd_local.base.atomic import atomic_path
        with atomic_path({str(models / "m.gguf")!r}) as tmp:
            tmp.write_bytes(b"x" * 1000)
            print("writing", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)  # no finally runs: the temporary file stays
    proc.wait()
    left = list(models.glob(".m.gguf.tmp-*"))
    assert len(left) == 1
    with pytest.raises(EesdError):
        registry.pull("no-such-model")  # any pull ... (this one fails at once)
    assert left[0].exists()
    write_text_atomic(models / "other.txt", "x")  # ... or any write into the folder sweeps it
    assert not left[0].exists()


def test_pull_sweeps_the_models_folder(isolated_home, monkeypatch):
    spec = next(iter(catalog.known_models().values()))
    stale = spec.path.parent / f".{spec.file}.tmp-{dead_pid()}"
    stale.write_bytes(b"x")
    monkeypatch.setattr(registry, "is_present", lambda s: True)  # nothing to download: the sweep alone
    registry.pull(spec.name)
    assert not stale.exists()


# --- Ctrl-C ---------------------------------------------------------------------------------


class Launched:
    """A console script (``.venv/bin/eesd``, what a user runs) started with CPython's import timing on:
    its stderr says when ``site`` has been imported, the end of the interpreter's own start-up and the
    first moment of the program (the wrapper pip writes, then eesd_local.startup). A Ctrl-C before that is
    CPython's (death by the signal, or "init_import_site"), not ours to report: the delays count from it."""

    def __init__(self, argv: list[str]) -> None:
        script = Path(sys.executable).parent / argv[0]
        env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
        self.proc = subprocess.Popen([str(script), *argv[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.err: list[str] = []
        self.out: list[str] = []
        self.site = threading.Event()
        self.answering = threading.Event()
        threading.Thread(target=self._read_err, daemon=True).start()
        threading.Thread(target=self._read_out, daemon=True).start()

    def _read_err(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            if line.startswith("import time:"):
                if line.rstrip().endswith("| site"):
                    self.site.set()
                continue
            self.err.append(line)

    def _read_out(self) -> None:
        while chunk := self.proc.stdout.read(1):  # type: ignore[union-attr]
            self.out.append(chunk)
            self.answering.set()

    def interrupt(self, after: threading.Event, delay: float) -> str:
        """Two SIGINTs 30 ms apart, ``delay`` s after ``after``; the process's own lines on stderr."""
        assert after.wait(120), "".join(self.err)
        time.sleep(delay)
        for _ in range(2):
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)
            time.sleep(0.03)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"still running 120 s after two SIGINTs: {''.join(self.err)[-2000:]}")
        time.sleep(0.2)  # the reader threads drain the pipes
        return "".join(self.err)


# from 10 ms: the first ~1 ms after site is pip's wrapper (its RESUME, `import re`, `from eesd_local.startup import`),
# where an interrupt is raised at the script's line 0, before any line of ours
STARTUP_DELAYS = [0.01, 0.015, 0.02, 0.03, 0.05, 0.08, 0.12, 0.2, 0.3, 0.5]


@pytest.mark.parametrize("command", ["eesd", "eesd-chat"])
def test_ctrl_c_at_any_moment_of_start_up_is_one_line_and_130(command, tiny, isolated_home):
    """Two SIGINTs at steps from the program's first moment (imports of argparse, Textual, numpy, numba and
    llama.cpp, loading): one line, exit 130, never a traceback. Neither command can finish first: the answer
    is a whole 16384-token context, the chat waits for input."""
    prog = ["eesd", "generate", "--model", str(tiny), "--prompt", "hello", "--max-tokens", "100000", "--ctx", "16384"] \
        if command == "eesd" else ["eesd-chat", str(tiny)]
    for delay in STARTUP_DELAYS:
        run = Launched(prog)
        err = run.interrupt(run.site, delay)
        assert "Traceback" not in err and "Fatal Python error" not in err and "Exception ignored" not in err, (delay, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines[-1:] == [f"{command}: interrupted"] and run.proc.returncode == 130, (delay, run.proc.returncode, err)


@pytest.mark.parametrize("delay", [0.0, 0.1, 0.5])
def test_ctrl_c_mid_answer_is_clean(delay, tiny, isolated_home):
    """Two SIGINTs while the answer streams (``delay`` s after its first character): the answer stops with one
    line and 130. It cannot have finished: it is a whole 16384-token context."""
    run = Launched(["eesd", "generate", "--model", str(tiny), "--prompt", "hello", "--drafter", "lookup",
                    "--max-tokens", "100000", "--ctx", "16384"])
    err = run.interrupt(run.answering, delay)
    assert "Traceback" not in err and "tok/s" not in err, err
    assert "eesd: interrupted" in err or "[interrupted]" in err, err
    assert run.proc.returncode == 130, (run.proc.returncode, err)


def test_an_interrupt_inside_a_ctypes_callback_is_raised_again_without_a_traceback(monkeypatch, capsys):
    """CPython prints and swallows an exception raised in a ctypes callback (llvmlite's while numba
    compiles, llama.cpp's log): a Ctrl-C that lands there must still stop the program, silently."""

    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    keep_interrupts()

    def callback() -> None:
        signal.raise_signal(signal.SIGINT)  # Python's handler raises KeyboardInterrupt here, inside the callback
        time.sleep(0.01)

    calls = ctypes.CFUNCTYPE(None)(callback)
    never = threading.Event()
    with pytest.raises(KeyboardInterrupt):
        calls()  # returns normally: ctypes swallowed the interrupt
        never.wait(60)  # ... and it is raised again here (a signal ends the wait)
        pytest.fail("the interrupt swallowed by the callback was never raised again")
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert sys.unraisablehook.__name__ == "_redeliver_interrupts"  # the command line installs it


def test_a_ctrl_c_while_numba_compiles_is_held_until_it_has_compiled():
    """A SIGINT landing while Numba holds its compiler lock (compiling, or loading a kernel from the cache) would
    be raised inside llvmlite's ctypes callbacks, whose C side then goes on with what the callback never returned:
    eesd-chat segfaulted 1 in ~150 Ctrl-Cs while loading. jitcache.HoldSignals holds it until the lock is
    released, then raises it: the kernel is whole, the interrupt comes after."""
    pytest.importorskip("numba")
    from numba.core import event  # noqa: PLC0415 - after importorskip

    from eesd_local.speculative.controllers import jitcache  # noqa: PLC0415 - after importorskip

    assert not event._registered["numba:compiler_lock"]  # HoldSignals listens only while a kernel compiles

    class CtrlC(event.Listener):  # registered before HoldSignals, so its on_end runs first: inside the held span
        fired = 0

        def on_start(self, ev):
            pass

        def on_end(self, ev):
            if not self.fired:
                self.fired += 1
                signal.raise_signal(signal.SIGINT)

    def twice(x):
        return 2 * x

    twice = jitcache.kernel(twice)
    before = signal.getsignal(signal.SIGINT)
    ctrl_c = CtrlC()
    event.register("numba:compiler_lock", ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            twice(21)  # compiles; the held interrupt is raised once the lock is released
    finally:
        event.unregister("numba:compiler_lock", ctrl_c)
    assert ctrl_c.fired == 1 and twice.signatures and twice(21) == 42  # compiled whole, before the interrupt
    assert signal.getsignal(signal.SIGINT) is before
    assert not event._registered["numba:compiler_lock"]


def test_a_ctrl_c_while_numba_imports_its_c_extensions_is_one_line_and_130(tiny, isolated_home):
    """numba._dispatcher imports numba._devicearray from C; a KeyboardInterrupt there is printed by Numba itself
    (PyErr_Print: a traceback) and replaced by "ImportError: numba._devicearray failed to import", which no
    handler of ours knew as an interrupt (seen in CI at 0.3 s into `eesd generate`). Here the Ctrl-C is raised
    exactly there, by an import hook: jitcache holds signals while Numba imports, and delivers it after."""
    hook = """
import signal, sys
class CtrlCAtDevicearray:
    def find_spec(self, name, path=None, target=None):
        if name == "numba._devicearray":
            sys.meta_path.remove(self)
            signal.raise_signal(signal.SIGINT)
        return None
sys.meta_path.insert(0, CtrlCAtDevicearray())
sys.argv = ["eesd", "generate", "--model", sys.argv[1], "--prompt", "hello", "--max-tokens", "4"]
from eesd_local.startup import eesd
sys.exit(eesd())
"""
    run = subprocess.run([sys.executable, "-c", hook, str(tiny)], capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert "Traceback" not in run.stderr and "failed to import" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines[-1:] == ["eesd: interrupted"] and run.returncode == 130, (run.returncode, run.stderr)


# --- bad input names itself -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tiny):
    model = Model(tiny)
    yield model
    model.close()


def test_prompt_with_undecodable_bytes(tiny_model):
    text = "def f():" + b"\xff\xfe".decode("utf-8", "surrogateescape") + " pass"  # how argv and stdin arrive
    with pytest.raises(EesdError) as err:
        tiny_model.tokenize(text)
    assert "not valid UTF-8" in err.value.message and "byte 0xff at character 8" in err.value.message
    assert err.value.hint and "UTF-8" in err.value.hint
    with pytest.raises(EesdError, match=r"lone surrogate U\+D800 at character 1"):
        tiny_model.tokenize("a\ud800b")


def test_prompt_with_undecodable_bytes_from_argv(tiny, isolated_home):
    r = subprocess.run([sys.executable, "-m", "eesd_local.cli", "generate", "--model", str(tiny), "--drafter", "lookup",
                        "--prompt", os.fsdecode(b"caf\xe9 au lait"), "--max-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "not valid UTF-8 text: byte 0xe9 at character 3" in r.stderr


@pytest.mark.parametrize("io_encoding", [
    None,  # this machine's default: Python reads stdin with surrogateescape in a C or C.UTF-8 locale
    "utf-8:strict",
])
def test_prompt_with_undecodable_bytes_from_stdin(tiny, isolated_home, io_encoding):
    env = {**os.environ, **({"PYTHONIOENCODING": io_encoding} if io_encoding else {})}
    r = subprocess.run([sys.executable, "-m", "eesd_local.cli", "generate", "--model", str(tiny), "--drafter", "lookup",
                        "--prompt", "-", "--max-tokens", "4"], input=b"caf\xe9 au lait", capture_output=True, timeout=300, env=env)
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err, err
    assert "not valid UTF-8 text: byte 0xe9 at character 3" in err


@pytest.mark.parametrize("n_ctx", [0, -1])
def test_ctx_must_be_positive(tiny_model, n_ctx):
    with pytest.raises(EesdError, match="--n-ctx must be a positive number of tokens"):
        Context(tiny_model, ContextParams(n_ctx=n_ctx))


def test_ctx_negative_from_the_cli(tiny, isolated_home):
    r = subprocess.run([sys.executable, "-m", "eesd_local.cli", "generate", "--model", str(tiny), "--drafter", "lookup",
                        "--prompt", "x", "--ctx", "-1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "n_ctx must be an integer from 1 to 2147483647, got -1" in r.stderr and "smaller --ctx" not in r.stderr
    assert "--n-ctx 4096" in r.stderr  # the hint names the flag


@pytest.mark.parametrize("bad", [-1, 300, 10**9])
def test_token_ids_out_of_range(tiny_model, bad):
    ctx = Context(tiny_model, ContextParams(n_ctx=64, n_threads=1))
    try:
        with pytest.raises(EesdError, match=f"token id {bad} \\(position 2 of 3\\).*0 to 299"):
            ctx.decode([1, 5, bad])
        assert ctx.n_past == 0  # nothing was decoded
        ctx.decode([1, 5, 299])  # the highest id is fine
        assert ctx.n_past == 3
    finally:
        ctx.close()


def test_token_ids_out_of_range_in_the_vocabulary_calls(tiny_model):
    """llama.cpp's token_to_piece and is_eog abort the process on an id outside the vocabulary."""
    for call in (tiny_model.token_to_piece, tiny_model.is_eog, lambda t: tiny_model.detokenize([5, t])):
        with pytest.raises(EesdError, match="token id 300 is not in the vocabulary"):
            call(300)
    assert tiny_model.detokenize([299]) and not tiny_model.is_eog(299)


def test_missing_head_says_pass_a_head_path(tiny, isolated_home, tmp_path):
    with pytest.raises(EesdError) as err:
        resolve_head(str(tmp_path / "missing.gguf"))
    assert "exit-head file not found" in err.value.message
    assert "pass an exit-head GGUF path" in err.value.hint and "eesd models list" not in err.value.hint
    with pytest.raises(EesdError) as err:
        check_gguf(tmp_path / "missing.gguf")  # a model keeps its hint
    assert "registry name" in err.value.hint
