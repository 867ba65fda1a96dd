"""scripts/gpu_carry.py and scripts/gpu_check.sh without a GPU (issue 44, part 2): what can go wrong before the
first device call does.

The carry is what a GPU machine without network gets: files cut into call folders that each fit beside the working
tree in one 64 MiB call, reassembled there part by part across calls. A part lost, sent twice, corrupted or from
another pack must never become a model file; the budget must count what a call really sends (tracked files and
untracked ones git does not ignore). And gpu_check.sh refuses what it cannot run, before it builds anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_carry", ROOT / "scripts" / "gpu_carry.py")
assert _spec is not None and _spec.loader is not None
gc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gc)


def _pack(tmp_path: Path, *files: Path, budget: int) -> tuple[Path, dict]:
    carry = tmp_path / "carry"
    m = gc.pack(carry, models=[], files=list(files), budget=budget, source=False, wheels=False, n_prompts=0)
    return carry, m


def _unpack(carry: Path, tmp_path: Path, *need: str) -> int:
    return gc.main(["unpack", "--dir", str(carry), "--into", str(tmp_path / "into"), "--home", str(tmp_path / "home"),
                    "--src-root", str(tmp_path / "src"), "--need", ",".join(need)])


def test_plan_cuts_every_file_exactly_and_fills_each_call_to_its_budget():
    blobs = [{"name": "a", "size": 10}, {"name": "b", "size": 0}, {"name": "c", "size": 95}]
    calls = gc.plan(blobs, 40)
    assert all(sum(p["size"] for p in c) <= 40 for c in calls)
    assert [sum(p["size"] for p in c) for c in calls] == [40, 40, 25]
    for blob in blobs:  # each file's parts tile it: consecutive offsets, sizes summing to its size
        parts = [p for c in calls for p in c if p["blob"] == blob["name"]]
        assert parts and [p["index"] for p in parts] == list(range(1, len(parts) + 1))
        assert [p["offset"] for p in parts] == [sum(q["size"] for q in parts[:i]) for i in range(len(parts))]
        assert sum(p["size"] for p in parts) == blob["size"]
    assert [p["blob"] for p in calls[0]] == ["a", "b", "c"]  # the small files travel whole in the first call
    with pytest.raises(gc.CarryError):
        gc.plan(blobs, 0)


def test_a_file_travels_in_parts_and_is_placed_only_once_whole_and_right(tmp_path, capsys):
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(10_000))
    carry, m = _pack(tmp_path, src, budget=3000)
    assert len(m["calls"]) == 4 and all(c["bytes"] <= 3000 for c in m["calls"])
    for n in range(1, 5):  # every call folder holds the manifest: each one is carried alone
        assert json.loads((carry / f"c{n:02d}" / "manifest.json").read_text()) == m
    away = tmp_path / "away"
    away.mkdir()
    for n in (2, 3, 4):  # only call 1 has come
        shutil.move(carry / f"c{n:02d}", away / f"c{n:02d}")
    assert _unpack(carry, tmp_path, "model") == 3
    assert not (tmp_path / "home" / "models" / "model.gguf").exists()
    assert "next: call c02" in capsys.readouterr().out
    shutil.move(away / "c02", carry / "c02")
    part = carry / "c02" / "model.gguf.p02"
    good = part.read_bytes()
    part.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # one bit flipped on the way
    assert _unpack(carry, tmp_path, "model") == 1
    assert "REFUSED c02/model.gguf.p02" in capsys.readouterr().out
    part.write_bytes(good)  # carried again
    for n in (3, 4):
        shutil.move(away / f"c{n:02d}", carry / f"c{n:02d}")
    assert _unpack(carry, tmp_path, "model") == 0
    assert (tmp_path / "home" / "models" / "model.gguf").read_bytes() == src.read_bytes()
    assert "all carried files are in place" in capsys.readouterr().out
    assert _unpack(carry, tmp_path, "all") == 0  # again: nothing to do, nothing broken
    assert not list((tmp_path / "into" / "partial").iterdir())


def test_parts_of_another_pack_are_never_mixed_in(tmp_path, capsys):
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(5000))
    carry, _ = _pack(tmp_path, src, budget=2000)
    shutil.rmtree(carry / "c03")
    assert _unpack(carry, tmp_path, "model") == 3  # two parts of three in
    src.write_bytes(os.urandom(5000))  # packed again: other bytes, the same names
    carry, _ = _pack(tmp_path, src, budget=2000)
    shutil.rmtree(carry / "c01")
    capsys.readouterr()
    assert _unpack(carry, tmp_path, "model") == 3  # the earlier pack's parts do not count: two of three, c01 to come
    out = capsys.readouterr().out
    assert "2/3 parts; still to come in call(s) c01" in out and "REFUSED" not in out
    shutil.copytree(carry / "c02", carry / "c01")  # a stale folder with another manifest: refused outright
    (carry / "c01" / "manifest.json").write_text(json.dumps({"blobs": []}))
    assert _unpack(carry, tmp_path, "model") == 2


def test_the_budget_counts_what_a_device_call_sends(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("build/\n")
    (tmp_path / "tracked.txt").write_bytes(b"x" * 1000)
    subprocess.run(["git", "-C", str(tmp_path), "add", "tracked.txt", ".gitignore"], check=True)
    (tmp_path / "untracked.txt").write_bytes(b"y" * 300)  # travels: not ignored
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "big.bin").write_bytes(b"z" * 50_000)  # stays: ignored
    assert gc.tree_bytes(tmp_path) == 1000 + 300 + len("build/\n")


def _sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize("args, needle", [
    (["--backend", "metal"], "--backend takes cuda or vulkan"),
    (["--max-tokens", "many"], "is not a whole number"),
    (["--background"], "--background goes with --build-only"),
    (["--model"], "--model takes a value"),
    (["--fast"], "unknown option --fast"),
])
def test_gpu_check_refuses_what_it_cannot_run_before_building(args, needle):
    r = _sh("scripts/gpu_check.sh", *args)
    assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr)
    assert "==> build" not in r.stdout


def test_gpu_check_and_gpu_path_say_how_they_are_run():
    r = _sh("scripts/gpu_check.sh", "--help")
    assert r.returncode == 0 and "--backend cuda|vulkan" in r.stdout and "--build-only" in r.stdout
    r = _sh("scripts/gpu_path.sh", "--backend", "rocm")
    assert r.returncode == 2 and "--backend takes vulkan or cuda" in r.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA compiler here")
def test_a_toolkit_without_cublas_takes_the_one_of_the_base_packages(tmp_path):
    """gpu_path.sh --backend cuda on a toolkit assembled from pip packages (no cuBLAS, no libcuda stub, as on this
    project's machines): it names the base's nvidia-cublas to CMake, and builds without the VMM pool when no libcuda
    is found; where neither has cuBLAS it stops and says so before building anything."""
    base = tmp_path / "base"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base)], check=True)
    py = base / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    env = {**os.environ, "EESD_GPU_BASE_PYTHON": str(py), "EESD_CUDA_ARCH": "90", "EESD_GPU_PATH_DIR": str(tmp_path / "gp")}
    r = subprocess.run(["bash", "scripts/gpu_path.sh", "--backend", "cuda", "--print-cmake-args"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT, env=env)
    toolkit_has_it = r.returncode == 0 and "cuBLAS in the toolkit" in r.stdout
    if not toolkit_has_it:
        assert r.returncode == 2 and "no cuBLAS" in r.stderr, (r.returncode, r.stdout, r.stderr)
    lib, inc = site / "nvidia" / "cu13" / "lib", site / "nvidia" / "cu13" / "include"
    lib.mkdir(parents=True)
    inc.mkdir(parents=True)
    for name in ("libcublas.so.13", "libcublasLt.so.13"):
        (lib / name).write_bytes(b"")
    (inc / "cublas_v2.h").write_text("")
    r = subprocess.run(["bash", "scripts/gpu_path.sh", "--backend", "cuda", "--print-cmake-args"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    args = r.stdout.strip().splitlines()[-1].split()
    assert args[:2] == ["-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=90"]
    if not toolkit_has_it:
        assert f"-DCUDA_cublas_LIBRARY={lib / 'libcublas.so.13'}" in args
        assert f"-DCUDA_cublasLt_LIBRARY={lib / 'libcublasLt.so.13'}" in args and f"-DCMAKE_CUDA_FLAGS=-I{inc}" in args
    assert any(a.startswith("-DCUDA_cuda_driver_LIBRARY=") or a == "-DGGML_CUDA_NO_VMM=ON" for a in args) \
        or "libcuda the toolkit's stub" in r.stdout
