"""GGUF block dots written as LLVM vector IR (numba intrinsics), for Q4_0, Q4_1 and Q8_0.

Hand-written because no library gives numba a quantized dot product, and numba's own loops
reduce each 32-weight block to a scalar before the next (a horizontal sum per block, which
bound the old kernels at 12-15 G weights/s). Here every (row, vector) pair keeps a 16-lane
fp32 accumulator across the whole row, as ggml's kernels do, and reduces it once at the end:
per block, the nibbles (or int8 values) are widened to fp32 lanes in vector IR,
multiplied by the activations, and added with the block's scale broadcast. The activations
stay fp32 (not quantized to int8 as llama.cpp does), so a dot equals the
dequantize-then-fp32 reference to float rounding; LLVM compiles the IR for the host (AVX2
or AVX-512), as numba does. Measured numbers: docs/BENCHMARKS.md, "Quantized GEMV".

A dot over R rows and V vectors shares each block's widening among the vectors and each
block of activations among the rows; every (row, vector) pair runs the same operations in
the same order whatever R and V are, so a batched decode equals the one-token decode bit
for bit.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_F32, _I8, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
_LANES = 16
_VF = ir.VectorType(_F32, _LANES)
_FAST = ("fast",)


def _const_i64(k: int) -> ir.Constant:
    return ir.Constant(_I64, k)


def _broadcast(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    v = builder.insert_element(ir.Constant(_VF, None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, _LANES), [0] * _LANES))


def _load_half(builder: ir.IRBuilder, p: ir.Value, offset: int) -> ir.Value:
    ptr = builder.bitcast(builder.gep(p, [_const_i64(offset)]), ir.HalfType().as_pointer())
    return builder.fpext(builder.load(ptr, align=1), _F32)


def _widen_block(builder: ir.IRBuilder, p: ir.Value, bb: int) -> tuple[ir.Value, ir.Value]:
    """A block's 32 quants (before the scale, and Q4_1's offset) as two 16-lane fp32 vectors:
    weights 0-15 and 16-31. Q4_0/Q4_1: low nibbles are 0-15, high nibbles 16-31; Q8_0: int8."""
    if bb == 34:
        ptr = builder.bitcast(builder.gep(p, [_const_i64(2)]), ir.VectorType(_I8, 32).as_pointer())
        q = builder.sitofp(builder.load(ptr, align=1), ir.VectorType(_F32, 32))
        first = ir.Constant(ir.VectorType(_I32, _LANES), list(range(_LANES)))
        second = ir.Constant(ir.VectorType(_I32, _LANES), list(range(_LANES, 32)))
        return builder.shuffle_vector(q, q, first), builder.shuffle_vector(q, q, second)
    bytes16 = ir.VectorType(_I8, 16)
    ptr = builder.bitcast(builder.gep(p, [_const_i64(2 if bb == 18 else 4)]), bytes16.as_pointer())
    qs = builder.load(ptr, align=1)
    lo = builder.and_(qs, ir.Constant(bytes16, [15] * 16))
    hi = builder.lshr(qs, ir.Constant(bytes16, [4] * 16))
    if bb == 18:  # Q4_0's nibbles are stored + 8
        eight = ir.Constant(bytes16, [8] * 16)
        return builder.sitofp(builder.sub(lo, eight), _VF), builder.sitofp(builder.sub(hi, eight), _VF)
    return builder.uitofp(lo, _VF), builder.uitofp(hi, _VF)


def _reduce(builder: ir.IRBuilder, acc: ir.Value) -> ir.Value:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32, _VF]),
                                        f"llvm.vector.reduce.fadd.v{_LANES}f32")
    return builder.call(fn, [ir.Constant(_F32, 0.0), acc], fastmath=_FAST)


def _block_dots(bb: int, R: int, V: int):
    """An intrinsic (rows, nb, vecs, sums) -> R*V float32s, row-major: rows is a tuple of R
    addresses of rows of nb blocks of bb bytes; vecs of V addresses of fp32 vectors of 32 nb
    values; sums of V addresses of their 32-sums (for Q4_1's offsets)."""

    @intrinsic
    def block_dots(typingctx, rows, nb, vecs, sums):
        sig = types.UniTuple(types.float32, R * V)(types.UniTuple(types.int64, R), types.int64,
                                                   types.UniTuple(types.int64, V), types.UniTuple(types.int64, V))

        def codegen(context, builder, signature, args):
            rows_t, nb_v, vecs_t, sums_t = args
            f32p, i8p = _F32.as_pointer(), _I8.as_pointer()
            row_ptrs = [builder.inttoptr(builder.extract_value(rows_t, k), i8p) for k in range(R)]
            vec_ptrs = [builder.inttoptr(builder.extract_value(vecs_t, j), f32p) for j in range(V)]
            sum_ptrs = [builder.inttoptr(builder.extract_value(sums_t, j), f32p) for j in range(V)]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_VF, [0.0] * _LANES)) for _ in range(R * V)]
            offsets = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(R * V)]
            with cgutils.for_range(builder, nb_v) as loop:
                b = loop.index
                halves = []
                for j in range(V):
                    vp = builder.gep(vec_ptrs[j], [builder.mul(b, _const_i64(32))])
                    lo = builder.load(builder.bitcast(vp, _VF.as_pointer()), align=4)
                    hi = builder.load(builder.bitcast(builder.gep(vp, [_const_i64(_LANES)]), _VF.as_pointer()), align=4)
                    s = builder.load(builder.gep(sum_ptrs[j], [b])) if bb == 20 else None
                    halves.append((lo, hi, s))
                for k in range(R):
                    p = builder.gep(row_ptrs[k], [builder.mul(b, _const_i64(bb))])
                    d = _load_half(builder, p, 0)
                    q_lo, q_hi = _widen_block(builder, p, bb)
                    dv = _broadcast(builder, d)
                    m = _load_half(builder, p, 2) if bb == 20 else None  # Q4_1: + m sum(v)
                    for j, (lo, hi, s) in enumerate(halves):
                        t = builder.fadd(builder.fmul(q_lo, lo, flags=_FAST), builder.fmul(q_hi, hi, flags=_FAST), flags=_FAST)
                        acc = accs[k * V + j]
                        builder.store(builder.fadd(builder.load(acc), builder.fmul(dv, t, flags=_FAST), flags=_FAST), acc)
                        if s is not None:
                            o = offsets[k * V + j]
                            builder.store(builder.fadd(builder.load(o), builder.fmul(m, s, flags=_FAST), flags=_FAST), o)
            outs = [builder.fadd(_reduce(builder, builder.load(accs[i])), builder.load(offsets[i]), flags=_FAST)
                    for i in range(R * V)]
            return context.make_tuple(builder, signature.return_type, outs)

        return sig, codegen

    return block_dots


