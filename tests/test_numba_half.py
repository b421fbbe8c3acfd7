"""fp16 <-> fp32 inside numba kernels (ops/numba_half.py): the F16C instructions on the host,
and, for a compile target without F16C (NUMBA_CPU_NAME=generic), the two compiler-rt
conversions the JIT is given instead; both against numpy's own, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from powerinfer.ops import numba_half


def _all_halves() -> np.ndarray:
    return np.arange(-32768, 32768, dtype=np.int64).astype(np.int16)


def _floats_to_narrow() -> np.ndarray:
    """Every finite fp16 value, every midpoint between neighbours (ties to even), random
    floats over 15 decades, and the edges: overflow, the subnormals, signed zeros, inf."""
    halves = _all_halves().view(np.float16).astype(np.float32)
    finite = np.unique(halves[np.isfinite(halves)])
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    spread = rng.standard_normal(50000).astype(np.float32) * (10 ** rng.uniform(-9, 6, 50000)).astype(np.float32)
    edges = np.array([np.inf, -np.inf, 65504, 65519.99, 65520, 1e9, 1e-9, 6e-8, 3e-8, 2.9e-8, 0.0, -0.0], np.float32)
    return np.concatenate([finite, mids, spread, edges])


def test_the_integer_conversions_equal_numpy_s_bit_for_bit():
    """The fallbacks themselves (what __extendhfsf2 / __truncsfhf2 run): every fp16 value
    widened, and fp32 values narrowed with ties to even; NaNs stay NaNs."""
    halves = _all_halves()
    want = halves.view(np.float16).astype(np.float32).view(np.uint32)
    got = np.array([numba_half.half_to_float_bits(int(h) & 0xFFFF) for h in halves], dtype=np.uint32)
    nan = np.isnan(want.view(np.float32))
    assert np.array_equal(got[~nan], want[~nan]) and np.isnan(got[nan].view(np.float32)).all()
    floats = _floats_to_narrow()
    with np.errstate(over="ignore"):
        want16 = floats.astype(np.float16).view(np.uint16)
    got16 = np.array([numba_half.float_to_half_bits(int(b)) for b in floats.view(np.uint32)], dtype=np.uint16)
    assert np.array_equal(got16, want16)
    nan_bits = numba_half.float_to_half_bits(int(np.array([np.nan], np.float32).view(np.uint32)[0]))
    assert np.isnan(np.array([nan_bits], np.uint16).view(np.float16)[0])


_KERNELS = textwrap.dedent("""
    import numpy as np
    from numba import njit
    from powerinfer.ops import numba_half as nh

    @njit
    def widen_all(bits):
        out = np.empty(bits.size, np.float32)
        for i in range(bits.size):
            out[i] = nh.widen(bits[i])
        return out

    @njit
    def narrow_all(v, like):
        out = np.empty(v.size, np.int16)
        for i in range(v.size):
            out[i] = nh.narrow(v[i], like)
        return out

    halves = np.load("HALVES")
    floats = np.load("FLOATS")
    np.save("WIDENED", widen_all(halves))
    np.save("NARROWED", narrow_all(floats, np.zeros(1, np.int16)))
""")


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine not in ("x86_64", "AMD64"),
                    reason="the fallback is for x86-64 targets without F16C")
@pytest.mark.parametrize("cpu_name", ["host", "generic"])
def test_widen_and_narrow_in_a_kernel_on_a_target_with_or_without_f16c(tmp_path, cpu_name):
    """`widen` / `narrow` compiled for the host (F16C) and for NUMBA_CPU_NAME=generic (LLVM
    calls the conversions; they once aborted the process: "Symbol not found:
    __extendhfsf2"): the same bits as numpy's in both."""
    halves, floats = _all_halves(), _floats_to_narrow()
    paths = {k: tmp_path / f"{k.lower()}.npy" for k in ("HALVES", "FLOATS", "WIDENED", "NARROWED")}
    np.save(paths["HALVES"], halves)
    np.save(paths["FLOATS"], floats)
    script = _KERNELS
    for k, p in paths.items():
        script = script.replace(f'"{k}"', repr(str(p)))
    env = dict(os.environ, NUMBA_CPU_NAME=cpu_name, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    want = halves.view(np.float16).astype(np.float32)
    got = np.load(paths["WIDENED"])
    nan = np.isnan(want)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)) and np.isnan(got[nan]).all()
    with np.errstate(over="ignore"):
        assert np.array_equal(np.load(paths["NARROWED"]), floats.astype(np.float16).view(np.int16))
