"""What scripts/gpu_check.sh needs on a GPU machine without network, carried there in device calls of 64 MiB.

    .venv/bin/python scripts/gpu_carry.py pack     # here: .gpu-carry/c01, c02, ... one folder per device call
    python3 scripts/gpu_carry.py unpack            # there, in every call: checks what came, assembles what is complete
    python3 scripts/gpu_carry.py status            # either side: what the pack holds and, there, what has arrived

A device call sends the working tree (tracked files and untracked ones git does not ignore) and the paths it
carries, 64 MiB in all; ignored files left on the machine stay there while it is warm (30 s idle). So ``pack``
measures the tree, and cuts what the check needs into call folders that each fit beside it (one ``carry``
path per call): the patched llama-cpp-python source (scripts/llama_build.py's tree, trimmed of what a build
never reads: llama.cpp's vocab models, docs, tools, tests, other backends; tar.xz), the wheels of the
packages missing in the device's image (gguf, diskcache), the bench prompts (code, chat and rewrite, made here
from the built-in sets, whose data packages the device lacks) and the models, in parts. Every piece and every
whole file has its sha256 in ``manifest.json``, a copy of which travels in every folder. Call 1 holds the
source and the wheels whole, so the build can start (in the background) while the model's parts travel.

``unpack`` reads the call folders present (a part that arrived before is skipped; a part whose bytes are not its
manifest's is refused, exit 1), writes each part at its offset into the file it belongs to, and places a file
once all of its parts are in and its whole sha256 matches: a model in ``--home``/models (EESD_HOME's layout),
the source as build/llama-src/VERSION-DIGEST (where scripts/llama_build.py finds it, patched), wheels and
prompts in ``--into``. It copies rather than moves: the carried folders stay as they came. ``--need`` exits 3
unless the named kinds are all placed. Standard library only (the device's python3 runs it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # what one device call may send: the working tree and its carried paths together
MARGIN = 1 * MIB  # left free in every call: a file added to the tree after packing
DEFAULT_MODELS = ("qwen2.5-coder-0.5b-instruct",)  # the 1.5B (1.1 GB) would take 29 calls: see README's GPU section
# not in the device image's packages (device README, KINDS.md): eesd_local imports gguf, llama-cpp-python diskcache
DEVICE_MISSING = ("gguf", "diskcache")
KINDS = ("source", "wheel", "prompts", "model")  # in this order into the calls: call 1 holds all but the models
# never read by a build of llama-cpp-python with GGML_CUDA or GGML_VULKAN (LLAMA_BUILD_TESTS/TOOLS/EXAMPLES and
# LLAVA_BUILD are off, ggml adds a backend's folder only when it is on); paths under the patched tree
TRIM = ("docs", "examples", "tests", "docker") + tuple(f"vendor/llama.cpp/{d}" for d in (
    "models", "docs", "media", "tools", "tests", "benches", "examples", "pocs", "gguf-py", "conversion", "ci", "app",
    "skills", "requirements", "licenses", "grammars")) + tuple(f"vendor/llama.cpp/ggml/src/ggml-{b}" for b in (
    "sycl", "opencl", "hexagon", "cann", "metal", "webgpu", "openvino", "et", "virtgpu", "zdnn", "zendnn", "musa", "hip"))
PROMPT_KINDS = ("code", "chat", "rewrite")


class CarryError(Exception):
    pass


def sha256_file(path: Path, offset: int = 0, size: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = os.path.getsize(path) - offset if size is None else size
        while left > 0:
            chunk = f.read(min(left, 4 * MIB))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def tree_bytes(root: Path = ROOT) -> int:
    """What a device call sends of the checkout: tracked files and untracked files git does not ignore."""
    res = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True)
    total = 0
    for name in res.stdout.decode().split("\0"):
        p = root / name
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


# --- pack (here) ------------------------------------------------------------------------------------


def _source_tarball(cache: Path) -> Path:
    """The patched llama-cpp-python tree of scripts/llama_build.py (the set-up's patches), trimmed, as tar.xz."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import llama_build  # noqa: PLC0415 - a script beside this one, found only when packing

    tree = llama_build.source(sys.executable)
    key = hashlib.sha256(json.dumps([tree.name, TRIM]).encode()).hexdigest()[:12]
    out = cache / f"llama-src-{tree.name}-{key}.tar.xz"
    if out.is_file():
        return out
    skip = {str(tree / t) for t in TRIM}

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        full = str(tree.parent / info.name)
        if full in skip or any(full.startswith(s + "/") for s in skip) or "/.git/" in full + "/":
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    print(f"  packing {tree.relative_to(ROOT)} (trimmed) into {out.name}", flush=True)
    with tarfile.open(tmp, "w:xz", preset=6) as tar:
        tar.add(tree, arcname=tree.name, filter=keep)
    os.replace(tmp, out)
    return out


def _wheels(cache: Path, names: tuple[str, ...]) -> list[Path]:
    """The wheels of ``names`` at the versions this environment has (pure Python: any interpreter takes them)."""
    from importlib.metadata import version  # noqa: PLC0415 - only when packing

    dest = cache / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    want = [f"{n}=={version(n)}" for n in names]
    found = []
    for spec in want:
        name, ver = spec.split("==")
        have = sorted(dest.glob(f"{name.replace('-', '_')}-{ver}-*.whl"))
        if not have:
            res = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                                  "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                                  "--platform", "manylinux_2_17_x86_64", "-d", str(dest), spec], capture_output=True, text=True)
            have = sorted(dest.glob(f"{name.replace('-', '_')}-{ver}-*.whl"))
            if res.returncode != 0 or not have:
                raise CarryError(f"pip could not download a wheel of {spec}: {(res.stderr.strip().splitlines() or [''])[-1]}")
        found.append(have[-1])
    return found


def _prompts(cache: Path, n: int) -> Path:
    """``n`` prompts of each kind (code, chat, rewrite) from the bench's built-in sets, as one JSONL file."""
    from eesd_local.tools.bench import prompts as bp  # noqa: PLC0415 - only when packing (needs the dev extras)

    lines = []
    for kind in PROMPT_KINDS:
        items = bp.spread(bp.load_prompts(kind), n)
        for it in items:  # every chat-* category counts as chat: three kinds in the tables
            rec: dict = {"id": it.id, "category": kind}
            if it.turns:
                rec["turns"] = list(it.turns)
            elif it.messages:
                rec["messages"] = [{"role": r, "content": c} for r, c in it.messages]
            else:
                rec["prompt"] = it.prompt
            lines.append(json.dumps(rec, ensure_ascii=False))
    out = cache / f"bench-prompts-{n}.jsonl"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def _model_file(name: str) -> Path:
    path = Path(name).expanduser()
    if path.is_file():
        return path
    from eesd_local.llama import catalog  # noqa: PLC0415 - only when packing

    spec = catalog.get_spec(name)
    if not catalog.is_present(spec):
        raise CarryError(f"model {name} is not downloaded here: run eesd models pull {name}")
    return spec.path


def plan(blobs: list[dict], budget: int) -> list[list[dict]]:
    """Cut the blobs (in order) into calls of at most ``budget`` bytes: each call a list of parts."""
    if budget <= 0:
        raise CarryError("the working tree alone fills a device call: nothing can be carried beside it")
    calls: list[list[dict]] = [[]]
    room = budget
    for blob in blobs:
        offset, idx = 0, 0
        while idx == 0 or offset < blob["size"]:  # an empty file is one empty part
            if room == 0:
                calls.append([])
                room = budget
            size = min(blob["size"] - offset, room)
            idx += 1
            calls[-1].append({"blob": blob["name"], "index": idx, "offset": offset, "size": size})
            offset += size
            room -= size
    return calls


def pack(out: Path, *, models: list[str], files: list[Path], budget: int | None, source: bool, wheels: bool,
         n_prompts: int) -> dict:
    cache = out / "cache"  # kept between packs, never carried
    blobs: list[dict] = []

    def add(path: Path, kind: str, name: str | None = None) -> None:
        blobs.append({"name": name or path.name, "kind": kind, "path": path, "size": path.stat().st_size})

    if source:
        add(_source_tarball(cache), "source")
    if wheels:
        for w in _wheels(cache, DEVICE_MISSING):
            add(w, "wheel")
    if n_prompts > 0:
        add(_prompts(cache, n_prompts), "prompts", "bench-prompts.jsonl")
    for m in models:
        add(_model_file(m), "model")
    for f in files:
        add(f, "model")
    if len({b["name"] for b in blobs}) != len(blobs):
        raise CarryError("two carried files share a name")
    tree = tree_bytes()
    if budget is None:
        budget = (CALL_LIMIT - tree - MARGIN) // MIB * MIB
    calls = plan(blobs, budget)
    if source and any(p["blob"] == blobs[0]["name"] for c in calls[1:] for p in c):
        raise CarryError(f"the source ({blobs[0]['size'] / MIB:.1f} MiB) does not fit in one call beside the tree")
    for old in out.glob("c[0-9][0-9]"):
        shutil.rmtree(old)
    by_name = {b["name"]: b for b in blobs}
    manifest: dict = {"format": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "call_limit": CALL_LIMIT,
                      "tree_bytes": tree, "budget": budget, "blobs": [], "calls": []}
    parts_of: dict[str, list[dict]] = {b["name"]: [] for b in blobs}
    for n, call in enumerate(calls, 1):
        folder = out / f"c{n:02d}"
        folder.mkdir(parents=True)
        for p in call:
            blob = by_name[p["blob"]]
            fname = f"{p['blob']}.p{p['index']:02d}"
            with open(blob["path"], "rb") as src, open(folder / fname, "wb") as dst:
                src.seek(p["offset"])
                left = p["size"]
                h = hashlib.sha256()
                while left:
                    chunk = src.read(min(left, 4 * MIB))
                    h.update(chunk)
                    dst.write(chunk)
                    left -= len(chunk)
            parts_of[p["blob"]].append({"file": f"{folder.name}/{fname}", "call": n, "offset": p["offset"],
                                        "size": p["size"], "sha256": h.hexdigest()})
        manifest["calls"].append({"call": n, "carry": f"{out.name}/{folder.name}", "bytes": sum(p["size"] for p in call)})
    for b in blobs:
        manifest["blobs"].append({"name": b["name"], "kind": b["kind"], "size": b["size"], "sha256": sha256_file(b["path"]),
                                  "parts": parts_of[b["name"]]})
    text = json.dumps(manifest, indent=1) + "\n"
    (out / "manifest.json").write_text(text)
    for n in range(1, len(calls) + 1):
        (out / f"c{n:02d}" / "manifest.json").write_text(text)
    return manifest


# --- unpack (there) ---------------------------------------------------------------------------------


def read_manifest(carry: Path) -> dict:
    texts = {p.read_text() for p in [carry / "manifest.json", *sorted(carry.glob("c[0-9][0-9]/manifest.json"))] if p.is_file()}
    if not texts:
        raise CarryError(f"no manifest.json in {carry} or its call folders: nothing was carried (or pack was not run)")
    if len(texts) > 1:
        raise CarryError("the call folders hold manifests of different packs: the carry was packed again after some "
                         "calls; start again from call 1 (or remove the stale folders)")
    return json.loads(texts.pop())


def _manifest_key(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest["blobs"], sort_keys=True).encode()).hexdigest()[:16]


