"""Build llama.cpp the way eesd-local needs it, from the source that llama-cpp-python vendors.

    python scripts/llama_build.py install [--python .venv/bin/python]   # llama-cpp-python, patched
    python scripts/llama_build.py check   [--python .venv/bin/python]   # exit 0 if that is what is installed
    python scripts/llama_build.py tools                                 # llama-server and rpc-server, same source and flags
    CMAKE_ARGS=-DGGML_VULKAN=on python scripts/llama_build.py install --python ENV/bin/python --into DIR
                                                                        # another build (a GPU backend) for another environment

One source for everything: the llama-cpp-python sdist (downloaded once by pip into build/sdist,
checked against its sha256), with eesd-local's patch applied (native/patches/*.patch, in name
order; see the patch's header: batch-invariant decode batches on the CPU). `install` builds
llama-cpp-python from it with the RPC backend on and the multimodal library off, plus whatever
CMAKE_ARGS the environment holds (a GPU backend, say), into a wheel kept under build/wheels
(installed again from there, with no compile, until the source, the patch or the flags change),
and records what it built in llama_cpp/lib/eesd-build.json. With ``--into DIR`` the wheel is kept in
DIR/wheels instead and compiled in DIR/cmake-KEY, a CMake tree kept between runs: an interrupted
compile (a GPU backend's shaders take long) goes on where it stopped; ``--patch FILE`` adds a patch
for that build alone (its own patched tree, key and record). scripts/gpu_path.sh builds the Vulkan test
environment so, beside the set-up's build. `tools` builds llama.cpp's own llama-server and rpc-server from the
same patched source with the same CMAKE_ARGS into build/llama-tools/KEY/bin, KEY naming the
source, the patch and the flags: built once, reused until one of them changes.

Standard library only: it runs before anything else is installed. A failed step stops with one
line saying which and why, never with a build that lacks the patch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PATCHES = sorted((ROOT / "native" / "patches").glob("*.patch"))  # and any --patch, after them
BUILD = ROOT / "build"
# RPC: the target's layers can live on other machines (eesd rpc-server); LLAVA (libmtmd): unused here
BASE_CMAKE_ARGS = ["-DGGML_RPC=ON", "-DLLAVA_BUILD=OFF"]
INFO_NAME = "eesd-build.json"


class BuildError(Exception):
    pass


def patch_digest() -> str:
    h = hashlib.sha256()
    for p in PATCHES:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def cmake_args() -> list[str]:
    """The flags of every build: ours, then the user's CMAKE_ARGS (which win where they clash)."""
    return BASE_CMAKE_ARGS + shlex.split(os.environ.get("CMAKE_ARGS", ""))


def build_key(args: list[str]) -> str:
    h = hashlib.sha256(json.dumps([SDIST_SHA256, patch_digest(), args]).encode())
    return h.hexdigest()[:16]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(python: str) -> Path:
    """The sdist, downloaded by pip from the package index the first time."""
    dest = BUILD / "sdist"
    path = dest / SDIST
    if not path.is_file() or sha256_file(path) != SDIST_SHA256:
        dest.mkdir(parents=True, exist_ok=True)
        print(f"  downloading llama-cpp-python {VERSION} source", flush=True)
        res = subprocess.run([python, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                              f"llama-cpp-python=={VERSION}", "-d", str(dest)], capture_output=True, text=True)
        if res.returncode != 0 or not path.is_file():
            last = (res.stderr.strip().splitlines() or ["pip said nothing"])[-1]
            raise BuildError(f"could not download llama-cpp-python {VERSION}'s source: {last}")
    got = sha256_file(path)
    if got != SDIST_SHA256:
        path.unlink()
        raise BuildError(f"{SDIST} has sha256 {got[:16]}..., expected {SDIST_SHA256[:16]}...: deleted; run again to re-download")
    return path


def source(python: str) -> Path:
    """The patched source tree (extracted and patched once; an interrupted attempt leaves nothing)."""
    tree = BUILD / "llama-src" / f"{VERSION}-{patch_digest()[:12]}"
    if (tree / ".eesd-patched").is_file():
        return tree
    sdist = fetch_sdist(python)
    tree.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=tree.parent))
    try:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        top = tmp / f"llama_cpp_python-{VERSION}"
        for p in PATCHES:
            res = subprocess.run(["git", "apply", "-p1", str(p)], cwd=top, capture_output=True, text=True)
            if res.returncode != 0:
                why = (res.stderr.strip().splitlines() or ["git apply failed"])[0]
                raise BuildError(f"the patch {p.name} does not apply to llama-cpp-python {VERSION}: {why}")
        (top / ".eesd-patched").write_text(json.dumps({"patches": [p.name for p in PATCHES], "digest": patch_digest()}))
        if tree.exists():
            shutil.rmtree(tree)
        top.rename(tree)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tree


