"""HF config.json -> transformers config object, and RoPE frequencies from it.

Parsing through transformers' own config classes gives us their defaults and their handling
of old and new key names (rope_theta vs rope_parameters, n_embed vs hidden_size, ...), and
its RoPE init functions cover the scaling types (linear, llama3, yarn) exactly as the
oracle computes them.
"""

from __future__ import annotations

from typing import Any

from ..errors import ModelFileError, UnsupportedModelError

# RoPE types whose frequencies change with the sequence length at run time.
_DYNAMIC_ROPE = {"dynamic", "longrope"}


def config_object(config: dict[str, Any]) -> Any:
    """A transformers config instance for an HF config.json dict."""
    from transformers import AutoConfig

    model_type = config.get("model_type")
    if not model_type:
        raise ModelFileError("config.json has no model_type")
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except Exception as e:  # transformers' strict configs raise their own error types
        detail = " ".join(str(e).split())
        raise ModelFileError(f"config.json: cannot read it as a {model_type!r} config ({detail})") from None


def rope_frequencies(cfg: Any, head_dim: int, layer_type: str | None = None) -> tuple[list[float], float]:
    """(inverse frequencies per rotary pair, attention factor) of a transformers config; with
    `layer_type`, those of that kind of layer (Gemma 3's "sliding_attention", "full_attention")."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if layer_type is not None:
        params = dict(params.get(layer_type, params))
    legacy = getattr(cfg, "rope_scaling", None) or {}
    if not params:  # transformers 4.x keeps these as separate attributes
        params = {"rope_theta": getattr(cfg, "rope_theta", 10000.0), **legacy}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if getattr(cfg, "partial_rotary_factor", 1.0) not in (None, 1.0) or params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    if rope_type == "default":
        theta = float(params.get("rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv.tolist(), 1.0
    if rope_type in _DYNAMIC_ROPE or rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModelError(f"RoPE scaling type {rope_type!r} is not supported")
    if layer_type is not None:
        inv, factor = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), layer_type=layer_type)
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    return inv.float().tolist(), float(factor)