def _place(blob: dict, data: Path, into: Path, home: Path, src_root: Path) -> str:
    kind, name = blob["kind"], blob["name"]
    if kind == "model":
        dest = home / "models" / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(data, dest)
        return str(dest)
    if kind == "source":
        with tarfile.open(data) as tar:
            top = {m.name.split("/")[0] for m in tar.getmembers()}
            if len(top) != 1:
                raise CarryError(f"{name} holds {len(top)} top folders, not one source tree")
            tree = src_root / top.pop()
            if not (tree / ".eesd-patched").is_file():  # a patched tree already there (here: the set-up's) is kept
                tmp = src_root / f".unpack-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                if hasattr(tarfile, "data_filter"):  # 3.12 and the 3.11.4+ backport
                    tar.extractall(tmp, filter="data")
                else:
                    tar.extractall(tmp)
                shutil.rmtree(tree, ignore_errors=True)
                os.replace(tmp / tree.name, tree)
                shutil.rmtree(tmp, ignore_errors=True)
        data.unlink()
        return str(tree)
    dest = into / ("wheels" if kind == "wheel" else "") / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(data, dest)
    return str(dest)


def unpack(carry: Path, into: Path, home: Path, src_root: Path, *, quiet: bool = False) -> dict:
    """Take every part present under ``carry``; returns the state (what is placed, what is missing)."""
    manifest = read_manifest(carry)
    key = _manifest_key(manifest)
    into.mkdir(parents=True, exist_ok=True)
    state_path = into / "state.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    if state.get("key") != key:  # another pack: what arrived of an earlier one is dropped
        shutil.rmtree(into / "partial", ignore_errors=True)
        state = {"key": key, "have": {}, "placed": {}}
    partial = into / "partial"
    partial.mkdir(exist_ok=True)
    bad = []
    for blob in manifest["blobs"]:
        name = blob["name"]
        if name in state["placed"] and os.path.exists(state["placed"][name]):
            continue
        state["placed"].pop(name, None)  # placed once, gone since: taken again from the parts still carried
        have = set(state["have"].get(name, []))
        data = partial / name
        for part in blob["parts"]:
            src = carry / part["file"]
            if part["file"] in have or not src.is_file():
                continue
            if src.stat().st_size != part["size"] or sha256_file(src) != part["sha256"]:
                bad.append(part["file"])
                continue
            with open(data, "r+b" if data.exists() else "wb") as f:
                f.seek(part["offset"])
                with open(src, "rb") as s:
                    shutil.copyfileobj(s, f, 4 * MIB)
            have.add(part["file"])
            state["have"][name] = sorted(have)
            state_path.write_text(json.dumps(state, indent=1))
        if len(have) == len(blob["parts"]):
            if blob["size"] == 0:
                data.touch()
            if data.stat().st_size != blob["size"] or sha256_file(data) != blob["sha256"]:
                data.unlink()
                state["have"][name] = []
                bad.append(f"{name} (assembled)")
            else:
                state["placed"][name] = _place(blob, data, into, home, src_root)
                state["have"].pop(name, None)
            state_path.write_text(json.dumps(state, indent=1))
    state["bad"] = bad
    if not quiet:
        print(describe(manifest, state))
    return state


