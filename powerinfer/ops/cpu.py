"""CPU kernels in numba (parallel, fastmath, cached).

Hand-written because no library gives what we need here: torch's CPU GEMV reaches about
12 GB/s on the 2-core dev machine while a numba prange row-dot reaches about 30 GB/s
(measured in benchmarks/), and numba reads bf16/fp16 weights directly with fp32
accumulation, where torch would first copy them to fp32. Kernels take numpy views of torch
tensors (no copies); weights are row-major (out, in), one output per row.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from .numba_half import bf16_to_f32, fp16_to_f32


@njit(parallel=True, fastmath=True, cache=True)
def _gemv_f32(w, x, bias, out):
    n, d = w.shape
    has_bias = bias.shape[0] > 0
    for i in prange(n):
        acc = np.float32(0.0)
        for j in range(d):
            acc += w[i, j] * x[j]
        out[i] = acc + bias[i] if has_bias else acc


@njit(parallel=True, fastmath=True, cache=True)
def _gemv_bf16(w, x, bias, out):
    n, d = w.shape
    has_bias = bias.shape[0] > 0
    for i in prange(n):
        acc = np.float32(0.0)
        for j in range(d):
            acc += bf16_to_f32(w[i, j]) * x[j]
        out[i] = acc + bias[i] if has_bias else acc


@njit(parallel=True, fastmath=True, cache=True)
def _gemv_f16(w, x, bias, out):
    n, d = w.shape
    has_bias = bias.shape[0] > 0
    for i in prange(n):
        acc = np.float32(0.0)
        for j in range(d):
            acc += fp16_to_f32(w[i, j]) * x[j]
        out[i] = acc + bias[i] if has_bias else acc


_GEMV = {torch.float32: _gemv_f32, torch.bfloat16: _gemv_bf16, torch.float16: _gemv_f16}
NO_BIAS = np.zeros(0, dtype=np.float32)


def supports(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in _GEMV and weight.dim() == 2


def numpy_view(weight: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view; half types are seen as uint16 bit patterns."""
    weight = weight.detach()
    if weight.dtype in (torch.bfloat16, torch.float16):
        return weight.view(torch.int16).numpy().view(np.uint16)
    return weight.numpy()


def gemv(weight: torch.Tensor, w_np: np.ndarray, x: torch.Tensor, bias: np.ndarray | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """out = weight @ x (+ bias) for one fp32 vector x; `w_np` is numpy_view(weight)."""
    if out is None:
        out = torch.empty(weight.shape[0], dtype=torch.float32)
    _GEMV[weight.dtype](w_np, x.numpy(), NO_BIAS if bias is None else bias, out.numpy())
    return out


def set_threads(n: int) -> None:
    """Threads for the numba kernels called from this thread."""
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
