"""The teacher pass: the full model's own answers and its top-k next-token distribution, by llama.cpp.

Several sequences decode together in one ``llama_decode`` (a batch of b tokens costs far less
than b single decodes), every position asks for logits, and each row is reduced at once to the
teacher's top-k log-probabilities. Chat items are prefilled and answered greedily (the text the
drafter must predict at inference); raw-text items are only teacher-forced. Results go to
shards ``teacher-NNNNN.npz`` (written atomically); a rerun skips items already in a shard.

Shard arrays: ``tokens`` int32 [T]; ``offsets`` int64 [S+1]; ``n_prompt`` int32 [S];
``topk_ids`` int32 [T, K] and ``topk_logp`` float16 [T, K], where row j is the teacher's
distribution for token j+1 of its sequence (the last row of a sequence is padding, ids -1);
``ids`` and ``categories`` [S] strings.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from eesd_local.base.atomic import atomic_path
from eesd_local.base.errors import EesdError
from eesd_local.base.interrupts import interrupt_for
from eesd_local.gguf.reader import read_header
from eesd_local.llama import runtime
from eesd_local.tools.heads.data import Item
from eesd_local.tools.heads.shards import shard_paths


@dataclass
class TeacherConfig:
    n_parallel: int = 12  # sequences decoded together
    max_prompt: int = 384  # longer prompts are skipped (chat) or cut (raw text)
    max_new: int = 320  # answer tokens per chat item
    top_k: int = 32  # teacher log-probs kept per position
    threads: int = 2
    shard_tokens: int = 16384  # tokens per shard file
    prompt_chunk: int = 128  # prompt tokens fed per sequence per step


@dataclass
class _Slot:
    seq: int
    item: Item
    tokens: list[int]
    n_prompt: int
    generate: bool
    fed: int = 0
    ids: list[np.ndarray] = field(default_factory=list)
    logp: list[np.ndarray] = field(default_factory=list)


def done_ids(out_dir: Path) -> set[str]:
    ids: set[str] = set()
    for p in shard_paths(out_dir):
        with np.load(p) as z:
            ids.update(str(x) for x in z["ids"])
    return ids


def count_tokens(out_dir: Path) -> int:
    total = 0
    for p in shard_paths(out_dir):
        with np.load(p) as z:
            total += int(z["offsets"][-1])
    return total


def chat_formatter(model_path: Path) -> Callable[[list[dict]], str]:
    """messages -> prompt text, with the model's own chat template (from its GGUF metadata)."""

    kv = read_header(Path(model_path), keep_strings=("tokenizer.ggml.tokens",)).kv
    if "tokenizer.chat_template" not in kv:
        raise EesdError(f"{model_path} has no chat template", hint="use a chat (instruct) model")
    template = str(kv["tokenizer.chat_template"])
    tokens = kv["tokenizer.ggml.tokens"]

    def token_text(key: str) -> str:
        return str(tokens[int(kv[key])]) if key in kv else ""

    fmt = Jinja2ChatFormatter(
        template, eos_token=token_text("tokenizer.ggml.eos_token_id"), bos_token=token_text("tokenizer.ggml.bos_token_id")
    )

    def render(messages: list[dict]) -> str:
        return fmt(messages=messages).prompt  # type: ignore[arg-type]  # plain role/content dicts

    return render


def open_context(model_path: Path, *, n_parallel: int, n_ctx_per_seq: int, threads: int, n_batch: int = 512,
                 kv_unified: bool = True) -> runtime.Context:
    """The model at ``model_path`` in a llama.cpp context of ``n_parallel`` sequences of ``n_ctx_per_seq``
    tokens each (``kv_unified``: in one KV buffer, else a stream each), with llama.cpp's own choice of GPU
    layers and flash attention. Closing the context frees the model (``ctx.model``) too."""
    model = runtime.Model(model_path, n_gpu_layers=-1)  # -1: llama.cpp's default, every layer on a GPU if there is one
    try:
        params = runtime.ContextParams(n_ctx=n_parallel * n_ctx_per_seq, n_batch=n_batch, n_threads=threads,
                                       flash_attn=None, n_seq_max=n_parallel, kv_unified=kv_unified)
        return runtime.Context(model, params)
    finally:
        model.close()  # at once if the context failed, else with the context


