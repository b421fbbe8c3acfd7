"""GGUF blocks re-laid 16 rows at a time (ops/lanes.py, ops/lane_ir.py): the layout round-trips,
every kernel against its reference twin (dequantize, the activations rounded as the kernels
round them, then the fp32 op), every lanes format, 1 and 2 threads; batches equal the GEMV
bit for bit; the AVX2 and plain integer dots equal VNNI's; and the dense engine picks lanes."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from numba import njit

from powerinfer.ops import block_ir, lane_ir, lanes, quant, reference
from powerinfer.ops.linear import Linear
from powerinfer.ops.weights import LaneWeight, QuantWeight, weight_for

from test_quant import acts, quantized

NONE = np.zeros(0, dtype=np.float32)


@pytest.mark.parametrize("fmt", lanes.FORMATS)
def test_interleave_round_trips_and_keeps_the_bytes(fmt):
    t = quantized(48, 96, fmt, seed=5)
    L = lanes.interleave(t)
    # the same bytes (Q4_K: plus its 6-bit scales and mins unpacked, 148 bytes per 144)
    assert lanes.is_lanes(L) and not quant.is_quantized(L) and L.numel() == t.numel() * int(L.shape[3]) // int(t.shape[2])
    assert lanes.shape_of(L) == quant.shape_of(t) and lanes.format_of(L) == fmt
    assert torch.equal(lanes.deinterleave(L), t)
    # row 17's scale d sits at lane 1 of group 1; its first quant bytes in the first chunk
    g = L.numpy()[1, 0].reshape(-1)
    d_at = 208 if fmt == "Q6_K" else 0  # Q6_K's d ends its block
    assert bytes(g[2:4]) == bytes(t.numpy()[17, 0, d_at : d_at + 2])
    # (first chunk in the group block, first quant byte in the row's block)
    start, qs = {"Q4_0": (32, 2), "Q4_1": (64, 4), "Q8_0": (32, 2), "Q4_K": (320, 16), "Q6_K": (288, 0)}[fmt]
    q = t.numpy()[17, 0, qs : qs + 4] ^ (0x80 if fmt == "Q8_0" else 0)
    assert bytes(g[start + 4 : start + 8]) == bytes(q)


def test_only_lanes_formats_and_row_counts_fit():
    assert lanes.fits(quantized(32, 64, "Q4_0"))
    assert not lanes.fits(quantized(40, 64, "Q4_0"))  # rows not a multiple of 16
    assert lanes.fits(quantized(32, 256, "Q4_K")) and lanes.fits(quantized(32, 256, "Q6_K"))
    assert not lanes.fits(quantized(32, 256, "Q5_K")) and not lanes.fits(quantized(32, 64, "Q5_0"))
    assert isinstance(weight_for(quantized(40, 64, "Q8_0")), QuantWeight)
    assert isinstance(weight_for(quantized(32, 64, "Q8_0")), LaneWeight)
    assert isinstance(weight_for(quantized(32, 64, "Q8_0"), kernels=False), QuantWeight)


@pytest.mark.parametrize("fmt", lanes.FORMATS)
@pytest.mark.parametrize("rows,cols", [(16, 32), (48, 96), (1536, 576), (64, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_matches_reference(fmt, rows, cols, threads):
    t = quantized(rows, cols, fmt, seed=rows + cols)
    cols = quant.shape_of(t)[1]  # K-quants: whole blocks of 256
    L = lanes.interleave(t)
    x = torch.randn(cols, generator=torch.Generator().manual_seed(1))
    b, res = torch.randn(rows), torch.randn(rows)
    out = res.numpy().copy()
    numba.set_num_threads(threads)
    try:
        lanes.add_matvec_lanes(L.numpy(), x.numpy(), b.numpy(), out, threads)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    dense = quant.dequantize(t)
    expect = reference.gemv(dense, acts(x), b, res)
    # fp32 sums in another order: the error scales with the sum of |terms| (K-quants' values
    # reach ~1000 with cancellation to ~0.3 in some rows), a wrong quant by whole terms
    scale = dense.abs() @ acts(x).abs()
    assert ((torch.from_numpy(out) - expect).abs() <= 2e-4 + 1e-6 * scale).all()


@pytest.mark.parametrize("fmt", lanes.FORMATS)
def test_batches_and_prefill_equal_the_gemv_bit_for_bit(fmt):
    """Eight, four, two and one vectors per pass: each row of a batch (decode) and of a
    prompt (prefill) is the GEMV's result on that vector alone."""
    t = quantized(64, 160, fmt, seed=9)
    cols = quant.shape_of(t)[1]
    L = lanes.interleave(t)
    w = L.numpy()
    X = torch.randn(15, cols, generator=torch.Generator().manual_seed(2))
    solo = np.zeros((15, 64), dtype=np.float32)
    for s in range(15):
        lanes.add_matvec_lanes(w, X[s].numpy(), NONE, solo[s], 2)
    batch = np.zeros((15, 64), dtype=np.float32)
    lanes.add_matvec_lanes_batch(w, X.numpy(), NONE, batch, 2)
    assert np.array_equal(batch, solo)
    assert np.array_equal(lanes.matmul(L, X).numpy(), solo)
    torch.testing.assert_close(torch.from_numpy(solo), acts(X) @ quant.dequantize(t).T, atol=2e-4, rtol=1e-4)