_ROWS4 = {bb: _block_dots(bb, 4, 1) for bb in (18, 20, 34)}
_VECS4 = {bb: _block_dots(bb, 1, 4) for bb in (18, 20, 34)}
_ONE = {bb: _block_dots(bb, 1, 1) for bb in (18, 20, 34)}
_r4_18, _r4_20, _r4_34 = _ROWS4[18], _ROWS4[20], _ROWS4[34]
_v4_18, _v4_20, _v4_34 = _VECS4[18], _VECS4[20], _VECS4[34]
_o_18, _o_20, _o_34 = _ONE[18], _ONE[20], _ONE[34]


@njit(inline="always")
def _row_address(w, r):
    return w.ctypes.data + r * w.strides[0]


@njit(inline="always")
def _check_blocks(w, v):
    # the IR walks a row's blocks as bb contiguous bytes each, and v as contiguous fp32
    if w.strides[2] != 1 or w.strides[1] != w.shape[2] or v.strides[v.ndim - 1] != 4:
        raise ValueError("block dots need contiguous blocks and activations")


@njit(fastmath=True)
def dot_rows4(w, r0, r1, r2, r3, v, xs):
    """Rows r0..r3 of w (Q4_0, Q4_1, Q8_0 blocks) dotted with fp32 v (contiguous); xs: v's
    32-sums (span_sums(v, 32)), read for Q4_1."""
    _check_blocks(w, v)
    rows = (_row_address(w, r0), _row_address(w, r1), _row_address(w, r2), _row_address(w, r3))
    vecs, sums, nb, bb = (v.ctypes.data,), (xs.ctypes.data,), w.shape[1], w.shape[2]
    if bb == 20:
        return _r4_20(rows, nb, vecs, sums)
    if bb == 18:
        return _r4_18(rows, nb, vecs, sums)
    return _r4_34(rows, nb, vecs, sums)


@njit(fastmath=True)
def dot_row(w, r, v, xs):
    """Row r of w (Q4_0, Q4_1, Q8_0 blocks) dotted with fp32 v; xs: v's 32-sums."""
    _check_blocks(w, v)
    rows, vecs, sums, nb, bb = (_row_address(w, r),), (v.ctypes.data,), (xs.ctypes.data,), w.shape[1], w.shape[2]
    if bb == 20:
        return _o_20(rows, nb, vecs, sums)[0]
    if bb == 18:
        return _o_18(rows, nb, vecs, sums)[0]
    return _o_34(rows, nb, vecs, sums)[0]


@njit(fastmath=True)
def dot_vecs4(w, r, V, s0, s1, s2, s3, xs):
    """Row r of w (Q4_0, Q4_1, Q8_0 blocks) dotted with rows s0..s3 of V (B, cols), each
    block widened once for the four; xs (B, cols / 32): V's 32-sums."""
    _check_blocks(w, V)
    if xs.strides[1] != 4:
        raise ValueError("block dots need contiguous block sums")
    rows, nb, bb = (_row_address(w, r),), w.shape[1], w.shape[2]
    vecs = (_row_address(V, s0), _row_address(V, s1), _row_address(V, s2), _row_address(V, s3))
    sums = (_row_address(xs, s0), _row_address(xs, s1), _row_address(xs, s2), _row_address(xs, s3))
    if bb == 20:
        return _v4_20(rows, nb, vecs, sums)
    if bb == 18:
        return _v4_18(rows, nb, vecs, sums)
    return _v4_34(rows, nb, vecs, sums)
