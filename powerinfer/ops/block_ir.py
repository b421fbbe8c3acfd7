"""GGUF block dots with int8 activations and integer dot products, as LLVM vector IR.

Hand-written because no library gives numba a quantized dot product. The activations are
quantized per 32 values to int8 with one fp32 scale (ggml's Q8_0 rule: d = max|x| / 127,
q = round(x / d)), once per vector per matrix, into records that sit next to each weight
block (`quantize_acts`). A weight block's quants are unpacked to unsigned bytes (nibbles,
5- and 6-bit values from their bit planes; Q8_0's int8) and multiplied with the int8
activations 32 at a time into eight exact int32 sums of four products each: one vpdpbusd
on AVX-512 VNNI, pmaddubsw + pmaddwd on AVX2, plain widening multiplies elsewhere, chosen
by the compile target's features (`_isa`). All three give the same integers, so results do
not depend on the CPU. A format's bias (Q4_0's 8, Q5_0's 16, Q6_K's 32, Q8_0's 128 when its
int8 is read as unsigned) is taken off in integers with the activations' 4-sums; the
int32 lanes are then converted and fused into an 8-lane fp32 accumulator per (row, vector)
with the block's scale times the activations' scale, and reduced once per row. Offsets
(Q4_1, Q5_1 m; the K-quants' mins) multiply the activations' fp32 32-sums.

Why int8 activations (as llama.cpp does): widening every weight to fp32 costs two
conversions and three fp32 operations per 16 weights and bound the fp32 lane dots below
the memory bus on 2 cores; the integer dot does 32 weights in one to three instructions,
and an extra vector (batched decode, prefill) costs a dot, not a widening. The price is the
activations' rounding (about 0.4% of a block's largest value), the same llama.cpp pays;
the reference twin quantizes the activations the same way (`reference_acts`) and then
runs the fp32 op on dequantized weights.

A dot over R rows and V vectors unpacks each weight block once for the V vectors and reads
each activation record once for the R rows; every (row, vector) pair runs the same
operations in the same order whatever R and V are, so a batched decode equals the one-token
decode bit for bit.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import cfunc, njit, prange, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from .symbols import compile_lock, export, symbol_call

_F32, _I8, _I16, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_VF8, _VI8 = ir.VectorType(_F32, 8), ir.VectorType(_I32, 8)
_VB32, _VB16 = ir.VectorType(_I8, 32), ir.VectorType(_I8, 16)
# FMAs, no reassociation (numba's fastmath pass would give an op without flags "fast"). Where
# two multiply-adds meet one accumulator (Q4_1/Q5_1's offset after the runs), the second is
# an explicit llvm.fmuladd: with two "contract" candidates LLVM re-chained them in a 4 x 4
# tile but not in the GEMV, and the two rounded apart.
_FUSE = ("contract",)
K_BLOCK_BYTES = (144, 176, 210)  # Q4_K, Q5_K, Q6_K: 256 weights per block; the others 32
PREBIASED = -1  # a run's bias shift when its records' 4-sums already carry -bias (Q6_K)


def per_block(bb: int) -> int:
    """Weights per block of a format with bb bytes per block."""
    return 256 if bb in K_BLOCK_BYTES else 32


def record_bytes(bb: int) -> int:
    """Bytes of one activation record (the activations under one weight block): int8 q[P],
    int32 4-sums[P / 4], fp32 scales[P / 32], fp32 32-sums[P / 32]. Q6_K's records hold
    -32 x each 16 values' sum in the first of its four 4-sums and zeros in the rest."""
    n = per_block(bb) // 32
    return 32 * n + 32 * n + 4 * n + 4 * n


def _isa() -> str:
    """The integer dot the compile target has: "vnni" (AVX-512 VNNI), "avx2" or "generic".
    numba compiles for NUMBA_CPU_NAME / NUMBA_CPU_FEATURES when set, else for the host."""
    import llvmlite.binding as llvm

    if config.CPU_FEATURES:
        feats = {f[1:] for f in config.CPU_FEATURES.split(",") if f.startswith("+")}
    elif config.CPU_NAME in (None, "host"):
        feats = {k for k, v in llvm.get_host_cpu_features().items() if v}
    else:
        feats = set()
    if {"avx512vnni", "avx512vl", "avx512bw"} <= feats:
        return "vnni"
    return "avx2" if "avx2" in feats else "generic"