@njit
def _groups_one_by_one(w, QA, X):
    for g in range(w.shape[0]):
        lanes.group_dots_batch(w, g, QA, X)


@njit
def _groups_by_pairs(w, QA, X):
    for i in range(lanes.pair_steps(0, w.shape[0])):
        lanes.pair_step(w, 0, w.shape[0], i, QA, X)


@pytest.mark.parametrize("fmt", lanes.FORMATS)
def test_groups_in_pairs_give_each_group_its_own_bits(fmt):
    """Two groups' blocks alternating in one loop (how a batch runs where `lanes.PAIRED`):
    every batch size (passes of eight, four, two, one) and an odd group count give the bits
    of the groups taken one at a time, which the GEMV's equal."""
    t = quantized(16 * 5, 320, fmt, seed=4)
    w = lanes.interleave(t).numpy()
    V = torch.randn(11, quant.shape_of(t)[1], generator=torch.Generator().manual_seed(5)).numpy()
    for B in (1, 2, 3, 4, 6, 8, 11):
        QA = block_ir.quantize_acts_rows(V[:B], lanes._row_bytes(w.shape[3]))
        single, paired = np.zeros((B, 80), dtype=np.float32), np.zeros((B, 80), dtype=np.float32)
        _groups_one_by_one(w, QA, single)
        _groups_by_pairs(w, QA, paired)
        assert np.array_equal(paired, single), B
        assert np.abs(single).max() > 0


_GEMVS: dict[tuple[str, int], object] = {}  # one compile per worker (~0.7 s each); the ISA is fixed when made


def _gemv_for(isa: str, bb: int, monkeypatch):
    """A one-vector lane GEMV over one group whose integer dots are `isa`'s (compiled on this
    machine: the AVX2 and plain code run on any AVX-512 CPU too)."""
    if (isa, bb) in _GEMVS:
        return _GEMVS[isa, bb]
    monkeypatch.setattr(lane_ir, "_isa", lambda: isa)
    dots = lane_ir._lane_dots(bb, 1)

    @njit
    def run(w, qa, out):
        dots(w.ctypes.data, w.shape[1], (qa.ctypes.data,), (out.ctypes.data,))

    _GEMVS[isa, bb] = run
    return run


