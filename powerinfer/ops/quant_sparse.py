"""The FFN over an active row set with GGUF quantized blocks (ops/quant.py), in numba.

Gate and up rows keep the source file's blocks (a row set gathers whole rows, blocks
intact); the down projection, stored transposed so that each neuron owns one row, is
requantized to Q8_0 at pack time (transposing breaks blocks; Q8_0 is the closest of the
block formats to the source, see docs/BENCHMARKS.md). One call computes, per token, every
active neuron's value in parallel, then accumulates h_k * down_k into per-thread partial
sums that are reduced at the end. Gate and up dots take block_ir's int8 activations; the
AXPY's coefficients stay fp32. Reference twin: dequantize, then the fp32 sparse ops on
`block_ir.reference_acts(x)`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .cpu import _act, gated_value
from .criterion import GATE
from . import block_lanes
from .block_ir import dot_row, dot_rows4, quantize_acts
from .quant import _half, _s8
from .row_dots import prefetch_l3


@njit(inline="always", fastmath=True)
def _prefetch_row(w, r):
    """Prefetch row r of blocks w into the outer caches: rows picked by index are scattered,
    so the hardware prefetcher only ramps up within a row once it is being read."""
    start = w.ctypes.data + r * w.strides[0]
    for off in range(0, w.strides[0], 64):
        prefetch_l3(start + off)


@njit(fastmath=True)
def _axpy_q8_0(wt, r, coef, acc):
    """acc += coef * row r of Q8_0 wt."""
    for b in range(wt.shape[1]):
        dd = coef * _half(wt[r, b, 0], wt[r, b, 1])
        base = 32 * b
        for j in range(32):
            acc[base + j] += dd * _s8(wt[r, b, 2 + j])


@njit(fastmath=True)
def _axpy4_q8_0(wt, r0, r1, r2, r3, c0, c1, c2, c3, acc):
    """acc += sum of c_i * row r_i of Q8_0 wt: four rows per pass, so acc is loaded and
    stored once per four neurons (7B shape, 10% of neurons: 0.24 -> 0.12 ms per layer)."""
    for b in range(wt.shape[1]):
        d0 = c0 * _half(wt[r0, b, 0], wt[r0, b, 1])
        d1 = c1 * _half(wt[r1, b, 0], wt[r1, b, 1])
        d2 = c2 * _half(wt[r2, b, 0], wt[r2, b, 1])
        d3 = c3 * _half(wt[r3, b, 0], wt[r3, b, 1])
        base = 32 * b
        for j in range(32):
            acc[base + j] += (d0 * _s8(wt[r0, b, 2 + j]) + d1 * _s8(wt[r1, b, 2 + j])
                              + d2 * _s8(wt[r2, b, 2 + j]) + d3 * _s8(wt[r3, b, 2 + j]))


@njit(parallel=True, fastmath=True, cache=True)
def ffn_rows_q(w_in, w_up, wt_down, x, idx, gated, b_in, act_id, up_act_id, criterion, threshold, n_chunks, h, out,
               blocked=False):
    """out (T, d_out) += the FFN over neurons `idx` for x (T, d): w_in holds gate rows (or
    fc1 rows of a plain FFN, with bias b_in), w_up up rows (gated), wt_down the Q8_0 down
    projection transposed (n, d_out). h (T, k) gets the neuron values (0 when off by the
    criterion, as the dense-weight kernels: GATE skips the up row). `blocked`: w_in and w_up
    are re-laid by `block_lanes` (one format for both)."""
    T, k = x.shape[0], idx.shape[0]
    d_out = out.shape[1]
    for t in range(T):
        if blocked:
            qa_in = block_lanes.records(x[t], w_in.shape[2])
            qa_up = qa_in
        else:
            qa_in = quantize_acts(x[t], w_in.shape[2])
            qa_up = qa_in if w_up.shape[2] == w_in.shape[2] else quantize_acts(x[t], w_up.shape[2])
        for c in prange(n_chunks):
            lo, hi = c * k // n_chunks, (c + 1) * k // n_chunks
            first = lo
            if gated and criterion != GATE:  # four neurons per pass over x (up rows read anyway)
                while first + 4 <= hi:
                    r0, r1, r2, r3 = idx[first], idx[first + 1], idx[first + 2], idx[first + 3]
                    for nxt in range(first + 4, min(first + 8, hi)):
                        _prefetch_row(w_in, idx[nxt])
                        _prefetch_row(w_up, idx[nxt])
                    if blocked:
                        g0, g1, g2, g3 = block_lanes.dot_rows4(w_in, r0, r1, r2, r3, qa_in)
                        u0, u1, u2, u3 = block_lanes.dot_rows4(w_up, r0, r1, r2, r3, qa_up)
                    else:
                        g0, g1, g2, g3 = dot_rows4(w_in, r0, r1, r2, r3, qa_in)
                        u0, u1, u2, u3 = dot_rows4(w_up, r0, r1, r2, r3, qa_up)
                    h[t, first] = gated_value(_act(g0, act_id), u0, up_act_id, criterion, threshold)
                    h[t, first + 1] = gated_value(_act(g1, act_id), u1, up_act_id, criterion, threshold)
                    h[t, first + 2] = gated_value(_act(g2, act_id), u2, up_act_id, criterion, threshold)
                    h[t, first + 3] = gated_value(_act(g3, act_id), u3, up_act_id, criterion, threshold)
                    first += 4
            for kk in range(first, hi):
                r = idx[kk]
                g = block_lanes.dot_row(w_in, r, qa_in) if blocked else dot_row(w_in, r, qa_in)
                if not gated:
                    if b_in.shape[0] > 0:
                        g += b_in[r]
                    a = _act(g, act_id)
                    h[t, kk] = np.float32(0.0) if criterion != 0 and abs(a) <= threshold else a
                    continue
                a = _act(g, act_id)
                if criterion == GATE and abs(a) <= threshold:
                    h[t, kk] = np.float32(0.0)
                    continue
                u = block_lanes.dot_row(w_up, r, qa_up) if blocked else dot_row(w_up, r, qa_up)
                h[t, kk] = gated_value(a, u, up_act_id, criterion, threshold)
        partial = np.zeros((n_chunks, d_out), dtype=np.float32)
        for c in prange(n_chunks):
            # the nonzero neurons of this chunk, four at a time
            rows = np.empty(4, np.int64)
            coefs = np.empty(4, np.float32)
            m = 0
            lo, hi = c * k // n_chunks, (c + 1) * k // n_chunks
            for kk in range(lo, hi):
                coef = h[t, kk]
                if coef != 0.0:
                    rows[m] = idx[kk]
                    coefs[m] = coef
                    m += 1
                    if m == 4:
                        _axpy4_q8_0(wt_down, rows[0], rows[1], rows[2], rows[3],
                                    coefs[0], coefs[1], coefs[2], coefs[3], partial[c])
                        m = 0
            for i in range(m):
                _axpy_q8_0(wt_down, rows[i], coefs[i], partial[c])
        for c in range(n_chunks):
            for j in range(d_out):
                out[t, j] += partial[c, j]
