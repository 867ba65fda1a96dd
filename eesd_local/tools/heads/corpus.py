"""The teacher corpus: the base model's own greedy answers, kept in the repository so every session adds to it.

Generating answers is what the teacher costs (the rest of a head's training, top-k targets, trunk states,
the exit block, is cheap to redo from them), so the answers are kept: as token ids, compressed, in shard
files under ``models/corpus/<model>/`` that are written once and never changed. A shard holds no text:
each answer names where its prompt comes from (an item id of :mod:`.data`, ``sharegpt:INDEX`` or
``code:MODULE.FUNC:LINE``), and the prompt is rebuilt from the installed packages when it is needed;
the sha256 of the prompt's token ids, kept beside it, catches a rebuild that came out different (another
Python's standard library, another ShareGPT file).

Shard file ``shard-NNNNN-HHHHHHHH.bin`` (NNNNN orders the shards, HHHHHHHH begins the file's sha256, so
that two clones growing apart never write the same name)::

    MAGIC (8 bytes) | header length (u32, little-endian) | header (JSON, utf-8) | payload (lzma, xz format)

The header names the model (fingerprint, name, file, vocabulary size), the generation settings, the
counts, and the payload's length and sha256. The payload decompresses to::

    meta length (u32) | meta (JSON: [[source, prompt sha, prompt tokens, answer tokens, finished], ...])
    | the answers' token ids, concatenated, int32 little-endian

Plain int32 under xz came out smallest of the encodings tried (varint, delta + zigzag varint, byte planes;
zlib, bz2, xz: models/README.md): lzma's 4-byte position context already models the ids' constant high
bytes. Shards are written to a hidden temporary name and renamed into place, and a reader lists only
complete names: reading while another process grows the corpus is safe. A shard that is truncated or
damaged (length, sha256, decoding, a token id outside the vocabulary) is skipped with a
:class:`CorpusWarning`; a shard made by another model is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import lzma
import os
import re
import signal
import struct
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np

from eesd_local.base.atomic import atomic_path
from eesd_local.base.errors import EesdError
from eesd_local.base.paths import cache_dir, models_dir
from eesd_local.gguf.headfile import fingerprint, model_info
from eesd_local.gguf.reader import read_header
from eesd_local.llama.catalog import known_models, registry_name_for
from eesd_local.tools.heads import data
from eesd_local.tools.heads.teacher import chat_formatter, open_context

FORMAT = 1
MAGIC = b"EESDCORP"
SHARD_GLOB = "shard-*.bin"
_SHARD_NAME = re.compile(r"^shard-(\d{5,})-([0-9a-f]{8})\.bin$")
_U32 = struct.Struct("<I")
MAX_HEADER = 1 << 20  # a larger header length is damage, not a header
DEFAULT_MAX_MB = 10.0  # per model: the two demo models' corpora stay under ~20 MB in git together
BYTES_PER_TOKEN_GUESS = 1.5  # until the corpus has its own figure (measured ~1.2-1.4: models/README.md)
SHARD_OVERHEAD = 600  # bytes of a shard besides its tokens: header, xz container, a few answers' metadata
XZ_PRESET = 9 | lzma.PRESET_EXTREME  # smallest; shards are written every few minutes, so the cost does not show


class CorpusWarning(UserWarning):
    """A shard was skipped (truncated, damaged, or written by a newer format)."""


@dataclass(frozen=True)
class GrowConfig:
    """How answers are generated (recorded in every shard, as ``settings``)."""

    n_parallel: int = 48  # sequences decoded together: tokens/s level off from 48 (models/README.md)
    max_new: int = 320  # answer tokens per prompt at most
    max_prompt: int = 384  # longer prompts are skipped
    threads: int = 2
    mix: str = "own"  # data.mix_items: code tasks and ShareGPT requests, training range only
    shard_tokens: int = 65536  # answer tokens per shard
    shard_seconds: float = 900.0  # or a shard at least this often: a kill -9 loses at most this much work
    prompt_chunk: int = 128  # prompt tokens fed per sequence per step
    n_batch: int = 512  # rows per llama_decode


@dataclass(frozen=True)
class Answer:
    """One greedy answer of the model."""

    source: str  # the prompt's item id in data.py: "sharegpt:INDEX" or "code:MODULE.FUNC:LINE"
    prompt_sha: str  # sha256 (first 16 hex digits) of the prompt's token ids as int32 little-endian
    n_prompt: int  # tokens of the prompt (chat template included)
    tokens: np.ndarray  # the answer's token ids (int32), with the end-of-generation token if it ended there
    finished: bool  # True: ended by the model (end of generation); False: cut at max_new


@dataclass(frozen=True)
class ModelStamp:
    """Which model wrote a shard."""

    fingerprint: str
    name: str
    file: str
    n_vocab: int

    @classmethod
    def of(cls, model_path: Path) -> ModelStamp:
        info = model_info(model_path)
        return cls(fingerprint(model_path), info["name"], Path(model_path).name, info["n_vocab"])

    def label(self) -> str:
        return f"{self.file} ({self.name}, fingerprint {self.fingerprint[:12]})"


@dataclass
class Shard:
    path: Path
    header: dict
    answers: list[Answer]


@dataclass
class Corpus:
    """What a corpus folder holds: the readable shards, their answers (one per source) and what was skipped."""

    folder: Path
    shards: list[Shard] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    duplicates: int = 0  # answers whose source an earlier shard already answered (clones that grew apart)

    @property
    def answers(self) -> list[Answer]:
        seen: set[str] = set()
        out = []
        for shard in self.shards:
            for a in shard.answers:
                if a.source not in seen:
                    seen.add(a.source)
                    out.append(a)
        return out

    def stats(self) -> dict:
        answers = self.answers
        tokens = sum(len(a.tokens) for a in answers)
        size = sum(s.path.stat().st_size for s in self.shards if s.path.exists())
        settings = Counter(json.dumps(s.header.get("settings", {}), sort_keys=True) for s in self.shards)
        return {
            "folder": str(self.folder),
            "shards": len(self.shards),
            "skipped": [f"{p.name}: {why}" for p, why in self.skipped],
            "answers": len(answers),
            "duplicates": self.duplicates,
            "tokens": tokens,
            "prompt_tokens": sum(a.n_prompt for a in answers),
            "finished": sum(a.finished for a in answers),
            "bytes": size,
            "bytes_per_1m_tokens": round(size / tokens * 1e6) if tokens else None,
            "sources": dict(Counter(a.source.split(":", 1)[0] for a in answers)),
            "models": sorted({ModelStamp(**s.header["model"]).label() for s in self.shards}),
            "settings": [json.loads(k) for k in settings],
        }


class CorruptShard(Exception):
    """Why a shard cannot be read (the reader turns it into a CorpusWarning and skips the shard)."""


# --- folders ------------------------------------------------------------------------


def corpus_root() -> Path:
    """``models/corpus`` of the checkout (``EESD_CORPUS`` overrides: tests, or a corpus kept elsewhere)."""
    env = os.environ.get("EESD_CORPUS")
    return Path(env).expanduser() if env else models_dir() / "corpus"


def corpus_dir_for(model: str, model_path: Path | None) -> Path:
    """The corpus folder of a model: its registry name, or the GGUF file's stem for a model given by path."""
    if model in known_models():
        name = model
    else:
        name = (registry_name_for(model_path) if model_path is not None else None) or Path(model).stem
    return corpus_root() / name