def installed_info(python: str) -> tuple[dict | None, str]:
    """What eesd-build.json of the llama-cpp-python that ``python`` imports says, and why not."""
    code = ("import json, os, llama_cpp; d = os.path.join(os.path.dirname(llama_cpp.__file__), 'lib'); "
            f"p = os.path.join(d, {INFO_NAME!r}); print(json.dumps(json.load(open(p))) if os.path.exists(p) else 'null')")
    res = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if res.returncode != 0:
        return None, "llama-cpp-python is not installed"
    info = json.loads(res.stdout.strip().splitlines()[-1] or "null")
    if info is None:
        return None, "the installed llama-cpp-python was not built by this script (no batch-invariant patch)"
    return info, ""


def check(python: str) -> str:
    """'' when the installed llama-cpp-python is this source, patch and flags; else why not."""
    info, why = installed_info(python)
    if info is None:
        return why
    if info.get("version") != VERSION or info.get("patch") != patch_digest():
        return "the installed llama-cpp-python was built with another patch or version"
    if info.get("cmake_args") != cmake_args():
        return f"the installed llama-cpp-python was built with CMAKE_ARGS {info.get('cmake_args')}, not {cmake_args()}"
    return ""


def run_progress(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None, what: str) -> None:
    """Run a compile, showing one line per 5% of its steps ([n/N] from ninja, [ p%] from make)."""
    step = re.compile(r"^\s*\[\s*(\d+)/(\d+)\]|^\[\s*(\d+)%\]")
    last = -5
    total = 0  # the largest step count seen: a sub-build's own [n/N] (the Vulkan shader generator's) is not the build's
    tail: list[str] = []
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            tail = (tail + [line])[-40:]
            m = step.match(line)
            if not m:
                continue
            if m.group(1):
                total = max(total, int(m.group(2)))
                if int(m.group(2)) < total:
                    continue
            pct = 100 * int(m.group(1)) // int(m.group(2)) if m.group(1) else int(m.group(3))
            if pct >= last + 5:
                last = pct
                print(f"  {what}: {pct}% ({time.monotonic() - start:.0f} s)", flush=True)
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        raise
    if rc != 0:
        sys.stdout.writelines(tail)
        raise BuildError(f"{what} failed (exit {rc}; its last lines are above)")


