"""bf16/fp16 -> fp32 conversion inside numba kernels.

numba has no float16/bfloat16 scalar type on CPU, so half weights are passed as uint16 and
widened in the kernel: bf16 is the top half of an fp32 (shift and bit-cast); fp16 uses
LLVM's `fpext half` (F16C on x86), exposed through a tiny intrinsic.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _fp16_bits_to_f32(typingctx, bits):
    if bits != types.uint16:
        return None
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return sig, codegen


@njit(inline="always", fastmath=True)
def bf16_to_f32(bits):
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@njit(inline="always", fastmath=True)
def fp16_to_f32(bits):
    return _fp16_bits_to_f32(bits)
