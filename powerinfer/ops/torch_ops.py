"""The torch backend of the sparse ops (gather the active rows, then dense math): the GPU
tier's code.

Same signatures as the CPU kernels (see api.py). On a CUDA device the gathers and small
GEMMs run at HBM speed; the same code runs on CPU tensors, which is how CI exercises the
GPU tier's code path without a GPU. All results are fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .activations import maybe_activation as _act
from .criterion import apply as apply_criterion


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32: on CUDA in the weights' dtype (tensor cores, fp32 accumulate), on CPU
    in fp32 because CPU half GEMMs are slow and round the activations."""
    if b.device.type == "cpu":
        return a.float() @ b.float()
    return (a.to(b.dtype) @ b).float()


def sparse_row_gemv(w: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, bias: torch.Tensor | None = None,
                    act: str | None = None) -> torch.Tensor:
    """(T, d) x -> (T, k): act(W[idx] x + bias[idx])."""
    y = matmul(x, F.embedding(idx, w).t())
    if bias is not None:
        y = y + bias.float()[idx]
    fn = _act(act)
    return fn(y) if fn else y


def sparse_col_axpy(wt: torch.Tensor, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(T, k) coefficients -> (T, d): sum_k a[:, k] Wt[idx[k]]."""
    return matmul(a, F.embedding(idx, wt))


def sparse_gated_ffn(w_gate: torch.Tensor, w_up: torch.Tensor, wt_down: torch.Tensor, x: torch.Tensor,
                     idx: torch.Tensor, act: str, up_act: str | None, criterion: int,
                     threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (T, d), neuron values h (T, k)); criterion as in sparse_cpu.gated_ffn."""
    a = sparse_row_gemv(w_gate, x, idx, act=act)
    u = sparse_row_gemv(w_up, x, idx, act=up_act)
    h = apply_criterion(a * u, a, criterion, threshold)
    return sparse_col_axpy(wt_down, h, idx), h


def predictor_logits(w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
                     x: torch.Tensor) -> torch.Tensor:
    """(T, d) -> (T, n_ff) logits of W2 relu(W1 x + b1) + b2."""
    h = F.relu(matmul(x, w1.t()) + (0.0 if b1 is None else b1.float()))
    return matmul(h, w2.t()) + (0.0 if b2 is None else b2.float())


def threshold_to_index(logits: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Sorted int64 indices where any token's logit exceeds the (per-neuron) threshold."""
    return torch.nonzero((logits > threshold).any(0)).flatten()
