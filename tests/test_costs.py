"""The cost profile (issue 31): kept per CPU, build, model and placement; never used for another;
re-measured when damaged; and the exit head's verdict from it."""

from __future__ import annotations

import json
import os

import pytest

import eesd_local
from eesd_local.gguf.tiny import write_tiny_gguf
from eesd_local.llama import costs, machine, runtime
from eesd_local.llama.runtime import default_threads
from eesd_local.speculative.controllers.thompson import PROFILE_COSTS
from eesd_local.speculative.drafters import AutoDrafter, LookupDrafter
from eesd_local.tools import heads


def test_measured_once_then_kept(fake):
    model, calls = fake
    first = costs.profile(model, n_threads=2)
    assert calls == [2] and "measured once" in first.note
    again = costs.profile(model, n_threads=2)
    assert calls == [2] and again.note == "" and again.bk == first.bk and again.t1_ms == 20.0
    costs.profile(model, n_threads=2, refresh=True)
    assert calls == [2, 2]


def test_the_test_suite_keeps_its_profiles_apart_from_the_users(fake, isolated_home, monkeypatch, tmp_path):
    """Profiles go to the cache's costs/ (a user's run), or to EESD_COSTS_DIR (the test suite's own,
    set by conftest for the session): a profile timed while tests ran is never the user's."""
    model, _ = fake
    fp = costs.fingerprint(model.path, n_threads=2)
    costs.profile(model, n_threads=2)
    assert costs.profile_path(fp).parent == isolated_home / "costs" and costs.profile_path(fp).is_file()
    apart = tmp_path / "session-costs"
    monkeypatch.setenv("EESD_COSTS_DIR", str(apart))
    costs.profile(model, n_threads=2)
    assert costs.profile_path(fp).parent == apart and costs.profile_path(fp).is_file()


def test_another_placement_or_model_is_never_used(fake):
    model, calls = fake
    costs.profile(model, n_threads=2)
    costs.profile(model, n_threads=1)  # other threads: other figures
    costs.profile(model, n_threads=2, rpc=("127.0.0.1:50052",), n_gpu_layers=-1)
    assert calls == [2, 1, 2]
    model.path.write_bytes(b"GGUF" + bytes(200))  # another file under the same name
    costs.profile(model, n_threads=2)
    assert calls == [2, 1, 2, 2]


def test_offloaded_layers_key_the_profile_by_device(fake, monkeypatch):
    """One GPU build drives many devices (Vulkan: lavapipe and a real card): a profile with offloaded layers is
    kept per device; with none offloaded the key is what it was (profiles kept before stay valid)."""
    model, calls = fake
    device = ["Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits))"]
    monkeypatch.setattr(costs, "offload_device_names", lambda: device)
    assert "devices" not in costs.fingerprint(model.path, n_threads=2)
    assert costs.fingerprint(model.path, n_threads=2, n_gpu_layers=-1)["devices"] == device
    assert "devices" not in costs.fingerprint(model.path, n_threads=2, n_gpu_layers=-1, rpc=("127.0.0.1:50052",))
    costs.profile(model, n_threads=2, n_gpu_layers=-1)
    costs.profile(model, n_threads=2, n_gpu_layers=-1)
    device[0] = "Vulkan0 (NVIDIA H200)"
    costs.profile(model, n_threads=2, n_gpu_layers=-1)
    assert calls == [2, 2]


def test_a_profile_of_another_cpu_is_not_used(fake):
    model, calls = fake
    fp = costs.fingerprint(model.path, n_threads=2)
    costs.profile(model, n_threads=2)
    path = costs.profile_path(fp)
    d = json.loads(path.read_text())
    d["fingerprint"]["cpu"] = "Some Other CPU"
    path.write_text(json.dumps(d))
    prof = costs.profile(model, n_threads=2)
    assert calls == [2, 2] and "another machine" in prof.note


@pytest.mark.parametrize("damage", ["", "{", '{"format": 1}', "null", "[]"])
def test_a_damaged_profile_is_measured_again(fake, damage):
    model, calls = fake
    costs.profile(model, n_threads=2)
    costs.profile_path(costs.fingerprint(model.path, n_threads=2)).write_text(damage)
    prof = costs.profile(model, n_threads=2)
    assert calls == [2, 2] and "damaged" in prof.note
    assert costs.profile(model, n_threads=2).note == ""  # and kept again