# ---------------------------------------------------------------- activations


def _strict(op: str):
    """An intrinsic float32 `op` ("fdiv" or "fmul") that stays IEEE in any caller. numba
    compiles a function called from a fastmath kernel with that kernel's flags (then reuses
    that compile in the process, while its on-disk cache holds a strict one), and its
    fastmath pass marks every float op without flags "fast": amax / 127 became amax times a
    rounded 1/127 and moved some activations' scales by an ulp, so a prompt's dots differed
    from the same tokens' decode dots depending on which ran first. An op that carries a flag
    is left alone, and "contract" has nothing to fuse with here."""

    @intrinsic
    def strict(typingctx, a, b):
        if a != types.float32 or b != types.float32:
            return None

        def codegen(context, builder, signature, args):
            return getattr(builder, op)(args[0], args[1], flags=_FUSE)

        return types.float32(types.float32, types.float32), codegen

    return strict


_div32, _mul32 = _strict("fdiv"), _strict("fmul")


_VF32, _VI32x32 = ir.VectorType(_F32, 32), ir.VectorType(_I32, 32)


@intrinsic
def _absmax32(typingctx, addr):
    """max |x| of the 32 float32 at byte address `addr`, or NaN when one of them is NaN (so
    that a NaN activation makes its block's dots NaN, as in `reference_acts`, instead of
    rounding to garbage integers)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        x = builder.load(builder.inttoptr(args[0], _VF32.as_pointer()), align=4)
        m = _call(builder, "llvm.vector.reduce.fmax.v32f32", _F32, [_call(builder, "llvm.fabs.v32f32", _VF32, [x])])
        # the NaN test and the choice in integers: a fastmath caller's flags (numba gives them
        # to float ops without flags of their own) would let LLVM assume no NaN
        bits = builder.and_(builder.bitcast(x, _VI32x32), ir.Constant(_VI32x32, [0x7FFFFFFF] * 32))
        nan = _call(builder, "llvm.vector.reduce.or.v32i1", ir.IntType(1),
                    [builder.icmp_unsigned(">", bits, ir.Constant(_VI32x32, [0x7F800000] * 32))])
        chosen = builder.select(nan, ir.Constant(_I32, 0x7FC00000), builder.bitcast(m, _I32))
        return builder.bitcast(chosen, _F32)

    return types.float32(addr), codegen


@intrinsic
def _round32(typingctx, addr, inv, q_addr, sums_addr):
    """The 32 float32 at `addr` times `inv` (IEEE), rounded to nearest even, as int8 at
    `q_addr` and their eight int32 4-sums at `sums_addr`: int32(rint(x * inv)) per value, its
    low byte stored."""
    if not (isinstance(addr, types.Integer) and inv == types.float32 and isinstance(q_addr, types.Integer)
            and isinstance(sums_addr, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        x = builder.load(builder.inttoptr(args[0], _VF32.as_pointer()), align=4)
        scaled = builder.fmul(x, _splat(builder, args[1], 32), flags=_FUSE)
        q = builder.fptosi(_call(builder, "llvm.rint.v32f32", _VF32, [scaled]), _VI32x32)
        builder.store(builder.trunc(q, _VB32), builder.inttoptr(args[2], _VB32.as_pointer()), align=1)
        parts = [builder.shuffle_vector(q, q, ir.Constant(_VI8, [4 * g + j for g in range(8)])) for j in range(4)]
        sums = builder.add(builder.add(builder.add(parts[0], parts[1]), parts[2]), parts[3])
        builder.store(sums, builder.inttoptr(args[3], _VI8.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(addr, inv, q_addr, sums_addr), codegen


@njit
def _quantize_into(v, bb, out):
    """v's records for weight blocks of bb bytes into out (uint8, blocks * record bytes).
    Its float steps are strict IEEE in every caller (`_strict`): a value on a rounding
    boundary rounds as in `reference_acts`. A block's largest magnitude and its rounding run
    as vector IR (`_absmax32`, `_round32`; the scalar loops ran ~1.8 ns a value)."""
    P = 256 if bb == 144 or bb == 176 or bb == 210 else 32
    n = P // 32
    rec = 72 * n  # P + 32n + 4n + 4n = 72n
    i32, f32 = out.view(np.int32), out.view(np.float32)
    sums = np.empty(8, dtype=np.int32)
    vc = np.ascontiguousarray(v)  # the IR reads 32 values at an address (a strided row is copied)
    v_at, out_at, sums_at = vc.ctypes.data, out.ctypes.data, sums.ctypes.data
    for blk in range(v.shape[0] // 32):
        b, k = blk // n, blk % n
        base = b * rec
        amax = _absmax32(v_at + 4 * 32 * blk)
        d = _div32(amax, np.float32(127.0))
        inv = _div32(np.float32(127.0), amax) if amax > 0 else np.float32(0.0)
        _round32(v_at + 4 * 32 * blk, inv, out_at + base + 32 * k, sums_at)
        total = 0
        sub = 0
        for g in range(8):
            gsum = sums[g]
            total += gsum
            if bb != 210:
                i32[(base + P) // 4 + 8 * k + g] = gsum
                continue
            # Q6_K's bias (32) taken off in the record, and each 16 values' sum in the first of
            # its four 4-sums (zeros in the others): the lanes kernel starts a 16-weight
            # sub-block's dot from that one word; the row kernel's lanes add up the same
            sub += gsum
            i32[(base + P) // 4 + 8 * k + g] = 0
            if g % 4 == 3:
                i32[(base + P) // 4 + 8 * k + g - 3] = sub * -32
                sub = 0
        f32[(base + P + 32 * n) // 4 + k] = d
        f32[(base + P + 36 * n) // 4 + k] = _mul32(d, np.float32(total))


@njit
def quantize_acts(v, bb):
    """fp32 activations v (cols,) as int8 records for weight blocks of bb bytes (uint8,
    (cols / P) * record_bytes(bb)): the one pass over v a set of dots shares."""
    P = 256 if bb == 144 or bb == 176 or bb == 210 else 32
    out = np.empty(v.shape[0] // P * (72 * (P // 32)), dtype=np.uint8)
    _quantize_into(v, bb, out)
    return out


@njit(parallel=True)
def quantize_acts_rows(V, bb):
    """`quantize_acts` for every row of V (B, cols): (B, record bytes per row), the rows
    shared among the threads (a row's records are the same whichever thread makes them)."""
    P = 256 if bb == 144 or bb == 176 or bb == 210 else 32
    out = np.empty((V.shape[0], V.shape[1] // P * (72 * (P // 32))), dtype=np.uint8)
    for s in prange(V.shape[0]):
        _quantize_into(V[s], bb, out[s])
    return out


def reference_acts(v: np.ndarray) -> np.ndarray:
    """The activations the kernels multiply: v quantized per 32 to int8 and back (numpy),
    the reference twin's input."""
    x = np.asarray(v, dtype=np.float32).reshape(-1, 32)
    amax = np.abs(x).max(axis=1, keepdims=True)
    d = amax / np.float32(127.0)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(x * inv) * d).astype(np.float32).reshape(np.shape(v))


# ---------------------------------------------------------------- IR helpers


def _c64(k: int) -> ir.Constant:
    return ir.Constant(_I64, k)


def _ptr(builder: ir.IRBuilder, p: ir.Value, offset, ty: ir.Type) -> ir.Value:
    off = offset if isinstance(offset, ir.Value) else _c64(offset)
    return builder.bitcast(builder.gep(p, [off]), ty.as_pointer())


def _load(builder: ir.IRBuilder, p: ir.Value, offset, ty: ir.Type) -> ir.Value:
    return builder.load(_ptr(builder, p, offset, ty), align=1)


def _half(builder: ir.IRBuilder, p: ir.Value, offset: int) -> ir.Value:
    return builder.fpext(_load(builder, p, offset, ir.HalfType()), _F32)


def _splat(builder: ir.IRBuilder, x: ir.Value, n: int) -> ir.Value:
    vt = ir.VectorType(x.type, n)
    v = builder.insert_element(ir.Constant(vt, None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _bytes_const(k: int, n: int = 32) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I8, n), [k] * n)


def _concat(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    n = a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))


def _call(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _idot(builder: ir.IRBuilder, isa: str, q: ir.Value, signed: bool, a: ir.Value, gs: ir.Value,
          bias_shift: int | None) -> ir.Value:
    """Eight int32 sums, lane i = sum over bytes 4i..4i+3 of (q - bias) * a, exact: q 32
    weight quants (unsigned bytes, or int8 when signed), a 32 int8 activations, gs their
    eight 4-sums, bias = 2**bias_shift (None: no bias; PREBIASED: gs already holds -bias x
    the 4-sums, as Q6_K's records do)."""
    zero = ir.Constant(_VI8, [0] * 8)

    def minus_bias(x: ir.Value, shift: int) -> ir.Value:
        if shift == PREBIASED:
            return builder.add(x, gs)
        return builder.sub(x, builder.shl(gs, ir.Constant(_VI8, [shift] * 8)))

    if isa == "vnni":
        init = zero if bias_shift is None else minus_bias(zero, bias_shift)
        if signed:  # |q| times a with q's sign (the abs is shared by the vectors: CSE)
            a = _call(builder, "llvm.x86.avx2.psign.b", _VB32, [a, q])
            q = _call(builder, "llvm.abs.v32i8", _VB32, [q, ir.Constant(ir.IntType(1), 0)])
        return _call(builder, "llvm.x86.avx512.vpdpbusd.256", _VI8,
                     [init, builder.bitcast(q, _VI8), builder.bitcast(a, _VI8)])
    if isa == "avx2":
        if signed:  # |q| times a with q's sign (pairs stay within int16: 2 * 128 * 127)
            a = _call(builder, "llvm.x86.avx2.psign.b", _VB32, [a, q])
            q = _call(builder, "llvm.abs.v32i8", _VB32, [q, ir.Constant(ir.IntType(1), 0)])
        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_I16, 16), [q, a])
        sums = _call(builder, "llvm.x86.avx2.pmadd.wd", _VI8, [pairs, ir.Constant(ir.VectorType(_I16, 16), [1] * 16)])
    else:
        v32 = ir.VectorType(_I32, 32)
        prod = builder.mul(builder.sext(q, v32) if signed else builder.zext(q, v32), builder.sext(a, v32))
        sums = None
        for j in range(4):
            part = builder.shuffle_vector(prod, prod, ir.Constant(_VI8, list(range(j, 32, 4))))
            sums = part if sums is None else builder.add(sums, part)
    return sums if bias_shift is None else minus_bias(sums, bias_shift)


