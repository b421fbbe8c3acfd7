"""`Linear`: y = W x + b with fp32 activations and W in the model's weight dtype.

Decode (one token, CPU) runs the numba GEMV; batches (prefill) use torch's GEMM, in fp32 on
CPU because there native bf16/fp16 GEMM is several times slower than widening the weights
first (measured on the AVX2 dev machine), and in the weight dtype on CUDA. Half weights for
the CPU kernels are stored in column panels (ops/panels.py), which the GEMV reads faster;
the widening for a batch re-lays them as rows in the same pass.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from . import cpu
from .memory import on_huge_pages
from .numba_half import numpy_weights
from .panels import gemv_any, panel_width, rows_from_panels, threads, to_panels

SMALL_BATCH = 4  # tokens up to which a half-weight matmul runs as one numba GEMV per token


class Linear:
    """A weight (out, in) and optional bias, callable on (T, in) fp32 activations."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, kernels: bool = True):
        """`kernels=False`: always the torch route (the GPU tier's code, also on CPU tensors).
        `weight` is then (out, in) as given; with the kernels and half weights it is stored as
        panels (in / P, out, P) (see `shape` for the matrix's)."""
        self.shape = (int(weight.shape[0]), int(weight.shape[1]))
        numba_ok = kernels and cpu.supports(weight)
        self.panels = numba_ok and weight.dtype != torch.float32 and panel_width(self.shape[1]) > 0
        self.weight = to_panels(weight) if self.panels else on_huge_pages(weight.contiguous())
        self.bias = None if bias is None else bias.float().contiguous()
        self._w_np = numpy_weights(self.weight) if numba_ok else None
        self._b_np = None if self.bias is None or self._w_np is None else self.bias.numpy()
        self._half = self.weight.dtype != torch.float32  # fp32 GEMMs need no widening copy

    @property
    def w_np(self) -> np.ndarray | None:
        """The weight as the numba kernels read it; None when they cannot (e.g. on a GPU)."""
        return self._w_np

    @property
    def b_np(self) -> np.ndarray:
        """The fp32 bias for the numba kernels; an empty array when there is none."""
        return cpu.NO_BIAS if self._b_np is None else self._b_np

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """W x + b (+ residual) for x of shape (T, in); fp32 result of shape (T, out)."""
        if self._w_np is not None and (x.shape[0] == 1 or (x.shape[0] <= SMALL_BATCH and self._half)):
            # numpy views and indexing cost well under a microsecond; torch's take several. For
            # a few tokens one GEMV each beats widening the half weights to fp32 for a GEMM
            # (SmolLM2 bf16, 4-token prefill: 35 -> 104-127 tok/s).
            T = x.shape[0]
            out = np.empty((T, self.shape[0]), dtype=np.float32)
            xs = x.contiguous().numpy()
            res = None if residual is None else residual.expand(T, -1).contiguous().numpy()
            bias = cpu.NO_BIAS if self._b_np is None else self._b_np
            nt = threads()
            for t in range(T):
                gemv_any(self._w_np, xs[t], bias, cpu.NO_BIAS if res is None else res[t], out[t], nt)
            return torch.from_numpy(out)
        w = self.weight
        if self.panels:
            w = rows_from_panels(w)
        elif w.device.type == "cpu" and w.dtype != torch.float32:
            w = w.float()
        y = F.linear(x.to(w.dtype), w, None if self.bias is None else self.bias.to(w.dtype)).float()
        return y if residual is None else y + residual

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]
