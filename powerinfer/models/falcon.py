"""Falcon: parallel attention + MLP blocks, LayerNorm, GELU FFN, RoPE (NEOX layout).

Old decoder (falcon-7b): one LayerNorm shared by both branches; multi-query (one KV head) or
per-head fused [q, k, v]. New decoder (falcon-40b/180b): grouped KV heads with the fused QKV
laid out per group as [q heads of the group, k, v], and two LayerNorms (ln_attn, ln_mlp)
unless num_ln_in_parallel_attn == 1.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedModelError
from ..formats.hf import HFCheckpoint
from .base import ModelArgs, half_split_to_interleaved
from .hf_config import config_object, rope_frequencies



def _layout(cfg: Any) -> tuple[str, int]:
    if cfg.new_decoder_architecture:
        return "grouped", cfg.num_kv_heads
    if cfg.multi_query:
        return "multi_query", 1
    return "per_head", cfg.num_attention_heads


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    cfg = config_object(config)
    if cfg.alibi:
        raise UnsupportedModelError("Falcon with ALiBi positions is not supported")
    if cfg.new_decoder_architecture and not cfg.parallel_attn:
        raise UnsupportedModelError("Falcon new_decoder_architecture without parallel_attn is not supported")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    inv_freq, factor = rope_frequencies(cfg, head_dim)
    _, n_kv = _layout(cfg)
    return ModelArgs(
        family="falcon",
        vocab_size=cfg.vocab_size,
        d_model=cfg.hidden_size,
        n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn_dim=cfg.ffn_hidden_size,
        max_seq_len=cfg.max_position_embeddings,
        norm="layer",
        norm_eps=cfg.layer_norm_epsilon,
        rope_inv_freq=inv_freq,
        rope_attention_factor=factor,
        act=cfg.activation,
        gated_ffn=False,
        parallel_block=bool(cfg.parallel_attn or cfg.new_decoder_architecture),
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        eos_token_ids=[cfg.eos_token_id] if getattr(cfg, "eos_token_id", None) is not None else [],
    )


def _split_qkv(w: torch.Tensor, layout: str, n_heads: int, n_kv: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    rest = w.shape[1:]
    if layout == "grouped":
        g = w.reshape(n_kv, n_heads // n_kv + 2, head_dim, *rest)
        q, k, v = g[:, :-2], g[:, -2], g[:, -1]
    elif layout == "multi_query":
        g = w.reshape(n_heads + 2, head_dim, *rest)
        q, k, v = g[:-2], g[-2:-1], g[-1:]
    else:
        g = w.reshape(n_heads, 3, head_dim, *rest)
        q, k, v = g[:, 0], g[:, 1], g[:, 2]
    return tuple(x.reshape(-1, *rest) for x in (q, k, v))


def state_from_hf(ckpt: HFCheckpoint, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    cfg = config_object(ckpt.config)
    layout, n_kv = _layout(cfg)
    t = ckpt.tensor
    root = "transformer."
    state: dict[str, torch.Tensor | None] = {
        "embed": t(root + "word_embeddings.weight"),
        "final_norm.weight": t(root + "ln_f.weight"),
        "final_norm.bias": t(root + "ln_f.bias"),
    }
    if not args.tie_embeddings:
        state["lm_head"] = t("lm_head.weight")
    two_norms = cfg.new_decoder_architecture and (cfg.num_ln_in_parallel_attn or 2) == 2
    for i in range(args.n_layers):
        p, s = f"{root}h.{i}.", f"layers.{i}."

        def opt(name: str) -> torch.Tensor | None:
            return t(p + name) if ckpt.has(p + name) else None

        def qkv(w: torch.Tensor) -> torch.Tensor:
            q, k, v = _split_qkv(w, layout, args.n_heads, n_kv, args.head_dim)
            q = half_split_to_interleaved(q, args.n_heads)
            k = half_split_to_interleaved(k, n_kv)
            return torch.cat([q, k, v])

        bqkv = opt("self_attention.query_key_value.bias")
        attn_norm = "ln_attn" if two_norms else "input_layernorm"
        ffn_norm = "ln_mlp" if two_norms else ("post_attention_layernorm" if not args.parallel_block else None)
        state.update({
            s + "attn_norm.weight": t(p + attn_norm + ".weight"),
            s + "attn_norm.bias": t(p + attn_norm + ".bias"),
            s + "wqkv": qkv(t(p + "self_attention.query_key_value.weight")),
            s + "bqkv": None if bqkv is None else qkv(bqkv),
            s + "wo": t(p + "self_attention.dense.weight"),
            s + "bo": opt("self_attention.dense.bias"),
            s + "ffn.w_in": t(p + "mlp.dense_h_to_4h.weight"),
            s + "ffn.b_in": opt("mlp.dense_h_to_4h.bias"),
            s + "ffn.w_out": t(p + "mlp.dense_4h_to_h.weight"),
            s + "ffn.b_out": opt("mlp.dense_4h_to_h.bias"),
        })
        if ffn_norm:
            state[s + "ffn_norm.weight"] = t(p + ffn_norm + ".weight")
            state[s + "ffn_norm.bias"] = t(p + ffn_norm + ".bias")
    return state