def _nibbles(builder: ir.IRBuilder, src: ir.Value, high: bool) -> ir.Value:
    n = src.type.count
    return builder.lshr(src, _bytes_const(4, n)) if high else builder.and_(src, _bytes_const(15, n))


def _fifth_bits(builder: ir.IRBuilder, qh: ir.Value) -> ir.Value:
    """The 32 bits of a Q5_0/Q5_1 block's u32 qh as 32 bytes of 0 or 16 (bit j for weight j)."""
    v32 = ir.VectorType(_I32, 32)
    spread = _splat(builder, qh, 32)
    bits = builder.and_(builder.lshr(spread, ir.Constant(v32, list(range(32)))), ir.Constant(v32, [1] * 32))
    return builder.trunc(builder.shl(bits, ir.Constant(v32, [4] * 32)), _VB32)


def _k4_scales_mins(builder: ir.IRBuilder, p: ir.Value) -> tuple[ir.Value, ir.Value]:
    """The 8 sub-blocks' 6-bit scales and mins of a Q4_K/Q5_K block as two <8 x float>
    (ggml's get_scale_min_k4 for j = 0..7 at once; the 12 scale bytes start at byte 4)."""
    v8, v12 = ir.VectorType(_I8, 8), ir.VectorType(_I8, 12)
    q = _load(builder, p, 4, v12)
    zero = ir.Constant(v12, [0] * 12)

    def pick(lanes: list[int]) -> ir.Value:  # lane index 12+ reads the zero vector
        return builder.shuffle_vector(q, zero, ir.Constant(_VI8, lanes))

    def c8(values: list[int]) -> ir.Constant:
        return ir.Constant(v8, values)

    a, b = pick([0, 1, 2, 3, 8, 9, 10, 11]), pick([12, 12, 12, 12, 0, 1, 2, 3])
    sc = builder.or_(builder.and_(a, c8([63] * 4 + [15] * 4)), builder.shl(builder.lshr(b, c8([6] * 8)), c8([4] * 8)))
    c, e = pick([4, 5, 6, 7, 8, 9, 10, 11]), pick([12, 12, 12, 12, 4, 5, 6, 7])
    low = builder.shuffle_vector(builder.and_(c, c8([63] * 8)), builder.lshr(c, c8([4] * 8)),
                                 ir.Constant(_VI8, [0, 1, 2, 3, 12, 13, 14, 15]))
    m = builder.or_(low, builder.shl(builder.lshr(e, c8([6] * 8)), c8([4] * 8)))
    return builder.uitofp(sc, _VF8), builder.uitofp(m, _VF8)


