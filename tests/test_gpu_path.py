"""The GPU path before a GPU is at hand (issue 44, part 1): every layer offloaded to a non-CPU backend.

Run by ``bash scripts/test.sh gpu-path`` (scripts/gpu_path.sh), which builds llama-cpp-python with llama.cpp's
Vulkan backend into its own environment (build/gpu-path/venv), this project's extension against that
libllama, and runs this file there on lavapipe (Mesa's Vulkan device on the CPU) with EESD_GPU_PATH=1.
Everywhere else it is skipped (the model tier collects it and skips it): the CPU build has no device to
offload to. On a machine with a real GPU the same file runs there as it is (scripts/gpu_check.sh).

What it checks on that backend, with the 0.5B demo model and every layer offloaded (n_gpu_layers=-1):
every drafter answers (none, lookup, eesd on the shared trunk and as a copy, auto, draft-model,
hierarchical); greedy output equals plain decoding's on the same backend, or differs only at a near tie
of the target's two best tokens while the engine says ``exact: false`` and why (a GPU's kernels change
with the batch size); the KV cache after rejected drafts holds no stale cell (a drafter whose every
draft is wrong, then the next token's logits against a fresh prefill's, with a planted stale cell as
the control that the comparison catches one); the cost profile is kept per backend and device and the
exit head's verdict reads it; ``eesd bench`` runs and writes its projection beside the measured speedup.
Few tokens each: lavapipe is slow (a token of the 0.5B costs tens of milliseconds to a second there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

import eesd_local
from eesd_local.gguf.tiny import write_tiny_gguf
from eesd_local.llama import costs, ggmlapi, native, runtime, trunk
from eesd_local.llama.runtime import Context, ContextParams, Model
from eesd_local.speculative.drafters import DrafterBase, auto_head, placement
from eesd_local.speculative.drafters.base import SRC_ANY, Proposal
from eesd_local.speculative.events import FinishEvent, TokenEvent

from .conftest import QWEN05

ACTIVE = bool(os.environ.get("EESD_GPU_PATH"))
pytestmark = [pytest.mark.gpu_path, pytest.mark.model,
              pytest.mark.skipif(not ACTIVE, reason="the GPU path runs in its own environment: bash scripts/test.sh gpu-path")]

MAX = 12  # tokens per answer
N_CTX = 1024
ALL = -1  # n_gpu_layers: every layer offloaded
TIE = 0.5  # logits: an answer may leave plain decoding's only where the target's two best were this close
PROMPTS = {
    # an edit: the answer copies the code, so lookup drafts (and has drafts rejected where the edit is)
    "edit": [{"role": "user", "content": "Rename n to count in this function and change nothing else:\n"
              "def total(n):\n    s = 0\n    for i in range(n):\n        s += i * i\n    return s\n"}],
    "chat": [{"role": "user", "content": "Write a Python function that reverses a string."}],
}
DRAFTERS = {  # name: engine options (fixed draft lengths: every drafter drafts every round it can)
    "none": dict(drafter="none"),
    "lookup": dict(drafter="lookup", controller="fixed:4"),
    "eesd": dict(drafter="eesd", controller="fixed:3"),  # the shared trunk: the target split on the device
    "eesd-copy": dict(drafter="eesd", shared_trunk=False, controller="fixed:3"),
    "auto": dict(drafter="auto"),
    "draft-model": dict(drafter="draft-model", draft_model=QWEN05, controller="fixed:3"),
    "hierarchical": dict(drafter="hierarchical", controller="fixed:3"),
}


def _tokens(eng, messages) -> list[int]:
    return eng.tokenize(eng.apply_chat_template(messages))


def _answer(eng, prompt: list[int], max_tokens: int = MAX) -> tuple[list[int], FinishEvent]:
    toks, fin = [], None
    for ev in eng.generate(prompt, max_tokens=max_tokens, temperature=0.0):
        if isinstance(ev, TokenEvent):
            toks.append(ev.token)
        elif isinstance(ev, FinishEvent):
            fin = ev
    assert fin is not None
    return toks, fin


def _top2_gap(model, tokens: list[int]) -> float:
    """The target's best logit over its second best after ``tokens`` (one fresh prefill on the device)."""
    ctx = Context(model, ContextParams(n_ctx=N_CTX, n_threads=runtime.default_threads()))
    try:
        ctx.decode(tokens)
        top = np.sort(ctx.logits().astype(np.float64))[-2:]
        return float(top[1] - top[0])
    finally:
        ctx.close()


