"""The frozen base in PyTorch, loaded straight from the GGUF (only the tensors needed).

``load_trunk`` builds the first N decoder layers (plus embeddings) to compute the hidden states
that enter the exit block; ``ExitHead`` is one decoder layer + final norm + the base's frozen LM
head, initialised from the base's last block. Weights are dequantised with gguf-py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eesd_local.base.errors import EesdError
from eesd_local.gguf.headfile import dequantize
from eesd_local.gguf.reader import read_header

SUPPORTED_ARCHS = ("qwen2",)
# the exit block's forms (issue 32's ablation): the base's decoder block whole, or only its attention
# or only its MLP sub-block (each with its residual); the runtime runs "full" heads only
BLOCK_FORMS = ("full", "attn", "mlp")

# GGUF block-local tensor name -> HF decoder-layer parameter name
BLOCK_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


class GGUFWeights:
    """Lazy float32 access to a GGUF's tensors by name."""

    def __init__(self, path: Path):
        self.header = read_header(Path(path))
        self.tensors = self.header.tensors

    def field(self, key: str, default=None):
        return self.header.kv.get(key, default)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> np.ndarray:
        return dequantize(self.header, name)


def hf_config(w: GGUFWeights, n_layers: int):
    from transformers import Qwen2Config  # noqa: PLC0415 - transformers: optional (train extra)

    arch = str(w.field("general.architecture"))
    if arch not in SUPPORTED_ARCHS:
        raise EesdError(
            f"training heads supports {', '.join(SUPPORTED_ARCHS)} models, not {arch!r}", hint="pick a qwen2-family GGUF"
        )
    p = f"{arch}."
    n_vocab = int(w.field("tokenizer.ggml.tokens"))  # the parser gives a skipped string array's length
    cfg = Qwen2Config(
        vocab_size=n_vocab,
        hidden_size=int(w.field(p + "embedding_length")),
        intermediate_size=int(w.field(p + "feed_forward_length")),
        num_hidden_layers=n_layers,
        num_attention_heads=int(w.field(p + "attention.head_count")),
        num_key_value_heads=int(w.field(p + "attention.head_count_kv")),
        rms_norm_eps=float(w.field(p + "attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(w.field(p + "context_length", 32768)),
        rope_parameters={"rope_theta": float(w.field(p + "rope.freq_base", 10000.0)), "rope_type": "default"},
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def _load_block(layer, w: GGUFWeights, src: int) -> None:
    import torch  # noqa: PLC0415 - torch: optional (train extra)

    sd = {}
    for gname, hname in BLOCK_MAP.items():
        key = f"blk.{src}.{gname}"
        if key in w:
            sd[hname] = torch.from_numpy(w.get(key).copy())
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if not m.endswith("rotary_emb.inv_freq")]:
        raise EesdError(f"block {src} of the GGUF does not match the model config (missing {missing}, unexpected {unexpected})")


class Trunk:
    """Embeddings + the first ``n_layers`` blocks of the base, frozen, float32."""

    def __init__(self, base_path: Path, n_layers: int, device: str = "cpu"):
        import torch  # noqa: PLC0415 - torch: optional (train extra)
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding  # noqa: PLC0415 - transformers: optional (train extra)

        w = GGUFWeights(base_path)
        self.device = device
        self.config = hf_config(w, n_layers)
        self.embed = torch.from_numpy(w.get("token_embd.weight")).to(device)
        self.layers = []
        for i in range(n_layers):
            layer = Qwen2DecoderLayer(self.config, layer_idx=i).eval()
            _load_block(layer, w, i)
            layer.requires_grad_(False)
            self.layers.append(layer.to(device))
        self.rotary = Qwen2RotaryEmbedding(self.config).to(device)

    def hidden_states(self, tokens: np.ndarray, keep: tuple[int, ...]) -> dict[int, np.ndarray]:
        """Hidden states entering block N (after N blocks), for each N in ``keep``, float16 [T, d]."""
        import torch  # noqa: PLC0415 - torch: optional (train extra)

        out = {}
        with torch.inference_mode():
            ids = torch.from_numpy(np.asarray(tokens, np.int64)).to(self.device)
            h = self.embed[ids].unsqueeze(0)
            pos = torch.arange(len(tokens), device=self.device).unsqueeze(0)
            pe = self.rotary(h, pos)
            for i, layer in enumerate(self.layers):
                h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
                if isinstance(h, tuple):
                    h = h[0]
                if i + 1 in keep:
                    out[i + 1] = h[0].to(torch.float16).cpu().numpy()
        return out


def make_exit_head(base_path: Path, exit_layer: int, init_from: int | None = None, block: str = "full"):
    """(ExitHead module, frozen LM-head weight [V, d]) initialised from the base's last block."""
    import torch  # noqa: PLC0415 - torch: optional (train extra)

    if block not in BLOCK_FORMS:
        raise EesdError(f"no exit block form {block!r}", hint=f"one of {', '.join(BLOCK_FORMS)}")
    w = GGUFWeights(base_path)
    arch = str(w.field("general.architecture"))
    n_layer = int(w.field(f"{arch}.block_count"))
    cfg = hf_config(w, 1)
    head = ExitHead(cfg, exit_layer, block)
    _load_block(head.block, w, n_layer - 1 if init_from is None else init_from)
    head.norm.weight.data.copy_(torch.from_numpy(w.get("output_norm.weight").copy()))
    lm = w.get("output.weight") if "output.weight" in w else w.get("token_embd.weight")
    return head, torch.from_numpy(lm)


def _exit_head_class():
    import torch  # noqa: PLC0415 - torch: optional (train extra)
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding  # noqa: PLC0415 - transformers: optional (train extra)

    class _ExitHead(torch.nn.Module):
        """One decoder layer + final RMSNorm: layer-N hidden states -> final normalised states."""

        def __init__(self, config, exit_layer: int, form: str = "full"):
            super().__init__()
            self.exit_layer = exit_layer
            self.form = form
            self.block = Qwen2DecoderLayer(config, layer_idx=0)
            self.norm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.rotary = Qwen2RotaryEmbedding(config)

        def forward(self, h):  # h: [B, T, d]; right padding is harmless under the causal mask
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0).expand(h.shape[0], -1)
            pe = self.rotary(h, pos)
            b = self.block
            if self.form == "full":
                out = b(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
                if isinstance(out, tuple):
                    out = out[0]
            elif self.form == "attn":  # the block's attention and its residual, no MLP
                out = h + b.self_attn(hidden_states=b.input_layernorm(h), position_embeddings=pe, attention_mask=None)[0]
            else:  # "mlp": the block's MLP and its residual, no attention
                out = h + b.mlp(b.post_attention_layernorm(h))
            return self.norm(out)

        def gguf_tensors(self, skip_mlp: bool = False) -> dict[str, np.ndarray]:
            sd = self.block.state_dict()
            out = {
                g: sd[h].detach().float().cpu().numpy()
                for g, h in BLOCK_MAP.items()
                if h in sd and not (skip_mlp and h.startswith("mlp."))
            }
            out["output_norm.weight"] = self.norm.weight.detach().float().cpu().numpy()
            return out

        def load_gguf_tensors(self, tensors: dict[str, np.ndarray]) -> None:
            sd = {
                BLOCK_MAP[g]: torch.from_numpy(np.array(a, np.float32).reshape(self.block.state_dict()[BLOCK_MAP[g]].shape))
                for g, a in tensors.items()
                if g in BLOCK_MAP
            }
            self.block.load_state_dict(sd, strict=False)
            if "output_norm.weight" in tensors:
                self.norm.weight.data.copy_(torch.from_numpy(np.array(tensors["output_norm.weight"], np.float32)))

    return _ExitHead


def ExitHead(config, exit_layer: int, form: str = "full"):  # noqa: N802 - a class made lazily so torch is imported only when training
    return _exit_head_class()(config, exit_layer, form)
