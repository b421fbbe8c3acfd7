"""Sparse ops (numba CPU kernels and the torch GPU-tier path run on CPU tensors) against
the dense reference definitions, over dtypes, odd shapes, index sets and token batches."""

from __future__ import annotations

import pytest
import torch

from powerinfer.errors import BadArgumentError
from powerinfer.ops import api as sparse, reference, torch_ops
from powerinfer.ops.criterion import Criterion

N, D = 301, 77  # odd, not multiples of 16
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def index_set(kind: str, n: int = N, dtype=torch.int64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if kind == "empty":
        idx = torch.zeros(0, dtype=torch.long)
    elif kind == "full":
        idx = torch.arange(n)
    elif kind == "sorted":
        idx = torch.sort(torch.randperm(n, generator=g)[: n // 5]).values
    else:
        idx = torch.randperm(n, generator=g)[: n // 3]
    return idx.to(dtype)


def tol(dtype):
    return dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)


def gpu_row_gemv(w, x, idx, bias=None, act=None):
    return torch_ops.sparse_row_gemv(w, x if x.dim() == 2 else x[None], idx, bias, act).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "sorted", "empty", "full"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens", [1, 3])
def test_row_gemv(dtype, kind, idx_dtype, tokens):
    w = torch.randn(N, D).to(dtype)
    bias = torch.randn(N)
    x = torch.randn(tokens, D) if tokens > 1 else torch.randn(D)
    idx = index_set(kind, dtype=idx_dtype)
    for act in (None, "relu", "silu"):
        expected = reference.sparse_row_gemv(w, x, idx, bias, act)
        torch.testing.assert_close(sparse.sparse_row_gemv(w, x, idx, bias, act), expected, **tol(dtype))
        if tokens > 1:
            torch.testing.assert_close(gpu_row_gemv(w, x, idx.long(), bias, act), expected, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "sorted", "empty", "full"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_col_axpy(dtype, kind, tokens):
    wt = torch.randn(N, D).to(dtype)
    idx = index_set(kind)
    a = torch.randn(tokens, len(idx)) if tokens > 1 else torch.randn(len(idx))
    if len(idx) > 2:
        a[..., 1] = 0.0  # skipped rows must not change the result
    expected = reference.sparse_col_axpy(wt, a, idx)
    torch.testing.assert_close(sparse.sparse_col_axpy(wt, a, idx), expected, **tol(dtype))
    a2 = a if a.dim() == 2 else a[None]
    torch.testing.assert_close(torch_ops.sparse_col_axpy(wt, a2, idx).reshape(expected.shape), expected, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "empty", "full"])
@pytest.mark.parametrize("criterion,threshold", [("none", 0.0), ("gate", 0.2), ("gate_up", 0.3)])
@pytest.mark.parametrize("tokens,up_act", [(1, None), (3, None), (2, "relu")])
def test_gated_ffn(dtype, kind, criterion, threshold, tokens, up_act):
    w_gate, w_up = torch.randn(N, D).to(dtype), torch.randn(N, D).to(dtype)
    wt_down = (torch.randn(N, D + 6) * 0.1).to(dtype)
    x = torch.randn(tokens, D) * 0.3 if tokens > 1 else torch.randn(D) * 0.3
    idx = index_set(kind)
    exp_out, exp_h = reference.sparse_gated_ffn(w_gate, w_up, wt_down, x, idx, "silu", up_act, criterion, threshold)
    out, h = sparse.sparse_gated_ffn(w_gate, w_up, wt_down, x, idx, "silu", up_act, criterion, threshold)
    torch.testing.assert_close(h, exp_h, **tol(dtype))
    torch.testing.assert_close(out, exp_out, **tol(dtype))
    x2 = x if x.dim() == 2 else x[None]
    g_out, g_h = torch_ops.sparse_gated_ffn(w_gate, w_up, wt_down, x2, idx, "silu", up_act,
                                      int(Criterion.parse(criterion)), threshold)
    torch.testing.assert_close(g_out.reshape(exp_out.shape), exp_out, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_relu_gate_criterion_is_exact(dtype):
    """With a ReLU gate at threshold 0 the gate criterion (up and down rows read only for
    neurons that fire) gives the same output as reading every row of the active set."""
    n, d = 997, 1100  # rows longer than SHORT_ROW and a sparse set: the blocked decode path
    w_gate, w_up = torch.randn(n, d).to(dtype), torch.randn(n, d).to(dtype)
    wt_down = (torch.randn(n, d) * 0.1).to(dtype)
    x = torch.randn(d) * 0.3
    idx = index_set("random", n)
    out_gate, h_gate = sparse.sparse_gated_ffn(w_gate, w_up, wt_down, x, idx, "relu", None, "gate", 0.0)
    out_all, h_all = sparse.sparse_gated_ffn(w_gate, w_up, wt_down, x, idx, "relu", None, "none", 0.0)
    assert 0.3 < float((h_gate == 0).float().mean()) < 0.7  # about half the predicted neurons do not fire
    torch.testing.assert_close(h_gate, h_all, **tol(dtype))
    torch.testing.assert_close(out_gate, out_all, **tol(dtype))
    exp_out, _ = reference.sparse_gated_ffn(w_gate, w_up, wt_down, x, idx, "relu", None, "gate", 0.0)
    torch.testing.assert_close(out_gate, exp_out, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3])
def test_predictor_and_threshold_to_index(dtype, tokens):
    w1, b1 = torch.randn(13, D).to(dtype), torch.randn(13)
    w2, b2 = torch.randn(N, 13).to(dtype), torch.randn(N)
    x = torch.randn(tokens, D) if tokens > 1 else torch.randn(D)
    expected = reference.predictor_logits(w1, b1, w2, b2, x)
    logits = sparse.predictor_logits(w1, b1, w2, b2, x)
    torch.testing.assert_close(logits, expected, **tol(dtype))
    x2 = x if x.dim() == 2 else x[None]
    torch.testing.assert_close(torch_ops.predictor_logits(w1, b1, w2, b2, x2).reshape(expected.shape), expected, **tol(dtype))
    for thr in (0.0, 5.0, torch.randn(N), float("inf"), float("-inf")):
        ref_idx = reference.threshold_to_index(expected, thr)
        assert torch.equal(sparse.threshold_to_index(expected, thr), ref_idx)
        thr_t = torch.as_tensor(thr, dtype=torch.float32)
        assert torch.equal(torch_ops.threshold_to_index(expected if expected.dim() == 2 else expected[None], thr_t), ref_idx)
    assert sparse.threshold_to_index(expected, 0.0, torch.int32).dtype == torch.int32


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as the CUDA tier multiplies it: rounded to the weights' dtype (torch_ops.matmul)."""
    return t.to(dtype).float()


def assert_cuda_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, ulps: float = 2.0) -> None:
    """On CUDA a half GEMM rounds its output to the half dtype (fp32 accumulation inside):
    `ulps` units of that rounding, relative and against the largest value."""
    eps = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got.cpu(), want, rtol=ulps * eps, atol=ulps * eps * scale + 1e-6)


def gap_threshold(h: torch.Tensor, lo: float, hi: float) -> float:
    """A threshold in [lo, hi] in the middle of the widest gap between the values |h|: no
    neuron sits at it, so rounding cannot move one across."""
    v = torch.cat([torch.tensor([lo, hi]), h.abs().flatten()])
    v = torch.sort(v[(v >= lo) & (v <= hi)]).values
    i = int(torch.argmax(v[1:] - v[:-1]))
    return float(v[i] + v[i + 1]) / 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "empty", "full"])