def _block_runs(builder: ir.IRBuilder, p: ir.Value, bb: int):
    """A weight block as runs of 32 quants, each: (quants <32 x i8>, signed, bias shift,
    activation block k, scale), scale an fp32 scalar or (for Q6_K) <8 x float> lanes; and
    its offsets: [(m, k)] (Q4_1, Q5_1), or <8 x float> -dmin m_j (Q4_K, Q5_K), or none.
    weight = scale * (quant - bias) (+ offset)."""
    if bb == 34:
        return [(_load(builder, p, 2, _VB32), True, None, 0, _half(builder, p, 0))], []
    if bb in (18, 20, 22, 24):
        qs_at = {18: 2, 20: 4, 22: 6, 24: 8}[bb]
        qs = _load(builder, p, qs_at, _VB16)
        q = _concat(builder, _nibbles(builder, qs, False), _nibbles(builder, qs, True))
        if bb in (22, 24):
            q = builder.or_(q, _fifth_bits(builder, _load(builder, p, qs_at - 4, _I32)))
        d = _half(builder, p, 0)
        if bb in (18, 22):  # the bias 8 (16) off in integers: the dot starts at -8 (-16) x the 4-sums
            return [(q, False, 3 if bb == 18 else 4, 0, d)], []
        return [(q, False, None, 0, d)], [(_half(builder, p, 2), 0)]
    if bb == 210:  # Q6_K: 16 sub-blocks of 16, d * int8 sc * (6-bit q - 32)
        d = _half(builder, p, 208)
        scales = builder.fmul(builder.sitofp(_load(builder, p, 192, _VB16), ir.VectorType(_F32, 16)),
                              _splat(builder, d, 16), flags=_FUSE)
        runs = []
        for half in range(2):
            a, c = _load(builder, p, 64 * half, _VB32), _load(builder, p, 64 * half + 32, _VB32)
            h = _load(builder, p, 128 + 32 * half, _VB32)
            for kk, (src, high, shift) in enumerate([(a, False, 0), (c, False, 2), (a, True, 4), (c, True, 6)]):
                # bits shift..shift+1 of h moved to bits 4-5 in one shift and one mask (x86 has
                # no byte shifts: each costs a word shift and a mask)
                moved = builder.shl(h, _bytes_const(4 - shift)) if shift < 4 else (
                    builder.lshr(h, _bytes_const(shift - 4)) if shift > 4 else h)
                top = builder.and_(moved, _bytes_const(0x30))
                k = 4 * half + kk
                lanes = builder.shuffle_vector(scales, scales, ir.Constant(_VI8, [2 * k] * 4 + [2 * k + 1] * 4))
                runs.append((builder.or_(_nibbles(builder, src, high), top), False, PREBIASED, k, lanes))
        return runs, []
    # Q4_K (144), Q5_K (176): 8 sub-blocks of 32, d sc_j q - dmin m_j; the 32 bytes of pair
    # p hold sub-block 2p in their low nibbles and 2p + 1 in their high ones
    d, dmin = _half(builder, p, 0), _half(builder, p, 2)
    qs_at = 16 if bb == 144 else 48
    sc8, m8 = _k4_scales_mins(builder, p)
    scales = builder.fmul(sc8, _splat(builder, d, 8), flags=_FUSE)
    mins = builder.fmul(m8, _splat(builder, builder.fmul(dmin, ir.Constant(_F32, -1.0), flags=_FUSE), 8), flags=_FUSE)
    qh = _load(builder, p, 16, _VB32) if bb == 176 else None
    runs = []
    for j in range(8):
        q = _nibbles(builder, _load(builder, p, qs_at + 32 * (j // 2), _VB32), j % 2 == 1)
        if qh is not None:  # fifth bit j of qh[l]
            q = builder.or_(q, builder.shl(builder.and_(builder.lshr(qh, _bytes_const(j)), _bytes_const(1)),
                                           _bytes_const(4)))
        runs.append((q, False, None, j, builder.extract_element(scales, ir.Constant(_I32, j))))
    return runs, mins


def _reduce(builder: ir.IRBuilder, acc: ir.Value) -> ir.Value:
    """The sum of acc's lanes in one fixed order (halves added until one lane is left), so
    that no context (one row, a tile of rows and vectors) can sum them otherwise. The adds
    carry a flag (contract: nothing to fuse here) because numba's fastmath pass gives every
    float instruction without flags "fast", which would let LLVM reassociate them."""
    while acc.type.count > 1:
        h = acc.type.count // 2
        lo = builder.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(_I32, h), list(range(h))))
        hi = builder.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(_I32, h), list(range(h, 2 * h))))
        acc = builder.fadd(lo, hi, flags=_FUSE)
    return builder.extract_element(acc, ir.Constant(_I32, 0))


