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

Every kernel takes its block dots from `block_ir`: the activations quantized to int8 per 32
values (as llama.cpp does) and integer dot products (VNNI, AVX2 or plain, by the CPU),
LLVM vector IR with lane accumulators across a row. The GEMV does four rows per step; the
matmul (prefill, and any batch past a few tokens) four rows by four tokens, each (row,
token) dot the GEMV's arithmetic; no float copy of a matrix is made. The dense kernels read
Q4_0/Q4_1/Q8_0 matrices re-laid 16 rows at a time instead (ops/lanes.py, chosen once by
`weights.weight_for`); this row layout serves the other formats, embeddings and the sparse
kernels, which pick rows one at a time.
Every kernel's reference twin is `dequantize` (the gguf package's) and the fp32 op on
`block_ir.reference_acts(x)` (the activations rounded as the kernels round them).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import q6k_tiles
from .block_ir import dot_row, dot_rows4, dot_tile, quantize_acts, quantize_acts_rows

# format name -> (weights per block, bytes per block)
FORMATS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q5_0": (32, 22), "Q5_1": (32, 24),
           "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
BLOCK_BYTES = {bb: name for name, (_, bb) in FORMATS.items()}
TILE_ROWS = 256  # rows widened at a time (the transposed matmul, widening)
# tokens from which a Q6_K matmul unpacks 16 rows at a time for all of them (ops/q6k_tiles.py):
# the unpacking pays from about 8-12 tokens (4096 x 4096: 54 vs 66 G MAC/s at 8, 75 vs 54 at 16)
Q6K_TILE_TOKENS = 12
# Byte offsets of each block's fp16 scales (d, and m/dmin where the format has one).
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2),
                 "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


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


def has_nonfinite_scales(t: torch.Tensor) -> bool:
    """Whether any block scale is NaN or Inf (the quantized values themselves are integers).
    An fp16 is NaN/Inf when its five exponent bits, bits 2-6 of its high byte, are all set."""
    blocks = t.numpy()
    return any(bool(np.any(blocks[:, :, off + 1] & 0x7C == 0x7C)) for off in SCALE_OFFSETS[format_of(t)])


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


def _byte_to_float(kind: str):
    """An intrinsic widening one uint8 to fp32 in 8-bit integer ops: its low nibble, high
    nibble, or the byte as int8. numba would widen the integer to 64 bits first, and LLVM
    does not vectorise 64-bit integer-to-float conversions; in 8 bits it does."""

    @intrinsic
    def widen_byte(typingctx, q):
        if q != types.uint8:
            return None

        def codegen(context, builder, signature, args):
            v = args[0]
            if kind == "lo":
                return builder.sitofp(builder.zext(builder.and_(v, ir.Constant(ir.IntType(8), 15)), ir.IntType(32)),
                                      ir.FloatType())
            if kind == "hi":
                return builder.sitofp(builder.zext(builder.lshr(v, ir.Constant(ir.IntType(8), 4)), ir.IntType(32)),
                                      ir.FloatType())
            if kind == "u8":
                return builder.sitofp(builder.zext(v, ir.IntType(32)), ir.FloatType())
            return builder.sitofp(builder.sext(v, ir.IntType(32)), ir.FloatType())

        return types.float32(types.uint8), codegen

    return widen_byte


_lo, _hi, _s8, _u8 = _byte_to_float("lo"), _byte_to_float("hi"), _byte_to_float("s8"), _byte_to_float("u8")


@njit(inline="always", fastmath=True)
def _dequant_small_block(w, r, b, out, base):
    """Block b of row r (Q4_0, Q4_1, Q8_0) as 32 fp32 values at out[base:]."""
    bb = w.shape[2]
    d = _half(w[r, b, 0], w[r, b, 1])
    if bb == 34:
        for j in range(32):
            out[base + j] = d * _s8(w[r, b, 2 + j])
        return
    off = 2 if bb == 18 else 4
    m = np.float32(-8.0) * d if bb == 18 else _half(w[r, b, 2], w[r, b, 3])
    for j in range(16):
        q = w[r, b, off + j]
        out[base + j] = d * _lo(q) + m
        out[base + 16 + j] = d * _hi(q) + m


@njit(fastmath=True)
def dequantize_row(w, r, out):
    """Row r of quantized w as fp32 into out (cols,)."""
    bb = w.shape[2]
    if bb == 18 or bb == 20 or bb == 34:
        for b in range(w.shape[1]):
            _dequant_small_block(w, r, b, out, 32 * b)
    else:
        _dequantize_row_generic(w, r, out)


