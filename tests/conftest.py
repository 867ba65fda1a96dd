"""Shared fixtures: the real demo models (from the user cache, pulled if missing) and
an isolated EESD_HOME for tests that write to the cache.

Tiers: a test that loads a real demo model is marked ``model`` (by hand, or here when it uses a
demo-model fixture); ``pytest -m "not model"`` is the fast tier, and a fast-tier run that loads a
real model anyway fails (pytest_configure): a missing mark cannot hide."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

# a suite started in the background by a script (`bash scripts/test.sh &`) inherits SIGINT ignored, and
# every process it starts would too: the Ctrl-C tests then see their SIGINT dropped. Handling it here
# (Python's own handler) gives the children SIGINT's default back across exec.
signal.signal(signal.SIGINT, signal.default_int_handler)

# set before llama.cpp loads: idle OpenMP threads sleep instead of spinning, which keeps
# tests fair on a shared machine (results are the same either way)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from eesd_local.llama import costs, machine, runtime  # noqa: E402
from eesd_local.tools import registry  # noqa: E402

# llama.cpp's model defaults made safe on AMX CPUs for the tests' llama_cpp.Llama loads too (and the kernels'
# choice file named: pytest_configure moves it into the session's own costs folder)
_CHOICE_FILE_GIVEN = "GGML_CPU_EXACT_CHOICE_FILE" in os.environ
runtime.setup_process()

QWEN05 = "qwen2.5-coder-0.5b-instruct"
QWEN15 = "qwen2.5-coder-1.5b-instruct"
GEMMA = "gemma-3-270m"


def _model(name: str) -> Path:
    return registry.resolve_model(name)  # pulls into the user cache when missing


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    return _model(QWEN05)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    return _model(GEMMA)


@pytest.fixture
def isolated_home(tmp_path, monkeypatch) -> Path:
    """A private EESD_HOME so a test never touches the user's cache."""
    home = tmp_path / "eesd-home"
    monkeypatch.setenv("EESD_HOME", str(home))
    monkeypatch.delenv("EESD_COSTS_DIR", raising=False)  # profiles in that home's costs/, as a user's
    return home


DEMO_FIXTURES = {"qwen05_path", "gemma_path"}
TINY_BYTES = 32 << 20  # the synthetic models of gguf.tiny are a few MB; the smallest demo model is 253 MB


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # a test that takes a demo model's fixture is in the model tier; any other test that loads a real model
    # says so with @pytest.mark.model (the fast tier fails a test that loads one without it: pytest_configure)
    for item in items:
        if DEMO_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


def _tiny_only(load):
    def tiny_only(self, path, *args, **kw):
        size = Path(path).stat().st_size if Path(path).is_file() else 0
        if size > TINY_BYTES:
            pytest.fail(f"the fast tier loaded {Path(path).name} ({size >> 20} MB): mark the test `model` or use gguf.tiny")
        load(self, path, *args, **kw)

    return tiny_only


_SESSION_COSTS = [""]  # the cost-profile folder this session made, removed at its end


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_COSTS[0]:
        shutil.rmtree(_SESSION_COSTS[0], ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("NUMBA_CACHE_DIR", str(Path.home() / ".cache" / "eesd-local" / "numba"))
    # cost profiles timed while the suite runs (servers, subprocesses beside the test) are not this machine's
    # batch costs: the session keeps its own, so that none becomes the user's kept profile (one measured so,
    # t(1) 3.4x the quiet figure, once made `auto` draft on every chat prompt of a later bench)
    if "EESD_COSTS_DIR" not in os.environ:
        os.environ["EESD_COSTS_DIR"] = _SESSION_COSTS[0] = tempfile.mkdtemp(prefix="eesd-test-costs-")
    if not _CHOICE_FILE_GIVEN:
        # kernel choices timed beside other tests are not this machine's either: the session's own file
        os.environ["GGML_CPU_EXACT_CHOICE_FILE"] = str(machine.kernel_choice_path())
    if config.getoption("markexpr", "").replace(" ", "") in ("notmodel", "(notmodel)"):
        # the fast tier must stay fast: loading a real model in the test process fails the test
        runtime.Model.__init__ = _tiny_only(runtime.Model.__init__)


class FakeModel:
    def __init__(self, path: Path) -> None:
        self.path = path


@pytest.fixture
def fake(tmp_path, isolated_home, monkeypatch):
    """(a model stand-in, the n_threads of each cost measurement): costs.measure is a fake that counts its calls."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    calls = []

    def measure(model, *, n_threads, ks=costs.KS, repeats=costs.REPEATS, progress=None):
        calls.append(n_threads)
        return 20.0, {k: 1.0 + 0.8 * (k - 1) for k in ks}, True

    monkeypatch.setattr(costs, "measure", measure)
    return FakeModel(gguf), calls
