"""A row's blocks re-laid one block per vector lane (ops/block_lanes.py): the layout keeps
every byte and row, and the dots equal the reference twin (dequantize, then fp32 on the
int8-rounded activations) on every format, CPU kind and thread count."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from numba import njit

from powerinfer.ops import block_ir, block_lanes, quant, reference

from test_quant import acts, quantized


@pytest.mark.parametrize("fmt", block_lanes.FORMATS)
def test_relay_round_trips_and_keeps_each_row_in_place(fmt):
    t = quantized(5, 1024, fmt, seed=1)
    r = block_lanes.relay(t)
    assert r.shape == t.shape and r.dtype == torch.uint8
    assert torch.equal(block_lanes.restore(r), t)
    for i in range(5):  # a row's bytes stay in its own row: rows can still be picked by index
        assert torch.equal(block_lanes.relay(t[i:i + 1])[0], r[i])
    torch.testing.assert_close(block_lanes.dequantize(r), quant.dequantize(t), rtol=0, atol=0)


def test_only_its_formats_and_whole_groups_fit():
    assert block_lanes.fits(quantized(3, 512, "Q4_0"))
    assert not block_lanes.fits(quantized(3, 576, "Q4_0"))  # 18 blocks: not whole groups of 16
    assert not block_lanes.fits(quantized(3, 512, "Q4_K"))
    assert not block_lanes.fits(quantized(3, 512, "Q6_K"))


@pytest.mark.parametrize("fmt", block_lanes.FORMATS)
@pytest.mark.parametrize("rows,cols", [(1, 512), (7, 1536), (37, 4096)])
@pytest.mark.parametrize("threads", [1, 2])
def test_dots_and_matmul_match_the_reference(fmt, rows, cols, threads):
    t = quantized(rows, cols, fmt, seed=rows)
    w = block_lanes.relay(t).numpy()
    bb = int(t.shape[2])
    X = torch.randn(11, cols, generator=torch.Generator().manual_seed(2))
    expect = acts(X) @ quant.dequantize(t).T
    numba.set_num_threads(threads)
    try:
        got = block_lanes.matmul(torch.from_numpy(w), X).numpy()
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    torch.testing.assert_close(torch.from_numpy(got), expect, atol=2e-4, rtol=1e-4)
    rec = block_lanes.records(X[3].numpy(), bb)
    one = np.array([block_lanes.dot_row(w, r, rec) for r in range(rows)], dtype=np.float32)
    assert np.array_equal(one, got[3])  # a batch row is the one-vector dot, bit for bit
    if rows >= 4:
        four = np.array(block_lanes.dot_rows4(w, 3, 0, rows - 1, 1, rec), dtype=np.float32)
        assert np.array_equal(four, one[[3, 0, rows - 1, 1]])


def _dot_for(isa: str, bb: int, monkeypatch):
    """A one-row, one-vector dot whose integer dots are `isa`'s, compiled on this machine."""
    monkeypatch.setattr(block_lanes, "_isa", lambda: isa)
    dots = block_lanes._bl_dots(bb, 1, 1)

    @njit
    def run(w, rec):
        return dots((w.ctypes.data,), w.shape[1] // 16, (rec.ctypes.data,))[0]

    return run


@pytest.mark.parametrize("fmt", block_lanes.FORMATS)
def test_integer_dots_of_every_cpu_kind_give_the_same_bits(fmt, monkeypatch):
    """AVX-512 VNNI, AVX2 only, neither: the same integers, the same float steps."""
    t = quantized(3, 1024, fmt, seed=4)
    w = block_lanes.relay(t).numpy()
    v = np.random.default_rng(3).standard_normal(1024).astype(np.float32)
    rec = block_lanes.records(v, int(t.shape[2]))
    results = {}
    for isa in ("vnni", "avx2", "generic"):
        if isa == "vnni" and block_ir._isa() != "vnni":
            continue
        run = _dot_for(isa, int(t.shape[2]), monkeypatch)
        results[isa] = [run(w[r:r + 1], rec) for r in range(3)]
        asm = run.inspect_asm(run.signatures[0])
        assert ("vpdpbusd" in asm, "pmaddubsw" in asm) == (isa == "vnni", isa == "avx2"), isa
    for isa, out in results.items():
        assert out == results["generic"], isa
    expect = reference.gemv(quant.dequantize(t), acts(torch.from_numpy(v)), torch.zeros(3), torch.zeros(3))
    torch.testing.assert_close(torch.tensor(results["generic"]), expect, atol=2e-4, rtol=1e-4)


def test_packed_q4_0_model_reads_its_rows_re_laid(tmp_path):
    """A planted Q4_0 model 512 wide (16 blocks per row) packed with its own blocks: the CPU
    tier's gate/up rows are re-laid, oracle mode at threshold 0 is the dense model on the same
    file (up to the Q8_0 down projection), and decode (quant_sparse) agrees with prefill
    (block_lanes.matmul)."""
    import argparse

    from powerinfer.bench.relu7b import Shape, planted_model
    from powerinfer.engine.packed import load_packed
    from powerinfer.loader import load

    args = argparse.Namespace(layers=2, sparsity=0.5, rank=4, threads=2, dtype="q4_0")
    gguf, packed, _ = planted_model(args, Shape(512, 1024, 8), str(tmp_path))
    lm = load_packed(packed, mode="oracle", dtype="native", with_tokenizer=False)
    assert all(layer.ffn.cpu.blocked for layer in lm.model.layers)
    ids = torch.tensor([1, 5, 9, 2, 7, 3])
    m = lm.model
    prefill = m.forward(ids, m.new_cache(16), all_logits=True)
    cache = m.new_cache(16)
    decode = torch.stack([m.forward(t[None], cache) for t in ids])
    dense = load(gguf, dtype="native", with_tokenizer=False).model
    want = dense.forward(ids, dense.new_cache(16), all_logits=True)
    # the routes differ by the int8 activations' rounding and the Q8_0 down projection: ~1%
    # of the largest logit (a wrong row or block moves logits by their spread, ~20%)
    scale = want.abs().max()
    assert (decode - prefill).abs().max() < 0.03 * scale
    assert (prefill - want).abs().max() < 0.03 * scale
