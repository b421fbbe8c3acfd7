"""GGUF blocks re-laid 16 rows at a time for the dense kernels (decode GEMV, batches, prefill).

A lanes matrix is a uint8 array (rows / 16, blocks per row, 16, last axis): per group of 16
rows and block b, one group block of 16 x last-axis bytes laid out for `lane_ir` (fp16
scales of the 16 rows side by side, then the quants in 64-byte chunks, four bytes per row).
Same bytes as the file's blocks, re-ordered once at load (llama.cpp repacks Q4_0 for
AVX-512 the same way): a block dot then costs one integer instruction per four quants of
16 rows, with the conversion and the fp32 multiply-add shared by the 16 (`lane_ir`).

Formats: Q4_0, Q4_1, Q8_0 (last axis = their block bytes), Q4_K (148: its 144 bytes per
block with the 6-bit scales and mins unpacked to bytes, 2.8% more) and Q6_K (210, the same
bytes), with rows a multiple of 16. Q6_K in lanes was once slower than its row kernel for
one vector; with its sub-blocks' dots started from pooled bias sums it is 1.4x faster for one
and 3.4-4x for 4-8 vectors (a 7B-shaped 4096 x 4096 matrix, Intel Xeon, 2 threads). Other
formats (Q5_*) and shapes stay in `quant`'s row layout, as do matrices whose rows are
picked one at a time (the sparse FFN's rows, embeddings). Every kernel's reference twin: `dequantize` (back to rows, then gguf's)
and the fp32 op on `block_ir.reference_acts(x)`.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from . import quant
from .block_ir import _isa, quantize_acts, quantize_acts_rows
from .lane_ir import (LAST_AXIS, LANES, lane_dots1, lane_dots2, lane_dots4, lane_dots8, lane_pair_dots2, lane_pair_dots4,
                      quant_start)

FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
# Vectors per pass over a group of rows in a batch: AVX2 has 16 vector registers, and the
# accumulators of 16 rows x 8 vectors alone overflow them (docs/BENCHMARKS.md "Batched decode").
MAX_VECTORS = 8 if _isa() == "vnni" else 4
# A batch's groups two at a time, far apart, their blocks alternating in one loop: a thread
# then streams two places in memory, and a batched pass over a matrix streamed from memory
# ran 10-20% faster (7B-shaped Q4_0, Intel Xeon, docs/BENCHMARKS.md "Batched decode"; one
# vector gained nothing, so a single token keeps one group a call). Each group's dots are
# the one-group kernel's bits. Off VNNI not used: on AVX2 (16 registers, already short at
# four vectors) the 7B-shaped Q4_0 batched step got 1.4x slower (Zen 3, "Quantized GEMV").
PAIRED = _isa() == "vnni"


def fits(t: torch.Tensor) -> bool:
    """Whether quantized row blocks `t` can be re-laid as lanes (format and row count)."""
    return (quant.is_quantized(t) and t.device.type == "cpu" and quant.format_of(t) in FORMATS
            and int(t.shape[0]) % LANES == 0 and int(t.shape[0]) > 0)


def is_lanes(t: torch.Tensor) -> bool:
    """Whether `t` is a lanes matrix."""
    return t.dtype == torch.uint8 and t.dim() == 4 and int(t.shape[2]) == LANES and int(t.shape[3]) in LAST_AXIS


def format_of(t: torch.Tensor) -> str:
    return quant.BLOCK_BYTES[LAST_AXIS[int(t.shape[3])]]


def shape_of(t: torch.Tensor) -> tuple[int, int]:
    """The (rows, cols) of the matrix a lanes tensor holds."""
    return int(t.shape[0]) * LANES, int(t.shape[1]) * quant.FORMATS[format_of(t)][0]


def _q4k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 sub-blocks' 6-bit scales and mins from Q4_K's 12 scale bytes (..., 12) -> two
    (..., 8) uint8 arrays (ggml's get_scale_min_k4)."""
    lo, mid, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, mn


def _q4k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """`_q4k_scales`' inverse: (..., 8) scales and mins -> the 12 bytes."""
    lo = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    mid = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    hi = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    return np.concatenate([lo, mid, hi], axis=-1).astype(np.uint8)