@njit(fastmath=True, cache=True)
def add_matvec_q(w, v, b, x, threads):
    """x += W v (+ b) for quantized W (any block format): v quantized, then
    `add_records_q`. `threads` is unused: the signature is the panel kernels'."""
    add_records_q(w, quantize_acts(v, w.shape[2]), x)
    if b.shape[0] > 0:
        for k in range(w.shape[0]):
            x[k] += b[k]


@njit(parallel=True, fastmath=True, cache=True)
def add_records_q(w, qa, x):
    """x += W v for quantized W, v given as its int8 records (`quantize_acts(v, w.shape[2])`),
    in parallel: rows i, i+q, i+2q, i+3q per step (four streams, each block of the records
    read once for the four; block_ir)."""
    n = w.shape[0]
    q = n // 4
    for i in prange(q):
        a0, a1, a2, a3 = dot_rows4(w, i, i + q, i + 2 * q, i + 3 * q, qa)
        x[i] += a0
        x[i + q] += a1
        x[i + 2 * q] += a2
        x[i + 3 * q] += a3
    for i in range(4 * q, n):
        x[i] += dot_row(w, i, qa)


@njit(parallel=True, fastmath=True, cache=True)
def dequantize_rows(w, r0, out):
    """out[k] = row r0 + k of quantized w as fp32, for every row of `out` (rows, cols)."""
    for k in prange(out.shape[0]):
        dequantize_row(w, r0 + k, out[k])


@njit(inline="always")
def _scale_min_k4(w, r, b, j):
    """Sub-block j's 6-bit (scale, min) of a Q4_K/Q5_K block (ggml's get_scale_min_k4)."""
    if j < 4:
        return np.float32(w[r, b, 4 + j] & 63), np.float32(w[r, b, 8 + j] & 63)
    sc = (w[r, b, 8 + j] & 15) | ((w[r, b, j] >> 6) << 4)
    m = (w[r, b, 8 + j] >> 4) | ((w[r, b, 4 + j] >> 6) << 4)
    return np.float32(sc), np.float32(m)


@njit(fastmath=True)
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
    """x (T, cols) @ W.T (+ bias) for quantized W: the block dots over four rows and four
    tokens at a time (`_matmul_tiles`), each (row, token) dot the GEMV's own; Q6_K from
    Q6K_TILE_TOKENS tokens on unpacked 16 rows at a time (`q6k_tiles`)."""
    if int(t.shape[2]) == q6k_tiles.BB and x.shape[0] >= Q6K_TILE_TOKENS:
        res = q6k_tiles.matmul(t, x)
        return res if bias is None else res.add_(bias)
    return _matmul_rows(t, x, bias)