def shard_paths(folder: Path) -> list[Path]:
    """Complete shards, in order (a temporary file being written has a hidden name and is not listed)."""
    found = [(int(m.group(1)), p.name, p) for p in Path(folder).glob(SHARD_GLOB) if (m := _SHARD_NAME.match(p.name))]
    return [p for _, _, p in sorted(found)]


def check_writable(folder: Path) -> None:
    """Create ``folder`` if needed and write (then remove) a hidden file in it: a corpus that cannot be
    written fails here, before a model loads, not after a run whose answers had nowhere to go."""
    folder = Path(folder)
    hint = "give a folder you can write with --corpus FOLDER"
    if folder.exists() and not folder.is_dir():
        raise EesdError(f"the corpus folder {folder} is a file, not a folder", hint=hint)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-check.tmp-{os.getpid()}"  # a name atomic.remove_stale_temps cleans up after a crash
        try:
            with open(probe, "wb") as fh:
                fh.write(b"eesd")
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
    except OSError as exc:
        raise EesdError(f"cannot write the corpus folder {folder}: {exc.strerror or exc}", hint=hint) from None


# --- the format -----------------------------------------------------------------------


def prompt_sha(tokens: Iterable[int]) -> str:
    return hashlib.sha256(np.asarray(list(tokens), "<i4").tobytes()).hexdigest()[:16]


def encode_tokens(ids: np.ndarray) -> bytes:
    return np.asarray(ids).astype("<i4", casting="same_kind").tobytes()


