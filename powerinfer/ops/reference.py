"""Plain-torch definitions of every op: the oracle the fast kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..engine.ffn import activation


def gemv(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    y = weight.float() @ x.float()
    if bias is not None:
        y = y + bias
    return y if residual is None else y + residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def gated_act(h: torch.Tensor, n_ff: int, act: str, up_act: str | None = None) -> torch.Tensor:
    up = h[..., n_ff:]
    if up_act:
        up = activation(up_act)(up)
    return activation(act)(h[..., :n_ff]) * up


def rope_interleaved(x: torch.Tensor, pos: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of each head of x (heads, head_dim) by pos * inv_freq[i]."""
    angle = pos * inv_freq
    cos, sin = torch.cos(angle), torch.sin(angle)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q (heads, d); keys/values (kv_heads, length, d) -> (heads * d), GQA by repetition."""
    group = q.shape[0] // keys.shape[0]
    k = keys.repeat_interleave(group, 0)
    v = values.repeat_interleave(group, 0)
    return F.scaled_dot_product_attention(q[:, None], k, v)[:, 0].reshape(-1)
