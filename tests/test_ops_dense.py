"""Dense CPU kernels (numba) against the plain-torch reference ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from powerinfer.ops import cpu, reference
from powerinfer.ops.activations import activation_id
from powerinfer.ops.linear import Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (37, 53), (300, 129)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_one_token_matches_reference(dtype, shape, with_bias):
    w = torch.randn(shape).to(dtype)
    b = torch.randn(shape[0]) if with_bias else None
    x, r = torch.randn(1, shape[1]), torch.randn(1, shape[0])
    lin = Linear(w, b)
    expected = reference.gemv(w, x[0], b, r[0])
    torch.testing.assert_close(lin(x, residual=r)[0], expected, atol=1e-4, rtol=1e-4)
    # batches of a few tokens (one numba GEMV per token for half weights) and larger ones
    # (torch) agree with the one-token path, residual included
    for T in (3, 4, 5, 9):
        xs = torch.cat([x, torch.randn(T - 1, shape[1])])
        rs = torch.cat([r, torch.randn(T - 1, shape[0])])
        ys = lin(xs, residual=rs)
        assert ys.shape == (T, shape[0])
        torch.testing.assert_close(ys[:1], lin(x, residual=r), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ys[1:], torch.stack([lin(xs[t:t + 1], residual=rs[t:t + 1])[0] for t in range(1, T)]),
                                   atol=1e-4, rtol=1e-4)


def test_rms_norm_matches_reference():
    x, w = torch.randn(577), torch.randn(577)
    out = np.empty(577, np.float32)
    cpu.rms_norm(x.numpy(), w.numpy(), 1e-5, out)
    torch.testing.assert_close(torch.from_numpy(out), reference.rms_norm(x, w, 1e-5))
    y = x.clone()
    delta = torch.randn(577)
    cpu.add_rms_norm(y.numpy(), delta.numpy(), w.numpy(), 1e-5, out)
    torch.testing.assert_close(y, x + delta)
    torch.testing.assert_close(torch.from_numpy(out), reference.rms_norm(x + delta, w, 1e-5))


@pytest.mark.parametrize("act", ["silu", "relu", "gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("up_act", [None, "relu"])
def test_gated_activation_matches_reference(act, up_act):
    n_ff = 101
    h = torch.randn(2 * n_ff) * 3
    out = np.empty(n_ff, np.float32)
    cpu.gated_act(h.numpy(), n_ff, activation_id(act), activation_id(up_act), out)
    torch.testing.assert_close(torch.from_numpy(out), reference.gated_act(h, n_ff, act, up_act), atol=1e-5, rtol=1e-5)
    plain = h.clone()
    cpu.act_inplace(plain.numpy(), activation_id(act))
    torch.testing.assert_close(plain, reference.gated_act(torch.cat([h, torch.ones_like(h)]), 2 * n_ff, act))


@pytest.mark.parametrize("n_heads,n_kv,rope,pos,window,softcap", [
    (4, 4, True, 13, 0, 0.0), (6, 2, True, 13, 0, 0.0), (8, 1, False, 13, 0, 0.0), (9, 3, True, 150, 0, 0.0),
    (6, 2, False, 127, 0, 0.0),
    (6, 2, True, 150, 32, 0.0), (4, 4, True, 5, 32, 0.0),  # a sliding window: past it, and not yet filled
    (6, 2, True, 40, 0, 0.5), (6, 2, True, 40, 8, 0.5),  # soft-capped scores (a cap that bites), and both
    # past one chunk of positions (cpu.CHUNK = 256): a 1-position last chunk, three chunks, a
    # window across a chunk boundary, a soft cap over several chunks
    (4, 4, True, 256, 0, 0.0), (9, 3, True, 700, 0, 0.0), (6, 2, True, 600, 300, 0.0), (6, 2, False, 520, 0, 0.5)])
def test_attend_one_matches_reference(n_heads, n_kv, rope, pos, window, softcap):
    d, max_len = 16, max(200, pos + 1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.outer(torch.arange(max_len).float(), inv_freq)
    cos, sin = torch.cos(angles).numpy(), torch.sin(angles).numpy()
    k_cache, v_cache = torch.randn(n_kv, max_len, d), torch.randn(n_kv, max_len, d)
    qkv = torch.randn((n_heads + 2 * n_kv) * d)
    q = qkv[: n_heads * d].view(n_heads, d)
    k = qkv[n_heads * d : (n_heads + n_kv) * d].view(n_kv, d)
    v = qkv[(n_heads + n_kv) * d :].view(n_kv, d)
    if rope:
        q, k = reference.rope_interleaved(q, pos, inv_freq), reference.rope_interleaved(k, pos, inv_freq)
    keys, values = k_cache.clone(), v_cache.clone()
    keys[:, pos], values[:, pos] = k, v
    expected = reference.attend_one(q, keys[:, : pos + 1], values[:, : pos + 1], window, softcap)
    if window or softcap:  # the variant really changes the result
        assert not torch.allclose(expected, reference.attend_one(q, keys[:, : pos + 1], values[:, : pos + 1]),
                                  atol=1e-3) or pos + 1 <= window
    out = np.empty(n_heads * d, np.float32)
    cpu.attend_one(qkv.numpy(), pos, cos, sin, k_cache.numpy(), v_cache.numpy(), n_heads, n_kv, d, d**-0.5, rope, out,
                   window, np.float32(softcap))
    torch.testing.assert_close(torch.from_numpy(out), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache[:, pos], k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v_cache[:, pos], v)