def decode_tokens(raw: bytes, n: int) -> np.ndarray:
    if len(raw) != 4 * n:
        raise ValueError(f"{len(raw)} bytes of token ids for {n} tokens")
    return np.frombuffer(raw, "<i4").astype(np.int32)


def shard_bytes(stamp: ModelStamp, settings: dict, answers: list[Answer]) -> bytes:
    """The bytes of a shard file (checked: every token id lies in the model's vocabulary)."""
    for a in answers:
        if len(a.tokens) and (int(np.min(a.tokens)) < 0 or int(np.max(a.tokens)) >= stamp.n_vocab):
            bad = int(a.tokens[(a.tokens < 0) | (a.tokens >= stamp.n_vocab)][0])
            raise EesdError(
                f"answer to {a.source} holds token id {bad}, outside the vocabulary of {stamp.label()} (0..{stamp.n_vocab - 1})",
                hint="it was not made by this model: grow the corpus with the model that made the answers",
            )
    meta = json.dumps([[a.source, a.prompt_sha, a.n_prompt, len(a.tokens), a.finished] for a in answers]).encode()
    ids = np.concatenate([a.tokens for a in answers]) if answers else np.zeros(0, np.int32)
    payload = lzma.compress(_U32.pack(len(meta)) + meta + encode_tokens(ids), preset=XZ_PRESET)
    header = {
        "format": FORMAT,
        "model": asdict(stamp),
        "settings": settings,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "answers": len(answers),
        "tokens": int(ids.size),
        "payload_bytes": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
    }
    head = json.dumps(header, sort_keys=True).encode()
    return MAGIC + _U32.pack(len(head)) + head + payload