def test_out_of_range_figures_are_damage(fake):
    model, calls = fake
    costs.profile(model, n_threads=2)
    path = costs.profile_path(costs.fingerprint(model.path, n_threads=2))
    d = json.loads(path.read_text())
    d["bk"]["2"] = -1.0
    path.write_text(json.dumps(d))
    assert "damaged" in costs.profile(model, n_threads=2).note


def _prof(b2: float, slope: float) -> costs.CostProfile:
    return costs.CostProfile(20.0, {k: (1.0 if k == 1 else b2 + slope * (k - 2)) for k in costs.KS}, {})


def test_verdict_on_a_flat_batch_cost_machine():
    """B(k) nearly flat (a GPU, or a CPU that batches well): a head that agrees 0.6 can pay."""
    v = costs.head_verdict(_prof(1.05, 0.05), agreement=0.62, exit_layer=5, n_layer=24, k_max=8)
    assert v.pays and v.needed < 0.62 and v.note.startswith("exit head: on")


def test_verdict_where_two_tokens_cost_nearly_two():
    """B(2) = 1.9 and B(k) growing by 0.5 a token (this kind of 2-core CPU with batch-invariant
    kernels): only long drafts accepted almost always could pay; a head agreeing 0.62 cannot."""
    v = costs.head_verdict(_prof(1.9, 0.5), agreement=0.62, exit_layer=5, n_layer=24, k_max=8)
    assert not v.pays and 0.9 < v.needed < 1.0
    assert v.note.startswith(f"exit head: off, cannot pay on this machine: B(2)=1.90, needs acceptance > {v.needed:.2f}")
    assert costs.head_verdict(_prof(1.9, 0.5), agreement=0.99, exit_layer=5, n_layer=24, k_max=8).pays


def test_verdict_with_the_controllers_margin():
    """A head that beats plain decoding only by less than the margin the controller wants before it drafts
    (CPU_DRAFT_MARGIN on the CPU) is off: it would never draft, and held it costs every round."""
    prof = costs.CostProfile(100.0, {1: 1.0, 2: 1.235, 3: 1.344, 4: 1.337, 5: 1.538, 6: 1.641, 7: 1.992, 8: 2.133,
                                     9: 2.35, 17: 4.84, 65: 8.64}, {})  # the 1.5B on a 2-core Xeon, 2026-12-02
    bare = costs.head_verdict(prof, agreement=0.49, exit_layer=6, n_layer=28, k_max=64)
    held = costs.head_verdict(prof, agreement=0.49, exit_layer=6, n_layer=28, k_max=64, margin=0.10)
    assert bare.pays and not held.pays and held.needed > bare.needed + 0.1, (bare, held)
    assert costs.head_verdict(prof, agreement=0.9, exit_layer=6, n_layer=28, k_max=64, margin=0.10).pays


def test_verdict_when_nothing_can_pay():
    """Every batch as dear as its tokens decoded one by one: no acceptance is enough."""
    prof = costs.CostProfile(20.0, {k: float(k) for k in costs.KS}, {})
    v = costs.head_verdict(prof, agreement=1.0, exit_layer=5, n_layer=24, k_max=8)
    assert not v.pays and v.needed >= 1.0 and "never pays" in v.note and "needs acceptance" not in v.note


def test_needed_acceptance_is_the_break_even():
    prof = _prof(1.2, 0.2)
    need = costs.needed_acceptance(prof, 0.25, 8)
    assert 0.0 < need < 1.0
    assert costs.best_gain(prof, need + 1e-3, 0.25, 8)[0] > 1.0
    assert costs.best_gain(prof, need - 1e-3, 0.25, 8)[0] <= 1.0


def test_tokens_per_round():
    assert costs.tokens_per_round(0.0, 4) == 1.0
    assert costs.tokens_per_round(1.0, 4) == 5.0
    assert costs.tokens_per_round(0.5, 1) == pytest.approx(1.5)


def test_extrapolated_beyond_measured():
    prof = costs.CostProfile(10.0, {1: 1.0, 2: 1.5, 3: 2.0}, {})
    assert prof.b(5) == pytest.approx(3.0)
    assert prof.b(2) == 1.5


# --- auto's exit head, on the demo model ---------------------------------------------------------


