"""The column-panel layout of dense half weights (ops/panels.py) against rows and the
plain-torch reference: the layout round trip, the panel GEMV, and the decode kernels that
take either layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from powerinfer.ops import cpu, decode, panels, reference
from powerinfer.ops.activations import activation_id
from powerinfer.ops.linear import Linear
from powerinfer.ops.numba_half import numpy_weights

HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("cols,width", [(4096, 512), (11008, 688), (576, 288), (1536, 512), (64, 32), (32, 16),
                                        (16, 0), (100, 0)])
def test_panel_width_divides_the_row(cols, width):
    assert panels.panel_width(cols) == width


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", [(1, 64), (37, 576), (300, 512)])
def test_panels_round_trip(dtype, shape):
    w = torch.randn(shape).to(dtype)
    wp = panels.to_panels(w)
    p = panels.panel_width(shape[1])
    assert wp.shape == (shape[1] // p, shape[0], p) and wp.is_contiguous()
    assert torch.equal(wp[1 % wp.shape[0], :, :], w[:, (1 % wp.shape[0]) * p : (1 % wp.shape[0] + 1) * p])
    assert torch.equal(panels.rows_from_panels(wp, dtype), w)
    assert torch.equal(panels.rows_from_panels(wp), w.float())
    with pytest.raises(ValueError, match="no panel width"):
        panels.to_panels(torch.zeros(3, 100, dtype=dtype))  # no multiple of 16 divides 100


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows", [1, 2, 3, 37, 301])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_gemv_matches_reference(dtype, rows, threads, with_bias):
    """Odd row counts: a thread's share splits into two streams plus a leftover row."""
    w = torch.randn(rows, 576).to(dtype)
    b = torch.randn(rows) if with_bias else None
    x, r = torch.randn(576), torch.randn(rows)
    out = np.empty(rows, np.float32)
    cpu.set_threads(threads)
    try:
        panels.gemv_any(numpy_weights(panels.to_panels(w)), x.numpy(), cpu.NO_BIAS if b is None else b.numpy(),
                        r.numpy(), out, threads)
    finally:
        cpu.set_threads(2)
    torch.testing.assert_close(torch.from_numpy(out), reference.gemv(w, x, b, r), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", [(37, 576), (300, 256), (5, 1024)])
def test_linear_stores_half_weights_in_panels(dtype, shape):
    w, b = torch.randn(shape).to(dtype), torch.randn(shape[0])
    lin = Linear(w, b)
    assert lin.panels and lin.weight.dim() == 3 and (lin.out_features, lin.in_features) == shape
    assert lin.weight.nbytes == w.nbytes
    for T in (1, 3, 9):  # one token, a few (a GEMV each), a batch (torch, rows widened back)
        x, r = torch.randn(T, shape[1]), torch.randn(T, shape[0])
        expected = torch.stack([reference.gemv(w, x[t], b, r[t]) for t in range(T)])
        torch.testing.assert_close(lin(x, residual=r), expected, atol=1e-4, rtol=1e-4)
    # fp32 weights, the torch route and rows no width divides stay rows
    assert not Linear(w.float()).panels and Linear(w.float()).weight.dim() == 2
    assert not Linear(w, kernels=False).panels
    assert not Linear(torch.randn(4, 100).to(dtype)).panels and not Linear(torch.randn(4, 16).to(dtype)).panels


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("gated,act,up_act,criterion", [(True, "silu", None, 0), (True, "relu", None, 1),
                                                        (True, "gelu", "relu", 2), (False, "relu", None, 1),
                                                        (False, "gelu_pytorch_tanh", None, 0)])
def test_dense_ffn_same_in_panels_and_rows(dtype, gated, act, up_act, criterion):
    d, n_ff = 192, 320  # panel widths 96 (w_in rows) and 160 (w_out rows)
    w_in = torch.randn((2 if gated else 1) * n_ff, d).to(dtype)
    w_out = (torch.randn(d, n_ff) / 8).to(dtype)
    b_in, b_out = torch.randn(w_in.shape[0]).numpy(), torch.randn(d).numpy()
    h = torch.randn(d).numpy()
    args = (activation_id(act), activation_id(up_act), criterion, np.float32(0.3))
    outs = []
    for lay in (lambda t: t, panels.to_panels):
        x = np.ones(d, np.float32)
        decode.dense_ffn(h, numpy_weights(lay(w_in)), b_in, numpy_weights(lay(w_out)), b_out, gated, *args, x, panels.threads())
        outs.append(x)
    np.testing.assert_allclose(outs[1], outs[0], atol=2e-4, rtol=2e-4)
    assert not np.allclose(outs[0], 1.0)


@pytest.mark.parametrize("dtype", HALF)
def test_attention_block_same_in_panels_and_rows(dtype):
    n_heads, n_kv, hd = 4, 2, 32
    d = n_heads * hd  # 128
    wqkv = (torch.randn((n_heads + 2 * n_kv) * hd, d) / 8).to(dtype)
    wo = (torch.randn(d, n_heads * hd) / 8).to(dtype)
    max_len, pos = 16, 5
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.outer(torch.arange(max_len).float(), inv_freq)
    cos, sin = torch.cos(angles).numpy(), torch.sin(angles).numpy()
    x0, norm_w, ffn_w = torch.randn(d).numpy(), torch.rand(d).numpy(), torch.rand(d).numpy()
    kv = torch.randn(2, n_kv, max_len, hd).numpy()
    results = []
    for lay in (lambda t: t, panels.to_panels):
        x, h_out, k_cache, v_cache = x0.copy(), np.empty(d, np.float32), kv[0].copy(), kv[1].copy()
        decode.attention_block(x, norm_w, 1e-5, numpy_weights(lay(wqkv)), cpu.NO_BIAS, numpy_weights(lay(wo)),
                               cpu.NO_BIAS, ffn_w, pos, cos, sin, k_cache, v_cache, n_heads, n_kv, hd, hd**-0.5,
                               True, h_out, panels.threads())
        results.append((x, h_out, k_cache[:, pos]))
    for a, b in zip(*results):
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)
    assert not np.allclose(results[0][0], x0)


