"""GGUF block rows widened to floats with torch ops, on whatever device holds them.

The GPU tier keeps a quantized model's FFN rows in their blocks (the VRAM they take is the
file's bytes per row) and widens only the rows a token needs, on the device, before torch's
GEMM. numba kernels serve the CPU tier (ops/quant.py); these are the device-agnostic twins,
written after the gguf package's numpy dequantizers (ggml-common.h layouts), which are the
oracle in tests/test_quant_torch.py. Every op is elementwise, a shift or a reshape, so the
same code runs on CUDA and CPU tensors.
"""

from __future__ import annotations

import torch

from .quant import FORMATS, format_of, shape_of


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Pairs of little-endian bytes (..., 2) as float32 (...)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) bytes -> (..., 32) values: the low nibbles, then the high ones (Q4/Q5 order)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """(..., 4) bytes of a Q5_0/Q5_1 qh word -> (..., 32) bits, weight j's bit j."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(*qh.shape[:-1], 32)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 12) packed 6-bit scales and mins of Q4_K/Q5_K -> two (..., 8) float32."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc.float(), mn.float()


def _blocks(b: torch.Tensor, fmt: str) -> torch.Tensor:
    """(N, block bytes) uint8 -> (N, weights per block) float32."""
    if fmt == "Q8_0":
        return _f16(b[:, 0:2]).unsqueeze(-1) * b[:, 2:34].contiguous().view(torch.int8).float()
    if fmt in ("Q4_0", "Q4_1"):
        q = _nibbles(b[:, -16:]).float()
        if fmt == "Q4_0":
            return _f16(b[:, 0:2]).unsqueeze(-1) * (q - 8)
        return _f16(b[:, 0:2]).unsqueeze(-1) * q + _f16(b[:, 2:4]).unsqueeze(-1)
    if fmt in ("Q5_0", "Q5_1"):
        qh_at = 2 if fmt == "Q5_0" else 4
        q = (_nibbles(b[:, qh_at + 4:]) | (_fifth_bits(b[:, qh_at:qh_at + 4]) << 4)).float()
        if fmt == "Q5_0":
            return _f16(b[:, 0:2]).unsqueeze(-1) * (q - 16)
        return _f16(b[:, 0:2]).unsqueeze(-1) * q + _f16(b[:, 2:4]).unsqueeze(-1)
    if fmt in ("Q4_K", "Q5_K"):
        n = b.shape[0]
        d, dmin = _f16(b[:, 0:2]).unsqueeze(-1), _f16(b[:, 2:4]).unsqueeze(-1)
        sc, mn = _k_scales(b[:, 4:16])
        qs = b[:, -128:].reshape(n, 4, 1, 32)
        q = (qs >> torch.tensor([0, 4], device=b.device, dtype=torch.uint8).reshape(1, 1, 2, 1)) & 15
        q = q.reshape(n, 8, 32)
        if fmt == "Q5_K":  # sub-block j's fifth bit is bit j of qh[l]
            shifts = torch.arange(8, device=b.device, dtype=torch.uint8).reshape(1, 8, 1)
            q = q | (((b[:, 16:48].reshape(n, 1, 32) >> shifts) & 1) << 4)
        return ((d * sc).unsqueeze(-1) * q.float() - (dmin * mn).unsqueeze(-1)).reshape(n, 256)
    if fmt == "Q6_K":
        n = b.shape[0]
        ql, qh = b[:, 0:128], b[:, 128:192]
        scales = b[:, 192:208].contiguous().view(torch.int8).float()
        d = _f16(b[:, 208:210]).unsqueeze(-1)
        lo = (ql.reshape(n, 2, 1, 64) >> torch.tensor([0, 4], device=b.device, dtype=torch.uint8).reshape(1, 1, 2, 1)) & 15
        hi = (qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], device=b.device,
                                                      dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3
        q = (lo.reshape(n, 2, 4, 32) | (hi << 4)).reshape(n, 16, 16).float() - 32
        return ((d * scales).unsqueeze(-1) * q).reshape(n, 256)
    raise ValueError(f"no torch dequantizer for {fmt}")


def dequantize(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantized rows `t` (rows, blocks, block bytes) as a (rows, cols) `dtype` matrix on
    t's device."""
    rows, cols = shape_of(t)
    fmt = format_of(t)
    bb = FORMATS[fmt][1]
    return _blocks(t.reshape(-1, bb), fmt).reshape(rows, cols).to(dtype)


def rows(t: torch.Tensor, idx: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `idx` (all when None) of quantized `t`, widened: only those rows' blocks are read."""
    return dequantize(t if idx is None else t.index_select(0, idx), dtype)
