"""Block dots over 16 interleaved rows at once, one row per vector lane, as LLVM vector IR.

Hand-written for the same reason as `block_ir`: no library gives numba a quantized dot.
`block_ir` keeps a row's 32 weights across the lanes of a vector, so every (row, vector,
block) pair ends in a conversion and two fp32 operations on eight partial sums. Here the
lanes are rows: `ops/lanes.py` re-lays 16 rows so that one 64-byte load holds four quants of
each of the 16 rows, and the activations' matching four int8 values are broadcast to all
lanes. One vpdpbusd then adds four products to each of 16 rows' sums; a block of 32 weights
costs 8 of them for 16 rows, and the conversion and fp32 multiply-add happen once per block
for all 16 rows (llama.cpp's repacked Q4_0 for AVX-512 works this way). Each lane is one
row's own accumulator from first block to last: no reduction at the end, and the same
arithmetic whatever the number of vectors.

Integer dots per CPU, all exact, so results do not depend on the CPU: vpdpbusd (AVX-512
VNNI, 512-bit), pmaddubsw + pmaddwd on 256-bit halves (AVX2), widening multiplies elsewhere.
Q8_0's quants are stored plus 128 (unsigned) for vpdpbusd, which takes 128 x the block's
activation sum off in the start value; pmaddubsw would saturate on them, so the AVX2 and
plain paths turn them back to int8 first.

Formats: Q4_0 (18-byte blocks), Q4_1 (20), Q8_0 (34). A group block (16 rows' block b):
fp16 d[16], (Q4_1) fp16 m[16], then the quants in chunks of 64 bytes, chunk c holding row
r's quant bytes 4c..4c+3 at 4r (Q4: low nibbles weights 4c+i, high nibbles 16+4c+i).
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .block_ir import _F32, _FUSE, _I8, _I16, _I32, _c64, _call, _isa, _load, _splat

LANES = 16  # rows per group: one 512-bit vector of int32 / fp32
GROUP_BYTES = {18: 288, 20: 320, 34: 544}  # Q4_0, Q4_1, Q8_0 block bytes -> a group block's
_VF16, _VI16, _VB64 = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16), ir.VectorType(_I8, 64)
_VB32 = ir.VectorType(_I8, 32)


def quant_start(bb: int) -> int:
    """Byte offset of the first quant chunk in a group block (after the fp16 d, m lanes)."""
    return 64 if bb == 20 else 32


def _chunks(builder: ir.IRBuilder, gp: ir.Value, bb: int, isa: str) -> list[tuple[ir.Value, int]]:
    """A group block's quants as (<64 x i8> weights of 16 rows x 4, activation byte offset):
    unsigned for Q4 and for Q8_0 on VNNI, int8 for Q8_0 elsewhere."""
    start = quant_start(bb)
    if bb == 34:
        out = []
        for c in range(8):
            q = _load(builder, gp, start + 64 * c, _VB64)
            out.append((q if isa == "vnni" else builder.xor(q, ir.Constant(_VB64, [128] * 64)), 4 * c))
        return out
    lo, hi = [], []
    for c in range(4):
        q = _load(builder, gp, start + 64 * c, _VB64)
        lo.append((builder.and_(q, ir.Constant(_VB64, [15] * 64)), 4 * c))
        hi.append((builder.lshr(q, ir.Constant(_VB64, [4] * 64)), 16 + 4 * c))
    return lo + hi


def _half_lanes(builder: ir.IRBuilder, gp: ir.Value, offset: int) -> ir.Value:
    return builder.fpext(_load(builder, gp, offset, ir.VectorType(ir.HalfType(), LANES)), _VF16)


def _idot16(builder: ir.IRBuilder, isa: str, acc: ir.Value, w: ir.Value, a: ir.Value, signed: bool) -> ir.Value:
    """acc + (lane r: the four products of w's bytes 4r..4r+3 with a's), exact int32."""
    if isa == "vnni":
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", _VI16,
                     [acc, builder.bitcast(w, _VI16), builder.bitcast(a, _VI16)])
    if isa == "avx2":
        vi8 = ir.VectorType(_I32, 8)
        halves = []
        for h in range(2):
            pick = ir.Constant(ir.VectorType(_I32, 32), list(range(32 * h, 32 * h + 32)))
            wh, ah = builder.shuffle_vector(w, w, pick), builder.shuffle_vector(a, a, pick)
            if signed:  # |q| times a with q's sign: pairs stay within int16
                ah = _call(builder, "llvm.x86.avx2.psign.b", _VB32, [ah, wh])
                wh = _call(builder, "llvm.abs.v32i8", _VB32, [wh, ir.Constant(ir.IntType(1), 0)])
            pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_I16, 16), [wh, ah])
            halves.append(_call(builder, "llvm.x86.avx2.pmadd.wd", vi8,
                                [pairs, ir.Constant(ir.VectorType(_I16, 16), [1] * 16)]))
        both = builder.shuffle_vector(halves[0], halves[1], ir.Constant(_VI16, list(range(16))))
        return builder.add(acc, both)
    v64 = ir.VectorType(_I32, 64)
    prod = builder.mul(builder.sext(w, v64) if signed else builder.zext(w, v64), builder.sext(a, v64))
    for j in range(4):
        acc = builder.add(acc, builder.shuffle_vector(prod, prod, ir.Constant(_VI16, list(range(j, 64, 4)))))
    return acc


def _lane_dots(bb: int, V: int):
    """An intrinsic (group, nb, acts, outs): for the 16 rows of the group block array at
    address `group` (nb group blocks of GROUP_BYTES[bb]) and V activation records (addresses
    `acts`, `block_ir.quantize_acts` for bb), adds the 16 dots of vector j to the 16 fp32 at
    outs[j]."""
    G, isa = GROUP_BYTES[bb], _isa()
    signed = bb == 34 and isa != "vnni"
    bias = 8 if bb == 18 else (128 if bb == 34 and isa == "vnni" else 0)

    @intrinsic
    def lane_dots(typingctx, group, nb, acts, outs):
        sig = types.none(types.int64, types.int64, types.UniTuple(types.int64, V), types.UniTuple(types.int64, V))

        def codegen(context, builder, signature, args):
            group_v, nb_v, acts_t, outs_t = args
            i8p = _I8.as_pointer()
            gbase = builder.inttoptr(group_v, i8p)
            act_ptrs = [builder.inttoptr(builder.extract_value(acts_t, j), i8p) for j in range(V)]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_VF16, [0.0] * LANES)) for _ in range(V)]
            with cgutils.for_range(builder, nb_v) as loop:
                b = loop.index
                gp = builder.gep(gbase, [builder.mul(b, _c64(G))])
                dw = _half_lanes(builder, gp, 0)
                mw = _half_lanes(builder, gp, 32) if bb == 20 else None
                chunks = _chunks(builder, gp, bb, isa)
                for j in range(V):
                    rec = builder.gep(act_ptrs[j], [builder.mul(b, _c64(72))])
                    start = ir.Constant(_VI16, [0] * LANES)
                    if bias:  # (q - bias) . a = q . a - bias * (the block's activation sum)
                        total = _call(builder, "llvm.vector.reduce.add.v8i32", _I32,
                                      [_load(builder, rec, 32, ir.VectorType(_I32, 8))])
                        start = _splat(builder, builder.mul(total, ir.Constant(_I32, -bias)), LANES)
                    isum = start
                    for q, off in chunks:
                        a4 = _splat(builder, _load(builder, rec, off, _I32), LANES)
                        isum = _idot16(builder, isa, isum, q, builder.bitcast(a4, _VB64), signed)
                    da = _splat(builder, _load(builder, rec, 64, _F32), LANES)
                    xa = builder.fmul(builder.sitofp(isum, _VF16), da, flags=_FUSE)
                    total = _call(builder, "llvm.fmuladd.v16f32", _VF16, [xa, dw, builder.load(accs[j])])
                    if mw is not None:  # m x the block's activation sum (fp32)
                        sa = _splat(builder, _load(builder, rec, 68, _F32), LANES)
                        total = _call(builder, "llvm.fmuladd.v16f32", _VF16, [mw, sa, total])
                    builder.store(total, accs[j])
            for j in range(V):
                out = builder.bitcast(builder.inttoptr(builder.extract_value(outs_t, j), i8p), _VF16.as_pointer())
                prev = builder.load(out, align=4)
                builder.store(builder.fadd(prev, builder.load(accs[j]), flags=_FUSE), out, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return lane_dots


FORMATS_BB = (18, 20, 34)


def _dispatch(V: int):
    """A numba function (bb, group, nb, acts, outs) running the V-vector lane dots of
    format bb: a chain of branches, each intrinsic compiled for its format alone."""
    d18, d20, d34 = (_lane_dots(bb, V) for bb in FORMATS_BB)

    @njit(inline="always")
    def dots(bb, group, nb, acts, outs):
        if bb == 18:
            d18(group, nb, acts, outs)
        elif bb == 20:
            d20(group, nb, acts, outs)
        else:
            d34(group, nb, acts, outs)

    return dots


lane_dots1, lane_dots2, lane_dots4, lane_dots8 = _dispatch(1), _dispatch(2), _dispatch(4), _dispatch(8)
