"""Q6_K prefill on unpacked 16-row tiles (ops/q6k_tiles.py): against the reference twin on
odd shapes (rows past a tile, tokens past the eight- and four-token steps), 1 and 2 threads,
every CPU kind; `quant.matmul` takes it from Q6K_TILE_TOKENS tokens."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from powerinfer.ops import block_ir, q6k_tiles, quant

from test_quant import acts, quantized


@pytest.mark.parametrize("rows,cols,tokens", [(16, 256, 8), (37, 512, 13), (5, 768, 1), (70, 1024, 23)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_matches_the_reference(rows, cols, tokens, threads):
    t = quantized(rows, cols, "Q6_K", seed=rows)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    numba.set_num_threads(threads)
    try:
        got = q6k_tiles.matmul(t, x)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    want = acts(x) @ quant.dequantize(t).T
    torch.testing.assert_close(got, want, atol=2e-4 * want.abs().max().item(), rtol=1e-5)
    # the row kernel (the GEMV's dots) agrees to float rounding: the integers are the same
    torch.testing.assert_close(got, quant._matmul_rows(t, x), atol=1e-5 * want.abs().max().item(), rtol=1e-6)


def test_quant_matmul_takes_tiles_for_a_prompt(monkeypatch):
    t = quantized(20, 512, "Q6_K", seed=2)
    calls = []
    real = q6k_tiles.matmul
    monkeypatch.setattr(q6k_tiles, "matmul", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    for T in (1, 4, quant.Q6K_TILE_TOKENS - 1, quant.Q6K_TILE_TOKENS, 40):
        quant.matmul(t, torch.randn(T, 512))
    assert calls == [quant.Q6K_TILE_TOKENS, 40]


def test_integer_dots_of_every_cpu_kind_give_the_same_bits(monkeypatch):
    """AVX-512 VNNI, AVX2 only, neither: the same integers, the same float steps."""
    from numba import njit

    t = quantized(16, 512, "Q6_K", seed=4)
    w = t.numpy()
    x = np.random.default_rng(3).standard_normal((1, 512)).astype(np.float32)
    QA = block_ir.quantize_acts_rows(x, 210)
    S = q6k_tiles._starts(QA, 512)
    qn, q = np.empty((16, 512), np.uint8), np.empty(512 * 16, np.uint8)
    sc, d = np.empty(32 * 16, np.int32), np.empty(2 * 16, np.float32)
    q6k_tiles._unpack(w, 0, qn, q, sc, d)
    results = {}
    for isa in ("vnni", "avx2", "generic"):
        if isa == "vnni" and block_ir._isa() != "vnni":
            continue
        monkeypatch.setattr(q6k_tiles, "_isa", lambda isa=isa: isa)
        dots = q6k_tiles._tile_dots(1)

        @njit
        def run(q, sc, d, QA, S, out):
            dots(q.ctypes.data, sc.ctypes.data, d.ctypes.data, 2, (QA.ctypes.data,), (S.ctypes.data,),
                 (out.ctypes.data,))

        out = np.zeros(16, dtype=np.float32)
        run(q, sc, d, QA, S, out)
        results[isa] = out
        asm = run.inspect_asm(run.signatures[0])
        assert ("vpdpbusd" in asm, "pmaddubsw" in asm) == (isa == "vnni", isa == "avx2"), isa
    for isa, out in results.items():
        assert np.array_equal(out, results["generic"]), isa
    want = (acts(torch.from_numpy(x)) @ quant.dequantize(t).T)[0]
    torch.testing.assert_close(torch.from_numpy(results["generic"]), want, atol=2e-4 * want.abs().max().item(), rtol=1e-5)
