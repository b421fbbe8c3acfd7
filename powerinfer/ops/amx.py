"""Intel AMX tiles for the lane dots: whether this process may use them, and the LLVM IR of
the few tile instructions `lane_ir` emits.

Hand-written because no library gives numba tile instructions. AMX-INT8 multiplies a tile of
up to 16 x 64 int8 by another and adds into 16 x 16 int32 in one instruction; a batch of
vectors against 16 rows of a block is one such product, where AVX-512 VNNI needs eight
vpdpbusd per vector. Linux hands the tile registers to a process only after it asks
(arch_prctl ARCH_REQ_XCOMP_PERM); where the CPU lacks AMX, the kernel cannot save the tiles,
or the request fails, `usable()` is False and the VNNI code runs.
"""

from __future__ import annotations

import ctypes
import functools
import platform

from llvmlite import ir
from numba.core import cgutils, config

_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86-64

_I8, _I64 = ir.IntType(8), ir.IntType(64)
_P = _I8.as_pointer()
_VOID = ir.VoidType()


def _target_has_amx() -> bool:
    """Whether numba's compile target has AMX-INT8 (NUMBA_CPU_FEATURES when set, else the host)."""
    import llvmlite.binding as llvm

    if config.CPU_FEATURES:
        feats = {f[1:] for f in config.CPU_FEATURES.split(",") if f.startswith("+")}
    elif config.CPU_NAME in (None, "host"):
        feats = {k for k, v in llvm.get_host_cpu_features().items() if v}
    else:
        return False
    return {"amx-tile", "amx-int8"} <= feats


@functools.cache
def usable() -> bool:
    """True when the compile target has AMX-INT8 and Linux granted this process the tile data
    state (asked once; the grant covers every thread of the process)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64") or not _target_has_amx():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def tile_config(shapes: dict[int, tuple[int, int]]) -> ir.Constant:
    """The 64-byte ldtilecfg operand (palette 1) giving tile t `rows` rows of `colsb` bytes
    for each t: (rows, colsb) in shapes."""
    cfg = bytearray(64)
    cfg[0] = 1
    for t, (rows, colsb) in shapes.items():
        cfg[16 + 2 * t:18 + 2 * t] = colsb.to_bytes(2, "little")
        cfg[48 + t] = rows
    return ir.Constant(ir.ArrayType(_I8, 64), bytearray(cfg))


def _void_call(builder: ir.IRBuilder, name: str, args: list[ir.Value]) -> None:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VOID, [a.type for a in args]), name)
    builder.call(fn, args)


def _tile(t: int) -> ir.Constant:
    return ir.Constant(_I8, t)


def load_config(builder: ir.IRBuilder, cfg: ir.Constant) -> None:
    """ldtilecfg from a stack copy of `tile_config`'s bytes."""
    slot = cgutils.alloca_once(builder, cfg.type)
    builder.store(cfg, slot)
    _void_call(builder, "llvm.x86.ldtilecfg", [builder.bitcast(slot, _P)])


def release(builder: ir.IRBuilder) -> None:
    """tilerelease: the tiles back to their init state (cheaper context switches)."""
    _void_call(builder, "llvm.x86.tilerelease", [])


def load(builder: ir.IRBuilder, t: int, base: ir.Value, stride: ir.Value) -> None:
    """tileloadd: tile t's rows from base, base + stride, ..."""
    _void_call(builder, "llvm.x86.tileloadd64", [_tile(t), builder.bitcast(base, _P), stride])


def store(builder: ir.IRBuilder, t: int, base: ir.Value, stride: int) -> None:
    """tilestored: tile t's rows to base, base + stride, ..."""
    _void_call(builder, "llvm.x86.tilestored64", [_tile(t), builder.bitcast(base, _P), ir.Constant(_I64, stride)])


def zero(builder: ir.IRBuilder, t: int) -> None:
    _void_call(builder, "llvm.x86.tilezero", [_tile(t)])


def dot_signed_unsigned(builder: ir.IRBuilder, c: int, a: int, b: int) -> None:
    """tdpbsud: C[m][n] += sum over k of A[m][4k..4k+3] (int8) x B[k][4n..4n+3] (uint8), int32."""
    _void_call(builder, "llvm.x86.tdpbsud", [_tile(c), _tile(a), _tile(b)])