def _block_dots(bb: int, R: int, V: int):
    """An intrinsic (rows, nb, acts) -> R*V float32s, row-major: rows is a tuple of R
    addresses of rows of nb blocks of bb bytes; acts of V addresses of activation records
    (`quantize_acts` for bb)."""
    P = per_block(bb)
    n, rec = P // 32, record_bytes(bb)
    isa = _isa()

    @intrinsic
    def block_dots(typingctx, rows, nb, acts):
        sig = types.UniTuple(types.float32, R * V)(types.UniTuple(types.int64, R), types.int64,
                                                   types.UniTuple(types.int64, V))

        def codegen(context, builder, signature, args):
            rows_t, nb_v, acts_t = args
            i8p = _I8.as_pointer()
            row_ptrs = [builder.inttoptr(builder.extract_value(rows_t, k), i8p) for k in range(R)]
            act_ptrs = [builder.inttoptr(builder.extract_value(acts_t, j), i8p) for j in range(V)]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_VF8, [0.0] * 8)) for _ in range(R * V)]
            k_mins = bb in (144, 176)
            zero = ir.Constant(_VF8, [0.0] * 8) if k_mins else ir.Constant(_F32, 0.0)
            offsets = [cgutils.alloca_once_value(builder, zero) for _ in range(R * V)]
            with cgutils.for_range(builder, nb_v) as loop:
                b = loop.index
                recs = [builder.gep(ap, [builder.mul(b, _c64(rec))]) for ap in act_ptrs]
                # per vector: its 32-block scales (and 32-sums), read once for the R rows
                act_scales = []
                for r in recs:
                    if n == 8:
                        act_scales.append((_load(builder, r, P + 32 * n, _VF8), _load(builder, r, P + 36 * n, _VF8)))
                    else:
                        act_scales.append((_load(builder, r, P + 32, _F32), _load(builder, r, P + 36, _F32)))
                # each vector's activation scales as 8 lanes, shared by the R rows
                da_lanes = [[_splat(builder, builder.extract_element(da, ir.Constant(_I32, k)) if n == 8 else da, 8)
                             for k in range(n)] for da, _ in act_scales]
                for kr in range(R):
                    runs, offs = _block_runs(builder, builder.gep(row_ptrs[kr], [builder.mul(b, _c64(bb))]), bb)
                    # each run's weight scale as 8 lanes, shared by the V vectors
                    w_lanes = [scale if isinstance(scale.type, ir.VectorType) else _splat(builder, scale, 8)
                               for _, _, _, _, scale in runs]
                    for j in range(V):
                        acc = accs[kr * V + j]
                        total = builder.load(acc)
                        sa = act_scales[j][1]
                        for (q, signed, shift, k, _), wl in zip(runs, w_lanes):
                            a = _load(builder, recs[j], 32 * k, _VB32)
                            gs = _load(builder, recs[j], P + 32 * k, _VI8) if shift is not None else None
                            i = _idot(builder, isa, q, signed, a, gs, shift)
                            xa = builder.fmul(builder.sitofp(i, _VF8), da_lanes[j][k], flags=_FUSE)
                            total = builder.fadd(total, builder.fmul(xa, wl, flags=_FUSE), flags=_FUSE)
                        builder.store(total, acc)
                        if k_mins:  # 8 sub-blocks' mins times their 32-sums
                            o = offsets[kr * V + j]
                            builder.store(builder.fadd(builder.load(o), builder.fmul(offs, sa, flags=_FUSE),
                                                       flags=_FUSE), o)
                        elif offs:  # m x 32-sum spread over the 8 lanes (no register of its own)
                            coef = offs[0][0]
                            t = _call(builder, "llvm.fmuladd.v8f32", _VF8,
                                      [_splat(builder, coef, 8),
                                       _splat(builder, builder.fmul(sa, ir.Constant(_F32, 0.125), flags=_FUSE), 8),
                                       builder.load(acc)])
                            builder.store(t, acc)
            outs = []
            for acc, o in zip(accs, offsets):
                off = _reduce(builder, builder.load(o)) if k_mins else ir.Constant(_F32, 0.0)
                outs.append(builder.fadd(_reduce(builder, builder.load(acc)), off, flags=_FUSE))
            return context.make_tuple(builder, signature.return_type, outs)

        return sig, codegen

    return block_dots


