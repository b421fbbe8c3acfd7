"""Q6_K prefill: 16 rows at a time unpacked to int8 lanes, then integer dots for many tokens.

Since Q6_K has a lanes layout (ops/lanes.py, as fast for a prefill), this serves only the
Q6_K matrices left in row blocks (rows not a multiple of 16).

Why: Q6_K (Q4_K_M files keep their output, attn_v and half their ffn_down matrices in it)
has the costliest unpacking of the K-quants (four low bits, two high bits from another
plane, an int8 scale per 16 weights), and the row kernel (`block_ir`) re-does it for every
tile of four tokens: Q6_K took 44% of a Q4_K_M prefill at 62 G MAC/s on two cores while
Q4_K lanes ran ~2.5x that. A prefill has many tokens per weight, so here a thread unpacks
16 rows once into a scratch tile that stays in its L2 (the 6-bit quants as bytes in
`lanes` order: sub-block j's four 64-byte chunks hold row r's quants 4c..4c+3 at 4r; the
int8 sub-block scales widened to int32 per row; the fp16 d per row), then runs every token
over it: per 16-weight sub-block four vpdpbusd for 16 rows, the sum multiplied by the
16 rows' scales in integers, the two sub-blocks under one activation scale (32 values)
added, and one conversion and fp32 multiply-add per 32 weights. The integer products are
exact (|sum| < 2^24, so the conversion is too), so the result differs from the row
kernel's by float rounding only. No float copy of the matrix is made; the scratch is
16 x cols bytes per thread.

Reference twin: dequantize (gguf), then the fp32 product with `block_ir.reference_acts`.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .block_ir import _F32, _FUSE, _I8, _I32, _c64, _call, _isa, _load, _row_address as _row, _splat, quantize_acts_rows
from .lane_ir import LANES, _idot16
from .numba_half import widen

BB = 210  # Q6_K block bytes
_VF16, _VI16, _VB64 = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16), ir.VectorType(_I8, 64)
RECORD = 576  # block_ir's activation record per 256 values


@njit(fastmath=True)
def _unpack(w, r0, qn, q, sc, d):
    """Rows r0..r0+15 of Q6_K w (rows past the end as zeros) into the scratch tile: q (uint8,
    cols * 16) in lanes order, sc (int32, (cols / 16) * 16) and d (fp32, (cols / 256) * 16);
    qn (uint8, (16, cols)) is the rows' quants in column order on the way (contiguous runs of
    32, which LLVM vectorizes, then one transpose of 4-byte words)."""
    n, nb = w.shape[0], w.shape[1]
    for r in range(LANES):
        row = r0 + r
        if row >= n:
            qn[r, :] = 0
            for b in range(nb):
                d[16 * b + r] = np.float32(0.0)
                for j in range(16):
                    sc[16 * (16 * b + j) + r] = 0
            continue
        for b in range(nb):
            d[16 * b + r] = widen(np.int16(np.uint16(w[row, b, 208]) | (np.uint16(w[row, b, 209]) << np.uint16(8))))
            for j in range(16):
                sc[16 * (16 * b + j) + r] = np.int32(np.int8(w[row, b, 192 + j]))
            for half in range(2):
                ql, qh, y = 64 * half, 128 + 32 * half, 256 * b + 128 * half
                for l in range(32):
                    h = w[row, b, qh + l]
                    lo, hi = w[row, b, ql + l], w[row, b, ql + l + 32]
                    qn[r, y + l] = (lo & np.uint8(15)) | ((h & np.uint8(3)) << np.uint8(4))
                    qn[r, y + l + 32] = (hi & np.uint8(15)) | (((h >> np.uint8(2)) & np.uint8(3)) << np.uint8(4))
                    qn[r, y + l + 64] = (lo >> np.uint8(4)) | (((h >> np.uint8(4)) & np.uint8(3)) << np.uint8(4))
                    qn[r, y + l + 96] = (hi >> np.uint8(4)) | (((h >> np.uint8(6)) & np.uint8(3)) << np.uint8(4))
    # column i of row r -> sub-block i // 16, chunk (i % 16) // 4, byte 4 r + i % 4: word k of
    # row r (columns 4k..4k+3) goes to word 16 k + r
    qn32, q32 = qn.view(np.uint32), q.view(np.uint32)
    for k in range(qn32.shape[1]):
        for r in range(LANES):
            q32[LANES * k + r] = qn32[r, k]


@njit(parallel=True)
def _starts(QA, cols):
    """Per token and 16-value sub-block, the dot's start value: -32 x the activations' sum
    (the records' 4-sums already carry the -32)."""
    T, nsub = QA.shape[0], cols // 16
    out = np.empty((T, nsub), dtype=np.int32)
    for s in prange(T):
        i32 = QA[s].view(np.int32)
        for J in range(nsub):
            b, j = J // 16, J % 16
            base = (RECORD * b + 256) // 4 + 4 * j
            out[s, J] = i32[base] + i32[base + 1] + i32[base + 2] + i32[base + 3]
    return out


def _tile_dots(V: int):
    """An intrinsic (q, sc, d, nb, acts, starts, outs): the 16 rows of a scratch tile (nb
    super-blocks) dotted with V tokens' records (`acts`: addresses of `quantize_acts` records
    for Q6_K; `starts`: of `_starts` rows), 16 fp32 written at each of `outs`."""
    isa = _isa()

    @intrinsic
    def tile_dots(typingctx, q, sc, d, nb, acts, starts, outs):
        tup = types.UniTuple(types.int64, V)
        sig = types.none(types.int64, types.int64, types.int64, types.int64, tup, tup, tup)

        def codegen(context, builder, signature, args):
            q_v, sc_v, d_v, nb_v, acts_t, starts_t, outs_t = args
            i8p = _I8.as_pointer()
            qp, scp, dp = (builder.inttoptr(v, i8p) for v in (q_v, sc_v, d_v))
            act_ptrs = [builder.inttoptr(builder.extract_value(acts_t, j), i8p) for j in range(V)]
            start_ptrs = [builder.inttoptr(builder.extract_value(starts_t, j), i8p) for j in range(V)]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_VF16, [0.0] * LANES)) for _ in range(V)]
            with cgutils.for_range(builder, nb_v) as loop:
                b = loop.index
                dw = _load(builder, dp, builder.mul(b, _c64(64)), _VF16)
                recs = [builder.gep(ap, [builder.mul(b, _c64(RECORD))]) for ap in act_ptrs]
                sts = [builder.gep(sp, [builder.mul(b, _c64(64))]) for sp in start_ptrs]
                qb = builder.gep(qp, [builder.mul(b, _c64(16 * 256))])
                scb = builder.gep(scp, [builder.mul(b, _c64(16 * 64))])
                for p in range(8):  # pairs of sub-blocks: one activation scale each
                    chunks = [[_load(builder, qb, 256 * (2 * p + h) + 64 * c, _VB64) for c in range(4)]
                              for h in range(2)]
                    scales = [_load(builder, scb, 64 * (2 * p + h), _VI16) for h in range(2)]
                    for j in range(V):
                        both = None
                        for h in range(2):
                            isum = _splat(builder, _load(builder, sts[j], 4 * (2 * p + h), _I32), LANES)
                            for c in range(4):
                                a4 = _splat(builder, _load(builder, recs[j], 32 * p + 16 * h + 4 * c, _I32), LANES)
                                isum = _idot16(builder, isa, isum, chunks[h][c], builder.bitcast(a4, _VB64), False)
                            prod = builder.mul(isum, scales[h])
                            both = prod if both is None else builder.add(both, prod)
                        da = _splat(builder, _load(builder, recs[j], 512 + 4 * p, _F32), LANES)
                        xa = builder.fmul(builder.sitofp(both, _VF16), da, flags=_FUSE)
                        builder.store(_call(builder, "llvm.fmuladd.v16f32", _VF16, [xa, dw, builder.load(accs[j])]),
                                      accs[j])
            for j in range(V):
                out = builder.bitcast(builder.inttoptr(builder.extract_value(outs_t, j), i8p), _VF16.as_pointer())
                builder.store(builder.load(accs[j]), out, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile_dots


_dots8, _dots4, _dots1 = _tile_dots(8), _tile_dots(4), _tile_dots(1)


@njit(parallel=True, fastmath=True, cache=True)
def _matmul(w, QA, S, out):
    """out (T, rows) = Q6_K w's rows dotted with the T records QA (starts S): per group of 16
    rows one unpacked tile, then eight tokens at a time (four, one at the end)."""
    n, nb, T = w.shape[0], w.shape[1], QA.shape[0]
    for g in prange((n + LANES - 1) // LANES):
        qn = np.empty((LANES, nb * 256), dtype=np.uint8)
        q = np.empty(nb * 256 * LANES, dtype=np.uint8)
        sc = np.empty(nb * 16 * LANES, dtype=np.int32)
        d = np.empty(nb * LANES, dtype=np.float32)
        _unpack(w, g * LANES, qn, q, sc, d)
        res = np.empty((8, LANES), dtype=np.float32)
        rows = min(LANES, n - g * LANES)
        s = 0
        while s < T:
            if T - s >= 8:
                V = 8
                _dots8(q.ctypes.data, sc.ctypes.data, d.ctypes.data, nb,
                       (_row(QA, s), _row(QA, s + 1), _row(QA, s + 2), _row(QA, s + 3), _row(QA, s + 4),
                        _row(QA, s + 5), _row(QA, s + 6), _row(QA, s + 7)),
                       (_row(S, s), _row(S, s + 1), _row(S, s + 2), _row(S, s + 3), _row(S, s + 4),
                        _row(S, s + 5), _row(S, s + 6), _row(S, s + 7)),
                       (_row(res, 0), _row(res, 1), _row(res, 2), _row(res, 3), _row(res, 4), _row(res, 5),
                        _row(res, 6), _row(res, 7)))
            elif T - s >= 4:
                V = 4
                _dots4(q.ctypes.data, sc.ctypes.data, d.ctypes.data, nb,
                       (_row(QA, s), _row(QA, s + 1), _row(QA, s + 2), _row(QA, s + 3)),
                       (_row(S, s), _row(S, s + 1), _row(S, s + 2), _row(S, s + 3)),
                       (_row(res, 0), _row(res, 1), _row(res, 2), _row(res, 3)))
            else:
                V = 1
                _dots1(q.ctypes.data, sc.ctypes.data, d.ctypes.data, nb, (_row(QA, s),), (_row(S, s),),
                       (_row(res, 0),))
            for v in range(V):
                for r in range(rows):
                    out[s + v, g * LANES + r] = res[v, r]
            s += V


def matmul(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x (T, cols) @ W.T for Q6_K row blocks W (rows, cols / 256, 210): fp32 (T, rows)."""
    w = t.numpy()
    xs = np.ascontiguousarray(x.float().numpy())
    QA = quantize_acts_rows(xs, BB)
    out = np.empty((xs.shape[0], w.shape[0]), dtype=np.float32)
    _matmul(w, QA, _starts(QA, xs.shape[1]), out)
    return torch.from_numpy(out)
