"""Phi-3 (and Phi-3.5/Phi-4-mini's `phi3` architecture with full rotary): Llama-style blocks
with fused weights, q/k/v in one `qkv_proj` and gate/up in one `gate_up_proj` (gate rows
first), which are the decoder's own fused layouts once q and k are permuted to the interleaved
RoPE layout. The 4k models' sliding window is the decoder's `sliding_window` option.

LongRoPE (the 128k models): transformers and llama.cpp switch from the short to the long
frequency factors once a sequence outgrows `original_max_position_embeddings`; this engine
uses the short factors and caps the context at that length, where both agree with it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import UnsupportedModelError
from ..formats.gguf import GGUFFile
from ..formats.hf import HFCheckpoint
from . import llama
from .base import ModelArgs, half_split_to_interleaved, rope_inv_freq
from .hf_config import config_object, rope_frequencies


def _rope(cfg: Any, head_dim: int) -> tuple[list[float], float, int | None]:
    """(inverse frequencies, attention factor, context cap or None) of a Phi-3 config."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if params.get("rope_type", params.get("type")) not in ("longrope", "su"):
        inv, factor = rope_frequencies(cfg, head_dim)
        return inv, factor, None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    inv, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, torch.device("cpu"))  # no seq_len: short factors
    original = params.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
    return inv.float().tolist(), float(factor), int(original)


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    cfg = config_object(config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv_freq, factor, cap = _rope(cfg, head_dim)
    window = getattr(cfg, "sliding_window", None)
    return ModelArgs(
        family="phi3",
        vocab_size=cfg.vocab_size,
        d_model=cfg.hidden_size,
        n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=head_dim,
        ffn_dim=cfg.intermediate_size,
        max_seq_len=min(cfg.max_position_embeddings, cap or cfg.max_position_embeddings),
        norm_eps=cfg.rms_norm_eps,
        rope_inv_freq=inv_freq,
        rope_attention_factor=factor,
        act=cfg.hidden_act,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        sliding_window=window or None,
        bos_token_id=getattr(cfg, "bos_token_id", None),
        eos_token_ids=llama._eos_list(getattr(cfg, "eos_token_id", None)),
    )


def _qkv(w: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The fused q/k/v rows with q and k permuted from the half-split RoPE layout (quantized
    blocks too: whole rows move)."""
    q, kv = args.q_dim, args.kv_dim
    return torch.cat([half_split_to_interleaved(w[:q], args.n_heads),
                      half_split_to_interleaved(w[q:q + kv], args.n_kv_heads), w[q + kv:]])


def state_from_hf(ckpt: HFCheckpoint, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    get = ckpt.tensor
    state: dict[str, torch.Tensor | None] = {
        "embed": get("model.embed_tokens.weight"),
        "final_norm.weight": get("model.norm.weight"),
    }
    if not args.tie_embeddings:
        state["lm_head"] = get("lm_head.weight")
    for i in range(args.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        state.update({
            q + "attn_norm.weight": get(p + "input_layernorm.weight"),
            q + "wqkv": _qkv(get(p + "self_attn.qkv_proj.weight"), args),
            q + "wo": get(p + "self_attn.o_proj.weight"),
            q + "ffn_norm.weight": get(p + "post_attention_layernorm.weight"),
            q + "ffn.w_in": get(p + "mlp.gate_up_proj.weight"),
            q + "ffn.w_out": get(p + "mlp.down_proj.weight"),
        })
    return state


# -- GGUF ------------------------------------------------------------------------------------
def args_from_gguf(g: GGUFFile) -> ModelArgs:
    from dataclasses import replace

    args = llama.args_from_gguf(g, "phi3")
    rot = g.get("{arch}.rope.dimension_count")
    if rot is not None and int(rot) != args.head_dim:
        raise UnsupportedModelError(f"{g.path}: partial rotary embeddings ({rot} of {args.head_dim} dimensions) "
                                    "are not supported")
    window = g.get("{arch}.attention.sliding_window")
    out = replace(args, sliding_window=int(window) if window else None)
    if g.has("rope_factors_short.weight"):  # LongRoPE: short factors, context capped (see above)
        base = rope_inv_freq(args.head_dim, float(g.get("{arch}.rope.freq_base", 10000.0)))
        factors = g.tensor("rope_factors_short.weight").flatten().tolist()
        original = int(g.require("{arch}.rope.scaling.original_context_length"))
        scale = args.max_seq_len / original
        attn = float(g.get("{arch}.rope.scaling.attn_factor",
                           math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0))
        out = replace(out, rope_inv_freq=[f / s for f, s in zip(base, factors)], rope_attention_factor=attn,
                      max_seq_len=min(args.max_seq_len, original))
    return out


def state_from_gguf(g: GGUFFile, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    get = g.tensor
    state: dict[str, torch.Tensor | None] = {
        "embed": get("token_embd.weight"),
        "final_norm.weight": get("output_norm.weight"),
    }
    if not args.tie_embeddings:
        state["lm_head"] = get("output.weight")
    for i in range(args.n_layers):
        p, q = f"blk.{i}.", f"layers.{i}."
        state.update({
            q + "attn_norm.weight": get(p + "attn_norm.weight"),
            # llama.cpp runs phi3 with NEOX RoPE: q/k keep HF's half-split layout
            q + "wqkv": _qkv(get(p + "attn_qkv.weight"), args),
            q + "wo": get(p + "attn_output.weight"),
            q + "ffn_norm.weight": get(p + "ffn_norm.weight"),
            q + "ffn.w_in": get(p + "ffn_up.weight"),
            q + "ffn.w_out": get(p + "ffn_down.weight"),
        })
    return state
