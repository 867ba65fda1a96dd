"""Training an exit head by self-distillation from cached teacher shards.

Pipeline (every stage cached on disk, so reruns and extra epochs are cheap):

1. teacher shards (``teacher.py``): tokens + the full model's top-k log-probs per position;
2. trunk states: the hidden states entering block N, float16, from llama.cpp's own trunk
   (``trunk-N{N}-llama-NNNNN.npy``) or the first N blocks in PyTorch (``trunk-N{N}-NNNNN.npy``)
   beside each shard;
3. the exit block (init: the base's last block) + final norm are trained against the teacher:
   loss = cross-entropy of the teacher's top-k distribution (renormalised) under the student's
   softmax over {the token's teacher top-k} U {shared sampled negatives}; the frozen LM head is
   touched only on those rows, which makes a step cost about one block forward/backward.

Held-out agreement (student argmax over the FULL vocabulary == teacher argmax) is measured on a
fixed 1-in-20 slice of the sequences that is never trained on.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from eesd_local.base import cachefile
from eesd_local.base.atomic import atomic_path
from eesd_local.base.errors import EesdError
from eesd_local.gguf.headfile import FFN_PARTS, head_tensors, read_head_info, write_head
from eesd_local.gguf.reader import read_header
from eesd_local.tools.heads.shards import TRUNK_SOURCES, shard_paths, trunk_path, trunk_paths
from eesd_local.tools.heads.torchmodel import Trunk, make_exit_head


@dataclass
class TrainConfig:
    exit_layer: int
    epochs: float = 3.0
    lr: float = 3e-4
    batch_tokens: int = 2048
    top_k: int = 16  # teacher top-k used in the loss
    negatives: int = 512  # shared sampled negatives per step
    heldout_every: int = 20  # every 20th sequence is held out
    threads: int = 2
    seed: int = 0
    eval_every: int = 50  # steps between held-out agreement checks
    freeze_mlp: bool = False  # keep the base's last-block MLP (the head file then omits it: small heads for big models)
    head_qtype: str = "Q8_0"
    ckpt_every: int = 50
    # train the softmax over the shared trunk's draft vocabulary V' (its size; 0 = the full vocabulary):
    # negatives are drawn from V', teacher top-k entries outside V' get no mass, held-out agreement is
    # the argmax over V' (what the shared-trunk draft computes)
    draft_vocab: int = 0
    init_from: int | None = None  # base block the exit block starts from (None: the last block)
    block: str = "full"  # the exit block's form: "full", "attn" (attention only) or "mlp" (MLP only); see BLOCK_FORMS
    loss: str = "sampled"  # "sampled": softmax over top-k + sampled negatives; "full": over every row (V''s with draft_vocab)
    train_fraction: float = 1.0  # train on this share of the training sequences, drawn once (held-out set unchanged)
    steps: int = 0  # a fixed number of steps (0: as many as ``epochs`` make)
    # also take every target token of the batch as a negative (hard targets: the row's own top-1 only, so
    # the tokens it is confused with are in the softmax only when sampled; the batch's targets are those)
    batch_negatives: bool = False
    trunk_source: str = "torch"  # which trunk states it reads (cache_trunk_states' source)


@dataclass
class Seq:
    hid: np.ndarray  # [L, d] float16, hidden state entering block N
    ids: np.ndarray  # [L, K] int32 teacher top-k (row j predicts token j+1; -1 = no row)
    logp: np.ndarray  # [L, K] float16
    n_prompt: int
    category: str


FINAL_EVAL_S = 60.0  # kept free before a deadline: the final held-out check and writing the head
# Rates of the stages after the teacher on this 2-core CPU for the 0.5B (tokens per second, 2 threads;
# 660 and 930 measured by scripts/heads_ablation.py): a slower machine is caught by train_head's deadline
TRUNK_TOK_S = 600.0
TRAIN_TOK_S = 800.0  # per epoch
RESERVE_S = 150.0  # loading the base into PyTorch, V', the held-out checks, writing the head


def teacher_stop_rule(
    deadline: float, epochs: float, *, trunk_tok_s: float = TRUNK_TOK_S, train_tok_s: float = TRAIN_TOK_S
) -> Callable[[int, float], bool]:
    """``run_teacher``'s ``stop_when`` for a run that must end by ``deadline``: stop generating once the
    trunk states and ``epochs`` of training over the tokens made so far would no longer fit."""
    after = 1.0 / trunk_tok_s + epochs / train_tok_s  # seconds of later stages per teacher token

    def stop_when(tokens: int, _elapsed: float) -> bool:
        return time.time() + tokens * after + RESERVE_S >= deadline

    return stop_when


_TRUNKS: dict = {}


def cache_trunk_states(
    base_path: Path, data_dir: Path, layers: tuple[int, ...], *, threads: int = 2, progress: Callable[[str], None] | None = None,
    device: str = "cpu", source: str = "torch",
) -> None:
    """Compute and save trunk states for every shard lacking them. ``source`` "torch": the first N blocks in
    PyTorch (float32 weights dequantised from the GGUF; one pass serves every N); "llama.cpp": the model's own
    trunk and kernels, as the runtime computes h_N (the shared trunk's capture), one pass per N."""
    if source not in TRUNK_SOURCES:
        raise EesdError(f"no trunk-state source {source!r}", hint=" or ".join(TRUNK_SOURCES))
    shards = shard_paths(data_dir)
    if source == "llama.cpp":
        for n in layers:
            todo = [s for s in shards if not trunk_path(s, n, source).exists()]
            if todo:
                with llama_trunk_states(base_path, n, data_dir, threads=threads, max_len=_longest(todo)) as states:
                    _save_states(todo, (n,), states, source, progress)
        return
    import torch  # noqa: PLC0415 - torch: optional (train extra)

    torch.set_num_threads(threads)
    todo = [s for s in shards if any(not trunk_path(s, n).exists() for n in layers)]
    if not todo:
        return
    key = (str(base_path), max(layers), device)
    if key not in _TRUNKS:  # loading dequantises the blocks: slow, keep it for the next call
        _TRUNKS.clear()
        _TRUNKS[key] = Trunk(base_path, max(layers), device=device)
    trunk = _TRUNKS[key]
    _save_states(todo, layers, lambda toks: trunk.hidden_states(toks, layers), source, progress)


def _longest(shards: list[Path]) -> int:
    longest = 0
    for shard in shards:
        with np.load(shard) as z:
            longest = max(longest, int(np.diff(z["offsets"]).max(initial=0)))
    return longest


def _save_states(todo: list[Path], layers: tuple[int, ...], states: Callable[[np.ndarray], dict[int, np.ndarray]],
                 source: str, progress: Callable[[str], None] | None) -> None:
    for shard in todo:
        t0 = time.time()
        with np.load(shard) as z:
            tokens, offsets = z["tokens"], z["offsets"]
        parts: dict[int, list[np.ndarray]] = {n: [] for n in layers}
        for a, b in zip(offsets[:-1], offsets[1:]):
            hs = states(tokens[a:b])
            for n in layers:
                parts[n].append(hs[n])
        for n in layers:
            out = trunk_path(shard, n, source)
            with atomic_path(out) as tmp:
                with open(tmp, "wb") as fh:
                    np.save(fh, np.concatenate(parts[n]))
        if progress:
            progress(f"trunk states ({source}) for {shard.name}: {len(tokens)} tokens in {time.time() - t0:.0f}s")


@contextlib.contextmanager
def llama_trunk_states(base_path: Path, n: int, work_dir: Path, *, threads: int = 2, max_len: int = 4096,
                       batch: int = 512) -> Iterator[Callable[[np.ndarray], dict[int, np.ndarray]]]:
    """tokens -> {n: h_N float16 [T, d]} from llama.cpp: the base's blocks 0..N-1 byte for byte, run by its own
    kernels, the rows entering block N captured as the shared trunk captures them (``TrunkContext``). The
    trunk model is built in ``work_dir`` around a placeholder exit block (the base's last, untrained: h_N is
    taken before it) and removed afterwards."""
    from eesd_local.llama.runtime import ContextParams, Model  # noqa: PLC0415 - llama.cpp: kept out of torch-only training
    from eesd_local.llama.trunk import EmbedTable, TrunkContext, build_trunk  # noqa: PLC0415 - as above

    head, _ = make_exit_head(base_path, n)
    h = read_header(Path(base_path))
    last = int(h.kv[f"{h.kv['general.architecture']}.block_count"]) - 1
    tag = f".trunk-states-N{n}.{os.getpid()}"  # two runs on one folder do not share the model
    placeholder, model_path = Path(work_dir) / f"{tag}.head.gguf", Path(work_dir) / f"{tag}.gguf"
    vocab_model = model = ctx = None
    try:
        write_head(placeholder, base_path=base_path, exit_layer=n, tensors=head.gguf_tensors(skip_mlp=True),
                   meta={"ffn_from_base_block": last, "recipe": "a placeholder for trunk states, never trained"})
        del head
        vocab = np.arange(32, dtype=np.int32)  # the LM head is never read (no logits asked): a few rows
        build_trunk(base_path, placeholder, vocab, force=True, out_path=model_path)
        vocab_model = Model(base_path, vocab_only=True)
        model = Model(model_path)
        n_ctx = max(batch, -(-max_len // 256) * 256)
        ctx = TrunkContext(model, ContextParams(n_ctx=n_ctx, n_batch=batch, n_threads=threads), n, EmbedTable(base_path),
                           vocab, vocab_model)

        def states(tokens: np.ndarray) -> dict[int, np.ndarray]:
            ctx.clear()
            for a in range(0, len(tokens), batch):
                ctx.decode([int(t) for t in tokens[a : a + batch]], n_logits=0)
            return {n: ctx.rows(0, len(tokens)).astype(np.float16)}

        yield states
    finally:
        for res in (ctx, model, vocab_model):
            if res is not None:
                res.close()
        for f in (placeholder, model_path, cachefile.digest_path(model_path)):
            f.unlink(missing_ok=True)


def load_sequences(data_dir: Path, n: int, top_k: int, max_tokens: int | None = None, source: str = "torch") -> list[Seq]:
    seqs: list[Seq] = []
    total = 0
    for shard, tp in zip(shard_paths(data_dir), trunk_paths(data_dir, n, source)):
        if not tp.exists():
            continue
        hid = np.load(tp, mmap_mode="r")
        with np.load(shard) as z:
            offsets, n_prompt, cats = z["offsets"], z["n_prompt"], z["categories"]
            ids, logp = z["topk_ids"][:, :top_k], z["topk_logp"][:, :top_k]
        for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
            seqs.append(Seq(np.asarray(hid[a:b]), ids[a:b], logp[a:b], int(n_prompt[i]), str(cats[i])))
            total += int(b - a)
            if max_tokens and total >= max_tokens:
                return seqs
    return seqs


def _batches(seqs: list[Seq], batch_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    order = rng.permutation(len(seqs))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        L = len(seqs[i].hid)
        if cur and max(cur_max, L) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(int(i))
        cur_max = max(cur_max, L)
    if cur:
        batches.append(cur)
    return batches


def _pad(seqs: list[Seq], idx: list[int]):
    import torch  # noqa: PLC0415 - torch: optional (train extra)

    T = max(len(seqs[i].hid) for i in idx)
    d = seqs[idx[0]].hid.shape[1]
    K = seqs[idx[0]].ids.shape[1]
    h = np.zeros((len(idx), T, d), np.float32)
    ids = -np.ones((len(idx), T, K), np.int64)
    lp = np.zeros((len(idx), T, K), np.float32)
    gen = np.zeros((len(idx), T), bool)
    for j, i in enumerate(idx):
        s = seqs[i]
        L = len(s.hid)
        h[j, :L] = s.hid
        ids[j, :L] = s.ids
        lp[j, :L] = s.logp
        gen[j, max(s.n_prompt - 1, 0) : L] = True  # rows that predict answer tokens
    return torch.from_numpy(h), torch.from_numpy(ids), torch.from_numpy(lp), torch.from_numpy(gen)


def distill_loss(z, lm_w, ids, logp, neg_ids, keep=None):
    """Top-k distillation with shared sampled negatives.

    z [M, d] student states; ids/logp [M, K] teacher top-k; neg_ids [S] sampled negatives.
    q = softmax over {top-k of this row} U {negatives not in it}; loss = -sum_j p_j log q_j with
    p the teacher's top-k probabilities renormalised to 1. ``keep`` [M, K] (optional) marks the
    top-k entries the student may propose (inside V'); the others get no mass on either side.
    """
    import torch  # noqa: PLC0415 - torch: optional (train extra)

    own = torch.einsum("md,mkd->mk", z, lm_w[ids])  # [M, K]
    if keep is not None:
        own = own.masked_fill(~keep, -1e4)  # exp() == 0, and 0 * finite in the loss
        logp = logp.masked_fill(~keep, float("-inf"))
    neg = z @ lm_w[neg_ids].T  # [M, S]
    clash = (ids.unsqueeze(-1) == neg_ids.view(1, 1, -1)).any(1)  # negative already in the row's top-k
    neg = neg.masked_fill(clash, float("-inf"))
    lse = torch.logsumexp(torch.cat([own, neg], dim=1), dim=1, keepdim=True)
    p = torch.softmax(logp, dim=1)
    loss = -(p * (own - lse)).sum(1).mean()
    acc = (own.argmax(1) == 0) & (own.max(1).values >= neg.max(1).values)
    return loss, acc.float().mean()


def full_loss(z, lm_w, ids, logp):
    """Distillation over the whole vocabulary: -sum_j p_j log q(ids_j) with q the student's softmax
    over every row of ``lm_w`` and p the teacher's top-k probabilities renormalised (entries -1
    carry none). Exact where ``distill_loss`` samples; it costs a [M, V] product a step."""
    import torch  # noqa: PLC0415 - torch: optional (train extra)

    logq = torch.log_softmax(z @ lm_w.T, dim=1)  # [M, V]
    own = logq.gather(1, ids.clamp(min=0))
    p = torch.softmax(logp.masked_fill(ids < 0, float("-inf")), dim=1)
    loss = -(p * own).sum(1).mean()
    acc = logq.argmax(1) == ids[:, 0]
    return loss, acc.float().mean()


def agreement(head, lm_w, seqs: list[Seq], max_seqs: int = 64, vocab=None) -> dict[str, float]:
    """Student argmax over the full vocabulary (or over the ids ``vocab``: V') vs the teacher's
    argmax, on answer rows."""
    import torch  # noqa: PLC0415 - torch: optional (train extra)

    dev = lm_w.device
    rows_w = lm_w if vocab is None else lm_w[torch.as_tensor(vocab, dtype=torch.long, device=dev)]

    hits: dict[str, list[int]] = {}
    with torch.inference_mode():
        for s in seqs[:max_seqs]:
            z = head(torch.from_numpy(s.hid.astype(np.float32)).to(dev).unsqueeze(0))[0]
            a = max(s.n_prompt - 1, 0)
            rows = np.nonzero(s.ids[a:, 0] >= 0)[0] + a
            if len(rows) == 0:
                continue
            pred = (z[torch.from_numpy(rows).to(dev)] @ rows_w.T).argmax(-1).cpu().numpy()
            if vocab is not None:
                pred = np.asarray(vocab)[pred]
            ok = (pred == s.ids[rows, 0]).astype(int)
            hits.setdefault(s.category, []).extend(ok.tolist())
            hits.setdefault("all", []).extend(ok.tolist())
    return {k: float(np.mean(v)) for k, v in hits.items() if v}


def split(n: int, *, heldout_every: int, train_fraction: float = 1.0, seed: int = 0) -> tuple[list[int], list[int]]:
    """(held-out, trained-on) sequence numbers of ``n``: every ``heldout_every``-th is held out; of the
    rest, a fixed random share ``train_fraction`` is trained on (the scaling of agreement with data)."""
    held = [i for i in range(n) if i % heldout_every == heldout_every - 1]
    train = [i for i in range(n) if i % heldout_every != heldout_every - 1]
    if train_fraction < 1.0:
        pick = np.random.default_rng(seed + 1).permutation(len(train))[: max(1, int(len(train) * train_fraction))]
        train = [train[i] for i in sorted(pick)]
    return held, train


def recipe_line(cfg: TrainConfig, init_head: Path | None, vprime: np.ndarray | None, steps: int) -> str:
    """How a head was made, in one line (its metadata's ``recipe``; ``eesd heads info`` shows it)."""
    if init_head is not None:
        start = f"head {Path(init_head).name}"
    else:
        start = "the base's last block" if cfg.init_from is None else f"base block {cfg.init_from}"
    rows = "the whole vocabulary" if vprime is None else f"V' ({len(vprime)} rows)"
    loss = f"softmax over {rows}" if cfg.loss == "full" else \
        f"softmax over the top-{cfg.top_k} + {cfg.negatives} sampled{' + in-batch' if cfg.batch_negatives else ''} negatives in {rows}"
    mlp = ""
    if cfg.freeze_mlp:
        mlp = " (its MLP kept from " + ("the base's last block" if cfg.init_from is None else f"base block {cfg.init_from}") + ")"
    return (f"exit block {cfg.block} from {start}{mlp}; {loss}; lr {cfg.lr:g}, {steps} steps of {cfg.batch_tokens} tokens; "
            f"trunk states from {cfg.trunk_source}")


def train_head(
    base_path: Path,
    data_dir: Path,
    out_path: Path | None,
    cfg: TrainConfig,
    *,
    ckpt_path: Path | None = None,
    max_tokens: int | None = None,
    log: Callable[[str], None] = print,
    use_bar: bool = True,
    device: str = "cpu",
    data_summary: dict | None = None,
    force: bool = True,
    init_head: Path | None = None,
    deadline: float | None = None,
) -> dict:
    """Train the exit head on cached shards; write the head GGUF to ``out_path`` (None: no file, for
    ablations; the only way to train a form the runtime cannot run); return a summary.

    ``deadline`` (a ``time.time()`` value): when the planned epochs would end later, the schedule is
    shortened (measured after the first steps) so that training ends by then; the summary says so."""
    import torch  # noqa: PLC0415 - torch: optional (train extra)

    if cfg.block != "full" and out_path is not None:
        raise EesdError(f"the runtime runs full exit blocks only; a {cfg.block!r} head is trained for comparison, without a file")
    if cfg.loss not in ("sampled", "full"):
        raise EesdError(f"no loss {cfg.loss!r}", hint="sampled or full")
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    rng = np.random.default_rng(cfg.seed)
    seqs = load_sequences(data_dir, cfg.exit_layer, cfg.top_k, max_tokens, cfg.trunk_source)
    if not seqs:
        raise EesdError(
            f"no training data with trunk states ({cfg.trunk_source}) for N={cfg.exit_layer} under {data_dir}",
            hint="run the teacher pass first (eesd heads train does it)",
        )
    held_idx, train_idx = split(len(seqs), heldout_every=cfg.heldout_every, train_fraction=cfg.train_fraction, seed=cfg.seed)
    held, train = [seqs[i] for i in held_idx], [seqs[i] for i in train_idx]
    n_tokens = sum(len(s.hid) for s in train)
    head, lm_w = make_exit_head(base_path, cfg.exit_layer, cfg.init_from, cfg.block)
    if init_head is not None:  # continue from an earlier head (more data, a fresh schedule)

        if read_head_info(init_head)["exit_layer"] != cfg.exit_layer:
            raise EesdError(f"{init_head} is a head for another exit layer than {cfg.exit_layer}")
        kept = head_tensors(init_head)
        if cfg.freeze_mlp:  # the frozen MLP is the base block's the file will name, whatever the earlier head trained
            kept = {name: a for name, a in kept.items() if name not in FFN_PARTS}
        head.load_gguf_tensors(kept)
    head.to(device)
    lm_w = lm_w.to(device)
    if cfg.freeze_mlp:
        head.block.mlp.requires_grad_(False)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))
    # negatives: half from the teacher-argmax unigram (the likely confusions), half uniform
    top1 = np.concatenate([s.ids[:, 0][s.ids[:, 0] >= 0] for s in train])
    vocab = lm_w.shape[0]
    # V' is read with llama.cpp, kept out of this module's imports (torch-only training)
    from eesd_local.tools.heads import draftvocab  # noqa: PLC0415 - llama.cpp, as above

    vprime = None  # the draft vocabulary V' (sorted ids) when training over it
    in_v = None
    if cfg.draft_vocab:
        vprime = draftvocab.draft_vocab(base_path, cfg.draft_vocab).astype(np.int64)
        in_v = torch.zeros(vocab + 1, dtype=torch.bool)  # index vocab = the "no row" id -1
        in_v[torch.from_numpy(vprime)] = True
    pool = np.arange(vocab) if vprime is None else vprime  # negatives are drawn from here
    rows_w, to_row = lm_w, None  # the full loss: every row of the head, or V''s rows (ids renumbered into V')
    if cfg.loss == "full" and vprime is not None:
        rows_w = lm_w[torch.from_numpy(vprime).to(device)]
        to_row = torch.full((vocab + 1,), -1, dtype=torch.long)
        to_row[torch.from_numpy(vprime)] = torch.arange(len(vprime))
    uni = (np.bincount(top1, minlength=vocab).astype(np.float64) + 1e-3)[pool]
    uni /= uni.sum()
    epoch_batches = len(_batches(train, cfg.batch_tokens, np.random.default_rng(0)))
    total_steps = cfg.steps or max(1, int(math.ceil(cfg.epochs * epoch_batches)))
    step, history = 0, []
    if ckpt_path is None and out_path is not None:
        ckpt_path = Path(str(out_path) + ".ckpt")
    if ckpt_path is not None and ckpt_path.exists():
        st = torch.load(ckpt_path, map_location=device, weights_only=False)
        if st.get("exit_layer") == cfg.exit_layer and st.get("trunk_source", "torch") == cfg.trunk_source:
            head.load_state_dict(st["head"])
            opt.load_state_dict(st["opt"])
            step, history = st["step"], st.get("history", [])
            log(f"resumed from {ckpt_path} at step {step}")

    def save_ckpt() -> None:
        if ckpt_path is None:
            return
        with atomic_path(ckpt_path) as tmp:
            torch.save(
                {
                    "head": head.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step,
                    "history": history,
                    "exit_layer": cfg.exit_layer,
                    "trunk_source": cfg.trunk_source,  # a run on the other source's states starts afresh
                },
                tmp,
            )

    def lr_at(s: int) -> float:
        warm = min(20, total_steps // 10 + 1)
        if s < warm:
            return cfg.lr * (s + 1) / warm
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, total_steps - warm))))

    stop = {"flag": False}
    old = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda *_: stop.__setitem__("flag", True))
    bar: Progress | None = None
    if use_bar:  # rich, on stderr: the one progress library of eesd-local
        bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), TextColumn("{task.fields[stats]}"),
                       console=Console(stderr=True))
        bar_task = bar.add_task("train", total=total_steps, completed=step, stats="")
        bar.start()
    t0, tokens_seen, loss_ema, acc_ema = time.time(), 0, None, None
    start_step, planned_steps = step, total_steps
    agree = agreement(head, lm_w, held, vocab=vprime) if step == 0 else (history[-1]["heldout"] if history else {})
    if step == 0:
        history.append({"step": 0, "tokens": 0, "epoch": 0.0, "heldout": agree})
        log(
            f"N={cfg.exit_layer}: {len(train)} train sequences ({n_tokens} tokens), {len(held)} held out; start agreement {agree}"
        )
    t_loop = time.time()  # step times for the deadline are counted from here (not the first held-out check)
    try:
        epoch = step // max(epoch_batches, 1)
        while step < total_steps and not stop["flag"]:
            batches = _batches(train, cfg.batch_tokens, np.random.default_rng(cfg.seed + epoch))
            skip = step - epoch * epoch_batches
            for idx in batches[skip:]:
                if step >= total_steps or stop["flag"]:
                    break
                h, ids, lp, _ = _pad(train, idx)
                valid = ids[..., 0] >= 0
                keep = None
                row_ids = torch.where(ids >= 0, ids, vocab)  # -1 ("no row") as index vocab
                if in_v is not None:  # top-k entries the V' head can propose; rows with none are skipped
                    keep_all = in_v[row_ids]
                    valid &= keep_all.any(-1)
                    keep = keep_all[valid].to(device)
                z = head(h.to(device))[valid.to(device)]
                if cfg.loss == "full":
                    tid = ids[valid] if to_row is None else to_row[row_ids[valid]]
                    loss, acc = full_loss(z, rows_w, tid.to(device), lp[valid].to(device))
                else:
                    parts = [pool[rng.choice(len(pool), cfg.negatives // 2, p=uni)], rng.choice(pool, cfg.negatives // 2)]
                    if cfg.batch_negatives:
                        tgt = ids[valid][:, 0].numpy()
                        parts.append(tgt if in_v is None else tgt[in_v[torch.from_numpy(tgt)].numpy()])
                    neg = np.unique(np.concatenate(parts))
                    loss, acc = distill_loss(
                        z, lm_w, ids[valid].to(device), lp[valid].to(device), torch.from_numpy(neg).to(device), keep
                    )
                for g in opt.param_groups:
                    g["lr"] = lr_at(step)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                step += 1
                done_here = step - start_step
                if deadline is not None and done_here >= 10 and done_here % 10 == 0:
                    # fit the schedule in the time left, from the mean step time so far (held-out checks
                    # included); refitted as it goes, never beyond the planned epochs
                    per_step = (time.time() - t_loop) / done_here
                    fit = max(step, min(planned_steps, step + int((deadline - time.time() - FINAL_EVAL_S) / per_step)))
                    if fit != total_steps:
                        if fit < planned_steps and total_steps == planned_steps:
                            log(f"time budget: {fit} of {planned_steps} planned steps fit ({per_step:.2f} s a step)")
                        total_steps = fit
                        if bar is not None:
                            bar.update(bar_task, total=total_steps)
                tokens_seen += int(valid.sum())
                loss_v, acc_v = float(loss.detach()), float(acc)
                loss_ema = loss_v if loss_ema is None else 0.9 * loss_ema + 0.1 * loss_v
                acc_ema = acc_v if acc_ema is None else 0.9 * acc_ema + 0.1 * acc_v
                if step % cfg.eval_every == 0 or step == total_steps:
                    agree = agreement(head, lm_w, held, vocab=vprime)
                    history.append(
                        {
                            "step": step,
                            "tokens": tokens_seen,
                            "epoch": round(step / epoch_batches, 2),
                            "loss": round(loss_ema, 4),
                            "heldout": agree,
                        }
                    )
                    log(json.dumps(history[-1]))
                if step % cfg.ckpt_every == 0:
                    save_ckpt()
                if bar is not None:
                    bar.update(bar_task, advance=1,
                               stats=f"loss={loss_ema:.3f} acc={acc_ema:.2f} held={agree.get('all', 0):.3f} "
                                     f"tok_s={tokens_seen / max(time.time() - t0, 1e-9):.0f}")
            epoch += 1
    finally:
        signal.signal(signal.SIGINT, old)
        if bar is not None:
            bar.stop()
        save_ckpt()
    if stop["flag"]:
        log(f"interrupted at step {step}: checkpoint saved to {ckpt_path}; rerun the same command to resume")
    agree = agreement(head, lm_w, held, max_seqs=len(held), vocab=vprime)
    elapsed = time.time() - t0
    summary = {
        "steps": step,
        "epochs": round(step / max(epoch_batches, 1), 2),
        "train_tokens": n_tokens,
        "final_loss": round(loss_ema or float("nan"), 4),
        "agreement": agree,
        "agreement_note": ("top-1" if vprime is None else "top-1 over V'")
                          + f" on held-out answer tokens of the training mix (1 in {cfg.heldout_every} sequences)",
        "recipe": recipe_line(cfg, init_head, vprime, step),
        "throughput_tok_s": round(tokens_seen / max(elapsed, 1e-9), 1),
        "planned_steps": planned_steps,
        "config": asdict(cfg),
        "data": data_summary or {},
        "history": history[-12:],
    }
    if cfg.freeze_mlp:
        h = read_header(Path(base_path))
        last = int(h.kv[f"{h.kv['general.architecture']}.block_count"]) - 1
        summary["ffn_from_base_block"] = last if cfg.init_from is None else cfg.init_from
    if out_path is not None:
        write_head(
            out_path,
            base_path=base_path,
            exit_layer=cfg.exit_layer,
            tensors=head.gguf_tensors(skip_mlp=cfg.freeze_mlp),
            meta=summary,
            qtype=cfg.head_qtype,
            force=force,
            draft_vocab=draftvocab.draft_vocab(base_path),  # the shared trunk's V' travels with the head
        )
    summary["interrupted"] = stop["flag"]
    return summary
