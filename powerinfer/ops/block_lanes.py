"""A row's GGUF blocks re-laid 16 at a time, one block per vector lane: the sparse FFN's rows.

The sparse FFN reads gate and up rows picked by index, so `lanes.py`'s layout (16 rows per
vector, one row per lane) cannot serve it, and the row layout (`block_ir`: one row's 32
weights across the lanes) ends every block in a conversion and two fp32 operations on
eight partial sums: about 13 instructions per 32 weights, which made the sparse gate/up dots
compute-bound at ~29 GB/s on two cores with the rows in cache. Here the lanes are a row's
own blocks: 16 consecutive blocks of one row form a group laid out exactly as a `lanes`
group block (fp16 scales of the 16 blocks side by side, then the quants in 64-byte chunks,
chunk c holding block b's quant bytes 4c..4c+3 at 4b), and the activations are re-laid the
same way once per vector (`records`). One vpdpbusd then adds four products to each of 16
blocks' sums; the conversion and the fp32 multiply-add happen once per 16 blocks, and the
row's 16 lanes are summed once at its end. A row keeps its bytes and its place, so rows are
still picked by index and a packed row set reorders whole rows.

Formats: Q4_0, Q4_1, Q8_0 (Q8_0 stored plus 128, as in `lanes`), rows whose block count is
a multiple of 16 (d = 512 k); others keep the row layout. Reference twin: `dequantize`
(back to row blocks, then gguf's), then the fp32 op on `block_ir.reference_acts(x)`.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import cfunc, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import quant
from .block_ir import (_F32, _FUSE, _I8, _I32, _c64, _call, _check_blocks, _isa, _load, _reduce, _row_address as _row,
                       quantize_acts)
from .lane_ir import LANES, _chunks, _half_lanes, _idot16
from .lanes import deinterleave, interleave
from .symbols import compile_lock, export, symbol_call

FORMATS = ("Q4_0", "Q4_1", "Q8_0")
# one group's activation record: int8 chunks (8 x 64), int32 block sums[16], fp32 scales[16],
# fp32 32-sums[16] (the offsets of Q4_1)
_SUMS, _SCALES, _OFFSETS = 8 * 64, 8 * 64 + 4 * LANES, 8 * 64 + 8 * LANES  # byte offsets of the fields
RECORD = 8 * 64 + 12 * LANES
_VF16, _VI16, _VB64 = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16), ir.VectorType(_I8, 64)


def fits(t: torch.Tensor) -> bool:
    """Whether quantized row blocks `t` can be re-laid (format, blocks per row, device)."""
    return (quant.is_quantized(t) and t.device.type == "cpu" and quant.format_of(t) in FORMATS
            and int(t.shape[1]) % LANES == 0 and int(t.shape[0]) > 0)


def relay(t: torch.Tensor) -> torch.Tensor:
    """Row blocks (rows, nb, bb) -> the same shape, each row's blocks re-laid in groups of 16
    (a new array)."""
    rows, nb, bb = (int(s) for s in t.shape)
    return interleave(t.reshape(rows * nb, 1, bb)).reshape(rows, nb, bb)


def restore(t: torch.Tensor) -> torch.Tensor:
    """`relay`'s inverse: back to the file's row blocks."""
    rows, nb, bb = (int(s) for s in t.shape)
    return deinterleave(t.reshape(rows * nb // LANES, 1, LANES, bb)).reshape(rows, nb, bb)


def dequantize(t: torch.Tensor) -> torch.Tensor:
    """The fp32 matrix (rows, cols) of re-laid blocks: the reference."""
    return quant.dequantize(restore(t))


@njit
def _relay_records(qa, out):
    """The row-layout activation records qa (`quantize_acts`, 72 bytes per 32 values) as
    one record per 16 blocks into out (see RECORD)."""
    i32, f32 = out.view(np.int32), out.view(np.float32)
    qi32, qf32 = qa.view(np.int32), qa.view(np.float32)
    for blk in range(qa.shape[0] // 72):
        g, b = blk // LANES, blk % LANES
        src, dst = 72 * blk, RECORD * g
        for c in range(8):
            for j in range(4):
                out[dst + 64 * c + 4 * b + j] = qa[src + 4 * c + j]
        total = 0
        for k in range(8):
            total += qi32[src // 4 + 8 + k]
        i32[(dst + _SUMS) // 4 + b] = total
        f32[(dst + _SCALES) // 4 + b] = qf32[src // 4 + 16]
        f32[(dst + _OFFSETS) // 4 + b] = qf32[src // 4 + 17]


@njit
def records(v, bb):
    """fp32 activations v (cols,) as block-lane records for weight blocks of bb bytes: the
    row layout's int8 quantization (`quantize_acts`), re-laid per 16 blocks."""
    qa = quantize_acts(v, bb)
    out = np.empty(v.shape[0] // (32 * LANES) * RECORD, dtype=np.uint8)
    _relay_records(qa, out)
    return out


def _bl_dots(bb: int, R: int, V: int):
    """An intrinsic (rows, groups, acts) -> R*V float32s, row-major: rows is a tuple of R
    addresses of re-laid rows of `groups` x 16 blocks of bb bytes, acts of V addresses of
    block-lane records (`records`)."""
    isa = _isa()
    signed = bb == 34 and isa != "vnni"
    bias = 8 if bb == 18 else (128 if bb == 34 and isa == "vnni" else 0)
    G = LANES * bb

    @intrinsic
    def bl_dots(typingctx, rows, groups, acts):
        sig = types.UniTuple(types.float32, R * V)(types.UniTuple(types.int64, R), types.int64,
                                                   types.UniTuple(types.int64, V))

        def codegen(context, builder, signature, args):
            rows_t, n_v, acts_t = args
            i8p = _I8.as_pointer()
            row_ptrs = [builder.inttoptr(builder.extract_value(rows_t, k), i8p) for k in range(R)]
            act_ptrs = [builder.inttoptr(builder.extract_value(acts_t, j), i8p) for j in range(V)]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_VF16, [0.0] * LANES)) for _ in range(R * V)]
            with cgutils.for_range(builder, n_v) as loop:
                g = loop.index
                recs = [builder.gep(ap, [builder.mul(g, _c64(RECORD))]) for ap in act_ptrs]
                for k in range(R):
                    gp = builder.gep(row_ptrs[k], [builder.mul(g, _c64(G))])
                    dw = _half_lanes(builder, gp, 0)
                    mw = _half_lanes(builder, gp, 32) if bb == 20 else None
                    chunks = _chunks(builder, gp, bb, isa)
                    for j, rec in enumerate(recs):
                        if bias:  # (q - bias) . a = q . a - bias * (the block's activation sum)
                            isum = builder.mul(_load(builder, rec, _SUMS, _VI16), ir.Constant(_VI16, [-bias] * LANES))
                        else:
                            isum = ir.Constant(_VI16, [0] * LANES)
                        for q, off in chunks:
                            isum = _idot16(builder, isa, isum, q, _load(builder, rec, 16 * off, _VB64), signed)
                        xa = builder.fmul(builder.sitofp(isum, _VF16), _load(builder, rec, _SCALES, _VF16), flags=_FUSE)
                        acc = accs[k * V + j]
                        total = _call(builder, "llvm.fmuladd.v16f32", _VF16, [xa, dw, builder.load(acc)])
                        if mw is not None:  # m x the block's activation sum
                            total = _call(builder, "llvm.fmuladd.v16f32", _VF16,
                                          [mw, _load(builder, rec, _OFFSETS, _VF16), total])
                        builder.store(total, acc)
            outs = [_reduce(builder, builder.load(acc)) for acc in accs]
            return context.make_tuple(builder, signature.return_type, outs)

        return sig, codegen

    return bl_dots