def topk_rows(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Teacher rows -> (top-k ids int32, top-k log-probs float16), log-probs over the full vocab."""
    import torch  # noqa: PLC0415 - torch: optional (train extra)

    t = torch.from_numpy(logits)
    lse = torch.logsumexp(t, dim=-1, keepdim=True)
    vals, idx = torch.topk(t, k, dim=-1)
    return idx.to(torch.int32).numpy(), (vals - lse).to(torch.float16).numpy()


def _prepare(item: Item, model: runtime.Model, render, cfg: TeacherConfig) -> tuple[list[int], bool] | None:
    if item.messages:
        text = render([{"role": r, "content": c} for r, c in item.messages])
        toks = model.tokenize(text, add_special=False)
        if len(toks) > cfg.max_prompt:
            return None
        return toks, True
    toks = model.tokenize(item.text, add_special=False, parse_special=False)[: cfg.max_prompt + cfg.max_new]
    return (toks, False) if len(toks) >= 16 else None


def run_teacher(
    model_path: Path,
    items: Iterable[Item],
    out_dir: Path,
    *,
    cfg: TeacherConfig | None = None,
    budget_tokens: int = 10**12,
    time_limit_s: float = 1e12,
    progress: Callable[[dict], None] | None = None,
    stop_when: Callable[[int, float], bool] | None = None,
    raise_on_signal: bool = False,
) -> int:
    """Generate/teacher-force ``items`` into shards under ``out_dir`` until ``budget_tokens``
    tokens are on disk (counting earlier shards), ``time_limit_s`` passed or ``stop_when(tokens
    on disk and in flight, seconds)`` says so; sequences under way are finished first. Returns
    the tokens on disk. Ctrl-C or SIGTERM stops it and keeps the finished sequences (a later run
    goes on from them); with ``raise_on_signal`` it then raises KeyboardInterrupt (Terminated
    for SIGTERM), for callers whose result would be partial."""
    cfg = cfg or TeacherConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    skip = done_ids(out_dir)
    on_disk = count_tokens(out_dir)
    if on_disk >= budget_tokens:
        return on_disk
    shard_no = len(shard_paths(out_dir))
    render = chat_formatter(model_path)
    ctx = open_context(model_path, n_parallel=cfg.n_parallel, n_ctx_per_seq=cfg.max_prompt + cfg.max_new + 8,
                       threads=cfg.threads)
    pending: Iterator[Item] = (it for it in items if it.id not in skip)
    slots: list[_Slot | None] = [None] * cfg.n_parallel
    finished: list[_Slot] = []
    buffered = 0
    t0 = time.time()
    made = 0
    stop = {"flag": False, "signum": 0}
    old = signal.getsignal(signal.SIGINT)
    old_term = signal.getsignal(signal.SIGTERM)

    def _on_sigint(signum, frame):  # noqa: ARG001
        stop["flag"] = True
        stop["signum"] = signum

    signal.signal(signal.SIGINT, _on_sigint)
    signal.signal(signal.SIGTERM, _on_sigint)

    def flush() -> None:
        nonlocal shard_no, buffered, finished
        if finished:
            _write_shard(out_dir / f"teacher-{shard_no:05d}.npz", finished, cfg.top_k)
            shard_no += 1
        finished = []
        buffered = 0

    try:
        exhausted = False
        while True:
            over = on_disk + made >= budget_tokens or time.time() - t0 > time_limit_s or stop["flag"]
            if not over and stop_when is not None:
                in_flight = sum(len(sl.tokens) for sl in slots if sl is not None)
                over = stop_when(on_disk + made + in_flight, time.time() - t0)
            for s in range(cfg.n_parallel):
                while slots[s] is None and not exhausted and not over:
                    item = next(pending, None)
                    if item is None:
                        exhausted = True
                        break
                    prep = _prepare(item, ctx.model, render, cfg)
                    if prep is not None:
                        slots[s] = _Slot(seq=s, item=item, tokens=prep[0], n_prompt=len(prep[0]), generate=prep[1])
            active = [sl for sl in slots if sl is not None]
            if not active or stop["flag"]:  # interrupted: keep the finished sequences, drop partial ones
                break
            entries: list[tuple[int, int, int, bool]] = []  # (token, position, sequence, logits): every row
            owners: list[tuple[_Slot, int]] = []
            room = ctx.n_batch
            for sl in active:  # generating slots first: one token each
                if sl.fed >= sl.n_prompt and sl.fed < len(sl.tokens):
                    entries.append((sl.tokens[sl.fed], sl.fed, sl.seq, True))
                    owners.append((sl, 1))
                    room -= 1
            for sl in active:  # then prompt chunks in the room left
                if sl.fed < sl.n_prompt and room > 0:
                    n = min(cfg.prompt_chunk, sl.n_prompt - sl.fed, room)
                    entries.extend((sl.tokens[sl.fed + j], sl.fed + j, sl.seq, True) for j in range(n))
                    owners.append((sl, n))
                    room -= n
            logits = ctx.decode_rows(entries)
            ids, logp = topk_rows(logits, cfg.top_k)
            row = 0
            for sl, n in owners:
                sl.ids.append(ids[row : row + n])
                sl.logp.append(logp[row : row + n])
                row += n
                sl.fed += n
                if sl.fed < sl.n_prompt:
                    continue
                done = False
                if sl.generate:
                    nxt = int(ids[row - 1, 0])  # greedy: the teacher's argmax
                    sl.tokens.append(nxt)
                    done = ctx.model.is_eog(nxt) or len(sl.tokens) - sl.n_prompt >= cfg.max_new
                else:
                    done = True
                if done:
                    ctx.clear_seq(sl.seq)
                    slots[sl.seq] = None
                    finished.append(sl)
                    made += len(sl.tokens)
                    buffered += len(sl.tokens)
                    if buffered >= cfg.shard_tokens:
                        flush()
            if progress is not None:
                progress({"tokens": on_disk + made, "new": made, "elapsed": time.time() - t0, "shards": shard_no})
        flush()
    finally:
        signal.signal(signal.SIGINT, old)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if old_term is None else old_term)
        ctx.close()
    if raise_on_signal and stop["signum"]:
        raise interrupt_for(stop["signum"])
    return on_disk + made


def _write_shard(path: Path, seqs: list[_Slot], k: int) -> None:
    tokens, offsets, n_prompt, ids_all, logp_all = [], [0], [], [], []
    for sl in seqs:
        L = len(sl.tokens)
        ids = np.concatenate(sl.ids)[: L - 1] if sl.ids else np.zeros((0, k), np.int32)
        lp = np.concatenate(sl.logp)[: L - 1] if sl.logp else np.zeros((0, k), np.float16)
        pad = L - ids.shape[0]  # rows exist for positions 0..L-2; pad the rest
        ids = np.concatenate([ids, -np.ones((pad, k), np.int32)])
        lp = np.concatenate([lp, np.zeros((pad, k), np.float16)])
        tokens.append(np.asarray(sl.tokens, np.int32))
        offsets.append(offsets[-1] + L)
        n_prompt.append(sl.n_prompt)
        ids_all.append(ids)
        logp_all.append(lp)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(
                fh,
                tokens=np.concatenate(tokens),
                offsets=np.asarray(offsets, np.int64),
                n_prompt=np.asarray(n_prompt, np.int32),
                topk_ids=np.concatenate(ids_all),
                topk_logp=np.concatenate(logp_all),
                ids=np.asarray([s.item.id for s in seqs]),
                categories=np.asarray([s.item.category for s in seqs]),
            )
