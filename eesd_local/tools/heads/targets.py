"""Training targets from the teacher corpus (issue 32): its answers as the trainer's shards.

The corpus keeps each answer's token ids and where its prompt comes from, never the prompt itself.
Here every prompt is rebuilt from the installed packages (``corpus.items_by_source``), rendered with
the model's chat template, tokenized as the grow tokenized it and checked against the sha256 the
corpus recorded; an answer whose prompt no longer rebuilds to the same tokens (a package changed) is
left out and counted.

The targets are hard: an answer token is the model's own greedy choice, so at the row before it the
teacher's argmax is that token (top-1, log-prob 0). Prompt rows carry no target (the next prompt
token is the user's, not the model's choice). No model is run: what training then needs is the
trunk states (``train.cache_trunk_states``), as for the teacher's own shards. The shards are written
once per corpus state into a cache folder named after the corpus' content (its shard files), so a
grown corpus gets a new folder and an unchanged one is reused.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eesd_local.base.atomic import atomic_path
from eesd_local.base.errors import EesdError
from eesd_local.llama.runtime import Model
from eesd_local.tools.heads import corpus, shards, teacher

SHARD_ANSWERS = 256  # answers per trainer shard


@dataclass
class Targets:
    folder: Path  # the trainer's shards (teacher format: tokens, offsets, n_prompt, topk_ids, topk_logp, ids, categories)
    answers: int = 0
    answer_tokens: int = 0
    prompt_tokens: int = 0
    left_out: dict[str, int] = field(default_factory=dict)  # why -> answers
    shards: int = 0  # the corpus' shards it was made from (its first ones)
    last_shard: str = ""  # the name of the last of them

    def summary(self) -> dict:
        return {"source": "corpus", "targets": "hard (the model's greedy answer token)", "answers": self.answers,
                "answer_tokens": self.answer_tokens, "prompt_tokens": self.prompt_tokens, "left_out": self.left_out,
                "corpus_shards": self.shards, "last_shard": self.last_shard}


def corpus_key(folder: Path, first: int | None = None) -> str:
    """A name for the corpus' content (its ``first`` shards when given): the shard files' names (they carry
    a hash of their bytes)."""
    names = "\n".join(p.name for p in corpus.shard_paths(folder)[:first])
    return hashlib.sha256(names.encode()).hexdigest()[:12]


def category_of(source: str) -> str:
    return "code" if source.startswith("code:") else "chat"


def hard_targets(tokens: np.ndarray, n_prompt: int) -> tuple[np.ndarray, np.ndarray]:
    """(topk_ids [L, 1], topk_logp [L, 1]) for one sequence of prompt + answer: row j predicts token
    j + 1; the rows before answer tokens hold them, every other row -1."""
    n = len(tokens)
    ids = -np.ones((n, 1), np.int32)
    if n > n_prompt:
        ids[n_prompt - 1 : n - 1, 0] = tokens[n_prompt:]
    return ids, np.zeros((n, 1), np.float16)


def build(model_path: Path, corpus_folder: Path, out_root: Path, *, mix: str = "own",
          progress: Callable[[int, int], None] | None = None, first: int | None = None) -> Targets:
    """The trainer's shards for the corpus in ``corpus_folder`` (made by ``model_path``'s model; only its
    ``first`` shards when given), under ``out_root``/corpus-KEY; reused when they are there already."""
    stamp = corpus.ModelStamp.of(model_path)
    paths = corpus.shard_paths(corpus_folder)
    if first is not None and not 1 <= first <= len(paths):
        raise EesdError(f"the corpus {corpus_folder} has {len(paths)} shards, not {first}",
                        hint=f"--corpus-shards 1..{len(paths)}, or leave it out for all of them")
    paths = paths[:first]
    # another model's corpus: refused, naming both
    found = corpus.read_corpus(corpus_folder, model=stamp, first=first)
    out = Path(out_root) / f"corpus-{corpus_key(corpus_folder, first)}"
    targets = Targets(out, shards=len(paths), last_shard=paths[-1].name if paths else "")
    answers = found.answers
    if shards.shard_paths(out):  # made before for this very corpus: count what it holds
        for p in shards.shard_paths(out):
            with np.load(p) as z:
                targets.answers += len(z["ids"])
                targets.prompt_tokens += int(z["n_prompt"].sum())
                targets.answer_tokens += int((z["topk_ids"][:, 0] >= 0).sum())
        return targets
    partial = out.with_name(out.name + ".partial")  # renamed into place once whole: a stopped build is redone
    if partial.exists():
        shutil.rmtree(partial)
    items = corpus.items_by_source(mix)
    render = teacher.chat_formatter(model_path)
    vocab = Model(model_path, vocab_only=True)
    seqs: list[tuple[str, str, np.ndarray, int]] = []
    n_written = 0

    def flush() -> None:
        nonlocal seqs, n_written
        if not seqs:
            return
        toks = [s[2] for s in seqs]
        offsets = np.concatenate([[0], np.cumsum([len(t) for t in toks])]).astype(np.int64)
        pairs = [hard_targets(t, s[3]) for t, s in zip(toks, seqs)]
        path = partial / f"teacher-{n_written:05d}.npz"
        partial.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as fh:
                np.savez(fh, tokens=np.concatenate(toks), offsets=offsets,
                         n_prompt=np.asarray([s[3] for s in seqs], np.int32),
                         topk_ids=np.concatenate([p[0] for p in pairs]), topk_logp=np.concatenate([p[1] for p in pairs]),
                         ids=np.asarray([s[0] for s in seqs]), categories=np.asarray([s[1] for s in seqs]))
        n_written += 1
        seqs = []

    try:
        for i, a in enumerate(answers):
            item = items.get(a.source)
            if item is None:
                why = "its prompt is not in this mix's training range"
            else:
                prompt = vocab.tokenize(render([{"role": r, "content": c} for r, c in item.messages]),
                                        add_special=False, parse_special=True)
                why = "" if corpus.prompt_sha(prompt) == a.prompt_sha else "its prompt rebuilds to other tokens"
            if why:
                targets.left_out[why] = targets.left_out.get(why, 0) + 1
                continue
            tokens = np.concatenate([np.asarray(prompt, np.int32), a.tokens.astype(np.int32)])
            seqs.append((a.source, category_of(a.source), tokens, len(prompt)))
            targets.answers += 1
            targets.prompt_tokens += len(prompt)
            targets.answer_tokens += len(a.tokens)
            if len(seqs) >= SHARD_ANSWERS:
                flush()
            if progress:
                progress(i + 1, len(answers))
        flush()
    finally:
        vocab.close()
    if partial.exists():
        partial.rename(out)
    return targets


def soft_targets(model_path: Path, hard: Path, out: Path, pick: set[int], *, k: int = 16, threads: int = 2,
                 progress: Callable[[int, int], None] | None = None) -> dict:
    """Trainer shards in ``out`` that mirror ``hard``'s (same sequences, same order; trunk states linked,
    not copied) with soft targets for the sequences numbered in ``pick`` (counted over every shard, in
    order): the model's top-``k`` log-probs at every answer row, from one teacher-forced prefill of prompt
    + answer. Other sequences keep their hard targets. Returns rows labelled and seconds (the cost side of
    "agreement per CPU-minute")."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = shards.shard_paths(hard)
    longest = 0
    for p in paths:
        with np.load(p) as z:
            longest = max(longest, int(np.diff(z["offsets"]).max()))
    ctx = teacher.open_context(model_path, n_parallel=1, n_ctx_per_seq=longest + 8, threads=threads)
    n_batch = ctx.n_batch
    rows = done = seq_no = same = 0
    t0 = time.time()
    try:
        for p in paths:
            with np.load(p) as z:
                arrays = {name: z[name] for name in z.files}
            tokens, offsets, n_prompt = arrays["tokens"], arrays["offsets"], arrays["n_prompt"]
            ids = -np.ones((len(tokens), k), np.int32)
            logp = np.zeros((len(tokens), k), np.float16)
            ids[:, 0] = arrays["topk_ids"][:, 0]
            for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
                a, b, n = int(a), int(b), int(n_prompt[i])
                if seq_no in pick and b - a > n:
                    ctx.clear_seq(0)
                    first, last = n - 1, b - a - 2  # rows that predict an answer token
                    got = []
                    for c in range(0, b - a - 1, n_batch):
                        pos = range(c, min(c + n_batch, b - a - 1))
                        want = [first <= j <= last for j in pos]
                        logits = ctx.decode_rows([(int(tokens[a + j]), j, 0, w) for j, w in zip(pos, want)])
                        if any(want):
                            got.append(teacher.topk_rows(np.array(logits), k))
                    ids[a + first : a + last + 1] = np.concatenate([g[0] for g in got])
                    logp[a + first : a + last + 1] = np.concatenate([g[1] for g in got])
                    same += int((ids[a + first : a + last + 1, 0] == arrays["topk_ids"][a + first : a + last + 1, 0]).sum())
                    rows += last - first + 1
                    done += 1
                    if progress:
                        progress(done, len(pick))
                seq_no += 1
            arrays["topk_ids"], arrays["topk_logp"] = ids, logp
            with atomic_path(out / p.name) as tmp:
                with open(tmp, "wb") as fh:
                    np.savez(fh, **arrays)
            for trunk in shards.trunk_files(p):
                link = out / trunk.name
                if not link.exists():
                    link.symlink_to(trunk.resolve())
    finally:
        ctx.close()
    # same: rows whose teacher-forced argmax is the corpus' answer token (greedy generation in a batch of
    # 48 vs one prefill: they differ only where the two best logits tie within the batch noise)
    return {"sequences": done, "rows": rows, "seconds": round(time.time() - t0, 1), "k": k,
            "argmax_is_answer": round(same / max(rows, 1), 4)}