def parse_shard(path: Path, raw: bytes) -> Shard:
    """A shard's bytes -> its header and answers; any damage raises CorruptShard."""
    if len(raw) < len(MAGIC) + 4 or raw[: len(MAGIC)] != MAGIC:
        raise CorruptShard("not a corpus shard (no magic)")
    (n_head,) = _U32.unpack_from(raw, len(MAGIC))
    start = len(MAGIC) + 4
    if n_head > MAX_HEADER or start + n_head > len(raw):
        raise CorruptShard(f"truncated ({len(raw)} bytes; the header alone needs {start + n_head})")
    try:
        header = json.loads(raw[start : start + n_head])
        if header["format"] != FORMAT:
            raise CorruptShard(f"format {header['format']} (this eesd reads {FORMAT}): update eesd-local")
        n_payload, sha, n_answers, n_tokens = (
            int(header["payload_bytes"]), str(header["payload_sha256"]), int(header["answers"]), int(header["tokens"]))
        ModelStamp(**header["model"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptShard(f"damaged header ({exc})") from None
    payload = raw[start + n_head :]
    if len(payload) != n_payload:
        raise CorruptShard(f"truncated ({len(payload)} payload bytes of {n_payload})")
    if hashlib.sha256(payload).hexdigest() != sha:
        raise CorruptShard("damaged (payload sha256 differs)")
    try:
        body = lzma.decompress(payload)
        (n_meta,) = _U32.unpack_from(body, 0)
        meta = json.loads(body[4 : 4 + n_meta])
        ids = decode_tokens(body[4 + n_meta :], n_tokens)
    except (lzma.LZMAError, struct.error, ValueError) as exc:
        raise CorruptShard(f"damaged payload ({exc})") from None
    if len(meta) != n_answers or sum(int(m[3]) for m in meta) != n_tokens:
        raise CorruptShard("damaged payload (counts differ from the header)")
    answers, at = [], 0
    for source, psha, n_prompt, n, finished in meta:
        answers.append(Answer(str(source), str(psha), int(n_prompt), ids[at : at + n], bool(finished)))
        at += n
    return Shard(path, header, answers)


def read_shard(path: Path) -> Shard:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise CorruptShard(f"unreadable ({exc.strerror or exc})") from None
    return parse_shard(Path(path), raw)


def _warn(path: Path, why: str) -> None:
    warnings.warn(f"corpus shard {path} skipped: {why}", CorpusWarning, stacklevel=3)


def read_corpus(
    folder: Path, *, model: ModelStamp | None = None, on_skip: Callable[[Path, str], None] = _warn,
    first: int | None = None,
) -> Corpus:
    """Every readable shard of ``folder`` (only the ``first`` shards when given: the corpus as it was
    when a head was made). Shards made by another model than ``model`` (or, without one, by another
    model than the first shard's) are refused with an EesdError naming both; damaged shards and shards
    holding a token id outside the writer's vocabulary are skipped through ``on_skip``."""
    corpus = Corpus(Path(folder))
    seen: set[str] = set()
    for path in shard_paths(folder)[:first]:
        try:
            shard = read_shard(path)
            stamp = ModelStamp(**shard.header["model"])
            n_vocab = model.n_vocab if model is not None else stamp.n_vocab
            for a in shard.answers:
                if len(a.tokens) and (int(a.tokens.min()) < 0 or int(a.tokens.max()) >= n_vocab):
                    bad = int(a.tokens[(a.tokens < 0) | (a.tokens >= n_vocab)][0])
                    raise CorruptShard(f"answer to {a.source} holds token id {bad}, outside the vocabulary (0..{n_vocab - 1})")
        except CorruptShard as exc:
            corpus.skipped.append((path, str(exc)))
            on_skip(path, str(exc))
            continue
        expected = model or (ModelStamp(**corpus.shards[0].header["model"]) if corpus.shards else stamp)
        if stamp.fingerprint != expected.fingerprint:
            raise EesdError(
                f"corpus shard {path} was made by {stamp.label()}, not by {expected.label()}",
                hint=f"train on the corpus of that model, or move the shard out of {Path(folder)}",
            )
        corpus.duplicates += sum(a.source in seen for a in shard.answers)
        seen.update(a.source for a in shard.answers)
        corpus.shards.append(shard)
    return corpus


def write_shard(folder: Path, stamp: ModelStamp, settings: dict, answers: list[Answer]) -> Path:
    """Write ``answers`` as the next shard of ``folder``, atomically; never replaces a file."""
    raw = shard_bytes(stamp, settings, answers)
    numbers = [int(m.group(1)) for p in shard_paths(folder) if (m := _SHARD_NAME.match(p.name))]
    sha = hashlib.sha256(raw).hexdigest()[:8]
    path = Path(folder) / f"shard-{max(numbers, default=0) + 1:05d}-{sha}.bin"
    with atomic_path(path, force=False) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())  # the rename must not reach the disk before the bytes do
    return path


@contextlib.contextmanager
def grow_lock(folder: Path) -> Iterator[None]:
    """One grower per corpus folder at a time (shard numbers are taken from the folder's listing)."""
    key = hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:16]
    lock_path = cache_dir("corpus-locks") / f"{key}.lock"
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise EesdError(
                f"another `eesd heads corpus grow` is writing to {folder} (pid {fh.read().strip() or '?'})",
                hint="let it run (it adds to the same corpus), or stop it first",
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        yield


# --- prompts ----------------------------------------------------------------------------------


def prompt_items(mix: str = "own") -> list[data.Item]:
    """The prompts a corpus answers, in the order it answers them (a fixed shuffle of the training range)."""
    return [it for it in data.mix_items(mix) if it.messages]


def items_by_source(mix: str = "own") -> dict[str, data.Item]:
    """Source id -> the prompt, rebuilt from the installed packages (what training reads answers against)."""
    return {it.id: it for it in prompt_items(mix)}


# --- generating answers ---------------------------------------------------------------------


@dataclass
class _Slot:
    item: data.Item
    prompt: list[int]
    answer: list[int] = field(default_factory=list)
    fed: int = 0  # prompt tokens in the KV cache


@dataclass
class GrowReport:
    answers: int = 0  # written by this run
    tokens: int = 0  # answer tokens written by this run
    generated: int = 0  # answer tokens generated (written, dropped at the end, or still buffered)
    prompt_tokens: int = 0  # prompt tokens fed
    seconds: float = 0.0
    shards: list[Path] = field(default_factory=list)
    stop: str = ""  # "minutes", "max-mb", "prompts" or "interrupted"
    signum: int = 0  # the signal that stopped it (SIGINT, SIGTERM), 0 if none
    bytes_on_disk: int = 0
    corpus_tokens: int = 0  # answer tokens of the whole corpus


def _batch(active: list[tuple[int, _Slot]], n_batch: int, chunk: int) -> tuple[list[tuple[int, int, int, bool]], list[int], int]:
    """One decode's rows (token, pos, seq, picks a token) for the slots under way, the slots whose next token
    the picking rows give (in row order), and the prompt tokens fed. Answering sequences come first, one row
    each; prompt chunks fill the room left, and a prompt's last row picks its answer's first token."""
    rows: list[tuple[int, int, int, bool]] = []
    owners: list[int] = []
    for s, sl in active:
        if sl.fed == len(sl.prompt):
            rows.append((sl.answer[-1], sl.fed + len(sl.answer) - 1, s, True))
            owners.append(s)
    fed = 0
    for s, sl in active:
        room = n_batch - len(rows)
        if sl.fed < len(sl.prompt) and room > 0:
            n = min(chunk, len(sl.prompt) - sl.fed, room)
            rows.extend((sl.prompt[sl.fed + j], sl.fed + j, s, sl.fed + j == len(sl.prompt) - 1) for j in range(n))
            sl.fed += n
            fed += n
            if sl.fed == len(sl.prompt):
                owners.append(s)
    return rows, owners, fed


def settings_of(cfg: GrowConfig, model_path: Path) -> dict:
    """The generation settings a shard records (the batch layout and the llama.cpp build decide near ties)."""
    kv = read_header(Path(model_path)).kv
    template = str(kv.get("tokenizer.chat_template", ""))
    try:  # which patch of llama.cpp (kernels) scripts/llama_build.py built, if it did
        build = json.loads((Path(llama_cpp.__file__).parent / "lib" / "eesd-build.json").read_text()).get("patch")
    except (OSError, ValueError, AttributeError):
        build = None
    return {
        "greedy": True,
        "max_new": cfg.max_new,
        "max_prompt": cfg.max_prompt,
        "n_parallel": cfg.n_parallel,
        "n_batch": cfg.n_batch,
        "prompt_chunk": cfg.prompt_chunk,
        "threads": cfg.threads,
        "mix": cfg.mix,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()[:16],
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_patch": build[:16] if isinstance(build, str) else None,
    }


def time_is_short(now: float, deadline: float, answer_s: float, *, answers_ended: int) -> bool:
    """Whether a new prompt would not be answered by ``deadline`` (``answer_s``: what one takes at the rate
    so far). Asked again at every step, and only once an answer has ended: until then the rate counts every
    sequence's prompt being prefilled and no answer yet (the 1.5B's first minute read 3 tokens/s, a fifteenth
    of its steady rate, and a sticky early "no" stopped a 22-minute run after 6)."""
    return answers_ended > 0 and now + answer_s >= deadline


def grow(
    model_path: Path,
    folder: Path,
    cfg: GrowConfig | None = None,
    *,
    minutes: float | None = None,
    max_bytes: int = int(DEFAULT_MAX_MB * 1e6),
    items: Iterable[data.Item] | None = None,
    progress: Callable[[dict], None] | None = None,
    on_skip: Callable[[Path, str], None] = _warn,
) -> GrowReport:
    """Answer prompts not yet in the corpus at ``folder`` and add the answers as shards, until ``minutes``
    pass, the corpus reaches ``max_bytes`` or the prompts (``items``, default the training mix) run out.
    Near a limit no new prompt is started and the answers under way are finished. Ctrl-C or SIGTERM
    writes the finished answers, drops the ones under way and returns (``stop`` "interrupted", ``signum``
    set: the caller raises ``interrupts.interrupt_for(signum)``); a later run goes on with the prompts
    not yet answered."""
    cfg = cfg or GrowConfig()
    folder = Path(folder)
    check_writable(folder)  # before the model loads
    stamp = ModelStamp.of(model_path)
    t0 = time.time()
    deadline = t0 + minutes * 60 if minutes else float("inf")
    report = GrowReport()
    with grow_lock(folder):
        corpus = read_corpus(folder, model=stamp, on_skip=on_skip)
        done = {a.source for a in corpus.answers}
        disk = sum(s.path.stat().st_size for s in corpus.shards)
        corpus_tokens = sum(len(a.tokens) for a in corpus.answers)
        report.bytes_on_disk, report.corpus_tokens = disk, corpus_tokens
        if disk >= max_bytes:
            report.stop = "max-mb"
            return report
        bytes_per_token = disk / corpus_tokens if corpus_tokens > 10_000 else BYTES_PER_TOKEN_GUESS
        pending = (it for it in (prompt_items(cfg.mix) if items is None else items) if it.id not in done and it.messages)
        settings = settings_of(cfg, model_path)
        render = chat_formatter(model_path)
        # each sequence in its own KV stream (a row attends to its sequence's cells only: with one unified
        # cache every row would scan all sequences' cells), logits only on the rows that pick a token
        ctx = open_context(model_path, n_parallel=cfg.n_parallel, n_ctx_per_seq=cfg.max_prompt + cfg.max_new + 8,
                           threads=cfg.threads, n_batch=cfg.n_batch, kv_unified=False)
        stop = {"signum": 0}

        def on_signal(signum, frame):  # noqa: ARG001
            stop["signum"] = signum

        old = signal.signal(signal.SIGINT, on_signal), signal.signal(signal.SIGTERM, on_signal)
        slots: list[_Slot | None] = [None] * cfg.n_parallel
        finished: list[Answer] = []
        last_write = time.time()
        lengths: list[int] = []  # answer lengths so far: what an answer under way will still cost
        t_gen = 0.0  # when the first decode started: the rate leaves the loading out

        def flush() -> None:
            nonlocal finished, last_write, disk
            if finished:
                path = write_shard(folder, stamp, settings, finished)
                report.shards.append(path)
                report.answers += len(finished)
                report.tokens += sum(len(a.tokens) for a in finished)
                disk += path.stat().st_size
            finished, last_write = [], time.time()

        try:
            while True:
                now = time.time()
                rate = report.generated / (now - t_gen) if t_gen and now > t_gen else 0.0
                mean_len = float(np.mean(lengths)) if lengths else cfg.max_new / 2
                answer_s = mean_len * cfg.n_parallel / rate if rate > 0 else 0.0  # time one new answer takes
                n_busy = sum(s is not None for s in slots)
                buffered = sum(len(a.tokens) for a in finished)
                in_flight = sum(max(len(s.answer), mean_len) for s in slots if s is not None)  # as they will end
                overhead = SHARD_OVERHEAD if finished or n_busy else 0  # the shard these answers will go to
                projected = disk + overhead + (buffered + in_flight) * bytes_per_token
                if projected >= max_bytes:
                    report.stop = report.stop or "max-mb"
                near_end = time_is_short(now, deadline, answer_s, answers_ended=len(lengths))
                for s in range(cfg.n_parallel):  # start new prompts while no limit is near
                    while slots[s] is None and not report.stop and not near_end:
                        item = next(pending, None)
                        if item is None:
                            report.stop = "prompts"
                            break
                        text = render([{"role": r, "content": c} for r, c in item.messages])
                        prompt = ctx.model.tokenize(text, add_special=False)
                        if len(prompt) <= cfg.max_prompt:
                            slots[s] = _Slot(item, prompt)
                active = [(s, sl) for s, sl in enumerate(slots) if sl is not None]
                if stop["signum"] or not active or now >= deadline:
                    if near_end or now >= deadline:
                        report.stop = report.stop or "minutes"
                    break
                rows, owners, fed = _batch(active, cfg.n_batch, cfg.prompt_chunk)
                report.prompt_tokens += fed
                t_gen = t_gen or time.time()
                next_tokens = ctx.decode_rows(rows).argmax(axis=1)
                for s, tok in zip(owners, next_tokens.tolist()):
                    ended = slots[s]
                    assert ended is not None
                    ended.answer.append(tok)
                    report.generated += 1
                    eog = ctx.model.is_eog(tok)
                    if eog or len(ended.answer) >= cfg.max_new:
                        answer = np.asarray(ended.answer, np.int32)
                        finished.append(Answer(ended.item.id, prompt_sha(ended.prompt), len(ended.prompt), answer, eog))
                        lengths.append(len(ended.answer))
                        ctx.clear_seq(s)
                        slots[s] = None
                buffered = sum(len(a.tokens) for a in finished)
                if buffered >= cfg.shard_tokens or (finished and time.time() - last_write >= cfg.shard_seconds):
                    flush()
                if progress is not None:
                    elapsed = time.time() - t0
                    progress({
                        "elapsed": elapsed,
                        "generated": report.generated,
                        "tok_s": rate,
                        "answers": report.answers + len(finished),
                        "corpus_tokens": corpus_tokens + report.tokens + buffered,
                        "bytes": disk + buffered * bytes_per_token,
                        "max_bytes": max_bytes,
                        "deadline_s": deadline - time.time(),
                        "active": len(active),
                        "stop": report.stop or ("minutes" if near_end else ""),  # why no new prompt starts
                    })
        finally:
            try:
                flush()  # the finished answers are kept whatever stopped the loop
            finally:
                signal.signal(signal.SIGINT, old[0])
                signal.signal(signal.SIGTERM, old[1])
                ctx.close()
    report.signum = stop["signum"]
    if report.signum:
        report.stop = "interrupted"
    report.seconds = time.time() - t0
    report.bytes_on_disk = disk
    report.corpus_tokens = corpus_tokens + report.tokens
    return report