def _interleave_q4k(t: torch.Tensor) -> torch.Tensor:
    rows, nb = int(t.shape[0]), int(t.shape[1])
    G = rows // LANES
    src = t.numpy().reshape(G, LANES, nb, 144).transpose(0, 2, 1, 3)  # (G, nb, 16, 144)
    out = np.empty((G, nb, LANES * 148), dtype=np.uint8)
    out[:, :, 0:32] = src[:, :, :, 0:2].reshape(G, nb, 32)
    out[:, :, 32:64] = src[:, :, :, 2:4].reshape(G, nb, 32)
    sc, mn = _q4k_scales(src[:, :, :, 4:16])  # (G, nb, 16, 8)
    out[:, :, 64:192] = sc.transpose(0, 1, 3, 2).reshape(G, nb, 128)
    out[:, :, 192:320] = mn.transpose(0, 1, 3, 2).reshape(G, nb, 128)
    qs = src[:, :, :, 16:144].reshape(G, nb, LANES, 32, 4)  # (pair p, chunk c) = 8p + c
    out[:, :, 320:] = qs.transpose(0, 1, 3, 2, 4).reshape(G, nb, -1)
    return torch.from_numpy(out.reshape(G, nb, LANES, 148))


def _deinterleave_q4k(t: torch.Tensor) -> torch.Tensor:
    G, nb = int(t.shape[0]), int(t.shape[1])
    src = t.numpy().reshape(G, nb, LANES * 148)
    out = np.empty((G, LANES, nb, 144), dtype=np.uint8)
    for k in (0, 2):
        out[:, :, :, k : k + 2] = src[:, :, 16 * k : 16 * k + 32].reshape(G, nb, LANES, 2).transpose(0, 2, 1, 3)
    sc = src[:, :, 64:192].reshape(G, nb, 8, LANES).transpose(0, 3, 1, 2)  # (G, 16, nb, 8)
    mn = src[:, :, 192:320].reshape(G, nb, 8, LANES).transpose(0, 3, 1, 2)
    out[:, :, :, 4:16] = _q4k_scale_bytes(sc, mn)
    out[:, :, :, 16:] = src[:, :, 320:].reshape(G, nb, 32, LANES, 4).transpose(0, 3, 1, 2, 4).reshape(G, LANES, nb, 128)
    return torch.from_numpy(out.reshape(G * LANES, nb, 144))


