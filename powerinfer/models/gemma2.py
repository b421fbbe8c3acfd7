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
from .hf_config import config_object, rope_frequencies

SLIDING_PATTERN = 2  # every other layer windowed, the first one included (as HF and llama.cpp)
LARGEST_LAYERS = 46  # Gemma 2 27B: llama.cpp scales its queries by (d / heads) ** -0.5


def window_layers(cfg: Any, n_layers: int, pattern: int) -> list[bool]:
    """Which layers are windowed: HF's layer_types where the config has them, else llama.cpp's
    rule (all but every `pattern`-th layer)."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return [t == "sliding_attention" for t in types]
    return [i % pattern < pattern - 1 for i in range(n_layers)]


def args_from_config(cfg: Any, family: str, inv_freq: list[float], factor: float,
                     local_inv_freq: list[float] | None = None, pattern: int = SLIDING_PATTERN) -> ModelArgs:
    """ModelArgs of a Gemma 2/3 transformers config, its RoPE frequencies given."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    window = getattr(cfg, "sliding_window", None)
    scalar = getattr(cfg, "query_pre_attn_scalar", None) or head_dim
    return ModelArgs(
        family=family,
        vocab_size=cfg.vocab_size,
        d_model=cfg.hidden_size,
        n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=head_dim,
        ffn_dim=cfg.intermediate_size,
        max_seq_len=cfg.max_position_embeddings,
        norm_eps=cfg.rms_norm_eps,
        rope_inv_freq=inv_freq,
        rope_attention_factor=factor,
        act=getattr(cfg, "hidden_activation", None) or cfg.hidden_act,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
        embed_scale=math.sqrt(cfg.hidden_size),
        post_norms=True,
        attn_scale=float(scalar) ** -0.5,
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None),
        final_softcap=getattr(cfg, "final_logit_softcapping", None),
        sliding_window=window or None,
        window_layers=window_layers(cfg, cfg.num_hidden_layers, pattern) if window else None,
        rope_inv_freq_local=local_inv_freq,
        bos_token_id=getattr(cfg, "bos_token_id", None),
        eos_token_ids=llama._eos_list(getattr(cfg, "eos_token_id", None)),
    )


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    cfg = config_object(config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv_freq, factor = rope_frequencies(cfg, head_dim)
    return args_from_config(cfg, "gemma2", inv_freq, factor)


def _plus_one(t: torch.Tensor) -> torch.Tensor:
    return t.float() + 1.0


def state_from_hf(ckpt: HFCheckpoint, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    get = ckpt.tensor
    state: dict[str, torch.Tensor | None] = {
        "embed": get("model.embed_tokens.weight"),
        "final_norm.weight": _plus_one(get("model.norm.weight")),
    }
    if not args.tie_embeddings:
        state["lm_head"] = get("lm_head.weight")
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        names = {
            "attn_norm": p + "input_layernorm.weight",
            "q": p + "self_attn.q_proj.weight",
            "k": p + "self_attn.k_proj.weight",
            "v": p + "self_attn.v_proj.weight",
            "o": p + "self_attn.o_proj.weight",
            "ffn_norm": p + "pre_feedforward_layernorm.weight",
            "gate": p + "mlp.gate_proj.weight",
            "up": p + "mlp.up_proj.weight",
            "down": p + "mlp.down_proj.weight",
        }
        state.update(llama.gated_layer_state(i, ckpt, names, args, permute_qk=True))
        q = f"layers.{i}."
        for name in ("attn_norm.weight", "ffn_norm.weight"):
            state[q + name] = _plus_one(state[q + name])
        state[q + "post_attn_norm.weight"] = _plus_one(get(p + "post_attention_layernorm.weight"))
        state[q + "post_ffn_norm.weight"] = _plus_one(get(p + "post_feedforward_layernorm.weight"))
    return state


# -- GGUF ------------------------------------------------------------------------------------
def args_from_gguf(g: GGUFFile, family: str = "gemma2", pattern: int = SLIDING_PATTERN,
                   largest_layers: int = LARGEST_LAYERS) -> ModelArgs:
    base = llama.args_from_gguf(g, family)
    n_layers, d = base.n_layers, base.d_model
    window = g.get("{arch}.attention.sliding_window")
    windows = g.get("{arch}.attention.sliding_window_pattern")  # newer files name each layer
    if windows is not None:
        windows = [bool(w) for w in windows]
    elif window:
        windows = [i % pattern < pattern - 1 for i in range(n_layers)]  # llama.cpp's set_swa_pattern
    # llama.cpp's converter drops query_pre_attn_scalar; it scales as the released sizes do
    scale = (d / base.n_heads) ** -0.5 if n_layers == largest_layers else base.head_dim ** -0.5
    return replace(
        base,
        act="gelu_pytorch_tanh",
        tie_embeddings=not g.has("output.weight"),
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
