"""Shared fixtures: the real demo models (from the user cache, pulled if missing) and
an isolated EESD_HOME for tests that write to the cache."""

from __future__ import annotations

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

# importing runtime makes llama.cpp's model defaults safe on AMX CPUs, for llama_cpp.Llama too
from eesd_local.tools import registry
from eesd_local.llama import runtime  # noqa: E402,F401

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
