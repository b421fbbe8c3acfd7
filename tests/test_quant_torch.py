"""The GPU tier's torch dequantizer (ops/quant_torch.py) against the gguf package's numpy
dequantizers on every format, and row selection reading only the chosen rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from powerinfer.ops import quant, quant_torch


def random_blocks(rows: int, fmt: str, n_blocks: int = 3, seed: int = 0) -> torch.Tensor:
    """Random bytes in `fmt`'s blocks with finite fp16 scales: every bit pattern of the quants
    (and of the 6-bit scales) is a valid block."""
    rng = np.random.default_rng(seed)
    _, bb = quant.FORMATS[fmt]
    b = rng.integers(0, 256, (rows, n_blocks, bb), dtype=np.uint8)
    for off in quant.SCALE_OFFSETS[fmt]:
        scales = rng.uniform(-0.05, 0.05, (rows, n_blocks)).astype(np.float16)
        b[:, :, off:off + 2] = scales.view(np.uint8).reshape(rows, n_blocks, 2)
    return torch.from_numpy(b)


@pytest.mark.parametrize("fmt", sorted(quant.FORMATS))
def test_dequantize_matches_gguf(fmt):
    t = random_blocks(5, fmt)
    rows, cols = quant.shape_of(t)
    want = gguf_dequantize(t.numpy().reshape(rows, -1), GGMLQuantizationType[fmt]).reshape(rows, cols)
    got = quant_torch.dequantize(t)
    assert got.shape == (rows, cols) and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), want.astype(np.float32))
    # the numba twin the CPU tier uses agrees too
    np.testing.assert_array_equal(quant.dequantize(t).numpy(), got.numpy())


def test_rows_reads_the_selected_rows():
    t = random_blocks(9, "Q4_K")
    idx = torch.tensor([7, 0, 3])
    torch.testing.assert_close(quant_torch.rows(t, idx), quant_torch.dequantize(t)[idx], rtol=0, atol=0)
    assert quant_torch.rows(t, None, torch.float16).dtype == torch.float16


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q4_0"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_gpu_tier_ffn_over_quantized_rows(fmt, tokens, device):
    """A GPU-tier block (no numba kernels; here on CPU tensors, the same torch code as on
    CUDA) of quantized gate/up rows and a Q8_0 transposed down projection: the FFN over a
    neuron subset equals fp32 math on the dequantized weights."""
    from powerinfer.ops.criterion import Criterion
    from powerinfer.ops.ffn_rows import FFNRows, FFNSpec, output

    n, d = 40, 256
    per_row = d // quant.FORMATS[fmt][0]
    w_gate, w_up = random_blocks(n, fmt, per_row, seed=1), random_blocks(n, fmt, per_row, seed=2)
    wt_down = random_blocks(n, "Q8_0", 8, seed=3)
    rows = FFNRows(w_gate.to(device), w_up.to(device), None, wt_down.to(device), numba_kernels=False)
    assert rows.quant and not rows.numba
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(0))
    idx = torch.tensor([3, 17, 0, 39, 8])
    got = output(rows, FFNSpec("silu", None, True), x, idx, Criterion.NONE)
    g, u, wd = (quant_torch.dequantize(t)[idx] for t in (w_gate, w_up, wt_down))
    want = (torch.nn.functional.silu(x @ g.t()) * (x @ u.t())) @ wd
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    every = output(rows, FFNSpec("silu", None, True), x, None, Criterion.NONE)
    g, u, wd = (quant_torch.dequantize(t) for t in (w_gate, w_up, wt_down))
    torch.testing.assert_close(every, (torch.nn.functional.silu(x @ g.t()) * (x @ u.t())) @ wd,
                               rtol=1e-5, atol=1e-5 * every.abs().max().item())
