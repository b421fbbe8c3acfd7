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
FORMATS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34)}
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


@njit(inline="always", fastmath=True)
def q_row_dot(w, r, v, xs):
    """Row r of quantized w dotted with v; xs: v's block sums (_block_sums)."""
    nb, bb = w.shape[1], w.shape[2]
    acc = np.float32(0.0)
    if bb == 18:
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
    else:
        for b in range(nb):
            base = 32 * b
            a0 += _half(w[r0, b, 0], w[r0, b, 1]) * _int8_dot(w, r0, b, v, base)
            a1 += _half(w[r1, b, 0], w[r1, b, 1]) * _int8_dot(w, r1, b, v, base)
            a2 += _half(w[r2, b, 0], w[r2, b, 1]) * _int8_dot(w, r2, b, v, base)
            a3 += _half(w[r3, b, 0], w[r3, b, 1]) * _int8_dot(w, r3, b, v, base)
    return a0, a1, a2, a3


@njit(parallel=True, fastmath=True, cache=True)
def add_matvec_q(w, v, b, x):
    """x += W v (+ b) for quantized W, in parallel; step i reads rows i, i+q, i+2q, i+3q
    (four distant streams per thread, as cpu.add_matvec)."""
    n = w.shape[0]
    xs = _block_sums(v, w.shape[1])
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
