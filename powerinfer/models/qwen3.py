"""Qwen3: Llama-style, without q/k/v biases, with an RMSNorm over each head's q and k before
RoPE (the decoder's `qk_norm` option)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..formats.gguf import GGUFFile
from ..formats.hf import HFCheckpoint
from . import llama
from .base import ModelArgs, half_split_to_interleaved


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    return replace(llama.args_from_hf(config, family="qwen3"), qk_norm=True)


def _norms(state: dict, get, names: list[tuple[str, str]]) -> dict:
    # our RoPE pairs interleaved dimensions (q/k rows are permuted to match): the per-dimension
    # norm weight is permuted the same way (RMS itself does not care about the order)
    for i, (q_name, k_name) in enumerate(names):
        state[f"layers.{i}.q_norm.weight"] = half_split_to_interleaved(get(q_name).float(), 1)
        state[f"layers.{i}.k_norm.weight"] = half_split_to_interleaved(get(k_name).float(), 1)
    return state


def state_from_hf(ckpt: HFCheckpoint, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    names = [(f"model.layers.{i}.self_attn.q_norm.weight", f"model.layers.{i}.self_attn.k_norm.weight")
             for i in range(args.n_layers)]
    return _norms(llama.state_from_hf(ckpt, args), ckpt.tensor, names)


def args_from_gguf(g: GGUFFile) -> ModelArgs:
    return replace(llama.args_from_gguf(g, family="qwen3"), qk_norm=True)


def state_from_gguf(g: GGUFFile, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    names = [(f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight") for i in range(args.n_layers)]
    # llama.cpp keeps Qwen's half-split (NEOX) q/k layout, as for qwen2
    return _norms(llama.state_from_gguf(g, args, permute_qk=True), g.tensor, names)
