"""GGUF block-quantized weights kept as they are in the file, and their numba kernels.

A quantized matrix is a uint8 tensor of shape (rows, blocks per row, block bytes): a view of
the GGUF file's bytes (ggml-common.h layouts), no float copy. Blocks run along a row, so
rows can be gathered, concatenated and permuted without touching a block, and the block
size names the format, which lets the numba kernels pick their code at compile time from
the array's type (3-D uint8) and at run time from one number:

| format | block bytes | weights | value |
|---|---|---|---|
| Q4_0 | 18: half d; u8 qs[16] | 32 | (nibble - 8) * d; low nibbles are 0-15, high 16-31 |
| Q4_1 | 20: half d, m; u8 qs[16] | 32 | nibble * d + m |
| Q8_0 | 34: half d; i8 qs[32] | 32 | q * d |
| Q5_0 | 22: half d; u8 qh[4]; u8 qs[16] | 32 | (nibble + 16 high bit - 16) * d |
| Q5_1 | 24: half d, m; u8 qh[4]; u8 qs[16] | 32 | (nibble + 16 high bit) * d + m |
| Q4_K | 144: half d, dmin; u8 scales[12]; u8 qs[128] | 256 | 8 sub-blocks of 32: d sc q - dmin m (6-bit sc, m) |
| Q5_K | 176: half d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] | 256 | as Q4_K with a fifth bit from qh |
| Q6_K | 210: u8 ql[128]; u8 qh[64]; i8 scales[16]; half d | 256 | 16 sub-blocks of 16: d sc (q - 32) |

The GEMV widens each block to fp32 in registers and multiplies by the fp32 activations, four
rows per step so that a block of x is read once for four rows (the layout of cpu.add_matvec;
docs/BENCHMARKS.md measures the alternatives, including int8 activations, which numba
cannot turn into VNNI dot products). Per block, sum((q - 8) x) = sum(q x) - 8 sum(x) and
sum((q d + m) x) = d sum(q x) + m sum(x): the block sums of x are taken once per call, so the
inner loop is one multiply-add per weight. Batches (prefill) widen a tile of rows at a time
into a reused fp32 buffer for torch's GEMM: no float copy of a whole matrix is kept or made.
Every kernel's reference twin is `dequantize` (the gguf package's) and the fp32 op.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

# format name -> (weights per block, bytes per block)
FORMATS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q5_0": (32, 22), "Q5_1": (32, 24),
           "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
BLOCK_BYTES = {bb: name for name, (_, bb) in FORMATS.items()}
TILE_ROWS = 256  # rows widened at a time for a batched matmul


def is_quantized(t: torch.Tensor) -> bool:
    """Whether `t` is a quantized matrix in this module's layout."""
    return t.dtype == torch.uint8 and t.dim() == 3 and int(t.shape[2]) in BLOCK_BYTES


def format_of(t: torch.Tensor) -> str:
    return BLOCK_BYTES[int(t.shape[2])]


def shape_of(t: torch.Tensor) -> tuple[int, int]:
    """The (rows, cols) of the matrix a quantized tensor holds."""
    return int(t.shape[0]), int(t.shape[1]) * FORMATS[format_of(t)][0]