def _interleave_q6k(t: torch.Tensor) -> torch.Tensor:
    # ql (128 bytes a row) and qh (64) in 4-byte chunks of 16 rows; d and the int8 scales
    # of the 16 rows side by side (lane_ir's Q6_K group block)
    rows, nb = int(t.shape[0]), int(t.shape[1])
    G = rows // LANES
    src = t.numpy().reshape(G, LANES, nb, 210).transpose(0, 2, 1, 3)  # (G, nb, 16, 210)
    out = np.empty((G, nb, LANES * 210), dtype=np.uint8)
    out[:, :, 0:32] = src[:, :, :, 208:210].reshape(G, nb, 32)
    out[:, :, 32:288] = src[:, :, :, 192:208].transpose(0, 1, 3, 2).reshape(G, nb, 256)
    for start, lo, n in ((288, 0, 128), (288 + 2048, 128, 64)):
        qs = src[:, :, :, lo : lo + n].reshape(G, nb, LANES, n // 4, 4)
        out[:, :, start : start + 16 * n] = qs.transpose(0, 1, 3, 2, 4).reshape(G, nb, -1)
    return torch.from_numpy(out.reshape(G, nb, LANES, 210))


def _deinterleave_q6k(t: torch.Tensor) -> torch.Tensor:
    G, nb = int(t.shape[0]), int(t.shape[1])
    src = t.numpy().reshape(G, nb, LANES * 210)
    out = np.empty((G, LANES, nb, 210), dtype=np.uint8)
    out[:, :, :, 208:210] = src[:, :, 0:32].reshape(G, nb, LANES, 2).transpose(0, 2, 1, 3)
    out[:, :, :, 192:208] = src[:, :, 32:288].reshape(G, nb, 16, LANES).transpose(0, 3, 1, 2)
    for start, lo, n in ((288, 0, 128), (288 + 2048, 128, 64)):
        qs = src[:, :, start : start + 16 * n].reshape(G, nb, n // 4, LANES, 4)
        out[:, :, :, lo : lo + n] = qs.transpose(0, 3, 1, 2, 4).reshape(G, LANES, nb, n)
    return torch.from_numpy(out.reshape(G * LANES, nb, 210))


def interleave(t: torch.Tensor) -> torch.Tensor:
    """Row blocks (rows, nb, bb) -> lanes (rows / 16, nb, 16, last axis): a new array."""
    bb = int(t.shape[2])
    if bb == 144:
        return _interleave_q4k(t)
    if bb == 210:
        return _interleave_q6k(t)
    rows, nb = int(t.shape[0]), int(t.shape[1])
    src = t.numpy().reshape(rows // LANES, LANES, nb, bb).transpose(0, 2, 1, 3)  # (G, nb, 16, bb) view
    out = np.empty((rows // LANES, nb, LANES * bb), dtype=np.uint8)
    scales = 4 if bb == 20 else 2  # d (and m) of each row, as they sit at the block's start
    for k in range(0, scales, 2):
        out[:, :, 16 * k : 16 * k + 32] = src[:, :, :, k : k + 2].reshape(rows // LANES, nb, 32)
    qs = src[:, :, :, scales:]  # (G, nb, 16, quant bytes)
    chunks = (bb - scales) // 4
    qs = qs.reshape(rows // LANES, nb, LANES, chunks, 4).transpose(0, 1, 3, 2, 4).reshape(rows // LANES, nb, -1)
    start = quant_start(bb)
    out[:, :, start:] = qs ^ np.uint8(0x80) if bb == 34 else qs  # Q8_0 stored unsigned (lane_ir)
    return torch.from_numpy(out.reshape(rows // LANES, nb, LANES, bb))


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Lanes -> row blocks (rows, nb, bb): `interleave`'s inverse (tests and tools)."""
    G, nb, _, bb = (int(s) for s in t.shape)
    if bb == 148:
        return _deinterleave_q4k(t)
    if bb == 210:
        return _deinterleave_q6k(t)
    src = t.numpy().reshape(G, nb, LANES * bb)
    out = np.empty((G, LANES, nb, bb), dtype=np.uint8)
    scales = 4 if bb == 20 else 2
    for k in range(0, scales, 2):
        out[:, :, :, k : k + 2] = src[:, :, 16 * k : 16 * k + 32].reshape(G, nb, LANES, 2).transpose(0, 2, 1, 3)
    chunks = (bb - scales) // 4
    qs = src[:, :, quant_start(bb):].reshape(G, nb, chunks, LANES, 4)
    qs = qs ^ np.uint8(0x80) if bb == 34 else qs
    out[:, :, :, scales:] = qs.transpose(0, 3, 1, 2, 4).reshape(G, LANES, nb, chunks * 4)
    return torch.from_numpy(out.reshape(G * LANES, nb, bb))


def dequantize(t: torch.Tensor) -> torch.Tensor:
    """The fp32 matrix (rows, cols): the reference."""
    return quant.dequantize(deinterleave(t))


@njit(inline="always")
def _row_bytes(last):
    # the row format's block bytes (what the activation records are cut for)
    return 144 if last == 148 else last


@njit(inline="always")
def block_weights(last):
    """Weights per row and block of a lanes matrix with last axis `last` (K-quants: 256)."""
    return 256 if last == 148 or last == 210 else 32


@njit(inline="always")
def _group(w, g):
    return w.ctypes.data + g * w.strides[0]


@njit(inline="always")
def _at(X, s, g):
    # the 16 fp32 of rows 16g..16g+15 in row s of X (contiguous rows checked by the caller)
    return X.ctypes.data + s * X.strides[0] + 4 * LANES * g


@njit(inline="always")
def _check(w, V, X):
    if w.strides[3] != 1 or w.strides[2] != w.shape[3] or w.strides[1] != w.shape[2] * w.shape[3]:
        raise ValueError("lane dots need contiguous group blocks")
    if X.strides[X.ndim - 1] != 4:
        raise ValueError("lane dots write contiguous rows")
    if V.shape[V.ndim - 1] != w.shape[1] * block_weights(w.shape[3]) or X.shape[X.ndim - 1] != w.shape[0] * 16:
        raise ValueError("lane dots: vector or output length does not match the matrix")


@njit(parallel=True, fastmath=True, cache=True)
def add_records_lanes(w, qa, x):
    """x += W v for W in lanes, v given as its int8 records (`quantize_acts(v,
    record_bytes(w))`): each thread takes groups of 16 rows (`lane_ir`)."""
    G, nb, bb = w.shape[0], w.shape[1], w.shape[3]
    for g in prange(G):
        lane_dots1(bb, _group(w, g), nb, (qa.ctypes.data,), (x.ctypes.data + 4 * LANES * g,))


@njit(inline="always")
def record_bytes(w):
    """The block bytes that a lanes matrix's activation records are cut for."""
    return _row_bytes(w.shape[3])


@njit(fastmath=True, cache=True)
def add_matvec_lanes(w, v, b, x, threads):
    """x += W v (+ b) for W in lanes: v quantized, then `add_records_lanes`.
    `threads` is unused: the signature is the panel kernels'."""
    _check(w, v, x)
    add_records_lanes(w, quantize_acts(v, _row_bytes(w.shape[3])), x)
    if b.shape[0] > 0:
        for k in range(x.shape[0]):
            x[k] += b[k]


@njit(inline="always")
def _pass8(w, g, QA, X, s):
    """Rows s..s+7 of X at group g += the group's dots with QA[s..s+7]."""
    q0, qs = QA.ctypes.data, QA.strides[0]
    lane_dots8(w.shape[3], _group(w, g), w.shape[1],
               (q0 + s * qs, q0 + (s + 1) * qs, q0 + (s + 2) * qs, q0 + (s + 3) * qs, q0 + (s + 4) * qs,
                q0 + (s + 5) * qs, q0 + (s + 6) * qs, q0 + (s + 7) * qs),
               (_at(X, s, g), _at(X, s + 1, g), _at(X, s + 2, g), _at(X, s + 3, g), _at(X, s + 4, g),
                _at(X, s + 5, g), _at(X, s + 6, g), _at(X, s + 7, g)))


@njit(inline="always")
def _pass1(w, g, QA, X, s):
    """Row s of X at group g += the group's dots with QA[s]."""
    lane_dots1(w.shape[3], _group(w, g), w.shape[1], (QA.ctypes.data + s * QA.strides[0],), (_at(X, s, g),))


@njit(inline="always")
def group_dots_batch(w, g, QA, X):
    """X[s, 16g:16g + 16] += rows 16g.. of W dotted with QA[s]'s records, for every s: eight
    vectors at a time (each chunk unpacked once for the eight; four on AVX2, MAX_VECTORS), then
    four, two, one. Each (row, vector) dot is the same arithmetic whatever the grouping."""
    nb, bb = w.shape[1], w.shape[3]
    B = QA.shape[0]
    q0 = QA.ctypes.data
    qs = QA.strides[0]
    wg = _group(w, g)
    s = 0
    while MAX_VECTORS >= 8 and B - s >= 8:
        _pass8(w, g, QA, X, s)
        s += 8
    while MAX_VECTORS >= 4 and B - s >= 4:
        lane_dots4(bb, wg, nb, (q0 + s * qs, q0 + (s + 1) * qs, q0 + (s + 2) * qs, q0 + (s + 3) * qs),
                   (_at(X, s, g), _at(X, s + 1, g), _at(X, s + 2, g), _at(X, s + 3, g)))
        s += 4
    while B - s >= 2:
        lane_dots2(bb, wg, nb, (q0 + s * qs, q0 + (s + 1) * qs), (_at(X, s, g), _at(X, s + 1, g)))
        s += 2
    if s < B:
        _pass1(w, g, QA, X, s)


@njit(inline="always")
def group_pair_dots_batch(w, g, h, QA, X):
    """`group_dots_batch` for groups g and h at once (`PAIRED`): the same passes of eight,
    four, two and one vectors, the same bits; the passes of four and two run both groups'
    blocks alternating in one loop (eight vectors of two groups spilled registers and ran
    slower than one group at a time)."""
    nb, bb = w.shape[1], w.shape[3]
    B = QA.shape[0]
    q0 = QA.ctypes.data
    qs = QA.strides[0]
    groups = (_group(w, g), _group(w, h))
    s = 0
    while MAX_VECTORS >= 8 and B - s >= 8:
        _pass8(w, g, QA, X, s)
        _pass8(w, h, QA, X, s)
        s += 8
    while MAX_VECTORS >= 4 and B - s >= 4:
        lane_pair_dots4(bb, groups, nb, (q0 + s * qs, q0 + (s + 1) * qs, q0 + (s + 2) * qs, q0 + (s + 3) * qs),
                        (_at(X, s, g), _at(X, s + 1, g), _at(X, s + 2, g), _at(X, s + 3, g), _at(X, s, h),
                         _at(X, s + 1, h), _at(X, s + 2, h), _at(X, s + 3, h)))
        s += 4
    while B - s >= 2:
        lane_pair_dots2(bb, groups, nb, (q0 + s * qs, q0 + (s + 1) * qs),
                        (_at(X, s, g), _at(X, s + 1, g), _at(X, s, h), _at(X, s + 1, h)))
        s += 2
    if s < B:
        _pass1(w, g, QA, X, s)
        _pass1(w, h, QA, X, s)


@njit(inline="always")
def pair_steps(lo, hi):
    """Steps of `pair_step` over groups [lo, hi): a pair each, the last group alone when odd."""
    return (hi - lo + 1) // 2


@njit(inline="always")
def pair_step(w, lo, hi, i, QA, X):
    """Step i of the groups [lo, hi) taken in pairs: groups lo + i and lo + i + half (half =
    (hi - lo) // 2; far apart, so a thread streams two places), or the odd last group alone."""
    half = (hi - lo) // 2
    if i < half:
        group_pair_dots_batch(w, lo + i, lo + i + half, QA, X)
    else:
        group_dots_batch(w, hi - 1, QA, X)


@njit(fastmath=True, cache=True, nogil=True)  # called, not inlined: one compile for the team kernels' uses
def add_groups(w, b, QA, X, lo, hi, zero):
    """X[:, 16g:16g + 16] (zeroed first when `zero`) += W QA[s] (+ b) for groups g in [lo, hi),
    every row s of the records QA (one row: a single token's GEMV, the same dots); a batch
    takes the groups in pairs (g, g + half the range) where `PAIRED`."""
    if zero:
        X[:, lo * LANES:hi * LANES] = 0.0
    if PAIRED and QA.shape[0] > 1:
        for i in range(pair_steps(lo, hi)):
            pair_step(w, lo, hi, i, QA, X)
    else:
        for g in range(lo, hi):
            group_dots_batch(w, g, QA, X)
    if b.shape[0] > 0:
        for s in range(X.shape[0]):
            for k in range(lo * LANES, hi * LANES):
                X[s, k] += b[k]


@njit(parallel=True, fastmath=True, cache=True)
def _add_dots(w, QA, X):
    """X[s] += the dots of W's rows with QA[s]'s records, for every s, a group of 16 rows per
    step (`group_dots_batch`; a batch two groups a step, `PAIRED`). Every (row, vector) pair
    runs the same arithmetic, so a batch row equals the GEMV's."""
    if PAIRED and QA.shape[0] > 1:
        for i in prange(pair_steps(0, w.shape[0])):
            pair_step(w, 0, w.shape[0], i, QA, X)
    else:
        for g in prange(w.shape[0]):
            group_dots_batch(w, g, QA, X)


@njit(fastmath=True, cache=True)
def add_matvec_lanes_batch(w, V, b, X, threads):
    """X[s] += W V[s] (+ b) for W in lanes, a batch: the vectors quantized once, then
    `_add_dots`; each row equals `add_matvec_lanes` on V[s]."""
    _check(w, V, X)
    _add_dots(w, quantize_acts_rows(V, _row_bytes(w.shape[3])), X)
    if b.shape[0] > 0:
        for s in range(X.shape[0]):
            for k in range(X.shape[1]):
                X[s, k] += b[k]


def matmul(t: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, cols) @ W.T (+ bias) for W in lanes (prefill): 16 rows x 8 tokens per step,
    each (row, token) dot the GEMV's own."""
    w = t.numpy()
    xs = np.ascontiguousarray(x.float().numpy())
    out = np.zeros((xs.shape[0], shape_of(t)[0]), dtype=np.float32)
    add_matvec_lanes_batch(w, xs, np.zeros(0, dtype=np.float32), out, 0)  # one token too: the GEMV's dots
    res = torch.from_numpy(out)
    return res if bias is None else res.add_(bias)
