"""Typed weights: a matrix knows its storage format, and the format decides which kernel runs.

A `Weight` is an (out, in) matrix stored one way:

* `RowWeight`: row-major rows, fp32, bf16 or fp16, on any device (the torch route always
  works; on the CPU the numba kernels read it too);
* `PanelWeight`: half rows re-laid in column panels (ops/panels.py) for the decode GEMV;
* `QuantWeight`: GGUF quantized blocks as they are in the file (ops/quant.py);
* `LaneWeight`: GGUF blocks of Q4_0/Q4_1/Q8_0/Q4_K re-laid 16 rows at a time (ops/lanes.py)
  for the dense kernels, the same bytes in another order (Q4_K's scales unpacked).

What callers use is the same for every format: `kernel` (what the numba kernels take; the
kernels choose their code path from its numpy type and rank, see panels.matvec_into),
`matmul(x, bias)` (a batch through torch's GEMM, widening or re-laying what the storage
needs, tile by tile for quantized blocks) and `tensors()`. `weight_for` is the one place that picks a format.
A new storage format is one new class here (or in its own module) with its kernels and
their reference test, registered in `FORMATS`.
"""

from __future__ import annotations

from typing import Callable, ClassVar

import numpy as np
import torch

import torch.nn.functional as F

from . import cpu, lanes, quant, quant_torch
from .memory import on_huge_pages
from .numba_half import numpy_weights
from .panels import panel_width, rows_from_panels, to_panels


class Weight:
    """An (out, in) matrix in one storage format (see the module docstring)."""

    format: ClassVar[str] = ""

    def __init__(self, stored: torch.Tensor, shape: tuple[int, int], kernel: np.ndarray | None):
        self.stored = stored
        self.shape = shape
        self.kernel = kernel

    @property
    def device(self) -> torch.device:
        return self.stored.device

    @property
    def dtype(self) -> torch.dtype:
        return self.stored.dtype

    def rows(self) -> torch.Tensor:
        """(out, in) for a torch GEMM: fp32 on the CPU (its half GEMMs are slow), the stored
        dtype elsewhere."""
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, in) W^T + bias as fp32 (T, out), through torch's GEMM: half weights on the
        CPU a tile of rows at a time (`_tiled_matmul`), the stored matrix elsewhere."""
        if self.device.type == "cpu" and self.dtype in (torch.float16, torch.bfloat16):
            return _tiled_matmul(self, x, bias)
        w = self.rows()
        return F.linear(x.to(w.dtype), w, None if bias is None else bias.to(w.dtype)).float()

    def widen_rows(self, r0: int, out: torch.Tensor) -> torch.Tensor:
        """Rows r0 .. r0 + len(out) of the matrix into fp32 `out`, returned (CPU half weights)."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        return [self.stored]


# fp32 bytes of one widened tile: enough rows for an efficient GEMM (a 7B-shaped F16 model's
# prefill: 8 MiB tiles 43-47 tok/s, 1 MiB 29-34), small beside a whole matrix
TILE_BYTES = 8 << 20