@pytest.fixture(scope="module")
def devices() -> list[str]:
    """The environment is what it says: a non-CPU device to offload to, and one libllama in the process."""
    found = ggmlapi.offload_devices()
    assert found, ("EESD_GPU_PATH is set but llama.cpp has no device to offload to: is this the gpu-path "
                   "environment (build/gpu-path/venv), and is GGML_VK_VISIBLE_DEVICES naming lavapipe?")
    assert native.load()[0] is not None, native.load()[1]
    maps = Path("/proc/self/maps")
    if maps.is_file():  # the extension runs on the same libllama as llama_cpp's ctypes (the device build's)
        libs = {ln.split()[-1] for ln in maps.read_text().splitlines() if ln.rstrip().endswith(".so") or "libllama.so" in ln}
        libllama = {p for p in libs if Path(p).name.startswith("libllama.so")}
        assert len({str(Path(p).resolve()) for p in libllama}) == 1, libllama
    return found


@pytest.fixture(scope="module")
def plain(devices):
    """Plain decoding on the device: the engine (kept open for the near-tie checks) and each prompt's answer."""
    eng = eesd_local.load(QWEN05, drafter="none", n_gpu_layers=ALL, n_ctx=N_CTX)
    try:
        yield eng, {name: _answer(eng, _tokens(eng, msgs))[0] for name, msgs in PROMPTS.items()}
    finally:
        eng.close()


def test_the_engine_says_it_is_not_exact_and_why(devices, plain):
    eng, _ = plain
    assert runtime.exactness(draft_max=8, n_gpu_layers=ALL) == (False, runtime.NOT_EXACT["gpu"])
    assert eng.exact is False and eng.exact_note == runtime.NOT_EXACT["gpu"]
    out = eng.create_chat_completion(PROMPTS["chat"], max_tokens=4, temperature=0)
    assert out["speculation"]["exact"] is False  # the API says it too
    # and no layer offloaded, in the same process and build: the CPU's batch-invariant kernels, exact again
    assert runtime.exactness(draft_max=8, n_gpu_layers=0)[0] is True


