"""The panel layout of dense weights for the single-token GEMV, and its kernel.

A dense (out, in) weight is stored as `in / P` column panels of shape (out, P), each
contiguous: panel b holds columns [b P, (b + 1) P) of every row. The GEMV then walks one
panel at a time, so the slice of x it multiplies by is P floats (2 KiB at P = 512) that stay
in the L1 cache while a whole panel streams past. In the row layout the whole x (16 KiB at
d = 4096, 44 KiB for a down projection) is re-read for every few rows, and the weight
stream evicts it from L1 between uses.

Why it is worth a layout: the panel GEMV reads a larger share of the memory bus than the
row GEMV for weights far above the LLC (docs/BENCHMARKS.md, "panel GEMV").

Only the dense decode GEMVs use panels (attention projections, untied LM heads, the dense
FFN): the sparse kernels read whole rows chosen by index, which the row layout keeps
contiguous. Batches (prefill) widen the panels back to fp32 rows for torch's GEMM, which
the row layout also had to do for half weights, so panels are used for bf16/fp16 weights.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from .cpu import add_matvec
from .memory import huge_empty
from .numba_half import widen
from .row_dots import prefetch_l3
from .lanes import add_matvec_lanes, block_weights
from .quant import add_matvec_q

# Panel widths are multiples of 16 (one AVX-512 vector of fp32) that divide the row, at
# least two panels per row, as near this as the row allows (512 was the fastest width;
# docs/BENCHMARKS.md, "panel GEMV").
TARGET_WIDTH = 512


def panel_width(cols: int) -> int:
    """The panel width for rows of `cols` elements; 0 when none fits (keep rows)."""
    widths = [p for p in range(16, cols // 2 + 1, 16) if cols % p == 0]
    return min(widths, key=lambda p: abs(math.log(p / TARGET_WIDTH))) if widths else 0


def to_panels(w: torch.Tensor) -> torch.Tensor:
    """(out, in) -> contiguous (in / P, out, P) panels, on huge pages where the system grants
    them; `w` must have a panel width."""
    out_f, in_f = w.shape
    p = panel_width(in_f)
    if p == 0:
        raise ValueError(f"no panel width divides {in_f}")
    shape = (in_f // p, out_f, p)
    panels = huge_empty(shape, w.dtype) if w.device.type == "cpu" else None
    if panels is None:
        panels = torch.empty(shape, dtype=w.dtype, device=w.device)
    panels.copy_(w.reshape(out_f, in_f // p, p).transpose(0, 1))
    return panels


def threads() -> int:
    """numba's thread count for kernels called from this thread (the kernels' last argument)."""
    return _thread_count()


@njit  # not cached: numba cannot cache its thread-count global
def _thread_count():
    # numba.get_num_threads() from Python takes two locks per call (~3 us, 5% of a SmolLM2
    # decode token at two calls per layer); from compiled code it is a thread-local read
    return numba.get_num_threads()


def rows_from_panels(wp: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (out, in) matrix of panels `wp`, in `dtype`, in one pass (widen and re-lay)."""
    nb, out_f, p = wp.shape
    rows = torch.empty(out_f, nb * p, dtype=dtype, device=wp.device)
    rows.view(out_f, nb, p).copy_(wp.transpose(0, 1))
    return rows


# Before a row pair, each stream prefetches its row this many rows ahead in the panel: the
# hardware prefetcher left the bus idle between the short runs (a panel row is 1 KiB).
# Measured, alternating processes (Intel Xeon, 2 threads): SmolLM2 F16 decode 93-105 ->
# 150-159 tok/s (8 rows ahead 139-156, 32 rows 134-138); a 7B-shaped F16 8-layer file from
# memory 5.9 -> 7.4 tok/s.
PREFETCH_ROWS = 16


@njit(inline="always")
def _prefetch_span(wp, blk, r):
    """Prefetch panel blk's row r (a hint: rows past the end fault nothing)."""
    base = wp.ctypes.data + blk * wp.strides[0] + r * wp.strides[1]
    for off in range(0, wp.shape[2] * wp.itemsize, 64):
        prefetch_l3(base + off)


@njit(parallel=True, fastmath=True, cache=True)
def add_matvec_panels(wp, v, b, x, threads):
    """x += W v (+ b) for W in panels (nb, out, P), on `threads` threads (numba's current
    count, passed in: numba.get_num_threads() inside a kernel stops it and its callers from
    being cached). Each thread owns a contiguous range of rows and reads it panel after
    panel as two sequential streams (its first and second half). Measured, 32 fp16 4096 x
    4096 matrices cycled: two streams 32.8 GB/s, one 30.7, rows 30.2; 32 shorter chunks
    instead of one range per thread 25.8 (short runs per panel)."""
    nb, n, p = wp.shape
    for t in prange(threads):
        lo, hi = t * n // threads, (t + 1) * n // threads
        h = (hi - lo) // 2
        for blk in range(nb):
            off = blk * p
            for i in range(lo, lo + h):
                k = i + h
                _prefetch_span(wp, blk, i + PREFETCH_ROWS)
                _prefetch_span(wp, blk, k + PREFETCH_ROWS)
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                for c in range(p):
                    vc = v[off + c]
                    a0 += widen(wp[blk, i, c]) * vc
                    a1 += widen(wp[blk, k, c]) * vc
                x[i] += a0
                x[k] += a1
            for i in range(lo + 2 * h, hi):
                acc = np.float32(0.0)
                for c in range(p):
                    acc += widen(wp[blk, i, c]) * v[off + c]
                x[i] += acc
        if b.shape[0] > 0:
            for i in range(lo, hi):
                x[i] += b[i]


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def gemv_any(w, x, bias, residual, out, threads):
    """out = W x (+ bias) (+ residual), W in rows or panels; empty arrays mean none."""
    if residual.shape[0] > 0:
        out[:] = residual
    else:
        out[:] = 0.0
    matvec_into(w, x, bias, out, threads)