FORMATS_BB = (18, 20, 34, 22, 24, 144, 176, 210)  # block bytes: Q4_0 Q4_1 Q8_0 Q5_0 Q5_1 Q4_K Q5_K Q6_K


def _dispatch(R: int, V: int):
    """A numba function (bb, rows, nb, acts) calling the (R, V) block dots of format bb: a
    chain of branches, each intrinsic compiled for its format alone."""
    fn = None
    for bb in reversed(FORMATS_BB):
        dots, rest = _block_dots(bb, R, V), fn
        if rest is None:
            def make_last(dots=dots):
                @njit(inline="always")
                def last(fmt, rows, nb, acts):
                    return dots(rows, nb, acts)
                return last
            fn = make_last()
        else:
            def make_step(dots=dots, rest=rest, this=bb):
                @njit(inline="always")
                def step(fmt, rows, nb, acts):
                    if fmt == this:
                        return dots(rows, nb, acts)
                    return rest(fmt, rows, nb, acts)
                return step
            fn = make_step()
    return fn


_rows4, _vecs4, _vecs2, _one = _dispatch(4, 1), _dispatch(1, 4), _dispatch(1, 2), _dispatch(1, 1)
_tile, _vecs8 = _dispatch(4, 4), _dispatch(1, 8)

# The dots as C functions compiled once, which every kernel calls by symbol (ops/symbols.py):
# (fmt, rows, nb, acts, out), the tuples as pointers to their addresses, the R x V results
# written to out.
_I64P = types.CPointer(types.int64)
_C_SIG = types.void(types.int64, _I64P, types.int64, _I64P, types.CPointer(types.float32))