def missing(manifest: dict, state: dict, kinds: set[str]) -> list[str]:
    return [b["name"] for b in manifest["blobs"] if b["kind"] in kinds and b["name"] not in state.get("placed", {})]


def describe(manifest: dict, state: dict) -> str:
    lines = []
    for blob in manifest["blobs"]:
        name, parts = blob["name"], blob["parts"]
        if name in state.get("placed", {}):
            lines.append(f"  {blob['kind']:8s} {name}: in place ({state['placed'][name]})")
            continue
        have = set(state.get("have", {}).get(name, []))
        calls = sorted({p["call"] for p in parts if p["file"] not in have})
        lines.append(f"  {blob['kind']:8s} {name}: {len(have)}/{len(parts)} parts; still to come in call(s) "
                     + ", ".join(f"c{c:02d}" for c in calls))
    for b in state.get("bad", []):
        lines.append(f"  REFUSED {b}: its bytes are not the manifest's (carry that call again)")
    todo = sorted({p["call"] for b in manifest["blobs"] if b["name"] not in state.get("placed", {})
                   for p in b["parts"] if p["file"] not in set(state.get("have", {}).get(b["name"], []))})
    lines.append("  all carried files are in place" if not todo else
                 f"  next: call c{todo[0]:02d} ({len(todo)} call(s) to go of {len(manifest['calls'])})")
    return "\n".join(lines)


