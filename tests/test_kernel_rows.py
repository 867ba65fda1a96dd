"""The batch-invariant CPU kernels type by type, without a model (native/patches/ggml-batch-invariant.patch).

scripts/matmul_rows.c multiplies random weights of one type by a batch of M rows in one product and checks
that every row is bit-identical to the same row multiplied alone, for batch sizes on both sides of every
kernel switch (the one-weight-row tiles or tinyBLAS's own below 17 rows, the K-quant gemv below 8 rows, the
gemv or the tiled kernels from 8 to 63 rows, whichever this CPU runs faster, the tiled kernels above) and
weight row counts that leave tails after the gemv's groups of 8 rows. The demo models carry only some of
these types (no Q5_K, Q4_0, IQ4_NL, BF16 ...): this covers the rest. With GGML_CPU_EXACT_ROWS=0 (llama.cpp's
stock kernels) the same program must find rows that differ, so the check can fail.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "scripts" / "matmul_rows.c"

# ggml's type numbers
TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
         "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30}
SIZES = ["1", "2", "3", "4", "5", "7", "8", "9", "11", "12", "13", "15", "16", "17", "19", "21", "24", "29", "31", "32",
         "33", "64"]


@pytest.fixture(scope="module")
def checker(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build scripts/matmul_rows.c")
    spec = importlib.util.find_spec("llama_cpp")
    assert spec is not None and spec.origin is not None, "llama-cpp-python is not installed"
    pkg = Path(spec.origin).parent
    lib, include = pkg / "lib", pkg.parent / "include"
    if not (include / "ggml-cpu.h").is_file():
        pytest.skip(f"llama-cpp-python installed no ggml headers ({include})")
    out = tmp_path_factory.mktemp("rows") / "matmul_rows"
    res = subprocess.run([cc, "-O2", "-o", str(out), str(SOURCE), f"-I{include}", f"-L{lib}", "-lggml-base", "-lggml-cpu",
                          "-lggml", f"-Wl,-rpath,{lib}"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return out


def _differing(checker: Path, type_no: int, k: int, n: int, threads: int, exact: bool,
               **extra: str) -> dict[int, int]:
    env = dict(os.environ, GGML_CPU_EXACT_ROWS="1" if exact else "0", **extra)
    res = subprocess.run([str(checker), str(type_no), str(k), str(n), str(threads), *SIZES], capture_output=True,
                         text=True, env=env, timeout=300)
    assert res.returncode in (0, 1), res.stderr
    return _rows_differing(res.stdout)


def _rows_differing(stdout: str) -> dict[int, int]:
    got = {}
    for line in stdout.splitlines():  # "<type> K=.. N=.. threads=.. exact=.. M=m: d of m rows differ"
        m = int(line.split(" M=")[1].split(":")[0])
        got[m] = int(line.split(": ")[1].split()[0])
    assert sorted(got) == sorted(int(s) for s in SIZES), stdout
    return got


@pytest.mark.parametrize("name", list(TYPES))
def test_every_row_of_a_batch_is_the_row_alone(checker, name):
    # K of two K-quant super-blocks; 203 weight rows: 16-row runs, each cut in groups of 8 with a tail
    for threads in (1, 2, 3):
        got = _differing(checker, TYPES[name], 512, 203, threads, exact=True)
        assert not any(got.values()), f"{name}, {threads} threads: rows that differ per batch size {got}"


@pytest.mark.parametrize("k, n", [(512, 204), (2048, 132), (4096, 36)])
def test_the_f16_gemv_gives_tinyblas_rows(checker, k, n):
    """One row of an F16 product (attention's K*Q and V*KQ in a decode) takes the patch's own gemv where the weight
    rows are a multiple of 4, 8 rows at once with one accumulator each; a batch takes tinyBLAS. Row counts with a
    tail after the groups of 8 and long rows (V*KQ at a long context: K = the context's length)."""
    for threads in (1, 2, 3):
        got = _differing(checker, TYPES["F16"], k, n, threads, exact=True)
        assert not any(got.values()), f"F16 {k} x {n}, {threads} threads: rows that differ per batch size {got}"


def test_long_runs_of_weight_rows_too(checker):
    """A larger matrix: the gemv's runs of weight rows are longer than 16 (62 rows here) and end in a tail."""
    for name in ("Q4_K", "Q6_K"):
        got = _differing(checker, TYPES[name], 768, 2003, 2, exact=True)
        assert not any(got.values()), f"{name}: rows that differ per batch size {got}"


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("policy", ["auto", "gemv", "tiled", "fixed"])
def test_either_kquant_kernel_gives_the_row_alone(checker, name, policy):
    """Batches of 8 to 63 K-quant rows run whichever of the gemv and the tiled kernels was the faster on this CPU
    (timed as they come: the first runs alternate). Each batch computed 8 times, so that under `auto` both kernels'
    runs are compared with the row alone; `gemv`, `tiled` and `fixed` pin the choice."""
    got = _differing(checker, TYPES[name], 512, 203, 2, exact=True, GGML_CPU_EXACT_KQUANT=policy,
                     MATMUL_ROWS_REPEAT="8")
    assert not any(got.values()), f"{name}, GGML_CPU_EXACT_KQUANT={policy}: rows that differ per batch size {got}"


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q5_0", "IQ4_NL"])
@pytest.mark.parametrize("policy", ["auto", "onerow", "tinyblas"])
def test_either_tile_shape_gives_the_row_alone(checker, name, policy):
    """Batches of 2 to 16 rows of these types run in tinyBLAS's own tiles or in tiles of one weight row by all of
    the batch's rows, whichever this CPU runs faster (timed as they come); one row always in the latter."""
    for threads in (2, 3):
        got = _differing(checker, TYPES[name], 512, 203, threads, exact=True, GGML_CPU_EXACT_Q0=policy,
                         MATMUL_ROWS_REPEAT="8")
        assert not any(got.values()), f"{name}, GGML_CPU_EXACT_Q0={policy}: rows that differ per batch size {got}"


def test_the_check_sees_stock_kernels_differ(checker):
    got = _differing(checker, TYPES["Q4_K"], 512, 203, 2, exact=False)
    assert got[1] == 0 and any(got[m] for m in (8, 16, 33)), got


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("policy", ["auto", "on", "off"])
def test_either_decode_kernel_gives_the_row_alone(checker, name, policy):
    """Batches of 1 and 2 K-quant rows run 8 weight rows in vector lanes or one weight row at a time, whichever
    this CPU runs faster (timed as they come: the rows alone are many one-row products, so under `auto` both
    kernels compute some of them); `on` and `off` pin it. 203 weight rows leave a tail after the groups of 8."""
    for threads in (2, 3):
        got = _differing(checker, TYPES[name], 512, 203, threads, exact=True, GGML_CPU_EXACT_KQUANT_LANES=policy,
                         MATMUL_ROWS_REPEAT="8")
        assert not any(got.values()), f"{name}, GGML_CPU_EXACT_KQUANT_LANES={policy}: rows that differ {got}"


def _run_logged(checker: Path, type_no: int, choices: Path) -> tuple[dict[int, int], str]:
    env = dict(os.environ, GGML_CPU_EXACT_ROWS="1", GGML_CPU_EXACT_CHOICE_FILE=str(choices), GGML_CPU_EXACT_CHOICE_LOG="1",
               MATMUL_ROWS_REPEAT="8")  # 8 runs: every shape decided (at most 3 runs of each kernel)
    env.pop("GGML_CPU_EXACT_KQUANT", None)
    env.pop("GGML_CPU_EXACT_KQUANT_LANES", None)
    res = subprocess.run([str(checker), str(type_no), "512", "203", "2", *SIZES], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode in (0, 1), res.stderr
    return _rows_differing(res.stdout), res.stderr


def test_kept_choices_are_read_back(checker, tmp_path):
    """GGML_CPU_EXACT_CHOICE_FILE: the first process appends each decision, a second reads them back and times
    no known shape again; lines it cannot use are skipped; every row stays the row alone."""
    choices = tmp_path / "kernels.txt"
    choices.write_text("garbage\nkquant 2 zz 1\nkquant 2 0 1\nkquant 2 ff 7\n")  # none of them usable
    got, err = _run_logged(checker, TYPES["Q4_K"], choices)
    assert not any(got.values()), got
    decided = [ln for ln in err.splitlines() if ln.startswith("exact choice: q4_K")]
    assert decided, err  # the shapes of 1, 2 and 8 to 63 rows were timed
    assert "kquant: 0 kept choices for 2 threads" in err, err
    lines = choices.read_text().splitlines()[4:]
    assert len(lines) == len(decided), (lines, decided)
    for ln in lines:
        table, threads, key, kernel = ln.split()
        assert table in ("kquant", "kquant-lanes") and threads == "2" and int(key, 16) > 0 and kernel in ("0", "1"), ln

    got, err = _run_logged(checker, TYPES["Q4_K"], choices)
    assert not any(got.values()), got
    assert not [ln for ln in err.splitlines() if ln.startswith("exact choice: q4_K")], err  # nothing timed again
    kept = sum(int(ln.split(": ")[2].split()[0]) for ln in err.splitlines() if " kept choices for " in ln)
    assert kept == len(lines), err
    assert choices.read_text().splitlines()[4:] == lines  # nothing appended