with compile_lock("block_dots"):
    @cfunc(_C_SIG, cache=True)
    def _c_one(fmt, rows, nb, acts, out):
        out[0] = _one(fmt, (rows[0],), nb, (acts[0],))[0]

    @cfunc(_C_SIG, cache=True)
    def _c_rows4(fmt, rows, nb, acts, out):
        r = _rows4(fmt, (rows[0], rows[1], rows[2], rows[3]), nb, (acts[0],))
        for k in range(4):
            out[k] = r[k]

    @cfunc(_C_SIG, cache=True)
    def _c_vecs2(fmt, rows, nb, acts, out):
        r = _vecs2(fmt, (rows[0],), nb, (acts[0], acts[1]))
        for k in range(2):
            out[k] = r[k]

    @cfunc(_C_SIG, cache=True)
    def _c_vecs4(fmt, rows, nb, acts, out):
        r = _vecs4(fmt, (rows[0],), nb, (acts[0], acts[1], acts[2], acts[3]))
        for k in range(4):
            out[k] = r[k]

    @cfunc(_C_SIG, cache=True)
    def _c_vecs8(fmt, rows, nb, acts, out):
        r = _vecs8(fmt, (rows[0],), nb, (acts[0], acts[1], acts[2], acts[3], acts[4], acts[5], acts[6], acts[7]))
        for k in range(8):
            out[k] = r[k]

    @cfunc(_C_SIG, cache=True)
    def _c_tile(fmt, rows, nb, acts, out):
        r = _tile(fmt, (rows[0], rows[1], rows[2], rows[3]), nb, (acts[0], acts[1], acts[2], acts[3]))
        for k in range(16):
            out[k] = r[k]

