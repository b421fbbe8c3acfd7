"""Widening weights to fp32 inside numba kernels: one `widen(v)` for every weight dtype.

numba has no float16/bfloat16 scalar type on CPU, so half weights reach the kernels as
16-bit integer views and are widened there, with the weight dtype encoded in the view's
numpy dtype so that each kernel compiles one branch-free specialisation per dtype:

* float32 -> as is;
* uint16  -> bfloat16 bits: the top half of an fp32 (shift, bit-cast);
* int16   -> float16 bits: LLVM `fpext half` (F16C on x86), through a tiny intrinsic.

`narrow(v, like)` is the way back for the stores of an fp16 KV cache: v in the element
encoding of the array `like` (fp32 as is, int16 as fp16 bits, rounded to nearest even).

A compile target without F16C (NUMBA_CPU_NAME=generic, for a cache shared between machines)
turns `fpext half` / `fptrunc ... to half` into calls of compiler-rt's `__extendhfsf2` and
`__truncsfhf2`, which numba's JIT does not have: LLVM aborted the process. For such targets
`provide_half_libcalls` gives the JIT both, written here with integer operations (ops/
__init__.py calls it before any kernel compiles).
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import cfunc, njit, types
from numba.extending import intrinsic, overload


@intrinsic
def _fp16_bits_to_f32(typingctx, bits):
    if bits != types.int16:
        return None
    sig = types.float32(types.int16)

    def codegen(context, builder, signature, args):
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return sig, codegen


@intrinsic
def _f32_to_fp16_bits(typingctx, v):
    if v != types.float32:
        return None
    sig = types.int16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@njit(cache=True)
def half_to_float_bits(h: int) -> int:
    """fp16 bits (the low 16 of h) -> fp32 bits, exactly as F16C's vcvtph2ps (a signalling
    NaN comes back quiet), with integer operations only."""
    h &= 0xFFFF
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        if m == 0:
            return sign
        s = 0
        while m & 0x400 == 0:  # a subnormal: normalize
            m <<= 1
            s += 1
        return sign | ((113 - s) << 23) | ((m & 0x3FF) << 13)
    if e == 31:
        return sign | 0x7F800000 | (m << 13) | (0x400000 if m != 0 else 0)
    return sign | ((e + 112) << 23) | (m << 13)


@njit(cache=True)
def float_to_half_bits(f: int) -> int:
    """fp32 bits -> fp16 bits rounded to nearest even, as vcvtps2ph (numpy's
    npy_floatbits_to_halfbits, NaNs made quiet), with integer operations only."""
    f &= 0xFFFFFFFF
    sign = (f & 0x80000000) >> 16
    f_exp = f & 0x7F800000
    if f_exp >= 0x47800000:  # too large for fp16, an infinity or a NaN
        if f_exp == 0x7F800000 and f & 0x7FFFFF != 0:
            return sign | 0x7E00 | ((f & 0x7FFFFF) >> 13)
        return sign | 0x7C00
    if f_exp <= 0x38000000:  # an fp16 subnormal, or zero
        if f_exp < 0x33000000:
            return sign
        e = f_exp >> 23
        sig = (0x800000 + (f & 0x7FFFFF)) >> (113 - e)
        if (sig & 0x3FFF) != 0x1000 or (f & 0x7FF) != 0:
            sig += 0x1000
        return sign | (sig >> 13)
    sig = f & 0x7FFFFF
    if (sig & 0x3FFF) != 0x1000:
        sig += 0x1000
    return sign | ((((f_exp - 0x38000000) >> 13) + (sig >> 13)) & 0xFFFF)


def _extendhfsf2(h):
    return np.uint32(half_to_float_bits(np.int64(np.float32(h).view(np.uint32)))).view(np.float32)


def _truncsfhf2(v):
    return np.uint32(float_to_half_bits(np.int64(np.float32(v).view(np.uint32)))).view(np.float32)


_LIBCALLS: list = []  # the compiled C functions, kept alive while the JIT may call them


def provide_half_libcalls() -> None:
    """Give numba's JIT compiler-rt's two fp16 conversions (see the module docstring). Their
    x86-64 convention (LLVM 15 on) passes the half in the low 16 bits of xmm0, where an fp32
    argument or result goes, so an fp32 -> fp32 C function serves both ways."""
    import llvmlite.binding as llvm

    if _LIBCALLS:
        return
    for name, fn in (("__extendhfsf2", _extendhfsf2), ("__truncsfhf2", _truncsfhf2)):
        compiled = cfunc(types.float32(types.float32), cache=True)(fn)
        llvm.add_symbol(name, compiled.address)
        _LIBCALLS.append(compiled)



def narrow(v, like):  # pragma: no cover - only its numba overload runs
    raise NotImplementedError("narrow() is for numba kernels")


@overload(narrow, inline="always", fastmath=True)
def _narrow(v, like):
    if not isinstance(like, types.Array):
        return None
    if isinstance(like.dtype, types.Float):
        return lambda v, like: np.float32(v)
    if like.dtype == types.int16:
        return lambda v, like: _f32_to_fp16_bits(np.float32(v))
    return None


def widen(v):  # pragma: no cover - only its numba overload runs
    raise NotImplementedError("widen() is for numba kernels")


@overload(widen, inline="always", fastmath=True)
def _widen(v):
    if isinstance(v, types.Float):
        return lambda v: np.float32(v)
    if v == types.uint16:
        return lambda v: np.uint32(np.uint32(v) << np.uint32(16)).view(np.float32)
    if v == types.int16:
        return lambda v: _fp16_bits_to_f32(v)
    return None


def numpy_weights(weight: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a CPU weight tensor in the encoding `widen` expects."""
    weight = weight.detach()
    if weight.dtype == torch.bfloat16:
        return weight.view(torch.int16).numpy().view(np.uint16)
    if weight.dtype == torch.float16:
        return weight.view(torch.int16).numpy()
    if weight.dtype == torch.float32:
        return weight.numpy()
    raise TypeError(f"unsupported weight dtype {weight.dtype}")
