"""A team of threads inside one numba parallel region, with spin barriers between phases.

Why hand-written: numba has no barrier inside a `prange`, so a kernel with phases that
depend on each other (a layer's QKV, attention, output projection, FFN) opens one parallel
region per phase. Each region costs a few microseconds to open and close (the gufunc call
and the OpenMP fork/join), and a SmolLM2 decode token opened ~150 of them. A team region
opens once per token: `prange(threads)` gives each thread one iteration (its rank), the
ranks split every phase's work among themselves and meet at `barrier` between phases.

A spin barrier deadlocks if two ranks run one after the other on the same thread (a
threading layer that does not give every iteration its own thread, or a region nested in
another). So ranks first `join` the team: rank 0 waits for the others to join and then says
go; if any rank waits too long it abandons the team, and rank 0 then does every rank's work
alone (`join` gives each rank the team's size: all, one, or none). Go and abandon are taken by compare-and-swap on one
word, so exactly one of them happens, and go is only said while every rank is running.
"""

from __future__ import annotations

import platform

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
_LINUX_X86_64 = platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")
if _LINUX_X86_64:
    llvm.initialize_native_asmparser()  # for the inline `syscall` (numba does not load it)
GO = 1 << 40  # state bits above the count of joined ranks
ABANDONED = 1 << 41
PAUSES = 1 << 12  # waits spent on `pause` before a waiting rank yields its core instead
SPINS = 1 << 19  # waits before a rank gives up waiting to join (0.1-0.3 s)
WORDS = 16  # int64s between the state word and the barrier counter (their own cache lines)


def _item_pointer(context, builder, arr_t, arr, idx):
    ary = context.make_array(arr_t)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arr_t, ary, [idx])


@intrinsic
def atomic_add(typingctx, arr, idx, val):
    """arr[idx] += val atomically (sequentially consistent); returns the old value."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, context.cast(builder, args[2], sig.args[2], types.int64), "seq_cst")

    return types.int64(arr, idx, val), codegen


@intrinsic
def atomic_load(typingctx, arr, idx):
    """arr[idx], read atomically with acquire ordering (later reads are not moved before it)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(arr, idx), codegen


@intrinsic
def compare_swap(typingctx, arr, idx, expected, new):
    """arr[idx] = new if it holds `expected` (atomically); True when it did."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1])
        res = builder.cmpxchg(ptr, args[2], args[3], "seq_cst", "seq_cst")
        return builder.extract_value(res, 1)

    return types.boolean(arr, idx, types.int64, types.int64), codegen


@intrinsic
def spin_pause(typingctx):
    """The x86 `pause` hint inside a spin loop (nothing elsewhere)."""

    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _sched_yield(typingctx):
    """sched_yield(2) as the raw x86-64 Linux system call (24), so the kernels that call it
    stay cacheable (a ctypes call would not); a `pause` elsewhere."""

    def codegen(context, builder, sig, args):
        if _LINUX_X86_64:
            fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64)])
            asm = ir.InlineAsm(fnty, "syscall", "={rax},{rax},~{rcx},~{r11},~{memory}", side_effect=True)
            builder.call(asm, [ir.Constant(ir.IntType(64), 24)])
        elif _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(inline="always")
def wait(spins):
    """One wait of a spinning rank: `pause` at first; after PAUSES waits, give the core away
    (when the machine runs more threads than cores, the rank we wait for may need it)."""
    if spins < PAUSES:
        spin_pause()
    else:
        _sched_yield()


def new_sync() -> np.ndarray:
    """The words one team region shares: state at 0, barrier count at WORDS (zeroed)."""
    return np.zeros(2 * WORDS, dtype=np.int64)


@njit(inline="always")
def join(sync, rank, size):
    """The team's size for this rank: `size` when every rank joined; when the team was
    abandoned, 1 for rank 0 (it works alone, as a team of one) and 0 for the others (they
    must do nothing)."""
    if size == 1:
        return 1
    if rank == 0:
        spins = 0
        while True:
            v = atomic_load(sync, 0)
            if v & ABANDONED:
                return 1
            if v == size - 1:
                if compare_swap(sync, 0, v, v | GO):
                    return size
                continue
            spins += 1
            if spins >= SPINS:
                if compare_swap(sync, 0, v, v | ABANDONED):
                    return 1
                continue
            wait(spins)
    while True:  # join, unless abandoned
        v = atomic_load(sync, 0)
        if v & ABANDONED:
            return 0
        if compare_swap(sync, 0, v, v + 1):
            break
    spins = 0
    while True:  # wait for go
        v = atomic_load(sync, 0)
        if v & GO:
            return size
        if v & ABANDONED:
            return 0
        spins += 1
        if spins >= SPINS and compare_swap(sync, 0, v, v | ABANDONED):
            return 0
        wait(spins)


@njit(inline="always")
def barrier(sync, passed, size):
    """Wait until all `size` ranks have reached their (passed + 1)-th barrier; returns the
    new count of barriers passed. Every rank must pass the same barriers in the same order."""
    if size > 1:
        atomic_add(sync, WORDS, 1)
        target = (passed + 1) * size
        spins = 0
        while atomic_load(sync, WORDS) < target:
            wait(spins)
            spins += 1
    return passed + 1


@njit(inline="always")
def share(n, rank, size):
    """This rank's [lo, hi) of n items: contiguous, sizes differing by at most one."""
    base, extra = n // size, n % size
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)