for _name, _c in (("one", _c_one), ("rows4", _c_rows4), ("vecs2", _c_vecs2), ("vecs4", _c_vecs4),
                  ("vecs8", _c_vecs8), ("tile", _c_tile)):
    export(f"powerinfer_block_{_name}", _c)
_call_one, _call_rows4, _call_vecs2, _call_vecs4, _call_vecs8, _call_tile = (
    symbol_call(f"powerinfer_block_{name}", n) for name, n in (("one", 1), ("rows4", 4), ("vecs2", 2), ("vecs4", 4),
                                                                ("vecs8", 8), ("tile", 16)))


@njit(inline="always")
def _row_address(w, r):
    return w.ctypes.data + r * w.strides[0]


@njit(inline="always")
def _check_blocks(w):
    # the IR walks a row's blocks as bb contiguous bytes each
    if w.strides[2] != 1 or w.strides[1] != w.shape[2]:
        raise ValueError("block dots need contiguous blocks")


@njit(fastmath=True)
def dot_rows4(w, r0, r1, r2, r3, qa):
    """Rows r0..r3 of quantized w (any block format) dotted with activations qa
    (`quantize_acts(v, w.shape[2])`)."""
    _check_blocks(w)
    rows = (_row_address(w, r0), _row_address(w, r1), _row_address(w, r2), _row_address(w, r3))
    return _call_rows4((w.shape[2], rows, w.shape[1], (qa.ctypes.data,)))


@njit(fastmath=True)
def dot_row(w, r, qa):
    """Row r of quantized w dotted with activations qa (`quantize_acts`)."""
    _check_blocks(w)
    return _call_one((w.shape[2], (_row_address(w, r),), w.shape[1], (qa.ctypes.data,)))[0]


@njit(fastmath=True)
def dot_vecs4(w, r, QA, s0, s1, s2, s3):
    """Row r of quantized w dotted with rows s0..s3 of QA (`quantize_acts_rows`), each
    block unpacked once for the four."""
    _check_blocks(w)
    acts = (_row_address(QA, s0), _row_address(QA, s1), _row_address(QA, s2), _row_address(QA, s3))
    return _call_vecs4((w.shape[2], (_row_address(w, r),), w.shape[1], acts))


@njit(fastmath=True)
def dot_tile(w, r, QA, s):
    """Rows r..r+3 of quantized w dotted with rows s..s+3 of QA: 16 results, row-major
    (row r with QA[s], QA[s+1], ..., then row r+1...), each block unpacked once for the four
    vectors and each record read once for the four rows."""
    _check_blocks(w)
    rows = (_row_address(w, r), _row_address(w, r + 1), _row_address(w, r + 2), _row_address(w, r + 3))
    acts = (_row_address(QA, s), _row_address(QA, s + 1), _row_address(QA, s + 2), _row_address(QA, s + 3))
    return _call_tile((w.shape[2], rows, w.shape[1], acts))


@njit(fastmath=True)
def dot_vecs8(w, r, QA, s):
    """Row r of quantized w dotted with rows s..s+7 of QA, each block unpacked once for the
    eight."""
    _check_blocks(w)
    acts = (_row_address(QA, s), _row_address(QA, s + 1), _row_address(QA, s + 2), _row_address(QA, s + 3),
            _row_address(QA, s + 4), _row_address(QA, s + 5), _row_address(QA, s + 6), _row_address(QA, s + 7))
    return _call_vecs8((w.shape[2], (_row_address(w, r),), w.shape[1], acts))


@njit(fastmath=True)
def dot_vecs2(w, r, QA, s0, s1):
    """Row r of quantized w dotted with rows s0, s1 of QA: `dot_vecs4` for two."""
    _check_blocks(w)
    return _call_vecs2((w.shape[2], (_row_address(w, r),), w.shape[1], (_row_address(QA, s0), _row_address(QA, s1))))
