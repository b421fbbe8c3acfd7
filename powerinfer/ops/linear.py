"""`Linear`: y = W x + b with fp32 activations and W a typed weight (ops/weights.py).

Decode (one token, CPU) runs the numba GEMV on the weight's kernel array, a few tokens the
batched GEMV (each row as the one-token GEMV computes it); batches (prefill) go through the
weight's own `matmul`: the block kernels for GGUF blocks (rows or lanes), torch's GEMM for
float weights, in fp32 on the CPU, where native bf16/fp16 GEMM is several times slower than
widening the weights first, and in the weight dtype on CUDA.
"""

from __future__ import annotations

import numpy as np
import torch

from . import batch_decode, cpu
from .panels import gemv_any, threads
from .quant import QuantParts
from .weights import PanelWeight, PartsWeight, Weight, weight_for

_NO_ROWS = np.zeros((0, 0), dtype=np.float32)  # no residual, for the batch kernels
SMALL_BATCH = 4  # tokens up to which a half-weight matmul runs as the batched numba GEMV
# GGUF blocks: the batched GEMV widens each block once per four tokens (ops/batch_decode.py),
# far cheaper than widening whole tiles for torch's GEMM at this size (docs/BENCHMARKS.md)
QUANT_SMALL_BATCH = 16


class Linear:
    """A weight (out, in) and optional bias, callable on (T, in) fp32 activations."""

    def __init__(self, weight: torch.Tensor | Weight | QuantParts, bias: torch.Tensor | None = None,
                 kernels: bool = True):
        """`weight`: a tensor (its format chosen by `weight_for`) or a typed weight.
        `kernels=False`: always the torch route (the GPU tier's code, also on CPU tensors)."""
        self.w = weight if isinstance(weight, Weight) else weight_for(weight, kernels)
        self.shape = self.w.shape
        self.bias = None if bias is None else bias.float().contiguous()
        self._b_np = None if self.bias is None or self.w.kernel is None else self.bias.numpy()
        self._half = self.w.dtype != torch.float32  # fp32 GEMMs need no widening copy
        self._quant = self.w.dtype == torch.uint8  # GGUF blocks

    @property
    def weight(self) -> torch.Tensor:
        """The stored tensor (rows (out, in), or panels (in / P, out, P))."""
        return self.w.stored

    @property
    def panels(self) -> bool:
        return isinstance(self.w, PanelWeight)

    @property
    def w_np(self) -> np.ndarray | None:
        """The weight as the numba kernels read it; None when they cannot (e.g. on a GPU)."""
        return self.w.kernel

    @property
    def fused_np(self) -> np.ndarray | tuple[np.ndarray, ...] | None:
        """What the fused decode kernels read (`panels.matvec_into`): `w_np`, or for a
        matrix of mixed-format parts on the CPU the tuple of its parts' kernel arrays."""
        if isinstance(self.w, PartsWeight) and self.w.part_kernels and len(self.w.part_kernels) <= 3:
            return tuple(k for k, _ in self.w.part_kernels)
        return self.w.kernel

    @property
    def b_np(self) -> np.ndarray:
        """The fp32 bias for the numba kernels; an empty array when there is none."""
        return cpu.NO_BIAS if self._b_np is None else self._b_np

    @property
    def batch_kernels(self) -> bool:
        """Whether `each_row` can run: a weight the CPU kernels read."""
        return self.w.kernel is not None or (isinstance(self.w, PartsWeight) and bool(self.w.part_kernels))

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """W x + b (+ residual) for x of shape (T, in); fp32 result of shape (T, out)."""
        T = x.shape[0]
        if self.batch_kernels and (T == 1 or (T <= SMALL_BATCH and self._half) or (T <= QUANT_SMALL_BATCH and
                                                                                   self._quant)):
            # For a few tokens the batched GEMV beats widening the weights to fp32 for a GEMM.
            return self.each_row(x, residual)
        y = self.w.matmul(x, self.bias)
        return y if residual is None else y + residual

    def each_row(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """W x + b (+ residual) for x (T, in) on the CPU, each row computed exactly as the
        one-token GEMV computes it, with the weight read once for all rows (batched decode:
        a sequence's result does not depend on the batch)."""
        xs = x.float().contiguous().numpy()
        if isinstance(self.w, PartsWeight):  # each part's rows as a one-format matrix's, side by side
            y = torch.cat([_each_row(k, rows, xs, cpu.NO_BIAS, None) for k, rows in self.w.part_kernels], dim=1)
            y = y if self.bias is None else y + self.bias
            return y if residual is None else y + residual
        assert self.w.kernel is not None, "each_row needs a weight the CPU kernels read"
        return _each_row(self.w.kernel, self.shape[0], xs, self.b_np, residual)

    def tensors(self) -> list[torch.Tensor]:
        return self.w.tensors() + ([self.bias] if self.bias is not None else [])


def _each_row(kernel: np.ndarray, rows: int, xs: np.ndarray, b_np: np.ndarray,
              residual: torch.Tensor | None) -> torch.Tensor:
    """W xs[t] + b (+ residual[t]) for every row t of xs (T, in), W the kernel array of a
    `rows`-row matrix, each as the one-token GEMV computes it: the GEMV for one row, the
    batched GEMV (the weight read once) for more."""
    T = xs.shape[0]
    out = np.empty((T, rows), dtype=np.float32)
    if T == 1:
        res = cpu.NO_BIAS if residual is None else residual.reshape(-1).contiguous().numpy()
        gemv_any(kernel, xs[0], b_np, res, out[0], threads())
    else:
        res = _NO_ROWS if residual is None else residual.expand(T, -1).contiguous().numpy()
        batch_decode.gemv(kernel, xs, b_np, res, out, threads())
    return torch.from_numpy(out)
