"""The trainer's shard files, by name alone: nothing here needs llama.cpp.

A shard ``teacher-NNNNN.npz`` holds sequences (tokens, offsets, n_prompt, the teacher's top-k ids
and log-probs, categories); ``trunk-N{n}-NNNNN.npy`` (torch) or ``trunk-N{n}-llama-NNNNN.npy``
(llama.cpp) beside it holds the trunk states that enter block n for the same tokens. Training reads
only these, so it runs where only torch is installed.
"""

from __future__ import annotations

from pathlib import Path

SHARD_GLOB = "teacher-*.npz"


def shard_paths(out_dir: Path) -> list[Path]:
    return sorted(Path(out_dir).glob(SHARD_GLOB))


TRUNK_SOURCES = ("llama.cpp", "torch")  # where trunk states come from (train.cache_trunk_states)


def trunk_path(shard: Path, n: int, source: str = "torch") -> Path:
    """The trunk states h_N of ``shard`` from ``source`` (torch: float32 weights dequantised from the GGUF;
    llama.cpp: the model's own quantised kernels): ``trunk-N6-…`` and ``trunk-N6-llama-…``."""
    tag = f"trunk-N{n}-" if source == "torch" else f"trunk-N{n}-llama-"
    return shard.with_name(shard.name.replace("teacher-", tag).replace(".npz", ".npy"))


def trunk_files(shard: Path) -> list[Path]:
    """The trunk-state files beside ``shard``, for every N and source made."""
    return sorted(shard.parent.glob(trunk_path(shard, 0).name.replace("-N0-", "-N*-")))


def trunk_paths(data_dir: Path, n: int, source: str = "torch") -> list[Path]:
    return [trunk_path(p, n, source) for p in shard_paths(data_dir)]