def _matmul_rows(t: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`matmul` on the row kernels alone (the GEMV for one token, 4 x 4 tiles otherwise)."""
    w = t.numpy()
    xs = np.ascontiguousarray(x.float().numpy())
    if xs.shape[0] == 1:  # the GEMV (four row streams) reads one vector's rows faster than tiles do
        out = np.zeros((1, w.shape[0]), dtype=np.float32)
        add_matvec_q(w, xs[0], np.zeros(0, dtype=np.float32), out[0], 0)
    else:
        out = np.empty((xs.shape[0], w.shape[0]), dtype=np.float32)
        _matmul_tiles(w, quantize_acts_rows(xs, w.shape[2]), out)
    res = torch.from_numpy(out)
    return res if bias is None else res.add_(bias)


@njit(parallel=True, fastmath=True, cache=True)
def _matmul_tiles(w, QA, out):
    """out (T, rows) = the dots of W's rows with QA's T activation rows: 4 x 4 tiles (the
    weight rows stay in L1 while the tokens pass), edges row by row."""
    n, T = w.shape[0], QA.shape[0]
    fours = T // 4 * 4
    for g in prange((n + 3) // 4):
        r = 4 * g
        if r + 4 <= n:
            for s in range(0, fours, 4):
                res = dot_tile(w, r, QA, s)
                for a in range(4):
                    for c in range(4):
                        out[s + c, r + a] = res[4 * a + c]
            for s in range(fours, T):
                a0, a1, a2, a3 = dot_rows4(w, r, r + 1, r + 2, r + 3, QA[s])
                out[s, r], out[s, r + 1], out[s, r + 2], out[s, r + 3] = a0, a1, a2, a3
        else:
            for i in range(r, n):
                for s in range(T):
                    out[s, i] = dot_row(w, i, QA[s])


def tiles(t: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, fp32 rows) of quantized `t`, TILE_ROWS rows at a time, widened into one
    reused buffer: each tile is valid until the next one is made."""
    rows, cols = shape_of(t)
    buf = np.empty((min(TILE_ROWS, rows), cols), dtype=np.float32)
    w = t.numpy()
    for r0 in range(0, rows, TILE_ROWS):
        n = min(TILE_ROWS, rows - r0)
        dequantize_rows(w, r0, buf[:n])
        yield r0, torch.from_numpy(buf[:n])


def embedding(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of quantized W as fp32 (T, cols): an embedding lookup."""
    rows = ids.reshape(-1).to(torch.int64).numpy()
    _, cols = shape_of(t)
    out = np.empty((len(rows), cols), dtype=np.float32)
    (_gather_rows if len(rows) < GATHER_PARALLEL_ROWS else _gather_rows_parallel)(t.numpy(), rows, out)
    return torch.from_numpy(out)


# Below this many rows a lookup runs on the calling thread: a decode step's one row took a
# parallel region, whose workers a server's HTTP thread may be holding a core from.
GATHER_PARALLEL_ROWS = 64


@njit(fastmath=True, cache=True)
def _gather_rows(w, rows, out):
    for k in range(len(rows)):
        dequantize_row(w, rows[k], out[k])


@njit(parallel=True, fastmath=True, cache=True)
def _gather_rows_parallel(w, rows, out):
    for k in prange(len(rows)):
        dequantize_row(w, rows[k], out[k])


class QuantParts:
    """Row blocks of different GGUF formats stacked as one matrix, each part in its own blocks:
    a fused QKV whose V rows are Q6_K beside Q4_K q and k rows, as Q4_K_M files store them."""

    def __init__(self, parts: list[torch.Tensor], shape: tuple[int, int] | None = None,
                 formats: list[str] | None = None):
        """`parts`: row blocks (rows, blocks, bytes); or, with the `shape` and `formats` of
        the matrix they came from, the same parts re-laid (ops/lanes.py) where they allow it."""
        self.parts = parts
        self.shape = shape or (sum(shape_of(p)[0] for p in parts), shape_of(parts[0])[1])
        self.formats = formats or [format_of(p) for p in parts]

    def widened(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The matrix as one float tensor (for the torch route and the packed format)."""
        return torch.cat([widen(p, dtype) for p in self.parts])


def cat_rows(parts: list[torch.Tensor], notes: set[str] | None = None,
             keep_parts: bool = False) -> torch.Tensor | QuantParts:
    """The rows of `parts` stacked into one matrix (a fused QKV or gate/up). Quantized parts of
    one format stay one block tensor. Parts of different formats (Q4_K_M files mix Q4_K and
    Q6_K) become `QuantParts` with `keep_parts` (each part in its blocks; the fused QKV), else
    are widened to bf16 for this matrix, noted in `notes` for the one-line message at load."""
    if not any(is_quantized(p) for p in parts):
        return torch.cat(parts)
    if all(is_quantized(p) for p in parts) and len({int(p.shape[2]) for p in parts}) == 1:
        return torch.cat(parts)
    if keep_parts and all(is_quantized(p) for p in parts):
        return QuantParts(list(parts))
    if notes is not None:
        notes.add("fused rows of mixed formats (" + ", ".join(sorted({format_of(p) for p in parts if is_quantized(p)}))
                  + ")")
    return torch.cat([widen(p, torch.bfloat16) if is_quantized(p) else p.to(torch.bfloat16) for p in parts])


def matrix_shape(t: torch.Tensor | QuantParts) -> tuple[int, ...]:
    """(rows, cols) of a quantized matrix or of `QuantParts`, else the tensor's shape."""
    if isinstance(t, QuantParts):
        return t.shape
    return shape_of(t) if is_quantized(t) else tuple(t.shape)


def widen(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The matrix of quantized `t` in `dtype`, widened a tile at a time (gguf's numpy
    dequantize makes temporaries many times the matrix's size)."""
    out = torch.empty(*shape_of(t), dtype=dtype)
    for r0, tile in tiles(t):
        out[r0 : r0 + tile.shape[0]] = tile
    return out


def matmul_t(t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """h (T, rows) @ W (rows, cols) for quantized W, TILE_ROWS rows widened at a time: a
    transposed down projection applied to a batch of neuron values."""
    out = torch.zeros(h.shape[0], shape_of(t)[1], dtype=torch.float32)
    hf = h.float()
    for r0, tile in tiles(t):
        out.addmm_(hf[:, r0 : r0 + tile.shape[0]], tile)
    return out


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """fp32 rows (rows, cols) as Q8_0 blocks (rows, cols / 32, 34), by the gguf package's
    reference quantizer (ggml's)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rows, cols = w.shape
    return from_gguf(quantize(np.ascontiguousarray(w.float().numpy()), GGMLQuantizationType.Q8_0), "Q8_0", rows, cols)
