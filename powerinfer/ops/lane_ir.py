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
Q8_0's quants are stored plus 128 (unsigned) for vpdpbusd; pmaddubsw would saturate on
them, so the AVX2 and plain paths dot them as int8 and add 128 x the activations' sum back.
A format's bias (Q4_0's 8, Q8_0's 128) is then taken off in fp32 with the activations'
32-sum, as Q4_1's offset is (`_small_block` says why).

Formats: Q4_0 (18-byte blocks), Q4_1 (20), Q8_0 (34). A group block (16 rows' block b):
fp16 d[16], (Q4_1) fp16 m[16], then the quants in chunks of 64 bytes, chunk c holding row
r's quant bytes 4c..4c+3 at 4r (Q4: low nibbles weights 4c+i, high nibbles 16+4c+i).
Q4_K (a 148 x 16-byte group block per super-block of 256): fp16 d[16], dmin[16], the 8
sub-blocks' scales as bytes sc[8][16] and mins m[8][16] (unpacked from their 6 bits at
load), then pair p's 32 quant bytes per row in 8 chunks (low nibbles sub-block 2p, high
2p + 1); per sub-block one conversion and two multiply-adds (scale, min) for 16 rows (an
AVX2 batch: 8 rows at a time, `_q4k_rows_avx2`, for the registers).
Q6_K (210 x 16 bytes): fp16 d[16], the 16 sub-blocks' int8 scales sc[16][16], then the
rows' ql bytes in 32 chunks and their qh bytes in 16 (`_q6k_block`); a sub-block of 16
weights costs four dots, one conversion and two multiplies for 16 rows.
"""

from __future__ import annotations

from functools import partial

from llvmlite import ir
from numba import cfunc, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .block_ir import _F32, _FUSE, _I8, _I16, _I32, _VB32, _VF8, _VI8, _c64, _call, _isa, _load, _splat
from .symbols import compile_lock, export, symbol_call

LANES = 16  # rows per group: one 512-bit vector of int32 / fp32
# the 4-D array's last axis (a group block's bytes / 16) -> the row format's block bytes:
# Q4_0, Q4_1, Q8_0 keep theirs; Q4_K (144) takes 148, its 6-bit scales and mins unpacked
LAST_AXIS = {18: 18, 20: 20, 34: 34, 148: 144, 210: 210}
GROUP_BYTES = {k: 16 * k for k in LAST_AXIS}
_VF16, _VI16, _VB64 = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16), ir.VectorType(_I8, 64)


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
    if isa == "avx2":  # a chunk's two nibble halves one after the other: LLVM then kept fewer raw
        # chunks live and spilled less on AVX2's 16 registers (Q4 batches +2-7% on Zen 3,
        # docs/BENCHMARKS.md "Quantized GEMV"; the integer sums are exact in any order)
        return [x for pair in zip(lo, hi) for x in pair]
    return lo + hi


def _half_lanes(builder: ir.IRBuilder, gp: ir.Value, offset: int) -> ir.Value:
    return builder.fpext(_load(builder, gp, offset, ir.VectorType(ir.HalfType(), LANES)), _VF16)


_VP16 = ir.VectorType(_I16, 16)
# AVX2 keeps a dot's pmaddubsw pairs in int16 over several chunks and widens them once
# (pmaddwd by ones): one multiply per chunk half instead of two on the ports both share
# (Q4_0 batches +10-17%, Q4_K +5-11% on Zen 3; docs/BENCHMARKS.md "Quantized GEMV"). Exact
# while the pairs cannot overflow: a pair is at most 2 x |q| x 128, so eight chunks of 4-bit
# quants (30720) and two of Q6_K's 6-bit ones (32256). Their chain is one vpaddw deep, so
# AVX2 keeps one partial sum per vector where VNNI's vpdpbusd chains want two.
PAIR_CHUNKS = {"Q4": 8, "Q6_K": 2}


def _pairs(builder: ir.IRBuilder, w: ir.Value, a: ir.Value, signed: bool = False) -> list[ir.Value]:
    """AVX2: the two 256-bit halves' pmaddubsw of w (unsigned, or int8 when signed) and int8
    a (rows 0-7, 8-15): int16 lanes 2r, 2r + 1 hold row r's two pair sums."""
    out = []
    for h in range(2):
        pick = ir.Constant(ir.VectorType(_I32, 32), list(range(32 * h, 32 * h + 32)))
        wh, ah = builder.shuffle_vector(w, w, pick), builder.shuffle_vector(a, a, pick)
        if signed:  # |q| times a with q's sign: pairs stay within int16
            ah = _call(builder, "llvm.x86.avx2.psign.b", _VB32, [ah, wh])
            wh = _call(builder, "llvm.abs.v32i8", _VB32, [wh, ir.Constant(ir.IntType(1), 0)])
        out.append(_call(builder, "llvm.x86.avx2.pmadd.ub.sw", _VP16, [wh, ah]))
    return out