@pytest.mark.model
def test_auto_leaves_a_head_that_cannot_pay_unbuilt(monkeypatch):
    monkeypatch.setattr(costs, "cached", lambda fp: (_prof(1.9, 0.5), ""))
    monkeypatch.setattr(costs, "profile", lambda model, **kw: _prof(1.9, 0.5))

    def no_build(*a, **kw):
        raise AssertionError("the exit head's draft was built although it cannot pay")

    monkeypatch.setattr(heads, "build_draft", no_build)
    with eesd_local.load("qwen2.5-coder-0.5b-instruct", drafter="auto") as eng:
        assert type(eng.drafter) is LookupDrafter and eng.trunk is None
        assert "exit head: off, cannot pay on this machine: B(2)=1.90, needs acceptance > 0.9" in eng.drafter_note
        fin = eng.run("def add(a, b):\n    return a + b\n\ndef add(a, b):\n", max_tokens=16)
        assert fin.stats.n_generated == 16
    with eesd_local.load("qwen2.5-coder-0.5b-instruct", drafter="eesd") as eng:  # the user asked: on
        assert eng.trunk is not None


@pytest.mark.model
def test_auto_runs_a_head_that_can_pay_on_the_shared_trunk(monkeypatch):
    monkeypatch.setattr(costs, "cached", lambda fp: (_prof(1.05, 0.05), ""))
    monkeypatch.setattr(costs, "profile", lambda model, **kw: _prof(1.05, 0.05))
    with eesd_local.load("qwen2.5-coder-0.5b-instruct", drafter="auto") as eng:
        assert isinstance(eng.drafter, AutoDrafter) and eng.drafter.n_sources == 2
        assert eng.trunk is not None and "shared trunk" in eng.drafter_note


@pytest.mark.model
@pytest.mark.parametrize("pays", [True, False], ids=["pays", "disturbed"])
def test_auto_with_no_kept_profile_measures_it_before_it_plans_the_trunk(monkeypatch, tmp_path, pays):
    """A new build or machine has no kept profile: the plan (a split target or a whole one) was made without it, so
    a head that pays ran as a separate draft model beside a whole target (each server's first start after a new
    build: auto at 0.73-0.84 of plain llama-server on chat). Now the profile is measured first, once per load."""
    calls = []
    paying = {k: (1.0 if k == 1 else 1.05 + 0.05 * (k - 2)) for k in costs.KS}
    disturbed = {1: 1.0, 2: 0.2, 3: 0.16, 8: 2.8, 9: 2.0}
    monkeypatch.setenv("EESD_COSTS_DIR", str(tmp_path))  # none kept
    monkeypatch.setattr(costs, "measure", lambda model, **kw: (calls.append(1) or 20.0, paying if pays else disturbed, True))
    monkeypatch.setattr(costs, "_unkept", {})
    with eesd_local.load("qwen2.5-coder-0.5b-instruct", drafter="auto") as eng:
        assert len(calls) == 1, calls  # the set-up's plan and the engine's ask: measured once
        if pays:
            assert isinstance(eng.drafter, AutoDrafter) and eng.trunk is not None and "shared trunk" in eng.drafter_note
        else:
            assert type(eng.drafter) is LookupDrafter and eng.trunk is None and "off for now" in eng.drafter_note
        assert eng.run("def add(a, b):\n    return a + b\n\ndef add(a, b):\n", max_tokens=8).stats.n_generated == 8


def test_a_disturbed_measurement_is_not_kept_nor_decided_from(fake, monkeypatch):
    model, calls = fake
    monkeypatch.setattr(costs, "measure", lambda model, **kw: (calls.append(1) or 634.0, {1: 1.0, 2: 0.2, 3: 0.16, 8: 2.8, 9: 2.0},
                                                               True))
    prof = costs.profile(model, n_threads=2)
    assert not prof.plausible and "could not be measured" in prof.note
    assert not costs.profile_path(costs.fingerprint(model.path, n_threads=2)).exists()
    v = costs.head_verdict(prof, agreement=0.9, exit_layer=5, n_layer=24, k_max=8)
    assert not v.pays and v.note.startswith("exit head: off for now")
    costs.profile(model, n_threads=2)
    assert len(calls) == 1  # the same load asks again (the trunk plan, then the drafter): not measured twice
    monkeypatch.setattr(costs, "UNKEPT_REUSE_S", 0.0)
    costs.profile(model, n_threads=2)
    assert len(calls) == 2  # measured again next time


def test_a_profile_that_stops_short_of_the_longest_drafts_is_measured_again(fake):
    """A profile kept before drafts grew to 64 tokens (batches of 1..9 only) would price a verify of 65 rows by
    extrapolation: it is measured again, and the note says why."""
    model, calls = fake
    fp = costs.fingerprint(model.path, n_threads=2)
    costs.keep(model.path, 20.0, {k: 1.0 + 0.5 * (k - 1) for k in range(1, 10)}, n_threads=2, repeats=3)
    got, why = costs.cached(fp)
    assert got is None and "stops at batches of 9 tokens" in why and f"up to {max(costs.KS)}" in why
    prof = costs.profile(model, n_threads=2)
    assert calls and max(prof.bk) == max(costs.KS) and "stops at batches of 9" in prof.note
    assert costs.cached(fp)[0] is not None  # kept, whole


