"""Llama family: Llama 2/3, Mistral, SmolLM2, ReluLLaMA and ProSparse (hidden_act relu),
and Bamboo-style FFNs with ReLU on the up projection too (config key `up_act`)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedModelError
from ..formats.gguf import GGUFFile
from ..formats.hf import HFCheckpoint
from ..ops import quant
from .base import ModelArgs, half_split_to_interleaved, rope_inv_freq
from .hf_config import config_object, rope_frequencies


def eos_list(value: Any) -> list[int]:
    """End-of-sequence ids as a list, from an HF config's or a GGUF's one id, list or None."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def head_dim_of(cfg: Any) -> int:
    """A transformers config's head size (an explicit head_dim, else hidden_size / heads)."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def config_args(cfg: Any, family: str, **fields: Any) -> ModelArgs:
    """ModelArgs of a Llama-shaped transformers config (gated FFN, RMSNorm, RoPE): the sizes,
    tokens and, unless `fields` say otherwise, the default RoPE frequencies and the context."""
    head_dim = head_dim_of(cfg)
    if "rope_inv_freq" not in fields:
        fields["rope_inv_freq"], fields["rope_attention_factor"] = rope_frequencies(cfg, head_dim)
    return ModelArgs(**{
        "family": family,
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.hidden_size,
        "n_layers": cfg.num_hidden_layers,
        "n_heads": cfg.num_attention_heads,
        "n_kv_heads": cfg.num_key_value_heads or cfg.num_attention_heads,
        "head_dim": head_dim,
        "ffn_dim": cfg.intermediate_size,
        "max_seq_len": cfg.max_position_embeddings,
        "norm_eps": cfg.rms_norm_eps,
        "act": getattr(cfg, "hidden_act", None),
        "tie_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "bos_token_id": getattr(cfg, "bos_token_id", None),
        "eos_token_ids": eos_list(getattr(cfg, "eos_token_id", None)),
        **fields,
    })


def args_from_hf(config: dict[str, Any], family: str = "llama") -> ModelArgs:
    cfg = config_object(config)
    max_len = cfg.max_position_embeddings
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):
        max_len = min(max_len, window)  # beyond the window our full attention would differ
    if getattr(cfg, "mlp_bias", False):
        raise UnsupportedModelError("llama mlp_bias=True is not supported")
    return config_args(cfg, family, max_seq_len=max_len, up_act=config.get("up_act"))


def gated_layer_state(i: int, ckpt: HFCheckpoint | GGUFFile, names: dict[str, str], args: ModelArgs,
                      permute_qk: bool) -> dict[str, torch.Tensor | None]:
    """Canonical tensors of one Llama-style layer from per-checkpoint tensor names; q/k/v
    biases are read where the checkpoint has them."""
    get = ckpt.tensor

    def bias(weight_name: str) -> torch.Tensor | None:
        name = weight_name.removesuffix(".weight") + ".bias"
        return ckpt.tensor(name) if ckpt.has(name) else None

    q, k, v = get(names["q"]), get(names["k"]), get(names["v"])
    notes = getattr(ckpt, "dequantized", None)  # a GGUF read natively collects what it widened
    bq, bk, bv = bias(names["q"]), bias(names["k"]), bias(names["v"])
    if permute_qk:
        q = half_split_to_interleaved(q, args.n_heads)
        k = half_split_to_interleaved(k, args.n_kv_heads)
        if bq is not None:
            bq = half_split_to_interleaved(bq, args.n_heads)
            bk = half_split_to_interleaved(bk, args.n_kv_heads)
    p = f"layers.{i}."
    out = {
        p + "attn_norm.weight": get(names["attn_norm"]),
        p + "wqkv": quant.cat_rows([q, k, v], notes, keep_parts=True),
        p + "bqkv": None if bq is None else torch.cat([bq, bk, bv]),
        p + "wo": get(names["o"]),
        p + "ffn_norm.weight": get(names["ffn_norm"]),
        p + "ffn.w_in": quant.cat_rows([get(names["gate"]), get(names["up"])], notes),
        p + "ffn.w_out": get(names["down"]),
    }
    if getattr(ckpt, "native", False):  # the fused matrices are copies: their sources' pages can go
        ckpt.release(names["q"], names["k"], names["v"], names["gate"], names["up"])
    return out


# a Llama-style HF layer's tensors, under model.layers.{i}.
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}


def state_from_hf(ckpt: HFCheckpoint, args: ModelArgs, **layer_names: str) -> dict[str, torch.Tensor | None]:
    """Canonical state of a Llama-style HF checkpoint; `layer_names` replace entries of
    HF_LAYER_NAMES where a family names a tensor its own way (Gemma's ffn_norm)."""
    get = ckpt.tensor
    state: dict[str, torch.Tensor | None] = {
        "embed": get("model.embed_tokens.weight"),
        "final_norm.weight": get("model.norm.weight"),
    }
    if not args.tie_embeddings:
        state["lm_head"] = get("lm_head.weight")
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        names = {key: p + name for key, name in {**HF_LAYER_NAMES, **layer_names}.items()}
        state.update(gated_layer_state(i, ckpt, names, args, permute_qk=True))
        if ckpt.has(p + "self_attn.o_proj.bias"):
            state[f"layers.{i}.bo"] = ckpt.tensor(p + "self_attn.o_proj.bias")
    return state


# -- GGUF ------------------------------------------------------------------------------------
def args_from_gguf(g: GGUFFile, family: str = "llama") -> ModelArgs:
    d = int(g.require("{arch}.embedding_length"))
    n_heads = int(g.require("{arch}.attention.head_count"))
    head_dim = int(g.get("{arch}.attention.key_length", d // n_heads))
    inv_freq = rope_inv_freq(head_dim, float(g.get("{arch}.rope.freq_base", 10000.0)))
    scaling = g.get("{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = float(g.require("{arch}.rope.scaling.factor"))
        inv_freq = [f / factor for f in inv_freq]
    elif scaling not in ("none", None):
        raise UnsupportedModelError(f"{g.path}: GGUF RoPE scaling {scaling!r} is not supported")
    if g.has("rope_freqs.weight"):  # Llama 3.1 style per-frequency factors
        factors = g.tensor("rope_freqs.weight").flatten().tolist()
        inv_freq = [f / s for f, s in zip(inv_freq, factors)]
    tokens = g.get("tokenizer.ggml.tokens")
    vocab = int(g.get("{arch}.vocab_size", len(tokens) if tokens else 0))
    return ModelArgs(
        family=family,
        vocab_size=vocab,
        d_model=d,
        n_layers=int(g.require("{arch}.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(g.get("{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(g.require("{arch}.feed_forward_length")),
        max_seq_len=int(g.get("{arch}.context_length", 2048)),
        norm="rms",
        norm_eps=float(g.get("{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_inv_freq=inv_freq,
        act="silu",
        tie_embeddings=not g.has("output.weight"),
        bos_token_id=g.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_list(g.get("tokenizer.ggml.eos_token_id")),
    )


def state_from_gguf(g: GGUFFile, args: ModelArgs, permute_qk: bool = False) -> dict[str, torch.Tensor | None]:
    """Canonical state of a llama-style GGUF. llama.cpp stores llama's q/k already interleaved;
    NEOX-rope archs (qwen2) keep HF's half-split layout and need `permute_qk`."""
    get = g.tensor
    state: dict[str, torch.Tensor | None] = {
        "embed": get("token_embd.weight"),
        "final_norm.weight": get("output_norm.weight"),
    }
    if not args.tie_embeddings:
        state["lm_head"] = get("output.weight")
    for i in range(args.n_layers):
        p = f"blk.{i}."
        names = {
            "attn_norm": p + "attn_norm.weight",
            "q": p + "attn_q.weight",
            "k": p + "attn_k.weight",
            "v": p + "attn_v.weight",
            "o": p + "attn_output.weight",
            "ffn_norm": p + "ffn_norm.weight",
            "gate": p + "ffn_gate.weight",
            "up": p + "ffn_up.weight",
            "down": p + "ffn_down.weight",
        }
        state.update(gated_layer_state(i, g, names, args, permute_qk=permute_qk))
    return state