def _widen_pairs(builder: ir.IRBuilder, acc: ir.Value, pairs: list[ir.Value]) -> ir.Value:
    """acc + the 16 rows' sums of `_pairs`' (accumulated) int16 halves."""
    ones = ir.Constant(_VP16, [1] * 16)
    halves = [_call(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), [p, ones]) for p in pairs]
    return builder.add(acc, builder.shuffle_vector(halves[0], halves[1], ir.Constant(_VI16, list(range(16)))))


def _idot16(builder: ir.IRBuilder, isa: str, acc: ir.Value, w: ir.Value, a: ir.Value, signed: bool) -> ir.Value:
    """acc + (lane r: the four products of w's bytes 4r..4r+3 with a's), exact int32."""
    if isa == "vnni":
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", _VI16,
                     [acc, builder.bitcast(w, _VI16), builder.bitcast(a, _VI16)])
    if isa == "avx2":
        return _widen_pairs(builder, acc, _pairs(builder, w, a, signed))
    v64 = ir.VectorType(_I32, 64)
    prod = builder.mul(builder.sext(w, v64) if signed else builder.zext(w, v64), builder.sext(a, v64))
    for j in range(4):
        acc = builder.add(acc, builder.shuffle_vector(prod, prod, ir.Constant(_VI16, list(range(j, 64, 4)))))
    return acc


class _PairDots:
    """Per vector, the int32 dots of a run of chunks; on AVX2 with unsigned quants the
    chunks' pairs are summed in int16, `span` chunks at a time, before they are widened."""

    def __init__(self, builder: ir.IRBuilder, isa: str, starts: list[ir.Value], span: int, signed: bool = False):
        self.builder, self.isa, self.signed = builder, isa, signed
        self.int16 = isa == "avx2" and not signed and span > 1
        self.span, self.sums = span, list(starts)
        self.pairs: list[list[ir.Value] | None] = [None] * len(starts)
        self.count = [0] * len(starts)

    def add(self, v: int, q: ir.Value, a: ir.Value) -> None:
        """Vector v's sums += the dots of chunk q (16 rows x 4 quants) with a (4 int8, splat)."""
        b = self.builder
        if not self.int16:
            self.sums[v] = _idot16(b, self.isa, self.sums[v], q, a, self.signed)
            return
        new = _pairs(b, q, a)
        self.pairs[v] = new if self.pairs[v] is None else [b.add(x, y) for x, y in zip(self.pairs[v], new)]
        self.count[v] += 1
        if self.count[v] == self.span:
            self.flush(v)

    def flush(self, v: int) -> None:
        if self.pairs[v] is not None:
            self.sums[v] = _widen_pairs(self.builder, self.sums[v], self.pairs[v])
            self.pairs[v], self.count[v] = None, 0

    def result(self, v: int) -> ir.Value:
        self.flush(v)
        return self.sums[v]


