"""Gemma 2: a GELU-tanh gated FFN, RMSNorms that scale by (1 + w), a norm before and after
both attention and FFN, embeddings scaled by sqrt(d), sliding-window layers interleaved with
global ones, soft-capped attention scores and logits, and the query scale taken from
query_pre_attn_scalar. Each of these is a decoder option (models/base.py), not a special case.

HF checkpoints store the norm weights as w and the norm computes x * (1 + w); llama.cpp's
converter stores 1 + w. The canonical state holds 1 + w, as the GGUF does.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from ..formats.gguf import GGUFFile
from ..formats.hf import HFCheckpoint
from . import llama
from .base import ModelArgs
from .hf_config import config_object

SLIDING_PATTERN = 2  # every other layer windowed, the first one included (as HF and llama.cpp)
LARGEST_LAYERS = 46  # Gemma 2 27B: llama.cpp scales its queries by (d / heads) ** -0.5


def swa_pattern(n_layers: int, pattern: int) -> list[bool]:
    """llama.cpp's rule for which layers are windowed: all but every `pattern`-th one."""
    return [i % pattern < pattern - 1 for i in range(n_layers)]


def args_from_config(cfg: Any, family: str, pattern: int = SLIDING_PATTERN, **fields: Any) -> ModelArgs:
    """ModelArgs of a Gemma 2/3 transformers config; `fields` add to or replace them."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    windows = [t == "sliding_attention" for t in types] if types else swa_pattern(cfg.num_hidden_layers, pattern)
    scalar = getattr(cfg, "query_pre_attn_scalar", None) or llama.head_dim_of(cfg)
    return llama.config_args(
        cfg, family,
        act=getattr(cfg, "hidden_activation", None) or cfg.hidden_act,
        embed_scale=math.sqrt(cfg.hidden_size),
        post_norms=True,
        attn_scale=float(scalar) ** -0.5,
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None),
        final_softcap=getattr(cfg, "final_logit_softcapping", None),
        sliding_window=window or None,
        window_layers=windows if window else None,
        **fields,
    )


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    return args_from_config(config_object(config), "gemma2")


def plus_one(t: torch.Tensor) -> torch.Tensor:
    """An HF Gemma norm weight w as the canonical 1 + w."""
    return t.float() + 1.0


def state_from_hf(ckpt: HFCheckpoint, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    # Gemma's post_attention_layernorm is the attention's post-norm, not the FFN's pre-norm
    state = llama.state_from_hf(ckpt, args, ffn_norm="pre_feedforward_layernorm.weight")
    state["final_norm.weight"] = plus_one(state["final_norm.weight"])
    for i in range(args.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        for name in ("attn_norm.weight", "ffn_norm.weight"):
            state[q + name] = plus_one(state[q + name])
        state[q + "post_attn_norm.weight"] = plus_one(ckpt.tensor(p + "post_attention_layernorm.weight"))
        state[q + "post_ffn_norm.weight"] = plus_one(ckpt.tensor(p + "post_feedforward_layernorm.weight"))
    return state


# -- GGUF ------------------------------------------------------------------------------------
def args_from_gguf(g: GGUFFile, family: str = "gemma2", pattern: int = SLIDING_PATTERN,
                   largest_layers: int = LARGEST_LAYERS) -> ModelArgs:
    base = llama.args_from_gguf(g, family)
    n_layers, d = base.n_layers, base.d_model
    window = g.get("{arch}.attention.sliding_window")
    named = g.get("{arch}.attention.sliding_window_pattern")  # newer files name each layer
    windows = [bool(w) for w in named] if named is not None else swa_pattern(n_layers, pattern)
    # llama.cpp's converter drops query_pre_attn_scalar; it scales as the released sizes do
    scale = (d / base.n_heads) ** -0.5 if n_layers == largest_layers else base.head_dim ** -0.5
    return replace(
        base,
        act="gelu_pytorch_tanh",
        embed_scale=math.sqrt(d),
        post_norms=True,
        attn_scale=scale,
        attn_softcap=g.get("{arch}.attn_logit_softcapping"),
        final_softcap=g.get("{arch}.final_logit_softcapping"),
        sliding_window=int(window) if window else None,
        window_layers=windows if window else None,
    )


def state_from_gguf(g: GGUFFile, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    # llama.cpp runs Gemma with NEOX RoPE: q/k keep HF's half-split layout
    state = llama.state_from_gguf(g, args, permute_qk=True)
    for i in range(args.n_layers):
        state[f"layers.{i}.post_attn_norm.weight"] = g.tensor(f"blk.{i}.post_attention_norm.weight")
        state[f"layers.{i}.post_ffn_norm.weight"] = g.tensor(f"blk.{i}.post_ffw_norm.weight")
    return state
