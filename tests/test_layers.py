"""The package's shape, checked in fresh interpreters: importing changes nothing in the process,
`eesd --help` does not need the training stack, and each layer imports on its own (the import
contracts themselves run as `lint-imports` in scripts/test.sh)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LAYERS = ["eesd_local.gguf", "eesd_local.llama", "eesd_local.speculative", "eesd_local.tools", "eesd_local.api",
          "eesd_local.server", "eesd_local.cli", "eesd_chat.app"]


def _run(code: str) -> str:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


def test_importing_everything_changes_nothing_in_the_process():
    code = """
import importlib, json, pkgutil, signal, sys
import llama_cpp, llama_cpp.llama_cpp as raw
from numba.core import caching, event
listeners = lambda: {kind: list(ls) for kind, ls in event._registered.items() if ls}
before = (raw.llama_model_default_params, list(caching.CompileResultCacheImpl._locator_classes), listeners(),
          signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook, sys.excepthook)
import eesd_local, eesd_chat
for pkg in (eesd_local, eesd_chat):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
from eesd_local.llama import memtune
after = (raw.llama_model_default_params, list(caching.CompileResultCacheImpl._locator_classes), listeners(),
         signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook, sys.excepthook)
print(json.dumps({"defaults": before[0] is after[0] and llama_cpp.llama_model_default_params is before[0],
                  "locators": before[1] == after[1], "listeners": [repr(x) for x in after[2].items() if x not in before[2].items()],
                  "handlers": before[3:] == after[3:], "malloc": memtune._done}))
"""
    # no Numba event listener (jitcache's HoldSignals listens only while a kernel compiles), no signal
    # handler or hook: a program that imports eesd_local keeps its own
    assert json.loads(_run(code)) == {"defaults": True, "locators": True, "listeners": [], "handlers": True, "malloc": False}


def test_the_first_model_makes_the_process_settings():
    code = """
import json
import llama_cpp.llama_cpp as raw
from eesd_local.llama import runtime
runtime.setup_process()
print(json.dumps(getattr(raw.llama_model_default_params, "_eesd_guarded", False)))
"""
    assert json.loads(_run(code)) is True


def test_eesd_help_does_not_import_the_training_stack():
    code = """
import json, sys
from eesd_local.cli import build_parser
build_parser().format_help()
print(json.dumps(sorted(m for m in ("torch", "transformers", "matplotlib") if m in sys.modules)))
"""
    assert json.loads(_run(code)) == []


@pytest.mark.parametrize("module", LAYERS)
def test_each_layer_imports_on_its_own(module):
    assert _run(f"import {module}; print('ok')") == "ok"