def _dispatch(R: int, V: int):
    """A numba function (bb, rows, groups, acts) running the (R, V) dots of format bb."""
    d18, d20, d34 = (_bl_dots(bb, R, V) for bb in (18, 20, 34))

    @njit(inline="always")
    def dots(bb, rows, groups, acts):
        if bb == 18:
            return d18(rows, groups, acts)
        if bb == 20:
            return d20(rows, groups, acts)
        return d34(rows, groups, acts)

    return dots


_rows4, _one, _vecs8, _vecs4 = _dispatch(4, 1), _dispatch(1, 1), _dispatch(1, 8), _dispatch(1, 4)

# The dots as C functions compiled once, which every kernel calls by symbol (ops/symbols.py):
# (bb, rows, groups, acts, out), the tuples as pointers to their addresses, the R x V results
# written to out.
_I64P = types.CPointer(types.int64)
_C_SIG = types.void(types.int64, _I64P, types.int64, _I64P, types.CPointer(types.float32))

with compile_lock("block_lanes_dots"):
    @cfunc(_C_SIG, cache=True)
    def _c_one(bb, rows, groups, acts, out):
        out[0] = _one(bb, (rows[0],), groups, (acts[0],))[0]

    @cfunc(_C_SIG, cache=True)
    def _c_rows4(bb, rows, groups, acts, out):
        r = _rows4(bb, (rows[0], rows[1], rows[2], rows[3]), groups, (acts[0],))
        for k in range(4):
            out[k] = r[k]

    @cfunc(_C_SIG, cache=True)
    def _c_vecs4(bb, rows, groups, acts, out):
        r = _vecs4(bb, (rows[0],), groups, (acts[0], acts[1], acts[2], acts[3]))
        for k in range(4):
            out[k] = r[k]

    @cfunc(_C_SIG, cache=True)
    def _c_vecs8(bb, rows, groups, acts, out):
        r = _vecs8(bb, (rows[0],), groups, (acts[0], acts[1], acts[2], acts[3], acts[4], acts[5], acts[6], acts[7]))
        for k in range(8):
            out[k] = r[k]

