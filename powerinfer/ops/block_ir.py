"""GGUF block dots written as LLVM vector IR (numba intrinsics), for every block format.

Hand-written because no library gives numba a quantized dot product, and numba's own loops
reduce each 32-weight block to a scalar before the next (a horizontal sum per block, which
bound the old kernels at 12-15 G weights/s). Here every (row, vector) pair keeps a 16-lane
fp32 accumulator across the whole row, as ggml's kernels do, and reduces it once at the end:
per block, the quants (nibbles, 5-bit and 6-bit values from their bit planes, int8) are
widened to fp32 lanes in vector IR, multiplied by the activations, and added with their
(sub-)block's scale broadcast; per-(sub-)block offsets (Q4_1, Q5_1, the K-quants' mins)
multiply precomputed sums of 32 activations. Additions are not reassociated (only fused),
so a dot rounds alike wherever it is inlined. The activations
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
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_F32, _I8, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
_LANES = 16
_VF = ir.VectorType(_F32, _LANES)
_VF8 = ir.VectorType(_F32, 8)
_FUSE = ("contract",)  # FMAs, no reassociation: every context rounds alike
_REASSOC = ("fast",)


def _const_i64(k: int) -> ir.Constant:
    return ir.Constant(_I64, k)


def _load_half(builder: ir.IRBuilder, p: ir.Value, offset: int) -> ir.Value:
    ptr = builder.bitcast(builder.gep(p, [_const_i64(offset)]), ir.HalfType().as_pointer())
    return builder.fpext(builder.load(ptr, align=1), _F32)


def _bytes(builder: ir.IRBuilder, p: ir.Value, offset: int, n: int = 16) -> ir.Value:
    ptr = builder.bitcast(builder.gep(p, [_const_i64(offset)]), ir.VectorType(_I8, n).as_pointer())
    return builder.load(ptr, align=1)


def _splat8(k: int) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I8, 16), [k] * 16)


def _byte(builder: ir.IRBuilder, p: ir.Value, offset: int) -> ir.Value:
    return builder.load(builder.gep(p, [_const_i64(offset)]))


def _fifth_bits(builder: ir.IRBuilder, qh: ir.Value, first: int) -> ir.Value:
    """Bits first..first+15 of the 32-bit qh of a Q5_0/Q5_1 block, each as 16 in a byte."""
    v32 = ir.VectorType(_I32, 16)
    spread = builder.shuffle_vector(builder.insert_element(ir.Constant(v32, None), qh, ir.Constant(_I32, 0)),
                                    ir.Constant(v32, None), ir.Constant(v32, [0] * 16))
    bits = builder.and_(builder.lshr(spread, ir.Constant(v32, list(range(first, first + 16)))), ir.Constant(v32, [1] * 16))
    return builder.trunc(builder.shl(bits, ir.Constant(v32, [4] * 16)), ir.VectorType(_I8, 16))


def _k4_scales_mins(builder: ir.IRBuilder, p: ir.Value) -> tuple[ir.Value, ir.Value]:
    """The 8 sub-blocks' 6-bit scales and mins of a Q4_K/Q5_K block as two <8 x float>
    (ggml's get_scale_min_k4 for j = 0..7 at once; the 12 scale bytes start at byte 4):
    j < 4: sc = q[j] & 63, m = q[j+4] & 63; j >= 4: sc = q[j+4] & 15 | (q[j-4] >> 6) << 4,
    m = q[j+4] >> 4 | (q[j] >> 6) << 4."""
    v8, v12 = ir.VectorType(_I8, 8), ir.VectorType(_I8, 12)
    q = builder.load(builder.bitcast(builder.gep(p, [_const_i64(4)]), v12.as_pointer()), align=1)
    zero = ir.Constant(v12, [0] * 12)

    def pick(lanes: list[int]) -> ir.Value:  # lane index 12+ reads the zero vector
        return builder.shuffle_vector(q, zero, ir.Constant(ir.VectorType(_I32, 8), lanes))

    def c8(values: list[int]) -> ir.Constant:
        return ir.Constant(v8, values)

    a, b = pick([0, 1, 2, 3, 8, 9, 10, 11]), pick([12, 12, 12, 12, 0, 1, 2, 3])
    sc = builder.or_(builder.and_(a, c8([63] * 4 + [15] * 4)), builder.shl(builder.lshr(b, c8([6] * 8)), c8([4] * 8)))
    c, e = pick([4, 5, 6, 7, 8, 9, 10, 11]), pick([12, 12, 12, 12, 4, 5, 6, 7])
    low = builder.shuffle_vector(builder.and_(c, c8([63] * 8)), builder.lshr(c, c8([4] * 8)),
                                 ir.Constant(ir.VectorType(_I32, 8), [0, 1, 2, 3, 12, 13, 14, 15]))
    m = builder.or_(low, builder.shl(builder.lshr(e, c8([6] * 8)), c8([4] * 8)))
    f8 = ir.VectorType(_F32, 8)
    return builder.uitofp(sc, f8), builder.uitofp(m, f8)


def _splat_f(builder: ir.IRBuilder, x: ir.Value, n: int = _LANES) -> ir.Value:
    """The fp32 scalar x in all n lanes."""
    vt = ir.VectorType(_F32, n)
    v = builder.insert_element(ir.Constant(vt, None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _block_parts(builder: ir.IRBuilder, p: ir.Value, bb: int):
    """A block's weights as groups sharing one fp32 scale, and its offset terms.

    Returns (groups, offsets): groups is a list of (scale, [(first weight, 16 quants as
    fp32 lanes), ...]); offsets a list of (coefficient, index of a 32-weight sub-block whose
    sum of activations it multiplies), or for the K-quants one <8 x float> of coefficients,
    one per sub-block. weight = scale * quant (+ coefficient, per sub-block)."""
    if bb in (18, 20, 22, 24, 34):
        d = _load_half(builder, p, 0)
        if bb == 34:
            q = builder.sitofp(_bytes(builder, p, 2, 32), ir.VectorType(_F32, 32))
            first = ir.Constant(ir.VectorType(_I32, _LANES), list(range(_LANES)))
            second = ir.Constant(ir.VectorType(_I32, _LANES), list(range(_LANES, 32)))
            return [(d, [(0, builder.shuffle_vector(q, q, first)), (16, builder.shuffle_vector(q, q, second))])], []
        qs_at = {18: 2, 20: 4, 22: 6, 24: 8}[bb]
        qs = _bytes(builder, p, qs_at)
        lo, hi = builder.and_(qs, _splat8(15)), builder.lshr(qs, _splat8(4))
        if bb in (22, 24):  # the fifth bits, from the u32 before qs
            qh = builder.load(builder.bitcast(builder.gep(p, [_const_i64(qs_at - 4)]), _I32.as_pointer()), align=1)
            lo, hi = builder.or_(lo, _fifth_bits(builder, qh, 0)), builder.or_(hi, _fifth_bits(builder, qh, 16))
        if bb in (18, 22):  # stored + 8 (Q4_0) or + 16 (Q5_0)
            bias = _splat8(8 if bb == 18 else 16)
            q_lo, q_hi = builder.sitofp(builder.sub(lo, bias), _VF), builder.sitofp(builder.sub(hi, bias), _VF)
            return [(d, [(0, q_lo), (16, q_hi)])], []
        m = _load_half(builder, p, 2)  # Q4_1, Q5_1: + m per block
        return [(d, [(0, builder.uitofp(lo, _VF)), (16, builder.uitofp(hi, _VF))])], [(m, 0)]
    if bb == 210:  # Q6_K: 16 sub-blocks of 16, scale d * int8 sc, quant 6 bits - 32
        d = _load_half(builder, p, 208)
        sc16 = builder.sitofp(_bytes(builder, p, 192), _VF)  # the 16 int8 scales, then times d
        scales = builder.fmul(sc16, _splat_f(builder, d, 16), flags=_FUSE)
        groups = []
        for half in range(2):
            for i in range(2):
                a = _bytes(builder, p, 64 * half + 16 * i)
                c = _bytes(builder, p, 64 * half + 32 + 16 * i)
                h = _bytes(builder, p, 128 + 32 * half + 16 * i)
                quads = [(a, False, 0), (c, False, 2), (a, True, 4), (c, True, 6)]
                for k, (src, high, shift) in enumerate(quads):
                    nib = builder.lshr(src, _splat8(4)) if high else builder.and_(src, _splat8(15))
                    top = builder.shl(builder.and_(builder.lshr(h, _splat8(shift)), _splat8(3)), _splat8(4))
                    q = builder.sitofp(builder.sub(builder.or_(nib, top), _splat8(32)), _VF)
                    scale = builder.extract_element(scales, ir.Constant(_I32, 8 * half + i + 2 * k))
                    groups.append((scale, [(128 * half + 16 * i + 32 * k, q)]))
        return groups, []
    # Q4_K (144) and Q5_K (176): 8 sub-blocks of 32, d sc_j q - dmin m_j; pair p of 32 bytes
    # holds sub-block 2p in its low nibbles and 2p + 1 in its high ones
    d, dmin = _load_half(builder, p, 0), _load_half(builder, p, 2)
    qs_at = 16 if bb == 144 else 48
    sc8, m8 = _k4_scales_mins(builder, p)
    scales = builder.fmul(sc8, _splat_f(builder, d, 8), flags=_FUSE)
    mins = builder.fmul(m8, _splat_f(builder, builder.fmul(dmin, ir.Constant(_F32, -1.0), flags=_FUSE), 8), flags=_FUSE)
    groups = []
    for j in range(8):
        pair, high = j // 2, j % 2 == 1
        chunks = []
        for part in range(2):
            src = _bytes(builder, p, qs_at + 32 * pair + 16 * part)
            q = builder.lshr(src, _splat8(4)) if high else builder.and_(src, _splat8(15))
            if bb == 176:  # fifth bit j of qh[l]
                qh = _bytes(builder, p, 16 + 16 * part)
                q = builder.or_(q, builder.shl(builder.and_(builder.lshr(qh, _splat8(j)), _splat8(1)), _splat8(4)))
            chunks.append((32 * j + 16 * part, builder.uitofp(q, _VF)))
        groups.append((builder.extract_element(scales, ir.Constant(_I32, j)), chunks))
    return groups, mins  # - dmin m_j, one lane per sub-block


def _reduce(builder: ir.IRBuilder, acc: ir.Value) -> ir.Value:
    n = acc.type.count
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32, acc.type]),
                                        f"llvm.vector.reduce.fadd.v{n}f32")
    return builder.call(fn, [ir.Constant(_F32, 0.0), acc], fastmath=_REASSOC)


def _block_dots(bb: int, R: int, V: int):
    """An intrinsic (rows, nb, vecs, sums) -> R*V float32s, row-major: rows is a tuple of R
    addresses of rows of nb blocks of bb bytes; vecs of V addresses of fp32 vectors (nb
    blocks' weights long); sums of V addresses of their 32-sums (read by the formats with
    offsets: Q4_1, Q5_1, Q4_K, Q5_K)."""
    per_block = 256 if bb in (144, 176, 210) else 32
    k_mins = bb in (144, 176)  # Q4_K, Q5_K: _block_parts gives their offsets as one vector

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
            # offset sums: one scalar per pair, or 8 lanes (a K-quant block's sub-blocks)
            zero = ir.Constant(_VF8, [0.0] * 8) if k_mins else ir.Constant(_F32, 0.0)
            offsets = [cgutils.alloca_once_value(builder, zero) for _ in range(R * V)]
            with cgutils.for_range(builder, nb_v) as loop:
                b = loop.index
                vecs_b = [builder.gep(vp, [builder.mul(b, _const_i64(per_block))]) for vp in vec_ptrs]
                sums_b = [builder.gep(sp, [builder.mul(b, _const_i64(per_block // 32))]) for sp in sum_ptrs]
                for k in range(R):
                    groups, offs = _block_parts(builder, builder.gep(row_ptrs[k], [builder.mul(b, _const_i64(bb))]), bb)
                    for j in range(V):
                        acc = accs[k * V + j]
                        total = builder.load(acc)
                        for scale, chunks in groups:
                            t = None
                            for first, q in chunks:
                                x = builder.load(builder.bitcast(builder.gep(vecs_b[j], [_const_i64(first)]), _VF.as_pointer()),
                                                 align=4)
                                qx = builder.fmul(q, x, flags=_FUSE)
                                t = qx if t is None else builder.fadd(t, qx, flags=_FUSE)
                            total = builder.fadd(total, builder.fmul(_splat_f(builder, scale), t, flags=_FUSE), flags=_FUSE)
                        builder.store(total, acc)
                        if k_mins:  # 8 sub-blocks' mins times their 32-sums
                            o = offsets[k * V + j]
                            xs8 = builder.load(builder.bitcast(sums_b[j], _VF8.as_pointer()), align=4)
                            builder.store(builder.fadd(builder.load(o), builder.fmul(offs, xs8, flags=_FUSE), flags=_FUSE), o)
                        elif offs:
                            o = offsets[k * V + j]
                            off = builder.load(o)
                            for coef, sub in offs:
                                xs = builder.load(builder.gep(sums_b[j], [_const_i64(sub)]))
                                off = builder.fadd(off, builder.fmul(coef, xs, flags=_FUSE), flags=_FUSE)
                            builder.store(off, o)
            outs = []
            for acc, o in zip(accs, offsets):
                off = _reduce(builder, builder.load(o)) if k_mins else builder.load(o)
                outs.append(builder.fadd(_reduce(builder, builder.load(acc)), off, flags=_FUSE))
            return context.make_tuple(builder, signature.return_type, outs)

        return sig, codegen

    return block_dots


FORMATS_BB = (18, 20, 34, 22, 24, 144, 176, 210)  # block bytes: Q4_0 Q4_1 Q8_0 Q5_0 Q5_1 Q4_K Q5_K Q6_K


def _dispatch(R: int, V: int):
    """A numba function (bb, rows, nb, vecs, sums) calling the (R, V) block dots of format
    bb: a chain of branches, each intrinsic compiled for its format alone."""
    fn = None
    for bb in reversed(FORMATS_BB):
        dots, rest = _block_dots(bb, R, V), fn
        if rest is None:
            def make_last(dots=dots):
                @njit(inline="always")
                def last(fmt, rows, nb, vecs, sums):
                    return dots(rows, nb, vecs, sums)
                return last
            fn = make_last()
        else:
            def make_step(dots=dots, rest=rest, this=bb):
                @njit(inline="always")
                def step(fmt, rows, nb, vecs, sums):
                    if fmt == this:
                        return dots(rows, nb, vecs, sums)
                    return rest(fmt, rows, nb, vecs, sums)
                return step
            fn = make_step()
    return fn


_rows4, _vecs4, _vecs2, _one = _dispatch(4, 1), _dispatch(1, 4), _dispatch(1, 2), _dispatch(1, 1)


@njit(inline="always")
def block_sums(v):
    """v's sums over each 32 values: the activation sums the offset formats read."""
    s = np.empty(v.shape[0] // 32, dtype=np.float32)
    for k in range(s.shape[0]):
        acc = np.float32(0.0)
        for j in range(32):
            acc += v[32 * k + j]
        s[k] = acc
    return s


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
    """Rows r0..r3 of quantized w (any block format) dotted with fp32 v (contiguous); xs:
    v's 32-sums (`block_sums`)."""
    _check_blocks(w, v)
    rows = (_row_address(w, r0), _row_address(w, r1), _row_address(w, r2), _row_address(w, r3))
    return _rows4(w.shape[2], rows, w.shape[1], (v.ctypes.data,), (xs.ctypes.data,))


@njit(fastmath=True)
def dot_row(w, r, v, xs):
    """Row r of quantized w (any block format) dotted with fp32 v; xs: v's 32-sums."""
    _check_blocks(w, v)
    return _one(w.shape[2], (_row_address(w, r),), w.shape[1], (v.ctypes.data,), (xs.ctypes.data,))[0]


@njit(fastmath=True)
def dot_vecs4(w, r, V, s0, s1, s2, s3, xs):
    """Row r of quantized w (any block format) dotted with rows s0..s3 of V (B, cols), each
    block widened once for the four; xs (B, cols / 32): V's 32-sums."""
    _check_blocks(w, V)
    if xs.strides[1] != 4:
        raise ValueError("block dots need contiguous block sums")
    vecs = (_row_address(V, s0), _row_address(V, s1), _row_address(V, s2), _row_address(V, s3))
    sums = (_row_address(xs, s0), _row_address(xs, s1), _row_address(xs, s2), _row_address(xs, s3))
    return _vecs4(w.shape[2], (_row_address(w, r),), w.shape[1], vecs, sums)


@njit(fastmath=True)
def dot_vecs2(w, r, V, s0, s1, xs):
    """Row r of quantized w dotted with rows s0, s1 of V: `dot_vecs4` for two vectors."""
    _check_blocks(w, V)
    if xs.strides[1] != 4:
        raise ValueError("block dots need contiguous block sums")
    vecs, sums = (_row_address(V, s0), _row_address(V, s1)), (_row_address(xs, s0), _row_address(xs, s1))
    return _vecs2(w.shape[2], (_row_address(w, r),), w.shape[1], vecs, sums)