def test_packed_all_cpu_dense_layout_uses_panels_and_equals_the_dense_model(tmp_path, smollm2_path):
    """A packed bf16 model, all on the CPU, in dense mode: its tiers re-lay into panels and
    decode (the dense FFN kernel), a few-token prefill (the kernel per token) and a batch
    (torch, rows widened from the panels) equal the dense model's, which uses panels in its
    own Linear and DenseFFN code."""
    import powerinfer
    from powerinfer.engine.packed import load_packed
    from powerinfer.offline.pack import pack_model
    from powerinfer.offline.stats import LayerStats, Profile
    from powerinfer.paths import content_hash
    from tiny_models import build_tokenized_llama

    path = build_tokenized_llama(tmp_path / "m", smollm2_path, hidden_size=64, intermediate_size=128)
    lm = powerinfer.load(str(path), dtype="bf16", with_tokenizer=False)
    a = lm.model.args
    prof = Profile([LayerStats(np.random.default_rng(i).integers(0, 100, a.ffn_dim).astype(np.int64), 100, 0.0)
                    for i in range(a.n_layers)], {"model": {"hash": content_hash(str(path))}, "criterion": "gate"})
    pack_model(str(path), str(tmp_path / "packed"), prof, None, None, "bf16")
    m = load_packed(str(tmp_path / "packed"), mode="dense", dtype="bf16", with_tokenizer=False).model
    tiers = [layer.ffn.cpu for layer in m.layers]
    assert all(t.dense_panels is not None and t.w_gate is None for t in tiers)
    assert sum(t.nbytes for t in tiers[0].tensors()) == 3 * a.ffn_dim * a.d_model * 2
    assert all(layer.attn.qkv.panels for layer in lm.model.layers)
    ids = torch.arange(1, 12)
    for prompt in (ids, ids[:3]):
        torch.testing.assert_close(m.forward(prompt, m.new_cache(64), all_logits=True),
                                   lm.model.forward(prompt, lm.model.new_cache(64), all_logits=True),
                                   atol=1e-4, rtol=1e-4)
    caches = m.new_cache(16), lm.model.new_cache(16)
    for t in ids:
        torch.testing.assert_close(m.forward(t[None], caches[0]), lm.model.forward(t[None], caches[1]),
                                   atol=1e-4, rtol=1e-4)
