"""Falcon: parallel attention + MLP blocks, LayerNorm, GELU FFN, RoPE (NEOX layout).

Old decoder (falcon-7b): one LayerNorm shared by both branches; multi-query (one KV head) or
per-head fused [q, k, v]. New decoder (falcon-40b/180b): grouped KV heads with the fused QKV
laid out per group as [q heads of the group, k, v], and two LayerNorms (ln_attn, ln_mlp)
unless num_ln_in_parallel_attn == 1.

GGUF (llama.cpp's `falcon` architecture, parallel blocks only): the converter rewrites every
fused QKV as [all q heads, k heads, v heads] ("jploski" layout), keeps RoPE's half-split
layout (NEOX), and with two LayerNorms names ln_mlp attn_norm and ln_attn attn_norm_2.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedModelError
from ..formats.gguf import GGUFFile
from ..formats.hf import HFCheckpoint
from .base import ModelArgs, half_split_to_interleaved, rope_inv_freq
from .hf_config import config_object, rope_frequencies
from .llama import eos_list



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


# -- GGUF ------------------------------------------------------------------------------------
def args_from_gguf(g: GGUFFile) -> ModelArgs:
    layout = g.get("{arch}.tensor_data_layout", "jploski")
    if layout != "jploski":
        raise UnsupportedModelError(f"{g.path}: Falcon QKV layout {layout!r} is not supported (jploski is)")
    d = int(g.require("{arch}.embedding_length"))
    n_heads = int(g.require("{arch}.attention.head_count"))
    head_dim = d // n_heads
    # the converter writes 4 * hidden whatever the checkpoint says; the tensor knows
    ffn_dim = g.tensor("blk.0.ffn_up.weight").shape[0] if g.has("blk.0.ffn_up.weight") else \
        int(g.require("{arch}.feed_forward_length"))
    return ModelArgs(
        family="falcon",
        vocab_size=int(g.tensor("token_embd.weight").shape[0]),
        d_model=d,
        n_layers=int(g.require("{arch}.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(g.get("{arch}.attention.head_count_kv", 1)),
        head_dim=head_dim,
        ffn_dim=int(ffn_dim),
        max_seq_len=int(g.get("{arch}.context_length", 2048)),
        norm="layer",
        norm_eps=float(g.get("{arch}.attention.layer_norm_epsilon", 1e-5)),
        rope_inv_freq=rope_inv_freq(head_dim, float(g.get("{arch}.rope.freq_base", 10000.0))),
        act="gelu",
        gated_ffn=False,
        parallel_block=True,
        tie_embeddings=not g.has("output.weight"),
        bos_token_id=g.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_list(g.get("tokenizer.ggml.eos_token_id")),
    )


def state_from_gguf(g: GGUFFile, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    get = g.tensor

    def opt(name: str) -> torch.Tensor | None:
        return get(name) if g.has(name) else None

    state: dict[str, torch.Tensor | None] = {
        "embed": get("token_embd.weight"),
        "final_norm.weight": get("output_norm.weight"),
        "final_norm.bias": get("output_norm.bias"),
    }
    if not args.tie_embeddings:
        state["lm_head"] = get("output.weight")
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    for i in range(args.n_layers):
        p, s = f"blk.{i}.", f"layers.{i}."
        w = get(p + "attn_qkv.weight")  # whole rows move: quantized blocks stay intact
        two_norms = g.has(p + "attn_norm_2.weight")
        attn_norm = p + ("attn_norm_2" if two_norms else "attn_norm")
        state.update({
            s + "attn_norm.weight": get(attn_norm + ".weight"),
            s + "attn_norm.bias": opt(attn_norm + ".bias"),
            s + "wqkv": torch.cat([half_split_to_interleaved(w[:q_dim], args.n_heads),
                                   half_split_to_interleaved(w[q_dim:q_dim + kv_dim], args.n_kv_heads),
                                   w[q_dim + kv_dim:]]),
            s + "bqkv": None,
            s + "wo": get(p + "attn_output.weight"),
            s + "bo": None,
            s + "ffn.w_in": get(p + "ffn_up.weight"),
            s + "ffn.b_in": None,
            s + "ffn.w_out": get(p + "ffn_down.weight"),
            s + "ffn.b_out": None,
        })
        if two_norms:
            state[s + "ffn_norm.weight"] = get(p + "attn_norm.weight")
            state[s + "ffn_norm.bias"] = opt(p + "attn_norm.bias")
    return state