def gemv(w_np: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """W @ x for one fp32 vector x; `w_np` is numpy_weights(W), in rows or panels."""
    if w_np.ndim == 4:  # lanes (ops/lanes.py)
        rows = w_np.shape[0] * w_np.shape[2]
    else:  # panels (nb, out, P); rows and GGUF blocks (out, ...)
        rows = w_np.shape[1] if w_np.ndim == 3 and w_np.dtype != np.uint8 else w_np.shape[0]
    out = np.empty(rows, dtype=np.float32)
    none = np.zeros(0, dtype=np.float32)  # no bias, no residual
    gemv_any(w_np, x.numpy(), none, none, out, threads())
    return torch.from_numpy(out)


def matvec_into(w, v, b, x, threads):  # pragma: no cover - only its numba overload runs
    """x += W v (+ b) inside numba kernels, for W in rows (2-D), panels (3-D; `threads` is
    numba's thread count, which the row kernel does not need), GGUF blocks (3-D uint8) or
    lanes (4-D)."""
    raise NotImplementedError("matvec_into() is for numba kernels")


@overload(matvec_into)
def _matvec_into(w, v, b, x, threads):
    if isinstance(w, types.BaseTuple):  # row parts of mixed formats (a Q4_K_M file's fused QKV)
        return lambda w, v, b, x, threads: _add_parts(w, v, b, x, threads)
    if w.ndim == 4:  # GGUF blocks re-laid 16 rows at a time (ops/lanes.py)
        return lambda w, v, b, x, threads: add_matvec_lanes(w, v, b, x, threads)
    if w.ndim == 3 and w.dtype == types.uint8:  # GGUF quantized blocks (ops/quant.py)
        return lambda w, v, b, x, threads: add_matvec_q(w, v, b, x, threads)
    if w.ndim == 3:
        return lambda w, v, b, x, threads: add_matvec_panels(w, v, b, x, threads)
    return lambda w, v, b, x, threads: add_matvec(w, v, b, x)


def weight_parts(matvec_into):
    """A numba function (w, v, b, x, threads): x += W v (+ b) for W a tuple of two or three
    row parts of mixed formats (a Q4_K_M file's fused QKV), each part's rows by
    `matvec_into` (this module's for one vector v, `batch_decode`'s for a batch V, x then
    (S, rows)) into a zeroed buffer, so they are what that part's one-format kernel gives."""

    @njit(inline="always")
    def part_into(w, v, x, first, threads):  # returns the next part's first row
        rows = out_features(w)
        part = np.zeros_like(x[..., first:first + rows])
        matvec_into(w, v, _NO_BIAS, part, threads)
        x[..., first:first + rows] += part
        return first + rows

    def parts_into(w, v, x, threads):  # pragma: no cover - only its numba overload runs
        raise NotImplementedError("parts_into() is for numba kernels")

    @overload(parts_into)
    def _parts_into(w, v, x, threads):
        if len(w) == 2:
            return lambda w, v, x, threads: part_into(w[1], v, x, part_into(w[0], v, x, 0, threads), threads)
        if len(w) == 3:
            return lambda w, v, x, threads: part_into(
                w[2], v, x, part_into(w[1], v, x, part_into(w[0], v, x, 0, threads), threads), threads)
        raise TypeError("weight parts: two or three")

    @njit(inline="always")
    def add_bias(x, b, _):
        """+= b (when given) after the parts, whose result is the unused third argument:
        taking it orders the calls."""
        if b.shape[0] > 0:
            x += b

    @njit(inline="always")
    def add_parts(w, v, b, x, threads):
        add_bias(x, b, parts_into(w, v, x, threads))

    return add_parts


_NO_BIAS = np.zeros(0, dtype=np.float32)
_add_parts = weight_parts(matvec_into)


def out_features(w):  # pragma: no cover - only its numba overload runs
    raise NotImplementedError("out_features() is for numba kernels")


@overload(out_features)
def _out_features(w):
    if isinstance(w, types.BaseTuple):
        if len(w) == 2:
            return lambda w: out_features(w[0]) + out_features(w[1])
        return lambda w: out_features(w[0]) + out_features(w[1]) + out_features(w[2])
    if w.ndim == 4:
        return lambda w: w.shape[0] * w.shape[2]
    if w.ndim == 3 and w.dtype == types.uint8:
        return lambda w: w.shape[0]
    if w.ndim == 3:
        return lambda w: w.shape[1]
    return lambda w: w.shape[0]


def in_features(w):  # pragma: no cover - only its numba overload runs
    raise NotImplementedError("in_features() is for numba kernels")


@overload(in_features)
def _in_features(w):
    if isinstance(w, types.BaseTuple):
        return lambda w: in_features(w[0])
    if w.ndim == 4:
        return lambda w: w.shape[1] * block_weights(w.shape[3])  # K-quant lanes: blocks of 256
    if w.ndim == 3 and w.dtype == types.uint8:
        return lambda w: w.shape[1] * (32 if w.shape[2] < 144 else 256)  # K-quants: blocks of 256
    if w.ndim == 3:
        return lambda w: w.shape[0] * w.shape[2]
    return lambda w: w.shape[1]
