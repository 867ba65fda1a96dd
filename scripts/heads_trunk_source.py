"""Trunk states h_N for training from torch or from llama.cpp's own trunk (issue 32): which is faster,
and does the head agree as much on either?

    python scripts/heads_trunk_source.py --model qwen2.5-coder-0.5b-instruct --data $EESD_HOME/heads-data/FP/corpus-KEY

Takes held-out sequences of a trainer folder (every 20th, as training holds them out), computes h_N for each
with the torch trunk the recipe uses (`Trunk.hidden_states`, float32 weights dequantised from the GGUF) and
with the shared trunk's llama.cpp context (`TrunkContext`: the model's own quantised kernels, the rows
captured by native/capture.hpp in 512-token batches, as the runtime computes them), times both, and runs
the shipped head on each: top-1 agreement over V' with the model's greedy tokens. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eesd_local.gguf.headfile import find_head, head_tensors, read_head_info
from eesd_local.llama.draftvocab import DRAFT_VOCAB
from eesd_local.llama.runtime import ContextParams, Model
from eesd_local.llama.trunk import open_split
from eesd_local.tools.heads.draftvocab import draft_vocab
from eesd_local.tools.heads.shards import shard_paths
from eesd_local.tools.heads.torchmodel import Trunk, make_exit_head
from eesd_local.tools.heads.train import Seq, agreement, split
from eesd_local.tools.registry import resolve_model


def held_out(data: Path, count: int) -> list[tuple[np.ndarray, np.ndarray, int, str]]:
    """(tokens, hard targets, n_prompt, category) of the first ``count`` held-out sequences."""
    seqs = []
    for shard in shard_paths(data):
        with np.load(shard) as z:
            offsets, n_prompt, cats, tokens, ids = z["offsets"], z["n_prompt"], z["categories"], z["tokens"], z["topk_ids"]
        for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
            seqs.append((tokens[a:b], ids[a:b, :1], int(n_prompt[i]), str(cats[i])))
    held, _ = split(len(seqs), heldout_every=20)
    return [seqs[i] for i in held[:count]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", type=Path, default=None, help="default: the shipped head")
    ap.add_argument("--data", type=Path, required=True, help="a trainer folder (corpus targets)")
    ap.add_argument("--sequences", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = resolve_model(args.model)
    head_path = args.head or find_head(base)
    n = int(read_head_info(head_path)["exit_layer"])
    seqs = held_out(args.data, args.sequences)
    n_tok = sum(len(s[0]) for s in seqs)
    print(f"{len(seqs)} held-out sequences, {n_tok} tokens, N={n}", file=sys.stderr)

    trunk = Trunk(base, n)
    t0 = time.perf_counter()
    h_torch = [trunk.hidden_states(s[0], (n,))[n] for s in seqs]
    t_torch = time.perf_counter() - t0
    del trunk

    vprime = draft_vocab(base, DRAFT_VOCAB)  # the shared trunk reads it from the cache
    params = ContextParams(n_ctx=4096, n_batch=512, n_threads=args.threads)
    vocab_model = Model(base, vocab_only=True)
    sp = open_split(vocab_model, head_path, params)
    h_llama = []
    t0 = time.perf_counter()
    for tokens, *_ in seqs:
        sp.trunk.clear()
        for a in range(0, len(tokens), params.n_batch):
            sp.trunk.decode([int(t) for t in tokens[a : a + params.n_batch]], n_logits=0)
        h_llama.append(sp.trunk.rows(0, len(tokens)).astype(np.float16))
    t_llama = time.perf_counter() - t0
    sp.close()

    rel = np.concatenate([np.linalg.norm(ht.astype(np.float32) - hl.astype(np.float32), axis=1)
                          / np.maximum(np.linalg.norm(ht.astype(np.float32), axis=1), 1e-6)
                          for ht, hl in zip(h_torch, h_llama)])
    head, lm_w = make_exit_head(base, n)
    head.load_gguf_tensors(head_tensors(head_path))
    head.eval()
    out = {"model": base.name, "head": str(head_path), "sequences": len(seqs), "tokens": n_tok, "threads": args.threads,
           "tokens_per_s": {"torch": round(n_tok / t_torch, 1), "llama.cpp": round(n_tok / t_llama, 1)},
           "relative_difference": {"median": round(float(np.median(rel)), 4), "p99": round(float(np.percentile(rel, 99)), 4)}}
    for name, hs in (("torch", h_torch), ("llama.cpp", h_llama)):
        ss = [Seq(h, s[1], np.zeros_like(s[1], np.float16), s[2], s[3]) for h, s in zip(hs, seqs)]
        out[f"agreement_{name}"] = {k: round(v, 4) for k, v in agreement(head, lm_w, ss, max_seqs=len(ss), vocab=vprime).items()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
