"""Weights that verify cheaply: B(k), requantisation (atomic, interruptible), registry variants,
and speculation staying lossless on a requantised model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp
import pytest

from eesd_local.api import load
from eesd_local.base.atomic import remove_stale_temps
from eesd_local.base.errors import EesdError
from eesd_local.cli import main
from eesd_local.gguf.tiny import write_tiny_gguf
from eesd_local.llama import catalog
from eesd_local.speculative.events import TokenEvent
from eesd_local.tools import registry, weights
from eesd_local.tools.bench.prompts import load_prompts

from .conftest import QWEN05

K_QUANTS = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def q4_home(tmp_path_factory, qwen05_path) -> Path:
    """An EESD_HOME holding the demo model (a link to the user's copy) and its q4_0 variant,
    built through the registry flow (about 6 s)."""
    home = tmp_path_factory.mktemp("eesd-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EESD_HOME", str(home))
        spec = catalog.get_spec(QWEN05)
        spec.path.parent.mkdir(parents=True, exist_ok=True)
        spec.path.symlink_to(qwen05_path)
        registry.pull_variant(QWEN05, "q4_0")
    return home


def _variant(home: Path) -> Path:
    return home / "models" / f"{Path(catalog.get_spec(QWEN05).file).stem}.q4_0.gguf"


# --- B(k) -------------------------------------------------------------------------------------


def test_batch_costs_on_the_tiny_model(tiny):
    (table,) = weights.batch_costs([tiny], [2, 4], repeats=2, prefix=16)
    assert sorted(table.ms) == [1, 2, 4]  # k = 1 is always measured: it is the unit
    assert table.ratios[1] == 1.0
    assert all(v > 0 for v in table.ms.values())
    js = table.to_json()
    assert set(js["B"]) == {"1", "2", "4"} and js["repeats"] == 2


def test_costs_command_writes_json(tiny, tmp_path, capsys):
    out = tmp_path / "costs.json"
    assert main(["models", "costs", str(tiny), "--max-k", "3", "--repeats", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert sorted(row["B"]) == ["1", "2", "3"] and row["name"] == str(tiny)


# --- requantisation mechanics (tiny model) ----------------------------------------------------


def test_requantize_tiny_to_each_variant(tiny, tmp_path):
    for kind in catalog.VARIANTS:
        out = weights.requantize(tiny, tmp_path / f"tiny.{kind}.gguf", kind)
        types = weights.tensor_types(out)
        assert kind.upper() in types and not K_QUANTS & set(types)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"tiny.{k}.gguf" for k in sorted(catalog.VARIANTS)]  # no temp file left
    with pytest.raises(EesdError, match="already exists"):
        weights.requantize(tiny, tmp_path / "tiny.q8_0.gguf", "q8_0")
    with pytest.raises(EesdError, match="unknown weight type"):
        weights.requantize(tiny, tmp_path / "x.gguf", "q4_k")


def test_stale_temp_files_are_removed(tiny, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".tiny.q8_0.gguf.tmp-{dead.pid}"
    stale.write_bytes(b"half a model")
    live = tmp_path / f".tiny.q8_0.gguf.tmp-{os.getppid()}"  # a running process's file stays
    live.write_bytes(b"in progress")
    weights.requantize(tiny, tmp_path / "tiny.q8_0.gguf", "q8_0")
    assert not stale.exists() and live.exists()


# --- registry variants --------------------------------------------------------------------------


def test_variant_names(isolated_home):
    assert catalog.split_variant(f"{QWEN05}:q4_0") == (QWEN05, "q4_0")
    assert catalog.split_variant("some/dir:x/model.gguf") == ("some/dir:x/model.gguf", None)
    with pytest.raises(EesdError, match="unknown weight type"):
        catalog.split_variant(f"{QWEN05}:q5_k")
    with pytest.raises(EesdError, match="not built yet"):
        registry.resolve_model(f"{QWEN05}:q8_0", pull_missing=False)


def test_registry_flow_builds_the_variant(q4_home, monkeypatch):
    monkeypatch.setenv("EESD_HOME", str(q4_home))
    spec = catalog.get_spec(QWEN05)
    path = registry.resolve_model(f"{QWEN05}:q4_0", pull_missing=False)
    assert path == _variant(q4_home)
    assert catalog.present_variants(spec) == ["q4_0"]
    assert catalog.registry_name_for(path) == f"{QWEN05}:q4_0"
    types = weights.tensor_types(path)
    assert not K_QUANTS & set(types) and types["Q8_0"] == 1  # the LM head stays Q8_0, every other matrix is Q4_0


# --- the requantised demo model -------------------------------------------------------------------


def test_variant_loads_in_plain_llama_cpp_python(q4_home):
    llm = llama_cpp.Llama(model_path=str(_variant(q4_home)), vocab_only=False, n_ctx=256, verbose=False)
    try:
        out = llm("def add(a, b):", max_tokens=8, temperature=0.0)
        assert out["choices"][0]["text"]
    finally:
        llm.close()


def test_speculation_stays_exact_on_the_variant(q4_home):
    path = _variant(q4_home)
    item = load_prompts("rewrite", n_per_category=2)[0]
    with load(str(path), drafter="none") as plain_eng, load(str(path), drafter="lookup") as spec_eng:
        prompt = plain_eng.tokenize(plain_eng.apply_chat_template([{"role": "user", "content": item.messages[0][1]}]))

        def tokens(eng) -> list[int]:
            return [ev.token for ev in eng.generate(prompt, max_tokens=64) if isinstance(ev, TokenEvent)]

        plain, spec = tokens(plain_eng), tokens(spec_eng)
    assert spec == plain


def _wait_for_temp(folder: Path, name: str, proc: subprocess.Popen, timeout: float = 60.0) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [p for p in folder.glob(f".{name}.tmp-*") if p.stat().st_size > 0]
        if found:
            return found[0]
        assert proc.poll() is None, "the requantisation ended before it could be interrupted"
        time.sleep(0.02)
    raise AssertionError("no temporary file appeared")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "term", "kill"])
def test_interrupted_requantisation_leaves_nothing(q4_home, qwen05_path, tmp_path, sig):
    out = tmp_path / "demo.q8_0.gguf"
    code = f"from eesd_local.tools.weights import requantize; requantize({str(qwen05_path)!r}, {str(out)!r}, 'q8_0')"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.DEVNULL)
    try:
        temp = _wait_for_temp(tmp_path, out.name, proc)
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not out.exists()
    if sig != signal.SIGKILL:
        assert list(tmp_path.iterdir()) == []  # the run removed its own temp file
        return
    time.sleep(0.5)  # the child dies with its parent (PR_SET_PDEATHSIG); its temp file is stale now
    assert remove_stale_temps(out.parent, out.name) == [temp]  # as the next write there does first
    assert list(tmp_path.iterdir()) == []