@pytest.mark.parametrize("fmt", lanes.FORMATS)
def test_integer_dots_of_every_cpu_kind_give_the_same_bits(fmt, monkeypatch):
    """Machines differ (AVX-512 VNNI, AVX2 only, neither): the three integer dots give the
    same integers, and the float steps are the same, so the results are equal bit for bit."""
    t = quantized(16, 512, fmt, seed=4)
    w = lanes.interleave(t).numpy()
    v = np.random.default_rng(3).standard_normal(512).astype(np.float32)
    qa = block_ir.quantize_acts(v, int(t.shape[2]))  # records cut for the row format
    results = {}
    for isa in ("vnni", "avx2", "generic"):
        if isa == "vnni" and block_ir._isa() != "vnni":
            continue
        out = np.zeros(16, dtype=np.float32)
        run = _gemv_for(isa, int(w.shape[3]), monkeypatch)
        run(w[0:1], qa, out)
        results[isa] = out
        asm = run.inspect_asm(run.signatures[0])
        assert ("vpdpbusd" in asm, "pmaddubsw" in asm) == (isa == "vnni", isa == "avx2"), isa
    base = results["generic"]
    for isa, out in results.items():
        assert np.array_equal(out, base), isa
    expect = reference.gemv(quant.dequantize(t), acts(torch.from_numpy(v)), torch.zeros(16), torch.zeros(16))
    torch.testing.assert_close(torch.from_numpy(base), expect, atol=2e-4, rtol=1e-4)


# the bytes of each format's fp16 scale fields, in the row block
_SCALE_BYTES = {"Q4_0": slice(0, 2), "Q4_1": slice(0, 4), "Q8_0": slice(0, 2), "Q4_K": slice(0, 4),
                "Q6_K": slice(208, 210)}