def test_no_layer_offloaded_keeps_every_op_on_the_cpu(devices, tmp_path):
    """With n_gpu_layers=0 in a build that has a GPU backend, llama.cpp's default still sends batches of 32 rows
    or more to the device (op_offload); the engine keeps them on the CPU's batch-invariant kernels, so a batch
    of 40 rows gives each row's logits bit for bit as that token decoded alone, and exactness() holds there."""
    model = Model(write_tiny_gguf(tmp_path / "tiny.gguf", n_embd=128, n_ff=256), n_gpu_layers=0)
    toks = [300 + (7 * i) % 200 for i in range(40)]
    try:
        batch = Context(model, ContextParams(n_ctx=256, n_batch=64, n_threads=2))
        batch.decode(toks, n_logits=len(toks))
        rows = [batch.logits(i).copy() for i in range(len(toks))]
        batch.close()
        one = Context(model, ContextParams(n_ctx=256, n_batch=64, n_threads=2))
        for i, t in enumerate(toks):
            one.decode([t])
            assert np.array_equal(one.logits(), rows[i]), f"row {i} of a 40-row batch is not the token decoded alone"
        one.close()
    finally:
        model.close()
    assert runtime.exactness(draft_max=64, n_gpu_layers=0)[0] is True


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_every_drafter_answers_as_plain_decoding_or_at_a_near_tie(plain, name):
    ref_eng, ref = plain
    drafted = 0
    with eesd_local.load(QWEN05, n_gpu_layers=ALL, n_ctx=N_CTX, **DRAFTERS[name]) as eng:
        assert eng.exact is False and eng.exact_note == runtime.NOT_EXACT["gpu"]
        if name == "eesd":
            assert isinstance(eng.ctx, trunk.SplitTarget), "eesd runs on the shared trunk on this backend too"
        for pname, msgs in PROMPTS.items():
            prompt = _tokens(eng, msgs)
            got, fin = _answer(eng, prompt)
            assert got and fin.stats.n_generated == len(got), f"{name} wrote nothing for {pname}"
            assert fin.stats.exact is False
            drafted += fin.stats.n_drafted
            want = ref[pname]
            if got != want:
                i = next(i for i, (a, b) in enumerate(zip(got + [-1], want + [-1])) if a != b)
                gap = _top2_gap(ref_eng.model, prompt + want[:i])
                assert gap < TIE, (f"{name}: {pname} leaves plain decoding at token {i}, where the target's two best "
                                   f"logits are {gap:.3f} apart: not a near tie, a wrong answer")
                print(f"{name}: {pname} leaves plain decoding at token {i}, a near tie (gap {gap:.3f})")  # -rA shows it
            if hasattr(eng.ctx, "trunk"):
                assert eng.ctx.trunk.n_past == eng.ctx.tail.n_past  # the split target rolled back together
    if name != "none" and name != "auto":  # auto drafts where it pays (lookup on the edit, maybe nothing else)
        assert drafted > 0, f"{name} never drafted: the test would test nothing"


class _Wrong(DrafterBase):
    """Drafts tokens the model never writes (each rejected): every round verifies them and trims them away."""

    name = "wrong"

    def __init__(self, bad: list[int]) -> None:
        self.bad = bad

    def propose(self, history, want_more, max_n, params, rng, source=SRC_ANY):
        prop = Proposal()
        for i, tok in enumerate(self.bad[:max_n]):
            if not want_more(i, 0.5):
                break
            prop.add(tok, None, 0.5)
        return prop


def _seq_pos_max(ctx) -> int | None:
    if not hasattr(llama_cpp, "llama_memory_seq_pos_max"):
        return None
    return int(llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(ctx.ptr), 0))


def test_rejected_drafts_leave_no_stale_cell(plain):
    """After rounds whose drafts are all rejected, the cache holds exactly the answer: the next token's
    logits match a fresh prefill of the same tokens up to the backend's batch-size noise, while one wrong
    cell in the middle (what a draft left behind would be) moves them far past that noise."""
    ref_eng, ref = plain
    model = ref_eng.model
    prompt = _tokens(ref_eng, PROMPTS["chat"])
    bad = model.tokenize(" zebra quantum violin", add_special=False)[:3]
    with eesd_local.load(QWEN05, n_gpu_layers=ALL, n_ctx=N_CTX, drafter=_Wrong(bad), controller="fixed:3") as eng:
        got, fin = _answer(eng, prompt)
        assert fin.stats.n_drafted >= fin.stats.n_rounds and fin.stats.n_accepted < fin.stats.n_drafted
        history = list(eng.ctx.tokens)
        assert history[:len(prompt)] == prompt and len(history) >= len(prompt) + len(got) - 1
        assert history[len(prompt):] == got[:len(history) - len(prompt)]  # the record holds the answer, no draft
        assert eng.ctx.n_past == len(history)
        pos_max = _seq_pos_max(eng.ctx)
        if pos_max is not None:
            assert pos_max == len(history) - 1, f"cells past the history: pos {pos_max} >= {len(history)}"
        nxt = got[-1] if len(history) < len(prompt) + len(got) else model.tokenize(" the", add_special=False)[0]
        eng.ctx.decode([nxt])
        after_rounds = eng.ctx.logits().astype(np.float64)

    def fresh(tokens: list[int]) -> np.ndarray:
        ctx = Context(model, ContextParams(n_ctx=N_CTX, n_threads=runtime.default_threads()))
        try:
            ctx.decode(tokens)
            return ctx.logits().astype(np.float64)
        finally:
            ctx.close()

    want = fresh(history + [nxt])
    mid = len(prompt) + (len(history) - len(prompt)) // 2
    stale = fresh(history[:mid] + [bad[0]] + history[mid + 1:] + [nxt])  # one wrong cell, as a kept draft would be
    noise = float(np.max(np.abs(after_rounds - want)))
    planted = float(np.max(np.abs(stale - want)))
    print(f"after {fin.stats.n_drafted} rejected drafts: logits within {noise:.4f} of a fresh prefill; "
          f"one stale cell: {planted:.3f}")
    assert int(np.argmax(after_rounds)) == int(np.argmax(want))
    assert planted > 4 * max(noise, 0.05), f"the check cannot tell a stale cell ({planted:.3f}) from noise ({noise:.3f})"
    assert noise < 0.25 * planted, f"the cache after rejected drafts differs from a fresh prefill by {noise:.3f}"


