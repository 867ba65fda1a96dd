"""On CPUs with AMX the vendored llama.cpp's AMX matmul can crash the process on the first
decode (seen on a Sapphire Rapids VM): every model load in the process then keeps the extra
buffer types off. Mechanics only; the demo-model tests exercise the loads themselves."""

from __future__ import annotations

import llama_cpp
import llama_cpp.llama_cpp as raw

from eesd_local.llama import runtime

AMX = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n"
NO_AMX = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n"


def test_amx_is_read_from_the_cpu_flags():
    assert runtime.cpu_has_amx(AMX)
    assert not runtime.cpu_has_amx(NO_AMX)
    assert not runtime.cpu_has_amx("")
    # a flag that merely contains the name does not count
    assert not runtime.cpu_has_amx("flags\t: avx512f amx_int8_like\n")


def test_extra_buffer_types_are_off_only_with_amx(monkeypatch):
    monkeypatch.delenv("EESD_EXTRA_BUFTS", raising=False)
    assert not runtime.extra_bufts_allowed(AMX)
    assert runtime.extra_bufts_allowed(NO_AMX)
    monkeypatch.setenv("EESD_EXTRA_BUFTS", "1")
    assert runtime.extra_bufts_allowed(AMX)
    monkeypatch.setenv("EESD_EXTRA_BUFTS", "0")
    assert not runtime.extra_bufts_allowed(NO_AMX)


def test_every_loader_in_the_process_gets_the_guarded_defaults(monkeypatch):
    runtime.guard_model_defaults()  # what every Model does first (runtime.setup_process); conftest did it too
    # llama_cpp.Llama reads llama_cpp.llama_cpp's function, our loaders the package's: both are guarded
    assert raw.llama_model_default_params is llama_cpp.llama_model_default_params
    for env, want in (("0", False), ("1", True)):
        monkeypatch.setenv("EESD_EXTRA_BUFTS", env)
        assert raw.llama_model_default_params().use_extra_bufts is want
    guarded = raw.llama_model_default_params
    runtime.guard_model_defaults()  # idempotent: no second wrapper around the first
    assert raw.llama_model_default_params is guarded
    monkeypatch.delenv("EESD_EXTRA_BUFTS")
    assert raw.llama_model_default_params().use_extra_bufts is runtime.extra_bufts_allowed()
