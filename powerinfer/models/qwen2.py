"""Qwen2: a Llama-style model with biases on q, k and v."""

from __future__ import annotations

from typing import Any

import torch

from ..formats.gguf import GGUFFile
from ..formats.hf import HFCheckpoint
from . import llama
from .base import ModelArgs



def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    return llama.args_from_hf(config, family="qwen2")


def state_from_hf(ckpt: HFCheckpoint, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    return llama.state_from_hf(ckpt, args)


def args_from_gguf(g: GGUFFile) -> ModelArgs:
    return llama.args_from_gguf(g, family="qwen2")


def state_from_gguf(g: GGUFFile, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    return llama.state_from_gguf(g, args, permute_qk=True)  # qwen2 uses NEOX rope in llama.cpp