def test_the_cost_profile_is_kept_per_backend_and_the_verdict_reads_it(plain):
    eng, _ = plain
    cfg = eng.config
    on_device = placement(cfg)
    assert on_device["n_gpu_layers"] == ALL
    fp_dev = costs.fingerprint(eng.model_path, **on_device)
    fp_cpu = costs.fingerprint(eng.model_path, **dict(on_device, n_gpu_layers=0))
    assert costs.profile_path(fp_dev) != costs.profile_path(fp_cpu)
    assert fp_dev["devices"] == ggmlapi.offload_device_names() and fp_dev["devices"]  # which device, not only "a GPU"
    assert "devices" not in fp_cpu  # CPU profiles kept before keep their key
    # measured on the device (here, or by auto's first load before: minutes on lavapipe), kept under its own key
    prof = costs.profile(eng.model, **on_device)
    assert prof.plausible, prof.note
    assert costs.profile_path(fp_dev).is_file()
    assert costs.cached(fp_dev)[0].bk == prof.bk  # what the engine reads for this placement
    head, verdict = auto_head(cfg, eng.model_path)
    assert head is not None and verdict is not None  # read from the kept device profile, nothing measured
    assert f"B(2)={prof.b(2):.2f}" in verdict.note
    # auto says that verdict in its drafter line
    with eesd_local.load(QWEN05, drafter="auto", n_gpu_layers=ALL, n_ctx=N_CTX) as auto:
        assert f"B(2)={prof.b(2):.2f}" in auto.drafter_note, auto.drafter_note
        fin = auto.run(_tokens(auto, PROMPTS["edit"]), max_tokens=6, temperature=0.0)
        assert fin.stats.n_generated > 0


def test_bench_runs_and_writes_its_projection_beside_the_speedup(plain, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "edit", "category": "code", "messages": PROMPTS["edit"]}) + "\n")
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    res = subprocess.run([sys.executable, "-m", "eesd_local.cli", "bench", "--model", QWEN05, "--prompts", str(prompts),
                          "--methods", "none,lookup,eesd", "--max-tokens", "8", "--warmup-tokens", "0", "--ctx", "512",
                          "--n-gpu-layers", "-1", "--cost-repeats", "1", "--json", str(out), "--markdown", str(md)],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["machine"]["n_gpu_layers"] == -1 and data["machine"]["gpu"] == ", ".join(ggmlapi.offload_device_names())
    for method in ("none", "lookup", "eesd"):
        f = data["methods"][method]["code"]  # one category: no "all" beside it
        assert f["lossless"] is True and f["exact"] is False
        assert f["tokens_per_s"] > 0 and f["speedup"] > 0
        assert f["projected_memory_bound_speedup"] is not None, method
    assert "projected mem-bound speedup" in md.read_text()