def _small_block(builder: ir.IRBuilder, gp: ir.Value, recs: list[ir.Value], accs: list[ir.Value], bb: int,
                 isa: str) -> None:
    """One group block of 32 weights per row (Q4_0, Q4_1, Q8_0) into the V accumulators: the
    16 rows' int32 dots of the unsigned quants, then acc += (isum * da) * d and + m * sa,
    where m is Q4_1's offset or -bias * d (Q4_0: 8, Q8_0 read unsigned: 128).

    The bias is an fp32 multiply-add with the activations' 32-sum rather than an integer
    start from their 4-sums: the 4-sums' horizontal add cost a quarter of the dot ports per
    block (Q4_0 prefill 160 -> 210 G MAC/s a core). AVX2 and plain CPUs read Q8_0 as int8
    (pmaddubsw would saturate) and add 128 x the 4-sums back, so every CPU multiplies the
    same integers."""
    signed = bb == 34 and isa != "vnni"
    bias = {18: 8, 34: 128}.get(bb, 0)
    dw = _half_lanes(builder, gp, 0)
    if bb == 20:
        mw = _half_lanes(builder, gp, 32)
    elif bias:
        mw = builder.fmul(dw, ir.Constant(_VF16, [float(-bias)] * LANES), flags=_FUSE)  # exact
    chunks = _chunks(builder, gp, bb, isa)
    zero = ir.Constant(_VI16, [0] * LANES)
    # two partial sums per vector, the chunks emitted vector by vector: 2V chains of 4
    # dependent dots instead of V of 8 keep the dot ports busy (+25%; the same integers);
    # AVX2's int16 pair sums chain through one vpaddw, so one sum per vector is enough there
    nsum = 1 if isa == "avx2" and not signed else 2
    parts = [_PairDots(builder, isa, [zero] * len(recs), PAIR_CHUNKS["Q4"] // nsum, signed) for _ in range(nsum)]
    for c, (q, off) in enumerate(chunks):
        for j, rec in enumerate(recs):
            a4 = _splat(builder, _load(builder, rec, off, _I32), LANES)
            parts[c % nsum].add(j, q, builder.bitcast(a4, _VB64))
    for j in range(len(recs)):
        rec = recs[j]
        isum = parts[0].result(j) if nsum == 1 else builder.add(parts[0].result(j), parts[1].result(j))
        if signed:  # back to the unsigned quants' dot: + 128 x the block's activation sum
            total = _call(builder, "llvm.vector.reduce.add.v8i32", _I32,
                          [_load(builder, rec, 32, ir.VectorType(_I32, 8))])
            isum = builder.add(isum, _splat(builder, builder.mul(total, ir.Constant(_I32, 128)), LANES))
        da = _splat(builder, _load(builder, rec, 64, _F32), LANES)
        xa = builder.fmul(builder.sitofp(isum, _VF16), da, flags=_FUSE)
        total = _call(builder, "llvm.fmuladd.v16f32", _VF16, [xa, dw, builder.load(accs[j])])
        sa = _splat(builder, _load(builder, rec, 68, _F32), LANES)  # the activations' fp32 32-sum
        builder.store(_call(builder, "llvm.fmuladd.v16f32", _VF16, [mw, sa, total]), accs[j])


def _offset(builder: ir.IRBuilder, base: int, i: ir.Value, stride: int) -> ir.Value:
    """The byte offset base + i * stride of iteration i of `_repeat`."""
    return builder.add(_c64(base), builder.mul(i, _c64(stride)))


def _repeat(builder: ir.IRBuilder, n: int, body) -> None:
    """body(i) for i in range(n) as one runtime loop. Unrolled, a K-quant block at four vectors
    was ~3,000 AVX2 instructions, more than Zen 3's decoded-op cache holds; as a loop Q4_K
    batches ran 1.2-1.6x faster on AVX2 and on VNNI alike (docs/BENCHMARKS.md "Quantized GEMV")."""
    with cgutils.for_range(builder, _c64(n)) as loop:
        body(loop.index)


def _q4k_block(builder: ir.IRBuilder, gp: ir.Value, recs: list[ir.Value], accs: list[ir.Value], isa: str) -> None:
    """One Q4_K group block into the V accumulators: per sub-block j, the 16 rows' int32 dots
    with vector v's 32 activations, then acc += (isum * da_j) * (d sc_j) and
    acc += (dmin m_j) * (-sa_j) (sa_j: the activations' fp32 32-sum)."""
    d, dmin = _half_lanes(builder, gp, 0), _half_lanes(builder, gp, 32)
    vb16 = ir.VectorType(_I8, 16)
    # as in `_small_block`, two partial sums per vector up to four vectors; at eight, one:
    # eight chains are enough, and 8 quants + 16 sums + 8 accumulators spilled registers
    # (AVX2: one, as in `_small_block`)
    nsum = 2 if len(recs) <= 4 and isa != "avx2" else 1
    zero = ir.Constant(_VI16, [0] * LANES)
    at = partial(_offset, builder)

    def pair(p: ir.Value) -> None:
        for half in range(2):  # sub-block j = 2p + half
            _prefetch_part(builder, gp, GROUP_BYTES[148], at(half, p, 2), 8)
            sc = builder.fmul(builder.uitofp(_load(builder, gp, at(64 + 16 * half, p, 32), vb16), _VF16), d,
                              flags=_FUSE)
            mn = builder.fmul(builder.uitofp(_load(builder, gp, at(192 + 16 * half, p, 32), vb16), _VF16), dmin,
                              flags=_FUSE)
            parts = [_PairDots(builder, isa, [zero] * len(recs), PAIR_CHUNKS["Q4"] // nsum) for _ in range(nsum)]
            for c in range(8):
                q = _load(builder, gp, at(320 + 64 * c, p, 512), _VB64)  # loaded per half: fewer live registers
                q = builder.lshr(q, ir.Constant(_VB64, [4] * 64)) if half else builder.and_(q, ir.Constant(_VB64, [15] * 64))
                for v, rec in enumerate(recs):
                    a4 = _splat(builder, _load(builder, rec, at(32 * half + 4 * c, p, 64), _I32), LANES)
                    parts[c % nsum].add(v, q, builder.bitcast(a4, _VB64))
            for v, (rec, acc) in enumerate(zip(recs, accs)):
                isum = parts[0].result(v) if nsum == 1 else builder.add(parts[0].result(v), parts[1].result(v))
                da = _splat(builder, _load(builder, rec, at(512 + 4 * half, p, 8), _F32), LANES)
                nsa = _splat(builder, builder.fneg(_load(builder, rec, at(544 + 4 * half, p, 8), _F32)), LANES)
                xa = builder.fmul(builder.sitofp(isum, _VF16), da, flags=_FUSE)
                total = _call(builder, "llvm.fmuladd.v16f32", _VF16, [xa, sc, builder.load(acc)])
                builder.store(_call(builder, "llvm.fmuladd.v16f32", _VF16, [mn, nsa, total]), acc)

    _repeat(builder, 4, pair)


def _q4k_rows_avx2(builder: ir.IRBuilder, gp: ir.Value, recs: list[ir.Value], accs: list[ir.Value],
                   rows: int) -> None:
    """AVX2: rows 8 rows..8 rows + 7 of one Q4_K group block into the V `<8 x float>`
    accumulators, each row's arithmetic that of `_q4k_block` (the same integers, the same fp32
    operations in the same order: the same bits). Why by halves: `_q4k_block`'s 16 rows at
    four vectors keep ~27 ymm live (accumulators, int16 pairs, scales) on AVX2's 16, and about
    a third of its instructions were spills; eight rows keep ~14."""
    v8h, vb8 = ir.VectorType(ir.HalfType(), 8), ir.VectorType(_I8, 8)
    d = builder.fpext(_load(builder, gp, 16 * rows, v8h), _VF8)
    dmin = builder.fpext(_load(builder, gp, 32 + 16 * rows, v8h), _VF8)
    ones = ir.Constant(_VP16, [1] * 16)
    at = partial(_offset, builder)

    def pair(p: ir.Value) -> None:
        for half in range(2):  # sub-block j = 2p + half
            if rows == 0:  # the block's lines, asked for once
                _prefetch_part(builder, gp, GROUP_BYTES[148], at(half, p, 2), 8)
            sc = builder.fmul(builder.uitofp(_load(builder, gp, at(64 + 16 * half + 8 * rows, p, 32), vb8), _VF8), d,
                              flags=_FUSE)
            mn = builder.fmul(builder.uitofp(_load(builder, gp, at(192 + 16 * half + 8 * rows, p, 32), vb8), _VF8),
                              dmin, flags=_FUSE)
            pairs: list[ir.Value | None] = [None] * len(recs)
            for c in range(8):
                q = _load(builder, gp, at(320 + 64 * c + 32 * rows, p, 512), _VB32)
                q = builder.lshr(q, ir.Constant(_VB32, [4] * 32)) if half else builder.and_(q, ir.Constant(_VB32, [15] * 32))
                for v, rec in enumerate(recs):
                    a = builder.bitcast(_splat(builder, _load(builder, rec, at(32 * half + 4 * c, p, 64), _I32), 8), _VB32)
                    prod = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _VP16, [q, a])
                    pairs[v] = prod if pairs[v] is None else builder.add(pairs[v], prod)
            for v, (rec, acc) in enumerate(zip(recs, accs)):
                isum = _call(builder, "llvm.x86.avx2.pmadd.wd", _VI8, [pairs[v], ones])
                da = _splat(builder, _load(builder, rec, at(512 + 4 * half, p, 8), _F32), 8)
                nsa = _splat(builder, builder.fneg(_load(builder, rec, at(544 + 4 * half, p, 8), _F32)), 8)
                xa = builder.fmul(builder.sitofp(isum, _VF8), da, flags=_FUSE)
                total = _call(builder, "llvm.fmuladd.v8f32", _VF8, [xa, sc, builder.load(acc)])
                builder.store(_call(builder, "llvm.fmuladd.v8f32", _VF8, [mn, nsa, total]), acc)

    _repeat(builder, 4, pair)


def _opaque_zero(builder: ir.IRBuilder) -> ir.Value:
    """An i64 0 the optimizer cannot see through (an empty inline asm passing it on)."""
    i64 = ir.IntType(64)
    return builder.call(ir.InlineAsm(ir.FunctionType(i64, [i64]), "", "=r,0"), [ir.Constant(i64, 0)])


def _q6k_block(builder: ir.IRBuilder, gp: ir.Value, recs: list[ir.Value], accs: list[ir.Value], isa: str) -> None:
    """One Q6_K group block into the V accumulators: per 16-weight sub-block j (run k = j // 2
    of 32 activations), the 16 rows' int32 dots of the 6-bit quants, started from -32 x the
    16 activations' sum (the record's pooled 4-sum), then acc += (isum * d sc_j) * da_k.
    Each chunk of 4 quants of 16 rows is put together from a ql chunk's nibbles and a qh
    chunk's two bits: ql byte 32(k % 2) + l of half h holds weight 128h + 32k' + l's low
    nibble (k' = k % 4: low nibbles for k' < 2, high ones after), qh byte l its bits 2k'."""
    d = _half_lanes(builder, gp, 0)
    mask = ir.Constant(_VB64, [0x30] * 64)
    at = partial(_offset, builder)

    def run(h: ir.Value) -> None:  # the run of 128 weights h: sub-block k = 4h + kk
        for kk in range(4):
            _prefetch_part(builder, gp, GROUP_BYTES[210], at(kk, h, 4), 8)
            for half in range(2):
                dsc = builder.fmul(builder.sitofp(_load(builder, gp, at(32 + 16 * (2 * kk + half), h, 128),
                                                        ir.VectorType(_I8, 16)), _VF16), d,
                                   flags=_FUSE)  # exact: an fp16 times an int8
                dots = _PairDots(builder, isa, [_splat(builder, _load(builder, rec, at(256 + 32 * kk + 16 * half, h, 128),
                                                                      _I32), LANES) for rec in recs], PAIR_CHUNKS["Q6_K"])
                # the sub-block's chunks from an address LLVM cannot equate with another
                # sub-block's: it would keep one load for the four runs sharing a chunk and spill
                # what it unpacked early (163 spills a block at eight vectors)
                gq = builder.gep(gp, [_opaque_zero(builder)])
                for c4 in range(4 * half, 4 * half + 4):
                    ql = _load(builder, gq, at(288 + 64 * (8 * (kk % 2) + c4), h, 1024), _VB64)
                    qh = _load(builder, gq, at(2336 + 64 * c4, h, 512), _VB64)
                    low = builder.and_(ql, ir.Constant(_VB64, [15] * 64)) if kk < 2 else \
                        builder.lshr(ql, ir.Constant(_VB64, [4] * 64))
                    shift = 2 * kk  # qh bits shift, shift + 1 to bits 4-5
                    moved = builder.shl(qh, ir.Constant(_VB64, [4 - shift] * 64)) if shift < 4 else (
                        builder.lshr(qh, ir.Constant(_VB64, [shift - 4] * 64)) if shift > 4 else qh)
                    q = builder.or_(low, builder.and_(moved, mask))
                    for v, rec in enumerate(recs):
                        a4 = _splat(builder, _load(builder, rec, at(32 * kk + 4 * c4, h, 128), _I32), LANES)
                        dots.add(v, q, builder.bitcast(a4, _VB64))
                for v, (rec, acc) in enumerate(zip(recs, accs)):
                    xa = builder.fmul(builder.sitofp(dots.result(v), _VF16), dsc, flags=_FUSE)
                    da = _splat(builder, _load(builder, rec, at(512 + 4 * kk, h, 16), _F32), LANES)
                    builder.store(_call(builder, "llvm.fmuladd.v16f32", _VF16, [xa, da, builder.load(acc)]), acc)

    _repeat(builder, 2, run)


# Each block's loop prefetches the lines of the group block this many bytes ahead into L2.
# The hardware prefetcher alone left the memory bus idle while a block was computed: a
# 7B-shaped 4096 x 4096 matrix streamed from memory, 2 threads, Intel Xeon: Q4_0 one vector
# 0.46 -> 0.30 ms, eight 0.77 -> 0.45; Q6_K 0.57 -> 0.48 and 0.93 -> 0.74 (4-20 KiB ahead
# alike; docs/BENCHMARKS.md, "Quantized GEMV").
PREFETCH_BYTES = 8192


def _prefetch_lines(builder: ir.IRBuilder, p: ir.Value, nbytes: int) -> None:
    """prefetcht1 of the `nbytes` at p, a line at a time (a hint: no fault past the array)."""
    i8p, i32 = _I8.as_pointer(), ir.IntType(32)
    fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
    for off in range(0, nbytes, 64):  # read, locality 2 (L2), data
        builder.call(fn, [builder.gep(p, [_c64(off)]), ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])


def _prefetch_part(builder: ir.IRBuilder, gp: ir.Value, G: int, part: ir.Value, parts: int) -> None:
    """Prefetch part `part` of `parts` of the group block PREFETCH_BYTES ahead of gp (G bytes;
    one part: the whole block). In parts a long block's lines are asked for a few at a time as
    it is computed: a K-quant block's 37-53 lines at once left Q4_K reading 10 GB/s from memory
    on AVX2."""
    span = -(-G // parts)
    ahead = -(-PREFETCH_BYTES // G) * G
    _prefetch_lines(builder, builder.gep(gp, [_offset(builder, ahead, part, span)]), -(-span // 64) * 64)


def _lane_dots(bb: int, V: int, groups: int = 1):
    """An intrinsic (group, nb, acts, outs): for the 16 rows of the group block array at
    address `group` (nb group blocks of GROUP_BYTES[bb]) and V activation records (addresses
    `acts`, `block_ir.quantize_acts` for bb), adds the 16 dots of vector j to the 16 fp32 at
    outs[j]. With `groups` = 2, `group` is two such arrays' addresses and outs 2V addresses
    (the first array's V, then the second's): the two arrays' blocks alternate in one loop,
    each into its own accumulators, so each gets the one-array bits (why: `lanes.PAIRED`)."""
    G, isa = GROUP_BYTES[bb], _isa()

    @intrinsic
    def lane_dots(typingctx, group, nb, acts, outs):
        group_t = types.int64 if groups == 1 else types.UniTuple(types.int64, groups)
        sig = types.none(group_t, types.int64, types.UniTuple(types.int64, V), types.UniTuple(types.int64, V * groups))

        def codegen(context, builder, signature, args):
            group_v, nb_v, acts_t, outs_t = args
            i8p = _I8.as_pointer()
            gbases = [builder.inttoptr(group_v if groups == 1 else builder.extract_value(group_v, k), i8p)
                      for k in range(groups)]
            act_ptrs = [builder.inttoptr(builder.extract_value(acts_t, j), i8p) for j in range(V)]
            # `_q4k_rows_avx2` for a batch: (rows 0-7, rows 8-15) per vector (one vector does not spill)
            by_rows = isa == "avx2" and bb == 148 and V > 1
            accs = [[tuple(cgutils.alloca_once_value(builder, ir.Constant(_VF8, [0.0] * 8)) for _ in range(2))
                     if by_rows else cgutils.alloca_once_value(builder, ir.Constant(_VF16, [0.0] * LANES))
                     for _ in range(V)] for _ in range(groups)]
            with cgutils.for_range(builder, nb_v) as loop:
                b = loop.index
                recs = [builder.gep(ap, [builder.mul(b, _c64(576 if bb in (148, 210) else 72))]) for ap in act_ptrs]
                for gbase, group_accs in zip(gbases, accs):
                    gp = builder.gep(gbase, [builder.mul(b, _c64(G))])
                    if bb not in (148, 210):  # K-quant blocks prefetch in parts, as computed
                        _prefetch_part(builder, gp, G, _c64(0), 1)
                    if by_rows:  # two loops, so that LLVM cannot interleave the halves
                        for rows in range(2):
                            _q4k_rows_avx2(builder, gp, recs, [a[rows] for a in group_accs], rows)
                    elif bb == 148:
                        _q4k_block(builder, gp, recs, group_accs, isa)
                    elif bb == 210:
                        _q6k_block(builder, gp, recs, group_accs, isa)
                    else:
                        _small_block(builder, gp, recs, group_accs, bb, isa)
            for j, acc in enumerate(a for group_accs in accs for a in group_accs):
                out = builder.inttoptr(builder.extract_value(outs_t, j), i8p)
                for part, vt, off in (zip(acc, (_VF8, _VF8), (0, 32)) if by_rows else ((acc, _VF16, 0),)):
                    at = builder.bitcast(builder.gep(out, [_c64(off)]), vt.as_pointer())
                    builder.store(builder.fadd(builder.load(at, align=4), builder.load(part), flags=_FUSE), at, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return lane_dots


def _dispatch(V: int, groups: int = 1):
    """A numba function (bb, group, nb, acts, outs) running the V-vector lane dots of
    format bb (the array's last axis) over `groups` arrays: a chain of branches, each
    intrinsic compiled for its format alone."""
    d18, d20, d34, d148, d210 = (_lane_dots(bb, V, groups) for bb in LAST_AXIS)

    @njit(inline="always")
    def dots(bb, group, nb, acts, outs):
        if bb == 18:
            d18(group, nb, acts, outs)
        elif bb == 20:
            d20(group, nb, acts, outs)
        elif bb == 34:
            d34(group, nb, acts, outs)
        elif bb == 148:
            d148(group, nb, acts, outs)
        else:
            d210(group, nb, acts, outs)

    return dots


_dots1, _dots2, _dots4, _dots8 = _dispatch(1), _dispatch(2), _dispatch(4), _dispatch(8)

# The dots as C functions compiled once, which every kernel calls by symbol (ops/symbols.py):
# (bb, group, nb, acts, outs), the tuples as pointers to their V addresses.
_I64P = types.CPointer(types.int64)
_C_SIG = types.void(types.int64, types.int64, types.int64, _I64P, _I64P)

with compile_lock("lane_dots"):
    @cfunc(_C_SIG, cache=True)
    def _c_dots1(bb, group, nb, acts, outs):
        _dots1(bb, group, nb, (acts[0],), (outs[0],))

    @cfunc(_C_SIG, cache=True)
    def _c_dots2(bb, group, nb, acts, outs):
        _dots2(bb, group, nb, (acts[0], acts[1]), (outs[0], outs[1]))

    @cfunc(_C_SIG, cache=True)
    def _c_dots4(bb, group, nb, acts, outs):
        _dots4(bb, group, nb, (acts[0], acts[1], acts[2], acts[3]), (outs[0], outs[1], outs[2], outs[3]))

    @cfunc(_C_SIG, cache=True)
    def _c_dots8(bb, group, nb, acts, outs):
        _dots8(bb, group, nb, (acts[0], acts[1], acts[2], acts[3], acts[4], acts[5], acts[6], acts[7]),
               (outs[0], outs[1], outs[2], outs[3], outs[4], outs[5], outs[6], outs[7]))

for _v, _c in ((1, _c_dots1), (2, _c_dots2), (4, _c_dots4), (8, _c_dots8)):
    export(f"powerinfer_lane_dots{_v}", _c)
_call1, _call2, _call4, _call8 = (symbol_call(f"powerinfer_lane_dots{v}") for v in (1, 2, 4, 8))

# two groups at eight vectors spilled registers and ran slower than one at a time: not made
_pair2, _pair4 = _dispatch(2, 2), _dispatch(4, 2)
# (bb, groups, nb, acts, outs): the two arrays' addresses, V records, 2V outputs
_C_PAIR_SIG = types.void(types.int64, _I64P, types.int64, _I64P, _I64P)

with compile_lock("lane_pair_dots"):
    @cfunc(_C_PAIR_SIG, cache=True)
    def _c_pair2(bb, group, nb, acts, outs):
        _pair2(bb, (group[0], group[1]), nb, (acts[0], acts[1]), (outs[0], outs[1], outs[2], outs[3]))

    @cfunc(_C_PAIR_SIG, cache=True)
    def _c_pair4(bb, group, nb, acts, outs):
        _pair4(bb, (group[0], group[1]), nb, (acts[0], acts[1], acts[2], acts[3]),
               (outs[0], outs[1], outs[2], outs[3], outs[4], outs[5], outs[6], outs[7]))

for _v, _c in ((2, _c_pair2), (4, _c_pair4)):
    export(f"powerinfer_lane_pair_dots{_v}", _c)
_pcall2, _pcall4 = (symbol_call(f"powerinfer_lane_pair_dots{v}") for v in (2, 4))


@njit(inline="always")
def lane_dots1(bb, group, nb, acts, outs):
    """For the 16 rows of the group block array at address `group` (nb group blocks of format
    bb, the array's last axis) and the activation records at acts[0] (`block_ir.quantize_acts`
    for bb), adds the 16 dots to the 16 fp32 at outs[0]."""
    _call1((bb, group, nb, acts, outs))


@njit(inline="always")
def lane_dots2(bb, group, nb, acts, outs):
    """`lane_dots1` for two vectors: the dots with the records at acts[j] added at outs[j]."""
    _call2((bb, group, nb, acts, outs))


@njit(inline="always")
def lane_dots4(bb, group, nb, acts, outs):
    """`lane_dots1` for four vectors, each group block unpacked once for the four."""
    _call4((bb, group, nb, acts, outs))


@njit(inline="always")
def lane_dots8(bb, group, nb, acts, outs):
    """`lane_dots1` for eight vectors, each group block unpacked once for the eight."""
    _call8((bb, group, nb, acts, outs))


@njit(inline="always")
def lane_pair_dots2(bb, groups, nb, acts, outs):
    """`lane_dots2` over the two group block arrays at groups[0] and groups[1] (the same
    records), their blocks alternating: outs[0:2] the first array's, outs[2:4] the second's."""
    _pcall2((bb, groups, nb, acts, outs))


@njit(inline="always")
def lane_pair_dots4(bb, groups, nb, acts, outs):
    """`lane_pair_dots2` for four vectors (outs: the first array's four, then the second's)."""
    _pcall4((bb, groups, nb, acts, outs))
