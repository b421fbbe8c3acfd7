"""The dispatch point for an FFN over a row set (ops/ffn_rows.py): every backend it picks
(numba rows, numba dense layout, torch) against the plain-torch reference, and the one
activation registry and criterion enum every backend reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from powerinfer.errors import BadArgumentError, UnsupportedModelError
from powerinfer.ops import cpu, ffn_rows, reference
from powerinfer.ops.activations import activation, activation_id, known
from powerinfer.ops.criterion import Criterion, apply, scores
from powerinfer.ops.ffn_rows import FFNRows, FFNSpec

D, N, D_OUT = 40, 48, 40


def reference_ffn(w_gate, w_up, b_in, wt_down, x, idx, spec: FFNSpec, criterion: Criterion):
    """The FFN over rows idx (None: all) from the reference ops, fp32."""
    idx = torch.arange(w_gate.shape[0]) if idx is None else idx
    c = criterion.for_ffn(spec.gated)
    if spec.gated:
        return reference.sparse_gated_ffn(w_gate, w_up, wt_down, x, idx, spec.act, spec.up_act, c.label,
                                          spec.threshold)[0]
    a = reference.sparse_row_gemv(w_gate, x, idx, b_in, spec.act)
    return reference.sparse_col_axpy(wt_down, apply(a, a, c, spec.threshold), idx)


def weights(gated: bool, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_gate = (torch.randn(N, D, generator=g) / D**0.5).to(dtype)
    w_up = (torch.randn(N, D, generator=g) / D**0.5).to(dtype) if gated else None
    b_in = None if gated else torch.randn(N, generator=g) * 0.1
    wt_down = (torch.randn(N, D_OUT, generator=g) / N**0.5).to(dtype)
    return w_gate, w_up, b_in, wt_down


BACKENDS = ["numba_rows", "numba_dense", "torch"]


def block(backend: str, w_gate, w_up, b_in, wt_down) -> FFNRows:
    rows = FFNRows(w_gate.clone(), None if w_up is None else w_up.clone(), b_in, wt_down.clone(),
                   numba_kernels=backend != "torch")
    if backend == "numba_dense":
        rows.use_dense_layout()
        assert rows.dense_np is not None
    assert rows.numba == (backend != "torch")
    return rows


CASES = [(b, t, s) for b in BACKENDS for t, s in ((1, True), (1, False), (3, True), (7, False))
         if not (b == "numba_dense" and s)]  # a dense-layout block is only ever asked for all rows


@pytest.mark.parametrize("backend,tokens,subset", CASES)
@pytest.mark.parametrize("gated,act,up_act", [(True, "silu", None), (True, "relu", "relu"), (False, "relu", None),
                                              (False, "gelu_pytorch_tanh", None)])
@pytest.mark.parametrize("criterion", list(Criterion))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_matches_reference(backend, gated, act, up_act, criterion, dtype, tokens, subset):
    w = weights(gated, dtype)
    spec = FFNSpec(act, up_act, gated, threshold=0.05)
    rows = block(backend, *w)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, D, generator=g)
    idx = torch.sort(torch.randperm(N, generator=g)[: N // 3]).values if subset else None
    base = torch.randn(tokens, D_OUT, generator=g)
    got = ffn_rows.output(rows, spec, x, idx, criterion, base)
    expected = reference_ffn(*w, x, idx, spec, criterion) + base
    tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("gated", [True, False])
def test_add_into_decode_path_matches_output(gated):
    w = weights(gated, torch.float32, seed=3)
    spec = FFNSpec("silu" if gated else "relu", None, gated, threshold=0.02)
    rows = block("numba_rows", *w)
    x = torch.randn(1, D)
    idx = torch.tensor([0, 5, 6, 17, 30, 47])
    out = np.zeros((1, D_OUT), dtype=np.float32)
    ffn_rows.add_into(rows, spec, x.numpy(), idx.numpy(), Criterion.GATE, out)
    torch.testing.assert_close(torch.from_numpy(out), reference_ffn(*w, x, idx, spec, Criterion.GATE),
                               atol=2e-5, rtol=1e-5)


def test_activation_registry_is_one_for_every_backend():
    x = torch.linspace(-4, 4, 101)
    for name in known():
        got = x.clone().numpy()
        cpu.act_inplace(got, activation_id(name))
        torch.testing.assert_close(torch.from_numpy(got), activation(name)(x), atol=1e-5, rtol=1e-5)
    assert activation_id(None) == -1
    with pytest.raises(UnsupportedModelError, match="activation 'mish' is not supported"):
        activation("mish")


def test_criterion_enum_and_reference_formula():
    assert [Criterion.parse(n) for n in ("none", "gate", "gate_up")] == list(Criterion)
    assert Criterion.parse(2) is Criterion.GATE_UP and Criterion.GATE_UP.label == "gate_up"
    assert Criterion.GATE_UP.for_ffn(gated=False) is Criterion.GATE and Criterion.NONE.for_ffn(False) is Criterion.NONE
    with pytest.raises(BadArgumentError, match="criterion must be one of none, gate, gate_up"):
        Criterion.parse("sometimes")
    a, u = torch.tensor([0.5, -0.05, 2.0]), torch.tensor([0.01, 10.0, 1.0])
    assert torch.equal(scores(a, u, "gate"), a.abs()) and torch.equal(scores(a, u, "gate_up"), (a * u).abs())
    h = a * u
    assert torch.equal(apply(h, a, Criterion.GATE, 0.1), torch.tensor([h[0], 0.0, h[2]]))
    assert torch.equal(apply(h, a, Criterion.GATE_UP, 0.1), torch.tensor([0.0, h[1], h[2]]))
    assert torch.equal(apply(h, a, Criterion.NONE, 0.1), h)


# -- typed weights and the decoder's named ops -------------------------------------------------
@pytest.mark.parametrize("dtype,kernels,fmt", [(torch.float32, True, "rows"), (torch.bfloat16, True, "panels"),
                                               (torch.float16, True, "panels"), (torch.bfloat16, False, "rows")])
def test_weight_format_is_chosen_once_and_every_format_computes_the_same(dtype, kernels, fmt):
    from powerinfer.ops.linear import Linear
    from powerinfer.ops.weights import FORMATS, weight_for

    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g)
    typed = weight_for(w, kernels)
    assert typed.format == fmt and isinstance(typed, FORMATS[fmt]) and typed.shape == (96, 64)
    assert (typed.kernel is not None) == kernels
    torch.testing.assert_close(typed.rows().float(), w.float())
    lin = Linear(typed, b)
    for tokens in (1, 3, 9):  # numba GEMV per token, and torch's GEMM for a batch
        x = torch.randn(tokens, 64, generator=g)
        res = torch.randn(tokens, 96, generator=g)
        expected = torch.stack([reference.gemv(w, x[t], b, res[t]) for t in range(tokens)])
        torch.testing.assert_close(lin(x, residual=res), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype,kernels", [(torch.float16, True), (torch.bfloat16, True), (torch.float16, False)])
def test_half_weights_matmul_a_tile_of_rows_at_a_time(monkeypatch, dtype, kernels):
    """A batch through half weights on the CPU (rows or panels) widens a tile of rows at a
    time, never the whole matrix (`rows()` is not called), and equals the fp32 GEMM on the
    widened matrix: tiles of 16 rows over 100 rows (a short last tile), bias added once."""
    from powerinfer.ops import weights

    g = torch.Generator().manual_seed(2)
    w = torch.randn(100, 64, generator=g).to(dtype)
    b = torch.randn(100, generator=g)
    typed = weights.weight_for(w, kernels)
    monkeypatch.setattr(weights, "TILE_BYTES", 16 * 64 * 4)
    monkeypatch.setattr(type(typed), "rows", lambda self: pytest.fail("the whole matrix widened"))
    x = torch.randn(7, 64, generator=g)
    got = typed.matmul(x, b)
    assert got.shape == (7, 100) and got.is_contiguous()
    torch.testing.assert_close(got, x @ w.float().t() + b, atol=1e-5, rtol=1e-5)


def test_rms_norm_backends_match_the_reference():
    from powerinfer.ops import api

    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, generator=g)
    for tokens in (1, 5):
        x = torch.randn(tokens, 48, generator=g)
        torch.testing.assert_close(api.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)
