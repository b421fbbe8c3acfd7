"""A team of threads inside one numba parallel region, working through dependent phases.

Why hand-written: numba has no barrier inside a `prange`, so a kernel with phases that
depend on each other (a layer's QKV, attention, output projection, FFN) opens one parallel
region per phase. Each region costs a few microseconds to open and close (the gufunc call
and the OpenMP fork/join), and a SmolLM2 decode token opened ~150 of them. A team region
opens once per token: `prange(threads)` gives each thread one iteration (a rank). Each phase
is cut into one share per rank; a rank claims its own share (`claim`), does it, counts it
done, and waits for the phase's other shares (`next_share`), taking over any share still
unclaimed after a short wait (its rank is late: descheduled by another program, or the
server's HTTP thread), before the next phase uses the output.

No rank ever waits for another rank to arrive, only for shares another rank has claimed, so
a descheduled rank holds a token up only while it holds a share, and ranks that run one
after another on one thread (a threading layer that does not give each iteration its own
thread) cannot deadlock: the first does every share. A rank that waits long sleeps on a
futex until the phase's last share is done.

A rank that comes late to a phase whose shares are all claimed skips it (`taken`); work each
rank repeats for itself (a norm, the activations' records) is only used for a share it then
claims, and a share is only there to claim while the phase's inputs are complete and not yet
overwritten by a later phase.
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
PAUSES = 1 << 10  # waits spent on `pause` (20-50 us) before a waiting rank sleeps or yields
GEN, SLEEPERS, TIMEOUT = 0, 1, 2  # sync words: wake-up generation, sleepers, a sleep's timespec
PHASES = 8  # phase p's words: claimed shares (a bit per rank) at PHASES + 2p, shares done at +1
STEAL_AFTER = 64  # waits before a waiting rank looks for an unclaimed share to take over
MAX_RANKS = 62  # shares are bits of one int64
SLEEP_NS = 1_000_000  # a sleeping rank's longest sleep (a wake-up is never missed; a guard)
_FUTEX_WAIT, _FUTEX_WAKE = 128, 129  # FUTEX_WAIT / FUTEX_WAKE | FUTEX_PRIVATE_FLAG


def _item_pointer(context, builder, arr_t, arr, idx):
    ary = context.make_array(arr_t)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arr_t, ary, [idx])


def _is_words(arr) -> bool:
    """Typing time: the 1-D int64 array the team's words live in."""
    return isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1


def _pause(builder) -> None:
    """Emit the x86 `pause` hint (nothing on other targets)."""
    if _X86:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
        builder.call(fn, [])


def _atomic_rmw(op: str, doc: str):
    """An intrinsic (arr, idx, val) -> old arr[idx], with arr[idx] = arr[idx] `op` val done
    atomically (sequentially consistent)."""

    @intrinsic
    def rmw(typingctx, arr, idx, val):
        if not _is_words(arr):
            return None

        def codegen(context, builder, sig, args):
            ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1])
            return builder.atomic_rmw(op, ptr, context.cast(builder, args[2], sig.args[2], types.int64), "seq_cst")

        return types.int64(arr, idx, val), codegen

    rmw.__doc__ = doc
    return rmw


atomic_add = _atomic_rmw("add", "arr[idx] += val atomically (sequentially consistent); returns the old value.")
atomic_or = _atomic_rmw("or", "arr[idx] |= val atomically (sequentially consistent); returns the old value.")


@intrinsic
def atomic_load(typingctx, arr, idx):
    """arr[idx], read atomically with acquire ordering (later reads are not moved before it)."""
    if not _is_words(arr):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(arr, idx), codegen


