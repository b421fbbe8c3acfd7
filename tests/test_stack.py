"""One-call decode through every layer (models/stack.py) and the fused lanes FFN it runs
(ops/decode.py `_gated_records`): equal to the per-layer path and to the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_quant import acts, quantized
from tiny_models import VOCAB, build_tiny

from powerinfer.loader import load
from powerinfer.models.ffn import InstrumentedFFN
from powerinfer.ops import batch_decode, cpu, decode, lanes, panels, quant
from powerinfer.ops.activations import activation_id


def _decode(model, tokens: torch.Tensor, stack: bool) -> torch.Tensor:
    model.stack_decode = stack
    cache = model.new_cache(len(tokens))
    model.forward(tokens[:3], cache)
    return torch.stack([model.forward(tokens[i : i + 1], cache) for i in range(3, len(tokens))])


def test_stack_decode_equals_per_layer_decode_on_the_default_model(smollm2_path):
    """The embedded Q4_1 model (lanes): one call per token gives the per-layer path's logits
    to the bit, and is what decode runs."""
    model = load(smollm2_path, dtype="native", with_tokenizer=False).model
    tokens = torch.randint(0, 49152, (12,), generator=torch.Generator().manual_seed(0))
    one_call = _decode(model, tokens, True)
    assert model._stack is not None
    per_layer = _decode(model, tokens, False)
    assert torch.equal(one_call, per_layer)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_stack_decode_equals_per_layer_decode_on_float_weights(dtype, tmp_path):
    model = load(str(build_tiny("llama", tmp_path)), dtype=dtype, with_tokenizer=False).model
    tokens = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(1))
    one_call = _decode(model, tokens, True)
    assert model._stack is not None
    assert torch.equal(one_call, _decode(model, tokens, False))


def test_stack_decode_steps_aside_for_a_swapped_ffn(tmp_path):
    """The profiler swaps in instrumented FFNs: decode must run them (per layer), then go
    back to one call when the dense FFNs return."""
    model = load(str(build_tiny("llama", tmp_path)), with_tokenizer=False).model
    tokens = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(2))
    _decode(model, tokens, True)
    assert model._stack is not None
    dense = [layer.ffn for layer in model.layers]
    seen = []
    for layer in model.layers:
        layer.ffn = InstrumentedFFN(layer.ffn, "gate", None, lambda x, score: seen.append(score.shape))
    _decode(model, tokens, True)
    assert model._stack is None and seen
    for layer, ffn in zip(model.layers, dense):
        layer.ffn = ffn
    _decode(model, tokens, True)
    assert model._stack is not None


def test_stack_not_built_for_mixed_formats_across_layers(tmp_path):
    """Layers whose arrays differ in type (a Q4_K_M file's Q6_K layers) keep the per-layer
    path rather than fail."""
    from powerinfer.models.stack import layer_stack
    from powerinfer.ops.linear import Linear

    model = load(str(build_tiny("llama", tmp_path)), dtype="bf16", with_tokenizer=False).model
    assert layer_stack(model) is not None
    f = model.layers[0].ffn
    f.w_out = Linear(f.w_out.w.rows().float(), None)  # fp32 rows in one layer, bf16 panels elsewhere
    assert layer_stack(model) is None


@pytest.mark.parametrize("fmt_in,fmt_out", [("Q4_0", "Q4_0"), ("Q8_0", "Q4_1"), ("Q4_K", "Q6_K"), ("Q4_K", "Q4_K"),
                                            ("Q4_1", "Q5_K")])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_lanes_ffn_equals_reference_and_two_passes(fmt_in, fmt_out, threads):
    """Gate/up in lanes, down in lanes or GGUF rows: the one-pass records (`_gated_records`)
    give the reference FFN, and the two-pass batch kernel's result to the bit."""
    import numba

    d, n_ff = 256, 512
    w_in = lanes.interleave(quantized(2 * n_ff, d, fmt_in, 1))
    w_out_rows = quantized(d, n_ff, fmt_out, 2)
    w_out = lanes.interleave(w_out_rows) if lanes.fits(w_out_rows) else w_out_rows
    h = np.random.default_rng(3).standard_normal(d).astype(np.float32)
    x = np.random.default_rng(4).standard_normal(d).astype(np.float32)
    b_out = np.random.default_rng(5).standard_normal(d).astype(np.float32)
    silu = activation_id("silu")
    numba.set_num_threads(threads)
    try:
        got = x.copy()
        decode.dense_ffn(h, w_in.numpy(), cpu.NO_BIAS, w_out.numpy(), b_out, True, silu, -1, 0, np.float32(0.0), got,
                         panels.threads())
        two = x[None].copy()
        batch_decode.dense_ffn(h[None], w_in.numpy(), cpu.NO_BIAS, w_out.numpy(), b_out, True, silu, -1, 0,
                               np.float32(0.0), two, panels.threads())
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert np.array_equal(got, two[0])
    g = lanes.dequantize(w_in) @ acts(torch.from_numpy(h))
    hidden = torch.nn.functional.silu(g[:n_ff]) * g[n_ff:]
    expected = torch.from_numpy(x) + quant.dequantize(w_out_rows) @ acts(hidden) + torch.from_numpy(b_out)
    torch.testing.assert_close(torch.from_numpy(got), expected, atol=2e-4, rtol=1e-4)
