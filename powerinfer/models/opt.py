"""OPT: learned positions (offset 2), LayerNorm, ReLU FFN with biases, optional
post-norm (OPT-350m) and a word-embedding width different from the hidden size."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedModelError
from ..formats.hf import HFCheckpoint
from .base import ModelArgs
from .hf_config import config_object



def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    cfg = config_object(config)
    if not getattr(cfg, "enable_bias", True):
        raise UnsupportedModelError("OPT with enable_bias=False is not supported")
    if not getattr(cfg, "layer_norm_elementwise_affine", True):
        raise UnsupportedModelError("OPT with layer_norm_elementwise_affine=False is not supported")
    pre_norm = bool(cfg.do_layer_norm_before)
    embed_dim = cfg.word_embed_proj_dim if cfg.word_embed_proj_dim != cfg.hidden_size else None
    return ModelArgs(
        family="opt",
        vocab_size=cfg.vocab_size,
        d_model=cfg.hidden_size,
        n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_attention_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        ffn_dim=cfg.ffn_dim,
        max_seq_len=cfg.max_position_embeddings,
        norm="layer",
        norm_eps=1e-5,
        position="learned",
        learned_pos_offset=2,
        act=cfg.activation_function,
        gated_ffn=False,
        pre_norm=pre_norm,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
        embed_dim=embed_dim,
        final_norm=pre_norm and not getattr(cfg, "_remove_final_layer_norm", False),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        eos_token_ids=[cfg.eos_token_id] if getattr(cfg, "eos_token_id", None) is not None else [],
    )


def state_from_hf(ckpt: HFCheckpoint, args: ModelArgs) -> dict[str, torch.Tensor | None]:
    # Checkpoints are saved either from OPTForCausalLM ("model.decoder.") or OPTModel ("decoder.").
    root = "model.decoder." if ckpt.has("model.decoder.embed_tokens.weight") else "decoder."
    t = ckpt.tensor

    def opt(name: str) -> torch.Tensor | None:
        return t(root + name) if ckpt.has(root + name) else None

    state: dict[str, torch.Tensor | None] = {
        "embed": t(root + "embed_tokens.weight"),
        "pos_embed": t(root + "embed_positions.weight"),
        "project_in": opt("project_in.weight"),
        "project_out": opt("project_out.weight"),
        "final_norm.weight": opt("final_layer_norm.weight"),
        "final_norm.bias": opt("final_layer_norm.bias"),
    }
    if not args.tie_embeddings:
        state["lm_head"] = t("lm_head.weight")
    for i in range(args.n_layers):
        p, q = f"{root}layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        state.update({
            q + "attn_norm.weight": t(p + "self_attn_layer_norm.weight"),
            q + "attn_norm.bias": t(p + "self_attn_layer_norm.bias"),
            q + "wqkv": torch.cat([t(a + f"{n}_proj.weight") for n in "qkv"]),
            q + "bqkv": torch.cat([t(a + f"{n}_proj.bias") for n in "qkv"]),
            q + "wo": t(a + "out_proj.weight"),
            q + "bo": t(a + "out_proj.bias"),
            q + "ffn_norm.weight": t(p + "final_layer_norm.weight"),
            q + "ffn_norm.bias": t(p + "final_layer_norm.bias"),
            q + "ffn.w_in": t(p + "fc1.weight"),
            q + "ffn.b_in": t(p + "fc1.bias"),
            q + "ffn.w_out": t(p + "fc2.weight"),
            q + "ffn.b_out": t(p + "fc2.bias"),
        })
    return state
