"""Shared fixtures: the real demo models (from the user cache, pulled if missing) and
an isolated EESD_HOME for tests that write to the cache.

Tiers: a test that loads a real demo model is marked ``model`` (by hand, or here when it uses a
demo-model fixture or names a demo model); ``pytest -m "not model"`` is the fast tier, and a
fast-tier test that loads a real model anyway fails (:func:`_fast_tier_loads_tiny_models_only`)."""

from __future__ import annotations

import inspect
import os
import signal
from pathlib import Path

import pytest

# a suite started in the background by a script (`bash scripts/test.sh &`) inherits SIGINT ignored, and
# every process it starts would too: the Ctrl-C tests then see their SIGINT dropped. Handling it here
# (Python's own handler) gives the children SIGINT's default back across exec.
signal.signal(signal.SIGINT, signal.default_int_handler)

# set before llama.cpp loads: idle OpenMP threads sleep instead of spinning, which keeps
# tests fair on a shared machine (results are the same either way)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from eesd_local.llama import runtime  # noqa: E402
from eesd_local.tools import registry  # noqa: E402

# llama.cpp's model defaults made safe on AMX CPUs for the tests' llama_cpp.Llama loads too
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
    return home


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("NUMBA_CACHE_DIR", str(Path.home() / ".cache" / "eesd-local" / "numba"))


DEMO_FIXTURES = {"qwen05_path", "gemma_path"}
DEMO_NAMES = (QWEN05, QWEN15, GEMMA, "QWEN05", "QWEN15", "GEMMA", "DEFAULT_MODEL")
TINY_BYTES = 32 << 20  # the synthetic models of gguf.tiny are a few MB; the smallest demo model is 253 MB


def _names_a_demo_model(item: pytest.Item) -> bool:
    try:
        source = inspect.getsource(item.function)  # type: ignore[attr-defined]
    except (AttributeError, OSError, TypeError):
        return False
    return any(name in source for name in DEMO_NAMES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if DEMO_FIXTURES & set(getattr(item, "fixturenames", ())) or _names_a_demo_model(item):
            item.add_marker(pytest.mark.model)


@pytest.fixture(autouse=True)
def _fast_tier_loads_tiny_models_only(request, monkeypatch):
    """Outside the model tier, loading a real model in the test process is a failure: the fast
    tier must stay fast (tiny synthetic GGUFs only)."""
    if request.node.get_closest_marker("model") is not None:
        return
    load = runtime.Model.__init__

    def tiny_only(self, path, *args, **kw):
        size = Path(path).stat().st_size if Path(path).is_file() else 0
        if size > TINY_BYTES:
            pytest.fail(f"a fast-tier test loaded {Path(path).name} ({size >> 20} MB): mark it `model` or use gguf.tiny")
        load(self, path, *args, **kw)

    monkeypatch.setattr(runtime.Model, "__init__", tiny_only)