def from_gguf(data: np.ndarray, type_name: str, rows: int, cols: int) -> torch.Tensor:
    """The quantized matrix in a GGUF tensor's bytes (a view, no copy)."""
    per, nbytes = FORMATS[type_name]
    return torch.from_numpy(np.asarray(data).reshape(rows, cols // per, nbytes))


def dequantize(t: torch.Tensor) -> torch.Tensor:
    """The fp32 matrix (rows, cols): the reference every kernel here is tested against."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rows, cols = shape_of(t)
    qtype = GGMLQuantizationType[format_of(t)]
    return torch.from_numpy(gguf_dequantize(t.numpy().reshape(rows, -1), qtype).reshape(rows, cols).astype(np.float32))


@intrinsic
def _half(typingctx, lo, hi):
    """The fp32 value of the little-endian fp16 in bytes (lo, hi)."""
    if lo != types.uint8 or hi != types.uint8:
        return None
    sig = types.float32(types.uint8, types.uint8)

    def codegen(context, builder, signature, args):
        i16 = ir.IntType(16)
        bits = builder.or_(builder.zext(args[0], i16), builder.shl(builder.zext(args[1], i16), ir.Constant(i16, 8)))
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())

    return sig, codegen


@njit(inline="always", fastmath=True)
def _block_sums(v, nb):
    """sum(v[32 b : 32 b + 32]) for every block b."""
    s = np.empty(nb, dtype=np.float32)
    for b in range(nb):
        acc = np.float32(0.0)
        for j in range(32):
            acc += v[32 * b + j]
        s[b] = acc
    return s


@njit(inline="always", fastmath=True)
def _nibble_dot(w, r, b, off, v, base):
    """sum over the block's 32 nibbles q of q * v (low nibbles 0-15, high 16-31)."""
    acc = np.float32(0.0)
    for j in range(16):
        q = w[r, b, off + j]
        acc += np.float32(q & 15) * v[base + j] + np.float32(q >> 4) * v[base + 16 + j]
    return acc


@njit(inline="always", fastmath=True)
def _int8_dot(w, r, b, v, base):
    acc = np.float32(0.0)
    for j in range(32):
        acc += np.float32(np.int8(w[r, b, 2 + j])) * v[base + j]
    return acc


@njit(inline="always")
def _scale_min_k4(w, r, b, j):
    """Sub-block j's 6-bit (scale, min) of a Q4_K/Q5_K block (ggml's get_scale_min_k4)."""
    if j < 4:
        return np.float32(w[r, b, 4 + j] & 63), np.float32(w[r, b, 8 + j] & 63)
    sc = (w[r, b, 8 + j] & 15) | ((w[r, b, j] >> 6) << 4)
    m = (w[r, b, 8 + j] >> 4) | ((w[r, b, 4 + j] >> 6) << 4)
    return np.float32(sc), np.float32(m)


@njit(fastmath=True)
def _kq_block_dot(w, r, b, v, base):
    """One 256-weight K-quant block (Q4_K, Q5_K, Q6_K) of row r dotted with v[base:]."""
    bb = w.shape[2]
    acc = np.float32(0.0)
    if bb == 210:  # Q6_K: ql[128] qh[64] scales[16] d; sub-blocks of 16
        d = _half(w[r, b, 208], w[r, b, 209])
        for half in range(2):
            ql, qh, sc, y = 64 * half, 128 + 32 * half, 192 + 8 * half, base + 128 * half
            for i in range(2):  # weights l in [16 i, 16 i + 16): sub-blocks i, i+2, i+4, i+6
                s0 = s1 = s2 = s3 = x0 = x1 = x2 = x3 = np.float32(0.0)
                for l in range(16 * i, 16 * i + 16):
                    h = np.int32(w[r, b, qh + l])
                    lo, hi = np.int32(w[r, b, ql + l]), np.int32(w[r, b, ql + l + 32])
                    s0 += np.float32((lo & 15) | ((h & 3) << 4)) * v[y + l]
                    s1 += np.float32((hi & 15) | (((h >> 2) & 3) << 4)) * v[y + l + 32]
                    s2 += np.float32((lo >> 4) | (((h >> 4) & 3) << 4)) * v[y + l + 64]
                    s3 += np.float32((hi >> 4) | (((h >> 6) & 3) << 4)) * v[y + l + 96]
                    x0 += v[y + l]
                    x1 += v[y + l + 32]
                    x2 += v[y + l + 64]
                    x3 += v[y + l + 96]
                thirty_two = np.float32(32.0)  # q - 32: subtract 32 sum(v) per sub-block
                acc += d * (np.float32(np.int8(w[r, b, sc + i])) * (s0 - thirty_two * x0)
                            + np.float32(np.int8(w[r, b, sc + i + 2])) * (s1 - thirty_two * x1)
                            + np.float32(np.int8(w[r, b, sc + i + 4])) * (s2 - thirty_two * x2)
                            + np.float32(np.int8(w[r, b, sc + i + 6])) * (s3 - thirty_two * x3))
        return acc
    d, dmin = _half(w[r, b, 0], w[r, b, 1]), _half(w[r, b, 2], w[r, b, 3])
    qs = 16 if bb == 144 else 48
    for p in range(4):  # pairs of sub-blocks: low nibbles, then high nibbles of 32 bytes
        sc0, m0 = _scale_min_k4(w, r, b, 2 * p)
        sc1, m1 = _scale_min_k4(w, r, b, 2 * p + 1)
        y = base + 64 * p
        d0 = d1 = x0 = x1 = np.float32(0.0)
        for l in range(32):
            q = w[r, b, qs + 32 * p + l]
            lo, hi = np.float32(q & 15), np.float32(q >> 4)
            if bb == 176:  # Q5_K: the fifth bit of weight l of sub-blocks 2p and 2p+1
                h = w[r, b, 16 + l]
                lo += np.float32(16.0) * np.float32((h >> (2 * p)) & 1)
                hi += np.float32(16.0) * np.float32((h >> (2 * p + 1)) & 1)
            d0 += lo * v[y + l]
            d1 += hi * v[y + 32 + l]
            x0 += v[y + l]
            x1 += v[y + 32 + l]
        acc += d * (sc0 * d0 + sc1 * d1) - dmin * (m0 * x0 + m1 * x1)
    return acc


@njit(inline="always", fastmath=True)
def _q5_block_dot(w, r, b, v, base):
    """sum of the block's 5-bit values q (before offset and scale) times v (Q5_0, Q5_1)."""
    off = 6 if w.shape[2] == 22 else 8
    qh = (np.uint32(w[r, b, off - 4]) | (np.uint32(w[r, b, off - 3]) << np.uint32(8))
          | (np.uint32(w[r, b, off - 2]) << np.uint32(16)) | (np.uint32(w[r, b, off - 1]) << np.uint32(24)))
    acc = np.float32(0.0)
    for j in range(16):
        q = w[r, b, off + j]
        lo = np.float32(q & 15) + np.float32(16.0) * np.float32((qh >> np.uint32(j)) & np.uint32(1))
        hi = np.float32(q >> 4) + np.float32(16.0) * np.float32((qh >> np.uint32(j + 16)) & np.uint32(1))
        acc += lo * v[base + j] + hi * v[base + 16 + j]
    return acc


@njit(inline="always", fastmath=True)
def q_row_dot(w, r, v, xs):
    """Row r of quantized w dotted with v; xs: v's block sums of 32 (_block_sums)."""
    nb, bb = w.shape[1], w.shape[2]
    acc = np.float32(0.0)
    if bb == 22:
        for b in range(nb):
            acc += _half(w[r, b, 0], w[r, b, 1]) * (_q5_block_dot(w, r, b, v, 32 * b) - np.float32(16.0) * xs[b])
    elif bb == 24:
        for b in range(nb):
            acc += _half(w[r, b, 0], w[r, b, 1]) * _q5_block_dot(w, r, b, v, 32 * b) + _half(w[r, b, 2], w[r, b, 3]) * xs[b]
    elif bb >= 144:
        for b in range(nb):
            acc += _kq_block_dot(w, r, b, v, 256 * b)
    elif bb == 18:
        for b in range(nb):
            acc += _half(w[r, b, 0], w[r, b, 1]) * (_nibble_dot(w, r, b, 2, v, 32 * b) - np.float32(8.0) * xs[b])
    elif bb == 20:
        for b in range(nb):
            acc += _half(w[r, b, 0], w[r, b, 1]) * _nibble_dot(w, r, b, 4, v, 32 * b) + _half(w[r, b, 2], w[r, b, 3]) * xs[b]
    else:
        for b in range(nb):
            acc += _half(w[r, b, 0], w[r, b, 1]) * _int8_dot(w, r, b, v, 32 * b)
    return acc


@njit(inline="always", fastmath=True)
def _q_dot4(w, r0, r1, r2, r3, v, xs):
    """Four rows dotted with v in one pass over v's blocks."""
    nb, bb = w.shape[1], w.shape[2]
    a0 = a1 = a2 = a3 = np.float32(0.0)
    if bb == 18:
        for b in range(nb):
            base = 32 * b
            e = np.float32(8.0) * xs[b]
            a0 += _half(w[r0, b, 0], w[r0, b, 1]) * (_nibble_dot(w, r0, b, 2, v, base) - e)
            a1 += _half(w[r1, b, 0], w[r1, b, 1]) * (_nibble_dot(w, r1, b, 2, v, base) - e)
            a2 += _half(w[r2, b, 0], w[r2, b, 1]) * (_nibble_dot(w, r2, b, 2, v, base) - e)
            a3 += _half(w[r3, b, 0], w[r3, b, 1]) * (_nibble_dot(w, r3, b, 2, v, base) - e)
    elif bb == 20:
        for b in range(nb):
            base, s = 32 * b, xs[b]
            a0 += _half(w[r0, b, 0], w[r0, b, 1]) * _nibble_dot(w, r0, b, 4, v, base) + _half(w[r0, b, 2], w[r0, b, 3]) * s
            a1 += _half(w[r1, b, 0], w[r1, b, 1]) * _nibble_dot(w, r1, b, 4, v, base) + _half(w[r1, b, 2], w[r1, b, 3]) * s
            a2 += _half(w[r2, b, 0], w[r2, b, 1]) * _nibble_dot(w, r2, b, 4, v, base) + _half(w[r2, b, 2], w[r2, b, 3]) * s
            a3 += _half(w[r3, b, 0], w[r3, b, 1]) * _nibble_dot(w, r3, b, 4, v, base) + _half(w[r3, b, 2], w[r3, b, 3]) * s
    elif bb == 34:
        for b in range(nb):
            base = 32 * b
            a0 += _half(w[r0, b, 0], w[r0, b, 1]) * _int8_dot(w, r0, b, v, base)
            a1 += _half(w[r1, b, 0], w[r1, b, 1]) * _int8_dot(w, r1, b, v, base)
            a2 += _half(w[r2, b, 0], w[r2, b, 1]) * _int8_dot(w, r2, b, v, base)
            a3 += _half(w[r3, b, 0], w[r3, b, 1]) * _int8_dot(w, r3, b, v, base)
    else:  # Q5_0, Q5_1 and the K-quants: one row at a time
        a0, a1, a2, a3 = q_row_dot(w, r0, v, xs), q_row_dot(w, r1, v, xs), q_row_dot(w, r2, v, xs), q_row_dot(w, r3, v, xs)
    return a0, a1, a2, a3


@njit(parallel=True, fastmath=True, cache=True)
def add_matvec_q(w, v, b, x):
    """x += W v (+ b) for quantized W, in parallel; step i reads rows i, i+q, i+2q, i+3q
    (four distant streams per thread, as cpu.add_matvec)."""
    n = w.shape[0]
    xs = _block_sums(v, v.shape[0] // 32)
    q = n // 4
    has_b = b.shape[0] > 0
    for i in prange(q):
        a0, a1, a2, a3 = _q_dot4(w, i, i + q, i + 2 * q, i + 3 * q, v, xs)
        if has_b:
            a0 += b[i]
            a1 += b[i + q]
            a2 += b[i + 2 * q]
            a3 += b[i + 3 * q]
        x[i] += a0
        x[i + q] += a1
        x[i + 2 * q] += a2
        x[i + 3 * q] += a3
    for i in range(4 * q, n):
        acc = q_row_dot(w, i, v, xs)
        if has_b:
            acc += b[i]
        x[i] += acc


@njit(parallel=True, fastmath=True, cache=True)
def dequantize_rows(w, r0, out):
    """out[k] = row r0 + k of quantized w as fp32, for every row of `out` (rows, cols)."""
    nb, bb = w.shape[1], w.shape[2]
    for k in prange(out.shape[0]):
        r = r0 + k
        if bb == 22 or bb == 24 or bb >= 144:
            _dequantize_row_generic(w, r, out[k])
            continue
        for b in range(nb):
            d = _half(w[r, b, 0], w[r, b, 1])
            base = 32 * b
            if bb == 34:
                for j in range(32):
                    out[k, base + j] = d * np.float32(np.int8(w[r, b, 2 + j]))
            else:
                off = 2 if bb == 18 else 4
                m = np.float32(-8.0) * d if bb == 18 else _half(w[r, b, 2], w[r, b, 3])
                for j in range(16):
                    qb = w[r, b, off + j]
                    out[k, base + j] = d * np.float32(qb & 15) + m
                    out[k, base + 16 + j] = d * np.float32(qb >> 4) + m


@njit
def _dequantize_row_generic(w, r, out):
    """Row r as fp32 for Q5_0, Q5_1 and the K-quants (ggml's dequantize_row_*)."""
    nb, bb = w.shape[1], w.shape[2]
    for b in range(nb):
        if bb == 22 or bb == 24:
            off = 6 if bb == 22 else 8
            d = _half(w[r, b, 0], w[r, b, 1])
            m = np.float32(-16.0) * d if bb == 22 else _half(w[r, b, 2], w[r, b, 3])
            qh = (np.uint32(w[r, b, off - 4]) | (np.uint32(w[r, b, off - 3]) << np.uint32(8))
                  | (np.uint32(w[r, b, off - 2]) << np.uint32(16)) | (np.uint32(w[r, b, off - 1]) << np.uint32(24)))
            for j in range(16):
                q = w[r, b, off + j]
                lo = np.float32(q & 15) + np.float32(16.0) * np.float32((qh >> np.uint32(j)) & np.uint32(1))
                hi = np.float32(q >> 4) + np.float32(16.0) * np.float32((qh >> np.uint32(j + 16)) & np.uint32(1))
                out[32 * b + j] = d * lo + m
                out[32 * b + 16 + j] = d * hi + m
        elif bb == 210:
            d = _half(w[r, b, 208], w[r, b, 209])
            for half in range(2):
                ql, qh, sc, y = 64 * half, 128 + 32 * half, 192 + 8 * half, 256 * b + 128 * half
                for l in range(32):
                    i = l // 16
                    h = np.int32(w[r, b, qh + l])
                    lo, hi = np.int32(w[r, b, ql + l]), np.int32(w[r, b, ql + l + 32])
                    out[y + l] = d * np.float32(np.int8(w[r, b, sc + i])) * np.float32(((lo & 15) | ((h & 3) << 4)) - 32)
                    out[y + l + 32] = d * np.float32(np.int8(w[r, b, sc + i + 2])) * np.float32(
                        ((hi & 15) | (((h >> 2) & 3) << 4)) - 32)
                    out[y + l + 64] = d * np.float32(np.int8(w[r, b, sc + i + 4])) * np.float32(
                        ((lo >> 4) | (((h >> 4) & 3) << 4)) - 32)
                    out[y + l + 96] = d * np.float32(np.int8(w[r, b, sc + i + 6])) * np.float32(
                        ((hi >> 4) | (((h >> 6) & 3) << 4)) - 32)
        else:  # Q4_K, Q5_K
            d, dmin = _half(w[r, b, 0], w[r, b, 1]), _half(w[r, b, 2], w[r, b, 3])
            qs = 16 if bb == 144 else 48
            for p in range(4):
                sc0, m0 = _scale_min_k4(w, r, b, 2 * p)
                sc1, m1 = _scale_min_k4(w, r, b, 2 * p + 1)
                y = 256 * b + 64 * p
                for l in range(32):
                    q = w[r, b, qs + 32 * p + l]
                    lo, hi = np.float32(q & 15), np.float32(q >> 4)
                    if bb == 176:
                        h = w[r, b, 16 + l]
                        lo += np.float32(16.0) * np.float32((h >> (2 * p)) & 1)
                        hi += np.float32(16.0) * np.float32((h >> (2 * p + 1)) & 1)
                    out[y + l] = d * sc0 * lo - dmin * m0
                    out[y + 32 + l] = d * sc1 * hi - dmin * m1
    return out


def matmul(t: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, cols) @ W.T (+ bias) for quantized W: TILE_ROWS rows widened at a time."""
    rows, cols = shape_of(t)
    w = t.numpy()
    out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    tile = np.empty((min(TILE_ROWS, rows), cols), dtype=np.float32)
    xf = x.float()
    for r0 in range(0, rows, TILE_ROWS):
        n = min(TILE_ROWS, rows - r0)
        dequantize_rows(w, r0, tile[:n])
        torch.matmul(xf, torch.from_numpy(tile[:n]).t(), out=out[:, r0 : r0 + n])
    return out if bias is None else out.add_(bias)


def embedding(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of quantized W as fp32 (T, cols): an embedding lookup."""
    rows = ids.tolist()
    _, cols = shape_of(t)
    out = np.empty((len(rows), cols), dtype=np.float32)
    w = t.numpy()
    for k, r in enumerate(rows):
        dequantize_rows(w, r, out[k : k + 1])
    return torch.from_numpy(out)