for _name, _c in (("one", _c_one), ("rows4", _c_rows4), ("vecs4", _c_vecs4), ("vecs8", _c_vecs8)):
    export(f"powerinfer_block_lanes_{_name}", _c)
_call_one, _call_rows4, _call_vecs4, _call_vecs8 = (
    symbol_call(f"powerinfer_block_lanes_{name}", n)
    for name, n in (("one", 1), ("rows4", 4), ("vecs4", 4), ("vecs8", 8)))


@njit(fastmath=True)
def dot_rows4(w, r0, r1, r2, r3, rec):
    """Rows r0..r3 of re-laid w dotted with block-lane records rec (`records`)."""
    _check_blocks(w)
    return _call_rows4((w.shape[2], (_row(w, r0), _row(w, r1), _row(w, r2), _row(w, r3)), w.shape[1] // LANES,
                        (rec.ctypes.data,)))


@njit(fastmath=True)
def dot_row(w, r, rec):
    """Row r of re-laid w dotted with block-lane records rec."""
    _check_blocks(w)
    return _call_one((w.shape[2], (_row(w, r),), w.shape[1] // LANES, (rec.ctypes.data,)))[0]


@njit(parallel=True)
def records_rows(V, bb):
    """`records` for every row of V (T, cols): (T, record bytes per row)."""
    out = np.empty((V.shape[0], V.shape[1] // (32 * LANES) * RECORD), dtype=np.uint8)
    for s in prange(V.shape[0]):
        out[s] = records(V[s], bb)
    return out


@njit(parallel=True, fastmath=True, cache=True)
def _matmul(w, QA, out):
    """out[s, r] = row r of re-laid w dotted with QA[s], eight vectors per pass over the row,
    then four, then one: each (row, vector) pair the same arithmetic as `dot_row`."""
    _check_blocks(w)
    n, T, groups, bb = w.shape[0], QA.shape[0], w.shape[1] // LANES, w.shape[2]
    for r in prange(n):
        row = (_row(w, r),)
        s = 0
        while T - s >= 8:
            d = _call_vecs8((bb, row, groups, (_row(QA, s), _row(QA, s + 1), _row(QA, s + 2), _row(QA, s + 3),
                                               _row(QA, s + 4), _row(QA, s + 5), _row(QA, s + 6), _row(QA, s + 7))))
            for j in range(8):
                out[s + j, r] = d[j]
            s += 8
        if T - s >= 4:
            d4 = _call_vecs4((bb, row, groups, (_row(QA, s), _row(QA, s + 1), _row(QA, s + 2), _row(QA, s + 3))))
            for j in range(4):
                out[s + j, r] = d4[j]
            s += 4
        while s < T:
            out[s, r] = _call_one((bb, row, groups, (_row(QA, s),)))[0]
            s += 1


def matmul(t: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, cols) @ W.T (+ bias) for re-laid W (the sparse FFN's prefill over all its rows)."""
    w = t.numpy()
    xs = np.ascontiguousarray(x.float().numpy())
    out = np.empty((xs.shape[0], w.shape[0]), dtype=np.float32)
    _matmul(w, records_rows(xs, w.shape[2]), out)
    res = torch.from_numpy(out)
    return res if bias is None else res.add_(bias)
