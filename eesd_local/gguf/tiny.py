"""A tiny synthetic llama GGUF: a few layers, tiny dimensions, a small vocabulary.

llama.cpp's own compute on it is negligible, so it measures the cost of everything
around ``llama_decode`` (the round loop's overhead) and exercises the round mechanics
fast. Random weights: the text is gibberish. The end-of-sequence token's output row
is zero (logit exactly 0) and the other rows are large, so greedy decoding all but
never ends a generation by itself.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

N_SPECIAL = 3  # <unk>, <s>, </s>
N_BYTES = 256  # <0x00> .. <0xFF>, the SentencePiece byte fallback
EOS = 2


def write_tiny_gguf(path: str | os.PathLike[str], *, seed: int = 0, n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
                    n_ff: int = 128, n_vocab: int = 512, n_ctx: int = 16384) -> Path:
    """Write the model to ``path`` (atomically) and return the path."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(N_BYTES)]
    tokens += [f"\u2581w{i}" for i in range(n_vocab - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * N_BYTES
    types += [gguf.TokenType.NORMAL] * (n_vocab - len(types))

    w = gguf.GGUFWriter(None, "llama")
    w.add_name("tiny-synthetic")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(EOS)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    ones = np.ones(n_embd, dtype=np.float32)
    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd, 1.0))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", mat(n_embd, n_embd, n_embd**-0.5))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(n_ff, n_embd, n_embd**-0.5))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(n_ff, n_embd, n_embd**-0.5))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(n_embd, n_ff, n_ff**-0.5))
    w.add_tensor("output_norm.weight", ones)
    out = mat(n_vocab, n_embd, 0.5)  # logits of standard deviation ~4: peaked but not one-hot
    out[EOS] = 0.0
    w.add_tensor("output.weight", out)

    tmp = path.with_name(path.name + ".tmp")
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path