@intrinsic
def spin_pause(typingctx):
    """The x86 `pause` hint inside a spin loop (nothing elsewhere)."""

    def codegen(context, builder, sig, args):
        _pause(builder)
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
        else:
            _pause(builder)
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _futex(typingctx, arr, idx, op, val, timeout_idx):
    """futex(2) on the low 32 bits of arr[idx] (FUTEX_WAIT with the timespec at
    arr[timeout_idx], or FUTEX_WAKE of `val` waiters), as the raw x86-64 Linux system call
    (202); a `pause` elsewhere (there the waiting ranks yield instead of sleeping)."""
    if not _is_words(arr):
        return None

    def codegen(context, builder, sig, args):
        if _LINUX_X86_64:
            i64 = ir.IntType(64)
            word = builder.ptrtoint(_item_pointer(context, builder, sig.args[0], args[0], args[1]), i64)
            ts = builder.ptrtoint(_item_pointer(context, builder, sig.args[0], args[0], args[4]), i64)
            fnty = ir.FunctionType(i64, [i64] * 5)
            asm = ir.InlineAsm(fnty, "syscall", "={rax},{rax},{rdi},{rsi},{rdx},{r10},~{rcx},~{r11},~{memory}",
                               side_effect=True)
            op = context.cast(builder, args[2], sig.args[2], types.int64)
            val = context.cast(builder, args[3], sig.args[3], types.int64)
            builder.call(asm, [ir.Constant(i64, 202), word, op, val, ts])
        else:
            _pause(builder)
        return context.get_dummy_value()

    return types.void(arr, idx, op, val, timeout_idx), codegen


@njit(inline="always")
def new_sync(phases):
    """The words one team region shares (zeroed counters; see the constants above)."""
    sync = np.zeros(PHASES + 2 * phases, dtype=np.int64)
    sync[TIMEOUT + 1] = SLEEP_NS
    return sync


@njit(inline="always")
def taken(sync, phase, size):
    """Whether every share of the phase has been claimed (a late rank skips the phase)."""
    return atomic_load(sync, PHASES + 2 * phase) == (1 << size) - 1


@njit(inline="always")
def claim(sync, phase, share):
    """Claim a share of the phase; True when this rank got it (nobody had)."""
    bit = 1 << share
    return (atomic_or(sync, PHASES + 2 * phase, bit) & bit) == 0


@njit(inline="always")
def finish(sync, phase, size):
    """Count one share of the phase done; the rank that completes the phase wakes any
    sleeping ranks."""
    if atomic_add(sync, PHASES + 2 * phase + 1, 1) + 1 == size:
        atomic_add(sync, GEN, 1)
        if atomic_load(sync, SLEEPERS) > 0:
            _futex(sync, GEN, _FUTEX_WAKE, 1 << 30, TIMEOUT)


@njit(inline="always")
def _sleep_or_yield(sync, word, size):
    if _LINUX_X86_64:
        # sleep until the generation moves; a rank that reads the old generation after the
        # phase's last share sees the count complete first (all seq_cst)
        atomic_add(sync, SLEEPERS, 1)
        gen = atomic_load(sync, GEN)
        if atomic_load(sync, word) < size:
            _futex(sync, GEN, _FUTEX_WAIT, gen & 0xFFFFFFFF, TIMEOUT)
        atomic_add(sync, SLEEPERS, -1)
    else:
        _sched_yield()


@njit(inline="always")
def next_share(sync, phase, size):
    """Wait for the phase's shares to be done: -1 when they are, or the index of a share
    that was still unclaimed after STEAL_AFTER waits, now claimed by this rank (do it, count
    it done, and call again)."""
    word = PHASES + 2 * phase + 1
    spins = 0
    while atomic_load(sync, word) < size:
        if spins >= STEAL_AFTER and not taken(sync, phase, size):
            for r in range(size):
                if claim(sync, phase, r):
                    return r
        if spins < PAUSES:
            spin_pause()
        else:
            _sleep_or_yield(sync, word, size)
        spins += 1
    return -1


@njit(inline="always")
def first_share(sync, phase, rank, size):
    """This rank's own share of the phase if it can claim it, else whatever `next_share` gives."""
    return rank if claim(sync, phase, rank) else next_share(sync, phase, size)


@njit(inline="always")
def await_phase(sync, phase, size):
    """Wait until every share of the phase is done (its output complete), without taking
    any over (a rank that skipped the phase: all its shares were claimed)."""
    word = PHASES + 2 * phase + 1
    spins = 0
    while atomic_load(sync, word) < size:
        if spins < PAUSES:
            spin_pause()
        else:
            _sleep_or_yield(sync, word, size)
        spins += 1


@njit(inline="always")
def share(n, r, size):
    """Share r's [lo, hi) of n items: contiguous, sizes differing by at most one."""
    base, extra = n // size, n % size
    lo = r * base + min(r, extra)
    return lo, lo + base + (1 if r < extra else 0)