def _tile_rows(shape: tuple[int, int], tile_bytes: int) -> int:
    """Rows per widened tile: `tile_bytes` of fp32, a multiple of 16, at least 16."""
    n, k = shape
    return max(16, min(n, tile_bytes // (4 * k)) // 16 * 16)


def _matmul_by_tiles(x: torch.Tensor, shape: tuple[int, int], tile_bytes: int,
                     widen: Callable[[int, int], torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """x (T, in) W^T + bias with W (out, in) = `shape` widened to fp32 a tile of rows at a time
    (`widen(r0, rows)`), one GEMM per tile, on x's device: no fp32 copy of the whole matrix
    is made per call."""
    n = shape[0]
    rows = _tile_rows(shape, tile_bytes)
    y = torch.empty(x.shape[0], n, device=x.device)
    for r0 in range(0, n, rows):
        m = min(rows, n - r0)
        y[:, r0 : r0 + m] = x @ widen(r0, m).t()
    return y if bias is None else y.add_(bias.to(y.device).float())


def _tiled_matmul(w: Weight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + bias for half weights on the CPU, whose native half GEMMs are slow: each tile
    of rows widened into one reused fp32 buffer (a 7B model's LM head widened whole would
    take 0.5 GB); as fast as widening the whole matrix on SmolLM2's layers at 128 tokens,
    faster on its LM head."""
    buf = torch.empty(min(_tile_rows(w.shape, TILE_BYTES), w.shape[0]), w.shape[1])
    return _matmul_by_tiles(x.float(), w.shape, TILE_BYTES, lambda r0, m: w.widen_rows(r0, buf[:m]), bias)


class RowWeight(Weight):
    format = "rows"

    def __init__(self, t: torch.Tensor, kernels: bool = True):
        stored = on_huge_pages(t.contiguous())
        super().__init__(stored, (int(t.shape[0]), int(t.shape[1])),
                         numpy_weights(stored) if kernels and cpu.supports(stored) else None)

    def rows(self) -> torch.Tensor:
        w = self.stored
        return w.float() if w.device.type == "cpu" and w.dtype != torch.float32 else w

    def widen_rows(self, r0: int, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self.stored[r0 : r0 + out.shape[0]])


class PanelWeight(Weight):
    format = "panels"

    def __init__(self, t: torch.Tensor):
        stored = to_panels(t)
        super().__init__(stored, (int(t.shape[0]), int(t.shape[1])), numpy_weights(stored))

    def rows(self) -> torch.Tensor:
        return rows_from_panels(self.stored)

    def widen_rows(self, r0: int, out: torch.Tensor) -> torch.Tensor:
        nb, _, p = self.stored.shape
        out.view(out.shape[0], nb, p).copy_(self.stored[:, r0 : r0 + out.shape[0]].transpose(0, 1))
        return out


class QuantWeight(Weight):
    """GGUF quantized blocks (rows, blocks, block bytes), as mapped from the file. On the CPU
    the block kernels read them; on the GPU tier (any device, `kernels=False`) each matmul
    widens the blocks to fp32 on the device (ops/quant_torch.py) for one torch GEMM."""

    format = "quant"

    def __init__(self, t: torch.Tensor, kernels: bool = True):
        super().__init__(t, quant.shape_of(t), t.numpy() if kernels and t.device.type == "cpu" else None)
        self.quant_format = quant.format_of(t)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    def rows(self) -> torch.Tensor:
        return quant.dequantize(self.stored)  # tests and tools only: the engine never calls it

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel is not None:
            return quant.matmul(self.stored, x, bias)
        return _widened_matmul(self.stored, x, bias)


# fp32 bytes of the blocks widened at once on the GPU tier: bounds the widening's transient
# memory (its intermediates are a few times the tile) whatever the matrix's size
TIER_TILE_BYTES = 64 << 20


def _widened_matmul(t: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + bias for blocks `t` on their device: widened there a tile of rows at a time
    (`_matmul_by_tiles`), result on t's device."""
    return _matmul_by_tiles(x.to(t.device).float(), quant.shape_of(t), TIER_TILE_BYTES,
                            lambda r0, m: quant_torch.dequantize(t[r0 : r0 + m]), bias)


class LaneWeight(Weight):
    """GGUF blocks re-laid 16 rows at a time (rows / 16, blocks, 16, group block bytes / 16),
    ops/lanes.py."""

    format = "lanes"

    def __init__(self, t: torch.Tensor):
        super().__init__(t, lanes.shape_of(t), t.numpy())
        self.quant_format = lanes.format_of(t)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    def rows(self) -> torch.Tensor:
        return lanes.dequantize(self.stored)  # tests and tools only: the engine never calls it

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return lanes.matmul(self.stored, x, bias)


class PartsWeight(Weight):
    """GGUF blocks of mixed formats stacked by rows (`quant.QuantParts`: a Q4_K_M file's fused
    QKV), each part in its own blocks (as lanes where the part allows it). No single array for
    the fused kernels (`kernel` is None): `Linear.each_row` runs each part's rows as a
    one-format matrix's (`part_kernels`), and `matmul` (prompts) each part's matmul."""

    format = "parts"

    def __init__(self, parts: quant.QuantParts, kernels: bool = True):
        super().__init__(parts.parts[0], parts.shape, None)
        self.parts = parts
        self.quant_format = "+".join(parts.formats)
        # (kernel array, rows) per part, for the one-token and batched GEMV (none on the GPU
        # tier: there each part goes through `_widened_matmul`)
        cpu_kernels = kernels and parts.parts[0].device.type == "cpu"
        self.part_kernels = [(p.numpy(), _rows_of(p)) for p in parts.parts] if cpu_kernels else []

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    def rows(self) -> torch.Tensor:  # tests and tools only
        return torch.cat([lanes.dequantize(p) if lanes.is_lanes(p) else quant.dequantize(p) for p in self.parts.parts])

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x.float()
        if not self.part_kernels:
            out = torch.cat([_widened_matmul(p, x, None) for p in self.parts.parts], dim=1)
        else:
            out = torch.cat([lanes.matmul(p, x) if lanes.is_lanes(p) else quant.matmul(p, x)
                             for p in self.parts.parts], dim=1)
        return out if bias is None else out.add_(bias.to(out.device))

    def tensors(self) -> list[torch.Tensor]:
        return list(self.parts.parts)


def _rows_of(t: torch.Tensor) -> int:
    return lanes.shape_of(t)[0] if lanes.is_lanes(t) else quant.shape_of(t)[0]


FORMATS: dict[str, type[Weight]] = {"rows": RowWeight, "panels": PanelWeight, "quant": QuantWeight,
                                    "lanes": LaneWeight, "parts": PartsWeight}


def weight_for(t: torch.Tensor | quant.QuantParts, kernels: bool = True) -> Weight:
    """The storage format for matrix `t`: panels for half weights the CPU kernels read (when
    a panel width divides the row), rows otherwise. `kernels=False`: rows for the torch route
    only (the GPU tier, also when it is CPU tensors in tests). Quantized blocks stay blocks:
    re-laid as lanes where their format and row count allow (a copy: callers that can free
    the source pass lanes already, `lanes.interleave`), else as they are."""
    if isinstance(t, quant.QuantParts):
        return PartsWeight(t, kernels)
    if lanes.is_lanes(t):
        return LaneWeight(t)
    if quant.is_quantized(t):
        return LaneWeight(lanes.interleave(t)) if kernels and lanes.fits(t) else QuantWeight(t, kernels)
    if kernels and cpu.supports(t) and t.dtype != torch.float32 and panel_width(int(t.shape[1])) > 0:
        return PanelWeight(t)
    return RowWeight(t, kernels)
