"""Row dots of fp32 / bf16 / fp16 weights with fp32 activations, compiled once per weight
dtype and called by symbol from every kernel (ops/symbols.py says why: inlined, each kernel
and each of its callers compiled them again, a vectorized loop per row and dtype).

Weights are numpy views in `numba_half.numpy_weights` encoding (fp32, bf16 as uint16, fp16
as int16), widened to fp32 and accumulated in fp32; rows, activations and `dot8_prefetch`'s
index and output arrays must be contiguous (not checked: see `_stride`). The
kernels: `row_dot` (one row), `dot4` (four rows in one pass over x: four row streams, see
cpu.add_matvec), `dot8_prefetch` (eight rows, prefetching the rows to be read next; the
sparse kernels' blocks). For kernels compiled once for every weight dtype (sparse_cpu) the
same C functions and the AXPYs (`axpy8`, `axpy`, `axpy4`) and a gated neuron pair's dots
(`pair_dots`) are called as `*_by_code(dtype code, args)` on a `weight_ref`.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload

from .numba_half import widen
from .symbols import c_function, compile_lock

# dot8_prefetch reads its rows in spans of this many elements and, before each span,
# prefetches the same span of the rows to be read next. Measured (fp16 11008 x 4096, 10% of
# rows, 2 threads, interleaved with a torch.sum probe): 38.3 vs 32.2 GB/s in the bus's fast
# phases, 27.9 vs 22.0 in its slow ones. Spans (not the whole row) keep the prefetched lines
# in cache until they are read; the uint64 column index keeps LLVM from assuming signed
# wraparound and not vectorising the loop (6 GB/s).
SPAN = 256


def _prefetch_codegen(locality: int):
    def codegen(context, builder, signature, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], fnty)
        # read, the locality asked, data cache
        builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, 0), ir.Constant(i32, locality),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return codegen


@intrinsic
def prefetch_l3(typingctx, addr):
    """Software prefetch of the cache line at byte address `addr` into the outer caches (x86
    prefetcht2): the rows of the next block start streaming while this block is computed
    (locality 1: the rows being computed keep L1)."""
    if not isinstance(addr, types.Integer):
        return None
    return types.void(addr), _prefetch_codegen(1)


@intrinsic
def prefetch_l2(typingctx, addr):
    """`prefetch_l3` into L2 as well (x86 prefetcht1), for data read soon after."""
    if not isinstance(addr, types.Integer):
        return None
    return types.void(addr), _prefetch_codegen(2)


# -- the C functions: (weights, row stride in elements, ..., x, d[, ...], out) ------------------
def _row_dot_c(w, stride, r, x, d, out):
    acc = np.float32(0.0)
    base = r * stride
    for j in range(d):
        acc += widen(w[base + j]) * x[j]
    out[0] = acc


def _dot4_c(w, stride, rows, x, d, out):
    b0, b1, b2, b3 = rows[0] * stride, rows[1] * stride, rows[2] * stride, rows[3] * stride
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for j in range(d):
        xj = x[j]
        a0 += widen(w[b0 + j]) * xj
        a1 += widen(w[b1 + j]) * xj
        a2 += widen(w[b2 + j]) * xj
        a3 += widen(w[b3 + j]) * xj
    out[0], out[1], out[2], out[3] = a0, a1, a2, a3


def _dot8_c(w, stride, rows, x, d, out, pw, pw_row_bytes, pw_el, ahead, n_ahead):
    b0, b1, b2, b3 = rows[0] * stride, rows[1] * stride, rows[2] * stride, rows[3] * stride
    b4, b5, b6, b7 = rows[4] * stride, rows[5] * stride, rows[6] * stride, rows[7] * stride
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for jb in range(0, d, SPAN):
        n = min(SPAN, d - jb)
        _prefetch_rows(pw, pw_row_bytes, pw_el, ahead, n_ahead, jb, n)
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
        for jj in range(n):
            j = np.uint64(jb + jj)
            xj = x[j]
            s0 += widen(w[b0 + j]) * xj
            s1 += widen(w[b1 + j]) * xj
            s2 += widen(w[b2 + j]) * xj
            s3 += widen(w[b3 + j]) * xj
            s4 += widen(w[b4 + j]) * xj
            s5 += widen(w[b5 + j]) * xj
            s6 += widen(w[b6 + j]) * xj
            s7 += widen(w[b7 + j]) * xj
        a0 += s0
        a1 += s1
        a2 += s2
        a3 += s3
        a4 += s4
        a5 += s5
        a6 += s6
        a7 += s7
    out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7] = a0, a1, a2, a3, a4, a5, a6, a7


@njit(inline="always")
def _prefetch_rows(pw, pw_row_bytes, pw_el, ahead, n_ahead, jb, n):
    """Prefetch elements [jb, jb + n) of the rows ahead[0:n_ahead] of the matrix at byte
    address pw (rows pw_row_bytes apart, elements pw_el bytes)."""
    for i in range(n_ahead):
        start = pw + ahead[i] * pw_row_bytes + jb * pw_el
        for off in range(0, n * pw_el, 64):
            prefetch_l3(start + off)


def _axpy8_c(w, stride, rows, coefs, d, acc, pw, pw_row_bytes, pw_el, ahead, n_ahead):
    """acc[0:d] += sum_i coefs[i] * w[rows[i]] over eight rows, in spans of SPAN elements, each
    span of the rows `ahead` prefetched first (the sparse kernels' next block)."""
    b0, b1, b2, b3 = rows[0] * stride, rows[1] * stride, rows[2] * stride, rows[3] * stride
    b4, b5, b6, b7 = rows[4] * stride, rows[5] * stride, rows[6] * stride, rows[7] * stride
    s0, s1, s2, s3, s4, s5, s6, s7 = coefs[0], coefs[1], coefs[2], coefs[3], coefs[4], coefs[5], coefs[6], coefs[7]
    for jb in range(0, d, SPAN):
        n = min(SPAN, d - jb)
        _prefetch_rows(pw, pw_row_bytes, pw_el, ahead, n_ahead, jb, n)
        for jj in range(n):
            j = np.uint64(jb + jj)
            acc[j] += (s0 * widen(w[b0 + j]) + s1 * widen(w[b1 + j]) + s2 * widen(w[b2 + j])
                       + s3 * widen(w[b3 + j]) + s4 * widen(w[b4 + j]) + s5 * widen(w[b5 + j])
                       + s6 * widen(w[b6 + j]) + s7 * widen(w[b7 + j]))


def _axpy_c(w, stride, rows, coefs, n, d, acc):
    """acc[0:d] += sum_i coefs[i] * w[rows[i]] over n rows, one row at a time."""
    for i in range(n):
        b, s = rows[i] * stride, coefs[i]
        for j in range(d):
            acc[j] += s * widen(w[b + j])


def _axpy4_c(w, stride, rows, s0, s1, s2, s3, d, acc):
    """acc[0:d] += s0 * w[rows[0]] + ... + s3 * w[rows[3]] in one pass: four row streams."""
    b0, b1, b2, b3 = rows[0] * stride, rows[1] * stride, rows[2] * stride, rows[3] * stride
    for j in range(d):
        acc[j] += (s0 * widen(w[b0 + j]) + s1 * widen(w[b1 + j])) + (s2 * widen(w[b2 + j]) + s3 * widen(w[b3 + j]))


def _pair_dots_c(wg, wu, stride, rows, x, d, out):
    """(wg[r0] . x, wu[r0] . x, wg[r1] . x, wu[r1] . x) for rows (r0, r1) of two matrices of one
    dtype and row stride, in one pass over x: a gated FFN's two neurons, four row streams."""
    b0, b1 = rows[0] * stride, rows[1] * stride
    g0 = u0 = g1 = u1 = np.float32(0.0)
    for j in range(d):
        xj = x[j]
        g0 += widen(wg[b0 + j]) * xj
        u0 += widen(wu[b0 + j]) * xj
        g1 += widen(wg[b1 + j]) * xj
        u1 += widen(wu[b1 + j]) * xj
    out[0], out[1], out[2], out[3] = g0, u0, g1, u1


_WEIGHT_DTYPES = {"float32": types.float32, "uint16": types.uint16, "int16": types.int16}
WEIGHT_CODES = {name: code for code, name in enumerate(_WEIGHT_DTYPES)}  # a weight view's dtype as an integer
_I64, _I64P, _F32P = types.int64, types.CPointer(types.int64), types.CPointer(types.float32)
_F32 = types.float32
_CALLS: dict[tuple[str, str], object] = {}  # (kernel, weight dtype) -> its symbol call


def _build() -> None:
    for name, dt in _WEIGHT_DTYPES.items():
        wp = types.CPointer(dt)
        prefetch = (_I64, _I64, _I64, _I64P, _I64)  # the matrix read next, its row and element bytes, rows, count
        for kernel, body, sig, results in (
                ("row_dot", _row_dot_c, types.void(wp, _I64, _I64, _F32P, _I64, _F32P), 1),
                ("dot4", _dot4_c, types.void(wp, _I64, _I64P, _F32P, _I64, _F32P), 4),
                ("dot8", _dot8_c, types.void(wp, _I64, _I64P, _F32P, _I64, _F32P, *prefetch), 0),
                ("axpy8", _axpy8_c, types.void(wp, _I64, _I64P, _F32P, _I64, _F32P, *prefetch), 0),
                ("axpy", _axpy_c, types.void(wp, _I64, _I64P, _F32P, _I64, _I64, _F32P), 0),
                ("axpy4", _axpy4_c, types.void(wp, _I64, _I64P, _F32, _F32, _F32, _F32, _I64, _F32P), 0),
                ("pair_dots", _pair_dots_c, types.void(wp, wp, _I64, _I64P, _F32P, _I64, _F32P), 4)):
            _CALLS[kernel, name] = c_function(f"powerinfer_{kernel}_{name}", body, sig, results, fastmath=True)


with compile_lock("row_dots"):
    _build()


def _call_for(kernel: str, w):
    call = _CALLS.get((kernel, str(getattr(w, "dtype", ""))))
    if call is None or not isinstance(w, types.Array) or w.ndim != 2:
        raise TypingError(f"{kernel}: weights must be a 2-D fp32, uint16 (bf16) or int16 (fp16) array, not {w}")
    return call


# No checks in the wrappers below: a `raise` inside a prange body makes numba run the loop on
# one thread. The callers' weights are `numpy_weights` views and their activations C arrays
# (rows of them), contiguous in their last axis, which the C functions assume.
@njit(inline="always")
def _stride(w):
    return w.strides[0] // w.itemsize


@njit(inline="always")
def _vector(x):
    return x.ctypes.data


def row_dot(w, i, x):  # pragma: no cover - only its numba overload runs
    """w[i] . x with the row widened to fp32 (fp32 accumulation)."""
    raise NotImplementedError("row_dot() is for numba kernels")


@overload(row_dot, inline="always")
def _ol_row_dot(w, i, x):
    call = _call_for("row_dot", w)
    return lambda w, i, x: call((w.ctypes.data, _stride(w), i, _vector(x), w.shape[1]))[0]


def dot4(w, r0, r1, r2, r3, v):  # pragma: no cover - only its numba overload runs
    """(w[r0] . v, w[r1] . v, w[r2] . v, w[r3] . v), fp32 accumulation, in one pass over v."""
    raise NotImplementedError("dot4() is for numba kernels")


@overload(dot4, inline="always")
def _ol_dot4(w, r0, r1, r2, r3, v):
    call = _call_for("dot4", w)
    return lambda w, r0, r1, r2, r3, v: call((w.ctypes.data, _stride(w), (r0, r1, r2, r3), _vector(v), w.shape[1]))


def row_dot_at(w, r, x, t):  # pragma: no cover - only its numba overload runs
    """w[r] . x[t] for activations x (T, d), without taking the view x[t]."""
    raise NotImplementedError("row_dot_at() is for numba kernels")


@overload(row_dot_at, inline="always")
def _ol_row_dot_at(w, r, x, t):
    call = _call_for("row_dot", w)
    return lambda w, r, x, t: call((w.ctypes.data, _stride(w), r, _vector(x) + t * x.strides[0], x.shape[1]))[0]


def dot8_prefetch(w, rows, x, t, out, pw, ahead):  # pragma: no cover - only its numba overload runs
    """out[0:8] = W[rows[i]] . x[t] for eight rows (x (T, d)), while prefetching the rows
    `ahead` of matrix `pw` (the rows read next, eight or none)."""
    raise NotImplementedError("dot8_prefetch() is for numba kernels")


@overload(dot8_prefetch, inline="always")
def _ol_dot8_prefetch(w, rows, x, t, out, pw, ahead):
    call = _call_for("dot8", w)

    def impl(w, rows, x, t, out, pw, ahead):
        call((w.ctypes.data, _stride(w), rows.ctypes.data, _vector(x) + t * x.strides[0], x.shape[1], out.ctypes.data,
              pw.ctypes.data, pw.strides[0], pw.itemsize, ahead.ctypes.data, ahead.shape[0]))

    return impl


# -- the same C functions for kernels compiled once for every weight dtype -------------------
# A weight matrix as `weight_ref` gives it: (byte address, rows, columns, row stride in
# elements, dtype code). Kernels taking weights so compile once instead of once per dtype
# (the sparse kernels: ~60 s of compile per dtype on a cold cache); each call below picks the
# dtype's C function at run time, one branch per call of a row-long loop.
def weight_ref(w: np.ndarray) -> tuple[int, int, int, int, int]:
    """(address, rows, columns, row stride in elements, dtype code) of a 2-D weight view in
    `numpy_weights` encoding whose rows are contiguous. The caller keeps `w` alive while a
    kernel uses the reference."""
    if w.ndim != 2 or str(w.dtype) not in WEIGHT_CODES or (w.shape[1] > 1 and w.strides[1] != w.itemsize):
        raise TypeError(f"weights must be a 2-D fp32, uint16 (bf16) or int16 (fp16) array with contiguous rows, "
                        f"not {w.dtype} {w.shape} strides {w.strides}")
    return (w.ctypes.data, w.shape[0], w.shape[1], w.strides[0] // w.itemsize, WEIGHT_CODES[str(w.dtype)])


def array_ref(w):  # pragma: no cover - only its numba overload runs
    """`weight_ref` inside numba kernels: the same tuple, all int64, from a 2-D weight view."""
    raise NotImplementedError("array_ref() is for numba kernels")


@overload(array_ref, inline="always")
def _ol_array_ref(w):
    if not isinstance(w, types.Array) or w.ndim != 2 or str(w.dtype) not in WEIGHT_CODES:
        raise TypingError(f"array_ref: weights must be a 2-D fp32, uint16 (bf16) or int16 (fp16) array, not {w}")
    code = WEIGHT_CODES[str(w.dtype)]
    # int64 casts: a literal code or the uintp address would make the tuple's type differ by dtype
    return lambda w: (np.int64(w.ctypes.data), np.int64(w.shape[0]), np.int64(w.shape[1]),
                      np.int64(w.strides[0] // w.itemsize), np.int64(code))


def _by_code(kernel: str):
    """A function f(code, args) that numba kernels call: the C function `kernel` of the weight
    dtype `code` (WEIGHT_CODES) with the tuple args, as its symbol call takes them."""
    def by_code(code, args):  # pragma: no cover - only its numba overload runs
        raise NotImplementedError(f"{kernel} by code is for numba kernels")

    f32, bf16, f16 = (_CALLS[kernel, name] for name in _WEIGHT_DTYPES)

    @overload(by_code, inline="always")
    def _ol(code, args):
        def impl(code, args):
            if code == 0:
                return f32(args)
            if code == 1:
                return bf16(args)
            return f16(args)
        return impl

    by_code.__name__ = f"{kernel}_by_code"
    return by_code


row_dot_by_code = _by_code("row_dot")
dot4_by_code = _by_code("dot4")
dot8_by_code = _by_code("dot8")
axpy8_by_code = _by_code("axpy8")
axpy_by_code = _by_code("axpy")
axpy4_by_code = _by_code("axpy4")
pair_dots_by_code = _by_code("pair_dots")
