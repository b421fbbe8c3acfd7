"""Plain-torch definitions of every op: the oracle the fast kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .activations import activation
from .criterion import Criterion, apply as apply_criterion


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


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
    """q (heads, d); keys/values (kv_heads, length, d) -> (heads * d), GQA by repetition; only
    the last `window` positions when > 0; scores soft-capped (cap * tanh(s / cap)) when > 0."""
    group = q.shape[0] // keys.shape[0]
    if window > 0:
        keys, values = keys[:, -window:], values[:, -window:]
    k = keys.repeat_interleave(group, 0)
    v = values.repeat_interleave(group, 0)
    if softcap <= 0:
        return F.scaled_dot_product_attention(q[:, None], k, v)[:, 0].reshape(-1)
    scores = (q[:, None] @ k.transpose(1, 2)) * q.shape[-1] ** -0.5
    scores = softcap * torch.tanh(scores / softcap)
    return (torch.softmax(scores, dim=-1) @ v)[:, 0].reshape(-1)


# -- sparse ops: defined densely, then restricted to the active set ---------------------------
def sparse_row_gemv(w: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, bias: torch.Tensor | None = None,
                    act: str | None = None) -> torch.Tensor:
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    if act:
        y = activation(act)(y)
    return y[..., idx.long()]


def sparse_col_axpy(wt: torch.Tensor, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    full = torch.zeros(*a.shape[:-1], wt.shape[0])
    full[..., idx.long()] = a.float()
    return full @ wt.float()


def sparse_gated_ffn(w_gate: torch.Tensor, w_up: torch.Tensor, wt_down: torch.Tensor, x: torch.Tensor,
                     idx: torch.Tensor, act: str, up_act: str | None = None, criterion: str = "none",
                     threshold: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    a = activation(act)(x.float() @ w_gate.float().t())
    u = x.float() @ w_up.float().t()
    if up_act:
        u = activation(up_act)(u)
    h = apply_criterion(a * u, a, Criterion.parse(criterion), threshold)
    mask = torch.zeros(w_gate.shape[0], dtype=torch.bool)
    mask[idx.long()] = True
    h = torch.where(mask, h, 0.0)
    return h @ wt_down.float(), h[..., idx.long()]


def predictor_logits(w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
                     x: torch.Tensor) -> torch.Tensor:
    h = F.relu(F.linear(x.float(), w1.float(), None if b1 is None else b1.float()))
    return F.linear(h, w2.float(), None if b2 is None else b2.float())


def threshold_to_index(logits: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    active = logits > torch.as_tensor(threshold, dtype=torch.float32)
    if active.dim() == 2:
        active = active.any(0)
    return torch.tensor([i for i, on in enumerate(active.tolist()) if on], dtype=torch.long)