@pytest.mark.parametrize("fmt", lanes.FORMATS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_integer_dots_hold_the_largest_quants_and_activations(fmt, sign, monkeypatch):
    """AVX2 sums a dot's pmaddubsw pairs in int16 over several chunks before widening them
    (`lane_ir.PAIR_CHUNKS`): with every quant at its largest (all bits set) and every
    activation at +-127 those int16 sums reach their bound, and must still equal the
    widening plain dots bit for bit."""
    t = quantized(16, 512, fmt, seed=6)
    blocks = t.numpy()
    keep = blocks[:, :, _SCALE_BYTES[fmt]].copy()
    blocks[:] = 0x81 if fmt == "Q8_0" else 0xFF  # Q8_0: -127, the largest |q| its dots take
    blocks[:, :, _SCALE_BYTES[fmt]] = keep
    w = lanes.interleave(t).numpy()
    qa = block_ir.quantize_acts(np.full(512, sign, dtype=np.float32), int(t.shape[2]))
    outs = {}
    for isa in ("avx2", "generic"):
        out = np.zeros(16, dtype=np.float32)
        _gemv_for(isa, int(w.shape[3]), monkeypatch)(w[0:1], qa, out)
        outs[isa] = out
    assert np.array_equal(outs["avx2"], outs["generic"])
    expect = reference.gemv(quant.dequantize(t), acts(torch.full((512,), sign)), torch.zeros(16), torch.zeros(16))
    torch.testing.assert_close(torch.from_numpy(outs["generic"]), expect, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", lanes.FORMATS)
def test_linear_on_lanes_decode_batch_and_prompt(fmt):
    """`Linear` on a lanes weight: one token (GEMV), a few (batched GEMV) and a prompt
    (lanes matmul), all equal to each token's GEMV, with bias and residual."""
    t = quantized(48, 64, fmt, seed=1)
    lin = Linear(t, torch.randn(48))
    assert isinstance(lin.w, LaneWeight) and lin.w.quant_format == fmt
    torch.testing.assert_close(lin.w.rows(), quant.dequantize(t))
    X = torch.randn(20, quant.shape_of(t)[1])
    one = torch.cat([lin(X[s : s + 1]) for s in range(20)])
    assert torch.equal(lin(X[:5]), one[:5])
    assert torch.equal(lin(X), one)
    r = torch.randn(20, 48)
    torch.testing.assert_close(lin(X, residual=r), one + r)


def test_q6k_records_pool_each_sixteen_values_bias_into_one_word():
    """Q6_K's lane dots start each 16-weight sub-block from one record word: -32 x the sum of
    its 16 quantized activations, the other three 4-sums zero (the row kernel adds them all)."""
    v = np.random.default_rng(7).standard_normal(512).astype(np.float32)
    rec = block_ir.quantize_acts(v, 210).reshape(2, 576)  # two super-blocks of 256
    for b in range(2):
        q = rec[b, :256].view(np.int8).astype(np.int64)
        sums = rec[b, 256:512].view(np.int32).reshape(16, 4)  # per 16 values: four 4-sums
        assert np.array_equal(sums[:, 0], -32 * q.reshape(16, 16).sum(axis=1))
        assert not sums[:, 1:].any()
    other = block_ir.quantize_acts(v, 144).reshape(2, 576)  # other formats: plain 4-sums
    q = other[0, :256].view(np.int8).astype(np.int64)
    assert np.array_equal(other[0, 256:512].view(np.int32), q.reshape(64, 4).sum(axis=1))


@pytest.mark.parametrize("bb", [18, 144])  # records of 32 values (Q4_0) and of 256 (Q4_K)
def test_records_are_the_numpy_recipe_bit_for_bit_and_a_nan_makes_its_block_nan(bb):
    """The vector IR records (`_absmax32`, `_round32`) against numpy: per 32 values d = amax /
    127, q = rint(v * (127 / amax)) (ties to even: values on .5 included), the 4-sums, d and
    d x the 32-sum; a NaN makes its block's scales NaN (the dots NaN, as `reference_acts`)
    and leaves the other blocks as they were."""
    rng = np.random.default_rng(11)
    v = (rng.standard_normal(512) * 3).astype(np.float32)
    v[32:64] = (rng.integers(-254, 255, 32) / 2).astype(np.float32)  # q = v exactly, or a tie
    v[40] = 127.0
    v[64:96] = 0.0  # amax 0: every q and scale 0
    P = block_ir.per_block(bb)
    n = P // 32
    rec = block_ir.quantize_acts(v, bb).reshape(512 // P, 72 * n)
    for blk in range(16):
        b, k = divmod(blk, n)
        x = v[32 * blk:32 * blk + 32]
        amax = np.abs(x).max()
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        q = np.rint(x * inv).astype(np.int64)
        d = amax / np.float32(127.0)
        assert np.array_equal(rec[b, 32 * k:32 * k + 32].view(np.int8), q)
        assert np.array_equal(rec[b, P + 32 * k:P + 32 * k + 32].view(np.int32), q.reshape(8, 4).sum(axis=1))
        scales = rec[b, P + 32 * n:].view(np.float32)
        assert scales[k] == d and scales[n + k] == d * np.float32(q.sum())
    strided = np.repeat(v[:, None], 3, axis=1)[:, 1]  # a column view: the same records
    assert np.array_equal(block_ir.quantize_acts(strided, bb).reshape(rec.shape), rec)
    v[100] = np.nan  # block 3
    poisoned = block_ir.quantize_acts(v, bb).reshape(512 // P, 72 * n)
    scales = poisoned[:, P + 32 * n:].view(np.float32).reshape(-1, 2, n).transpose(0, 2, 1).reshape(16, 2)
    assert np.isnan(scales[3]).all()
    assert np.array_equal(np.delete(scales, 3, axis=0),
                          np.delete(rec[:, P + 32 * n:].view(np.float32).reshape(-1, 2, n).transpose(0, 2, 1)
                                    .reshape(16, 2), 3, axis=0))


def test_a_q6k_matrix_is_read_as_lanes_by_the_dense_engine():
    t = quantized(32, 256, "Q6_K", seed=2)
    w = weight_for(t)
    assert isinstance(w, LaneWeight) and w.quant_format == "Q6_K"
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(w.matmul(x), acts(x) @ quant.dequantize(t).T, atol=2e-3, rtol=1e-4)