def install(python: str, into: Path | None = None, deps: bool = True) -> None:
    """Build (or take the kept wheel) and install it into ``python``'s environment; ``into``: keep the
    wheel and a resumable CMake tree there rather than in build/wheels (a second build beside the set-up's);
    ``deps``: False installs the package alone (its dependencies come from elsewhere)."""
    why = check(python)
    if not why:
        print("  llama-cpp-python: already built from the patched source", flush=True)
        return
    args = cmake_args()
    wheels = WHEELS if into is None else into / "wheels"
    wheel = built_wheel(args, wheels)
    if wheel is None:
        wheel = build_wheel(python, args, wheels, None if into is None else into / f"cmake-{build_key(args)}")
    else:
        print(f"  llama-cpp-python: installing the wheel built before ({wheel})", flush=True)
    # its dependencies first, by name from the wheel's metadata (pip resolves them); then the package itself
    res = subprocess.run([python, "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True) if deps else None
    if res is not None and res.returncode != 0:
        raise BuildError(f"installing llama-cpp-python's dependencies failed: {(res.stderr.strip().splitlines() or [''])[-1]}")
    res = subprocess.run([python, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheel)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise BuildError(f"installing {wheel.name} failed: {(res.stderr.strip().splitlines() or [''])[-1]}")
    # found, not imported: without its dependencies it is not importable, yet installed
    code = "import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec('llama_cpp').origin), 'lib'))"
    libdir = Path(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip())
    info = {"version": VERSION, "sdist_sha256": SDIST_SHA256, "patch": patch_digest(), "cmake_args": args,
            "key": build_key(args)}
    (libdir / INFO_NAME).write_text(json.dumps(info, indent=1) + "\n")


WHEELS = BUILD / "wheels"  # the built llama-cpp-python wheel, kept for reuse (scripts/wheel_check.sh installs it)
WHEEL_KEY = WHEELS / "llama-cpp-python.key"  # build_key() of the wheel there


def built_wheel(args: list[str], wheels: Path = WHEELS) -> Path | None:
    """The llama-cpp-python wheel built before from this source, patch and flags, if it is kept in ``wheels``."""
    found = sorted(wheels.glob(f"llama_cpp_python-{VERSION}-*.whl"))
    key = wheels / WHEEL_KEY.name
    if len(found) == 1 and key.is_file() and key.read_text().strip() == build_key(args):
        return found[0]
    return None


def build_wheel(python: str, args: list[str], wheels: Path = WHEELS, cmake_tree: Path | None = None) -> Path:
    """Compile llama-cpp-python from the patched source into a wheel under ``wheels`` (the one
    kept there: a wheel of another source, patch or flags is replaced). ``cmake_tree``: scikit-build-core's
    build directory, kept (an interrupted compile resumes there; other keys' trees beside it are removed)."""
    tree = source(python)
    env = dict(os.environ, CMAKE_ARGS=" ".join(args))
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    print(f"  building llama-cpp-python {VERSION} from the patched source (CMAKE_ARGS={' '.join(args)})", flush=True)
    cmd = [python, "-m", "pip", "wheel", "-v", "--no-deps"]
    if cmake_tree is not None:
        for old in cmake_tree.parent.glob("cmake-*"):
            if old != cmake_tree:
                shutil.rmtree(old, ignore_errors=True)
        cmake_tree.mkdir(parents=True, exist_ok=True)
        print(f"  (compiling in {cmake_tree}: an interrupted build goes on from there)", flush=True)
        cmd.append(f"--config-settings=build-dir={cmake_tree}")
    BUILD.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=".wheel-", dir=BUILD))
    try:
        run_progress([*cmd, "-w", str(out), str(tree)], env=env, what="compiling llama.cpp")
        (wheel,) = out.glob("llama_cpp_python-*.whl")
        wheels.mkdir(parents=True, exist_ok=True)
        for old in wheels.glob("llama_cpp_python-*.whl"):
            old.unlink()
        kept = wheels / wheel.name
        os.replace(wheel, kept)
        (wheels / WHEEL_KEY.name).write_text(build_key(args) + "\n")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return kept


def tools_dir(args: list[str] | None = None) -> Path:
    return BUILD / "llama-tools" / build_key(cmake_args() if args is None else args)


def tools(python: str) -> Path:
    """llama-server and ggml-rpc-server (llama.cpp's rpc-server) from the patched source, with the install's flags."""
    args = cmake_args()
    out = tools_dir(args)
    bins = [out / "bin" / "llama-server", out / "bin" / "ggml-rpc-server"]  # (llama.cpp's rpc-server target)
    if all(b.is_file() for b in bins):
        print(f"  llama.cpp tools: already built in {out.relative_to(ROOT)}", flush=True)
        return out
    if shutil.which("cmake") is None:
        raise BuildError("cmake is not installed: install it (e.g. apt-get install cmake) and run again")
    tree = source(python) / "vendor" / "llama.cpp"
    work = out.with_name(out.name + ".build")
    configure = ["cmake", "-S", str(tree), "-B", str(work), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", *[a for a in args if not a.startswith("-DLLAVA")]]
    res = subprocess.run(configure, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stdout.write(res.stdout[-4000:] + res.stderr[-4000:])
        raise BuildError("configuring the llama.cpp tools failed (cmake's messages are above)")
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    print(f"  building llama-server and ggml-rpc-server into {out.relative_to(ROOT)}", flush=True)
    run_progress(["cmake", "--build", str(work), "--target", *(b.name for b in bins), "-j", jobs],
                 what="compiling llama.cpp tools")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "bin").mkdir(parents=True)
    for b in bins:
        shutil.copy2(work / "bin" / b.name, tmp / "bin" / b.name)
    (tmp / INFO_NAME).write_text(json.dumps({"version": VERSION, "patch": patch_digest(), "cmake_args": args}, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["install", "check", "tools", "source"])
    ap.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"), help="the interpreter of the environment (default .venv)")
    ap.add_argument("--patch", type=Path, action="append", default=[], metavar="FILE",
                    help="install, check, source: a patch applied after native/patches for this build only (its own "
                         "source tree and key; e.g. scripts/patches/ggml-vulkan-old-headers.patch for the gpu-path build)")
    ap.add_argument("--no-deps", action="store_true", help="install: the package alone, not its dependencies")
    ap.add_argument("--into", type=Path, help="install: keep the wheel and a resumable CMake tree in this folder "
                                              "(default: the wheel in build/wheels, a temporary tree)")
    args = ap.parse_args()
    global PATCHES
    PATCHES = PATCHES + [f.resolve() for f in args.patch]
    try:
        if args.what == "check":
            why = check(args.python)
            print(why or "llama-cpp-python is built from the patched source")
            return 1 if why else 0
        if args.what == "install":
            install(args.python, args.into.resolve() if args.into else None, deps=not args.no_deps)
        elif args.what == "tools":
            print(tools(args.python) / "bin")
        else:
            print(source(args.python))
    except BuildError as exc:
        print(f"llama_build: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("llama_build: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
