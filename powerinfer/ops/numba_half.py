"""Widening weights to fp32 inside numba kernels: one `widen(v)` for every weight dtype.

numba has no float16/bfloat16 scalar type on CPU, so half weights reach the kernels as
16-bit integer views and are widened there, with the weight dtype encoded in the view's
numpy dtype so that each kernel compiles one branch-free specialisation per dtype:

* float32 -> as is;
* uint16  -> bfloat16 bits: the top half of an fp32 (shift, bit-cast);
* int16   -> float16 bits: LLVM `fpext half` (F16C on x86), through a tiny intrinsic.

`narrow(v, like)` is the way back for the stores of an fp16 KV cache: v in the element
encoding of the array `like` (fp32 as is, int16 as fp16 bits, rounded to nearest even).
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import types
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
