"""Gemma 3 (text): Gemma 2's decoder (see gemma2.py) without attention soft-capping, with
RMSNorms of each head's q and k (scaled by 1 + w too), and separate RoPE frequencies for the
windowed (local) and the global layers. Vision towers are not part of this family: llama.cpp's
converter writes the text model alone to the GGUF, and from HF the `gemma3_text` checkpoints
are read."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..formats.gguf import GGUFFile
from ..formats.hf import HFCheckpoint
from . import gemma2, llama, qwen3
from .base import ModelArgs, rope_inv_freq
from .hf_config import config_object, rope_frequencies

SLIDING_PATTERN = 6  # five windowed layers, then a global one
LARGEST_LAYERS = 62  # Gemma 3 27B
LOCAL_ROPE_BASE = 10000.0  # llama.cpp's default base for the windowed layers


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    cfg = config_object(config)
    head_dim = llama.head_dim_of(cfg)
    per_type = "full_attention" in (getattr(cfg, "rope_parameters", None) or {})
    inv_freq, factor = rope_frequencies(cfg, head_dim, "full_attention" if per_type else None)
    local, _ = rope_frequencies(cfg, head_dim, "sliding_attention") if per_type else (None, 1.0)
    return gemma2.args_from_config(cfg, "gemma3", SLIDING_PATTERN, rope_inv_freq=inv_freq, rope_attention_factor=factor,
                                   rope_inv_freq_local=local, qk_norm=True)


def state_from_hf(ckpt: HFCheckpoint, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    names = [(f"model.layers.{i}.self_attn.q_norm.weight", f"model.layers.{i}.self_attn.k_norm.weight")
             for i in range(args.n_layers)]
    return qwen3._norms(gemma2.state_from_hf(ckpt, args), lambda name: gemma2.plus_one(ckpt.tensor(name)), names)


def args_from_gguf(g: GGUFFile) -> ModelArgs:
    args = gemma2.args_from_gguf(g, "gemma3", SLIDING_PATTERN, LARGEST_LAYERS)
    base = float(g.get("{arch}.rope.freq_base_swa", LOCAL_ROPE_BASE))  # newer converters write it
    local = rope_inv_freq(args.head_dim, base) if args.sliding_window else None
    return replace(args, qk_norm=True, attn_softcap=None, rope_inv_freq_local=local)


def state_from_gguf(g: GGUFFile, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    names = [(f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight") for i in range(args.n_layers)]
    return qwen3._norms(gemma2.state_from_gguf(g, args), g.tensor, names)
