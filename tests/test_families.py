"""Every family against transformers on the same tiny random weights."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY_MODELS, VOCAB, build_tiny

from powerinfer.loader import load


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_logits_match_transformers(name, tiny_dir):
    path = build_tiny(name, tiny_dir)
    ours = load(str(path), with_tokenizer=False).model
    ref = hf_model(path)
    tokens = torch.randint(0, VOCAB, (12,))
    with torch.no_grad():
        expected = ref(tokens[None]).logits[0]
    # prefill of the first 9 tokens, then 3 cached decode steps
    cache = ours.new_cache(16)
    got = [ours.forward(tokens[:9], cache, all_logits=True)]
    for i in range(9, 12):
        got.append(ours.forward(tokens[i : i + 1], cache, all_logits=True))
    got = torch.cat(got)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "opt_proj_postnorm",
                                  "falcon_new_arch"])
def test_greedy_tokens_match_transformers(name, tiny_dir):
    from powerinfer.engine.generate import generate_step
    from powerinfer.engine.sample import Sampler, SamplingParams

    path = tiny_dir / name if (tiny_dir / name).exists() else build_tiny(name, tiny_dir)
    ours = load(str(path), with_tokenizer=False).model
    ref = hf_model(path)
    prompt = torch.randint(0, VOCAB, (7,))
    ref.generation_config.eos_token_id = None  # generate_step itself knows no EOS
    with torch.no_grad():
        expected = ref.generate(prompt[None], attention_mask=torch.ones(1, 7, dtype=torch.long),
                                max_new_tokens=20, do_sample=False, pad_token_id=0)[0, 7:].tolist()
    assert len(expected) == 20
    got = list(generate_step(ours, prompt.tolist(), Sampler(SamplingParams(temperature=0)), 20))
    assert got == expected


def test_cached_decode_equals_uncached(tiny_dir):
    path = tiny_dir / "llama" if (tiny_dir / "llama").exists() else build_tiny("llama", tiny_dir)
    model = load(str(path), with_tokenizer=False).model
    tokens = torch.randint(0, VOCAB, (10,))
    full = model.forward(tokens, model.new_cache(10), all_logits=True)
    cache = model.new_cache(10)
    steps = torch.stack([model.forward(tokens[i : i + 1], cache) for i in range(10)])
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    # a prefill that continues a filled cache uses the offset causal mask
    cache = model.new_cache(10)
    model.forward(tokens[:4], cache)
    rest = model.forward(tokens[4:], cache, all_logits=True)
    torch.testing.assert_close(rest, full[4:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_dtypes_close_to_fp32(dtype, tiny_dir):
    path = tiny_dir / "llama" if (tiny_dir / "llama").exists() else build_tiny("llama", tiny_dir)
    tokens = torch.randint(0, VOCAB, (8,))
    ref = load(str(path), with_tokenizer=False).model
    half = load(str(path), dtype=dtype, with_tokenizer=False).model
    a = ref.forward(tokens, ref.new_cache(8), all_logits=True)
    b = half.forward(tokens, half.new_cache(8), all_logits=True)
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.1 * a.abs().max()


def test_bamboo_style_relu_on_up_matches_patched_transformers(tmp_path):
    """`up_act: relu` (ReLU on gate and up, as Bamboo) against HF Llama with that MLP patched in."""
    import json
    import types

    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, hidden_act="relu")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).eval()
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "up_act": "relu"}))

    def drelu_forward(self, x):
        return self.down_proj(torch.relu(self.gate_proj(x)) * torch.relu(self.up_proj(x)))

    for layer in ref.model.layers:
        layer.mlp.forward = types.MethodType(drelu_forward, layer.mlp)
    tokens = torch.randint(0, VOCAB, (9,))
    ours = load(str(tmp_path), with_tokenizer=False).model
    cache = ours.new_cache(9)
    got = torch.cat([ours.forward(tokens[:6], cache, all_logits=True),
                     *[ours.forward(tokens[i : i + 1], cache, all_logits=True) for i in range(6, 9)]])
    with torch.no_grad():
        torch.testing.assert_close(got, ref(tokens[None]).logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "llama_tied_relu"])
def test_fused_decode_equals_per_op_decode(name, dtype, tiny_dir):
    """The one-call attention block and dense FFN (ops/decode.py) against the per-op path."""
    path = tiny_dir / name if (tiny_dir / name).exists() else build_tiny(name, tiny_dir)
    model = load(str(path), dtype=dtype, with_tokenizer=False).model
    assert all(layer.fused_decode for layer in model.layers)
    tokens = torch.randint(0, VOCAB, (9,))

    def decode_all() -> torch.Tensor:
        cache = model.new_cache(9)
        model.forward(tokens[:3], cache)
        return torch.stack([model.forward(tokens[i : i + 1], cache) for i in range(3, 9)])

    fused = decode_all()
    for layer in model.layers:
        layer.fused_decode = False
    per_op = decode_all()
    torch.testing.assert_close(fused, per_op, atol=1e-4, rtol=1e-4)


def test_fused_decode_not_used_where_it_does_not_apply(tiny_dir):
    for name in ("opt", "falcon_mq_parallel"):
        path = tiny_dir / name if (tiny_dir / name).exists() else build_tiny(name, tiny_dir)
        model = load(str(path), with_tokenizer=False).model
        assert not any(layer.fused_decode for layer in model.layers)