@pytest.mark.parametrize("bk, ok", [({1: 1.0, 2: 1.8, 3: 2.3}, True), ({1: 1.0, 2: 1.02, 3: 1.05}, True),
                                     ({1: 1.0, 2: 0.5}, False), ({1: 1.0, 2: 3.0, 3: 2.0}, False)])
def test_plausible(bk, ok):
    assert costs.plausible(bk) is ok


@pytest.mark.parametrize("samples, ok", [((22.0, 22.4, 23.1, 22.2, 22.9), True), ((22.0, 22.4, 41.0, 22.2, 22.9), True),
                                          ((31.0, 74.6, 52.0, 88.1, 60.3), False), ((22.0, 40.0), True)])
def test_steady(samples, ok):
    """One outlier is forgiven (a quiet VM has them); timings spread as under other work are not."""
    assert costs.steady(samples) is ok


def test_a_flat_but_unsteady_measurement_is_not_kept(fake, monkeypatch):
    """The test suite's load once measured t(1) 74.6 ms and B(2) 1.23: a B(k) of plausible shape, every draft
    looking cheap. Its timings disagreed with each other: such a profile is neither kept nor decided from."""
    model, calls = fake
    monkeypatch.setattr(costs, "measure", lambda model, **kw: (calls.append(1) or 74.6, {k: 1.0 + 0.23 * (k - 1) for k in kw.get("ks", costs.KS)},
                                                               False))
    prof = costs.profile(model, n_threads=2)
    assert not prof.plausible and "timings unsteady" in prof.note
    assert not costs.profile_path(costs.fingerprint(model.path, n_threads=2)).exists()


def test_the_engine_plans_from_the_kept_profile(tmp_path, isolated_home):
    """A kept profile reaches the controller of a fresh engine: its first request already prices a
    batch of nine as this machine does, not as the largest batch it happened to time."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    with eesd_local.load(str(path), drafter="lookup", n_ctx=512) as eng:
        assert eng.controller.fields["batch_costs"] != PROFILE_COSTS  # nothing kept yet: timed online
    bk = {k: 1.0 + 0.7 * (k - 1) for k in costs.KS}
    costs.keep(path, 4.0, bk, n_threads=default_threads(), repeats=3)
    with eesd_local.load(str(path), drafter="lookup", n_ctx=512) as eng:
        assert eng.controller.fields["batch_costs"] == PROFILE_COSTS
        est = eng.controller.state_dict()["verify_estimate"]
        assert est[0] == pytest.approx(0.004) and est[8] / est[0] == pytest.approx(bk[9])
        list(eng.generate(list(range(300, 340)) * 2, max_tokens=40))
        est = eng.controller.state_dict()["verify_estimate"]
        assert est[8] / est[0] == pytest.approx(bk[9])  # the ratios stay the profile's
    with eesd_local.load(str(path), drafter="none", n_ctx=512) as eng:  # plain decoding plans nothing
        assert eng.controller.fields["batch_costs"] != PROFILE_COSTS


def test_kernel_choices_are_kept_beside_the_profiles(isolated_home, monkeypatch):
    """setup_process points the patched kernels at one file per CPU and build in the costs folder (the test
    suite's own folder while it runs), and leaves a file the environment names, or an empty value, alone."""
    monkeypatch.delenv("GGML_CPU_EXACT_CHOICE_FILE", raising=False)
    runtime.keep_kernel_choices()
    path = machine.kernel_choice_path()
    assert os.environ["GGML_CPU_EXACT_CHOICE_FILE"] == str(path)
    assert path.parent == machine.costs_dir() and path.parent.is_relative_to(isolated_home)
    assert path.name.startswith("kernels-") and path.suffix == ".txt"
    monkeypatch.setattr(machine, "build", lambda: "another build")
    assert machine.kernel_choice_path() != path  # another build (or CPU) times its kernels again
    for mine in ("/somewhere/else.txt", ""):
        monkeypatch.setenv("GGML_CPU_EXACT_CHOICE_FILE", mine)
        runtime.keep_kernel_choices()
        assert os.environ["GGML_CPU_EXACT_CHOICE_FILE"] == mine