# --- command line -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="here: the call folders")
    p.add_argument("--dir", type=Path, default=ROOT / ".gpu-carry")
    p.add_argument("--model", action="append", help=f"registry name or GGUF path (repeatable; default {', '.join(DEFAULT_MODELS)})")
    p.add_argument("--file", type=Path, action="append", default=[], help="any other file, placed as a model")
    p.add_argument("--budget-bytes", type=int, help="bytes of parts per call (default: 64 MiB less the working tree less 1 MiB)")
    p.add_argument("--prompts", type=int, default=4, metavar="N", help="bench prompts per kind (default 4; 0: none)")
    p.add_argument("--no-source", action="store_true")
    p.add_argument("--no-wheels", action="store_true")
    p.add_argument("--no-models", action="store_true")
    u = sub.add_parser("unpack", help="there: take what arrived, place what is complete")
    u.add_argument("--dir", type=Path, default=ROOT / ".gpu-carry")
    u.add_argument("--into", type=Path, default=ROOT / "build" / "gpu-carry")
    u.add_argument("--home", type=Path, default=Path(os.environ.get("EESD_HOME") or Path.home() / ".cache" / "eesd-local"),
                   help="EESD_HOME that receives the models (default: $EESD_HOME or ~/.cache/eesd-local)")
    u.add_argument("--src-root", type=Path, default=ROOT / "build" / "llama-src")
    u.add_argument("--need", default="", help="comma-separated kinds (source, wheel, prompts, model, all): exit 3 unless placed")
    s = sub.add_parser("status", help="what the pack holds and what has arrived")
    s.add_argument("--dir", type=Path, default=ROOT / ".gpu-carry")
    s.add_argument("--into", type=Path, default=ROOT / "build" / "gpu-carry")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "pack":
            models = [] if args.no_models else (args.model or list(DEFAULT_MODELS))
            m = pack(args.dir, models=models, files=args.file, budget=args.budget_bytes, source=not args.no_source,
                     wheels=not args.no_wheels, n_prompts=args.prompts)
            total = sum(b["size"] for b in m["blobs"])
            print(f"packed {total / MIB:.1f} MiB into {len(m['calls'])} device call(s) of at most {m['budget'] / MIB:.0f} MiB "
                  f"each (the working tree sends {m['tree_bytes'] / MIB:.1f} MiB beside them) in {args.dir}:")
            for c in m["calls"]:
                what = sorted({p["file"].split("/")[1].rsplit(".p", 1)[0] for b in m["blobs"] for p in b["parts"]
                               if p["call"] == c["call"]})
                print(f"  c{c['call']:02d}: {c['bytes'] / MIB:5.1f} MiB  {', '.join(what)}")
            return 0
        manifest = read_manifest(args.dir)
        if args.cmd == "status":
            sp = args.into / "state.json"
            state = json.loads(sp.read_text()) if sp.is_file() else {}
            print(describe(manifest, state if state.get("key") == _manifest_key(manifest) else {}))
            return 0
        state = unpack(args.dir, args.into, args.home, args.src_root)
        if state["bad"]:
            return 1
        kinds = set(KINDS) if "all" in args.need.split(",") else {k for k in args.need.split(",") if k}
        if kinds - set(KINDS):
            raise CarryError(f"--need takes {', '.join(KINDS)} or all, not {', '.join(sorted(kinds - set(KINDS)))}")
        lacking = missing(manifest, state, kinds)
        if lacking:
            print(f"gpu_carry: not all here yet: {', '.join(lacking)}", file=sys.stderr)
            return 3
        return 0
    except (CarryError, OSError, subprocess.CalledProcessError) as exc:
        print(f"gpu_carry: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
