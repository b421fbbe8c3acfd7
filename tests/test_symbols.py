"""Kernels called by symbol (ops/symbols.py) and compiles serialized across processes
(ops/kernel_cache.py `serialize_compiles`)."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import sys
import textwrap
from pathlib import Path

import numpy as np
from numba import cfunc, njit, types

from powerinfer.ops.symbols import export, symbol_call

_SIG = types.void(types.int64, types.CPointer(types.int64), types.CPointer(types.float32))


@cfunc(_SIG)
def _affine(k, items, out):
    out[0] = k * items[0] + items[1]
    out[1] = items[2]


export("powerinfer_test_affine", _affine)
_call_affine = symbol_call("powerinfer_test_affine", 2)


@njit
def _run(k, a, b, c):
    return _call_affine((k, (a, b, c)))


def test_a_symbol_call_passes_integers_tuples_and_results():
    assert _run(3, 4, 5, 6) == (17.0, 6.0)
    # narrower integers are widened to int64 on the way (a tuple of mixed widths is no UniTuple:
    # one width per tuple)
    assert _run(np.int32(-2), np.int16(7), np.int16(1), np.int16(-9)) == (-13.0, -9.0)


_SLOW_MODULE = textwrap.dedent('''
    from numba import njit

    @njit(cache=True)
    def slow(x):
        t = 0.0
        for i in range(10):
            t += x * i
        for i in range(20):
            t -= x / (i + 1)
        for i in range(30):
            t *= 1.0 + x * i
        return t
''')


def _compile_after(folder: str, barrier, results) -> None:
    sys.path.insert(0, folder)
    importlib.import_module("powerinfer.ops")  # installs the compile lock
    import slowmod

    barrier.wait()
    slowmod.slow(1.0)
    results.put(sum(slowmod.slow.stats.cache_misses.values()))


def test_two_processes_compile_a_cached_kernel_once(tmp_path: Path):
    """Both processes ask for the same kernel at the same moment; one compiles it, the
    other waits for the lock and loads it from the cache."""
    (tmp_path / "slowmod.py").write_text(_SLOW_MODULE)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_compile_after, args=(str(tmp_path), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    misses = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(misses) == [0, 1]