def test_cuda_ops_equal_the_reference(dtype, kind):
    """The public ops with CUDA tensors (dispatched to the GPU tier's torch code) equal the
    CPU reference on the activations as that tier rounds them (to the weights' dtype): row
    GEMV, column AXPY, the gated FFN, predictor and threshold-to-index."""
    cuda = torch.device("cuda")
    w, wu = torch.randn(N, D).to(dtype), torch.randn(N, D).to(dtype)
    wt = (torch.randn(N, D + 6) * 0.1).to(dtype)
    x, bias = torch.randn(3, D) * 0.3, torch.randn(N)
    idx = index_set(kind)
    a = torch.randn(3, len(idx))
    got = sparse.sparse_row_gemv(w.to(cuda), x.to(cuda), idx.to(cuda), bias.to(cuda), "relu")
    assert got.device.type == "cuda"
    assert_cuda_close(got, reference.sparse_row_gemv(w, rounded(x, dtype), idx, bias, "relu"), dtype)
    assert_cuda_close(sparse.sparse_col_axpy(wt.to(cuda), a.to(cuda), idx.to(cuda)),
                      reference.sparse_col_axpy(wt, rounded(a, dtype), idx), dtype)
    _, all_h = reference.sparse_gated_ffn(w, wu, wt, rounded(x, dtype), idx, "silu", None, "none", 0.0)
    thr = gap_threshold(all_h, 0.2, 0.4)
    out, h = sparse.sparse_gated_ffn(w.to(cuda), wu.to(cuda), wt.to(cuda), x.to(cuda), idx.to(cuda), "silu", None,
                                     "gate_up", thr)
    _, exp_h = reference.sparse_gated_ffn(w, wu, wt, rounded(x, dtype), idx, "silu", None, "gate_up", thr)
    assert_cuda_close(h, exp_h, dtype, ulps=3)  # gate and up each rounded once
    assert_cuda_close(out, reference.sparse_col_axpy(wt, rounded(h.cpu(), dtype), idx), dtype)
    w2, b2 = torch.randn(N, 13).to(dtype), torch.randn(N)
    logits = sparse.predictor_logits(w[:13].to(cuda), bias[:13].to(cuda), w2.to(cuda), b2.to(cuda), x.to(cuda))
    hidden = torch.relu(rounded(x, dtype) @ w[:13].float().t() + bias[:13])
    assert_cuda_close(logits, rounded(hidden, dtype) @ w2.float().t() + b2, dtype, ulps=4)
    assert torch.equal(sparse.threshold_to_index(logits, 0.5).cpu(), reference.threshold_to_index(logits.cpu(), 0.5))


@pytest.mark.parametrize("bad,message", [
    (torch.tensor([0, 5, N]), "out of range"),
    (torch.tensor([3, -1]), "out of range"),
    (torch.tensor([4, 9, 4]), "duplicate index 4"),
    (torch.tensor([1.0, 2.0]), "int32/int64"),
    (torch.tensor([[1, 2]]), "1-D"),
])
def test_bad_indices_are_refused(bad, message):
    w, x = torch.randn(N, D), torch.randn(D)
    with pytest.raises(BadArgumentError, match=message):
        sparse.sparse_row_gemv(w, x, bad)
    with pytest.raises(BadArgumentError, match=message):
        sparse.sparse_col_axpy(w, torch.randn(bad.numel()), bad)
    with pytest.raises(BadArgumentError, match=message):
        sparse.sparse_gated_ffn(w, w, w, x, bad)
