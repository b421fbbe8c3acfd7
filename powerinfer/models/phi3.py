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
from dataclasses import replace
from typing import Any, Callable

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
    inv_freq, factor, cap = _rope(cfg, llama.head_dim_of(cfg))
    window = getattr(cfg, "sliding_window", None)
    return llama.config_args(cfg, "phi3", rope_inv_freq=inv_freq, rope_attention_factor=factor,
                             max_seq_len=min(cfg.max_position_embeddings, cap or cfg.max_position_embeddings),
                             sliding_window=window or None)


def _qkv(w: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The fused q/k/v rows with q and k permuted from the half-split RoPE layout (quantized
    blocks too: whole rows move)."""
    q, kv = args.q_dim, args.kv_dim
    return torch.cat([half_split_to_interleaved(w[:q], args.n_heads),
                      half_split_to_interleaved(w[q:q + kv], args.n_kv_heads), w[q + kv:]])


# the checkpoint's names of the canonical tensors: top level, then per layer ({p}: its prefix)
HF_NAMES = ({"embed": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight", "lm_head": "lm_head.weight"},
            {"attn_norm.weight": "{p}input_layernorm.weight", "wqkv": "{p}self_attn.qkv_proj.weight",
             "wo": "{p}self_attn.o_proj.weight", "ffn_norm.weight": "{p}post_attention_layernorm.weight",
             "ffn.w_in": "{p}mlp.gate_up_proj.weight", "ffn.w_out": "{p}mlp.down_proj.weight"}, "model.layers.{i}.")
GGUF_NAMES = ({"embed": "token_embd.weight", "final_norm.weight": "output_norm.weight", "lm_head": "output.weight"},
              {"attn_norm.weight": "{p}attn_norm.weight", "wqkv": "{p}attn_qkv.weight", "wo": "{p}attn_output.weight",
               "ffn_norm.weight": "{p}ffn_norm.weight", "ffn.w_in": "{p}ffn_up.weight", "ffn.w_out": "{p}ffn_down.weight"},
              "blk.{i}.")


def _state(get: Callable[[str], torch.Tensor], args: ModelArgs, names: tuple) -> dict[str, torch.Tensor | None]:
    """Canonical state from either checkpoint's names. The fused q/k/v rows keep HF's
    half-split RoPE layout in both (llama.cpp runs phi3 with NEOX RoPE) and are permuted."""
    top, layer, prefix = names
    state: dict[str, torch.Tensor | None] = {key: get(name) for key, name in top.items()
                                             if key != "lm_head" or not args.tie_embeddings}
    for i in range(args.n_layers):
        p = prefix.format(i=i)
        for key, name in layer.items():
            t = get(name.format(p=p))
            state[f"layers.{i}.{key}"] = _qkv(t, args) if key == "wqkv" else t
    return state


def state_from_hf(ckpt: HFCheckpoint, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    return _state(ckpt.tensor, args, HF_NAMES)


# -- GGUF ------------------------------------------------------------------------------------
def args_from_gguf(g: GGUFFile) -> ModelArgs:
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
    return _state(g.tensor, args, GGUF_NAMES)
