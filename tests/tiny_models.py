"""Tiny random-weight checkpoints of every family, made with transformers' own classes."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96


def _configs() -> dict:
    from transformers import FalconConfig, LlamaConfig, MistralConfig, OPTConfig, Qwen2Config, Qwen3Config

    llama = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    falcon = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, ffn_hidden_size=112)
    opt = dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=128, word_embed_proj_dim=64)
    return {
        "llama": LlamaConfig(**llama, tie_word_embeddings=False),
        "llama_tied_relu": LlamaConfig(**llama, tie_word_embeddings=True, hidden_act="relu"),
        "llama3_rope": LlamaConfig(**llama, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        "llama_linear_rope": LlamaConfig(**llama, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                   "factor": 2.0}),
        "mistral": MistralConfig(**llama, sliding_window=None),
        "qwen2": Qwen2Config(**llama, tie_word_embeddings=True),
        # q/k norms; head_dim 24 with 4 heads: q is 96 wide on a 64-wide model, as Qwen3's are
        "qwen3": Qwen3Config(**llama, head_dim=24, tie_word_embeddings=True),
        "opt": OPTConfig(**opt),
        "opt_proj_postnorm": OPTConfig(**{**opt, "word_embed_proj_dim": 32}, do_layer_norm_before=False),
        "opt_proj_prenorm": OPTConfig(**{**opt, "word_embed_proj_dim": 48}),
        "falcon_mq_parallel": FalconConfig(**falcon, multi_query=True, parallel_attn=True, bias=False),
        "falcon_sequential_bias": FalconConfig(**falcon, multi_query=False, parallel_attn=False, bias=True),
        "falcon_new_arch": FalconConfig(**falcon, new_decoder_architecture=True, num_kv_heads=2),
        "falcon_new_arch_1ln": FalconConfig(**falcon, new_decoder_architecture=True, num_kv_heads=2,
                                            num_ln_in_parallel_attn=1),
    }


TINY_MODELS = sorted(_configs())


def build_tiny(name: str, out: Path) -> Path:
    """Save tiny model `name` (random weights, seed 0) as an HF directory under `out`."""
    from transformers import AutoModelForCausalLM

    config = _configs()[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; scale up so differences would show
        for p in model.parameters():
            if p.dim() >= 1:
                p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    path = out / name
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_tokenized_llama(out: Path, smollm2_path: str, **overrides) -> Path:
    """A tiny random llama with SmolLM2's tokenizer (vocab 49152), so it takes text prompts."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from powerinfer.tokenizer import load_tokenizer

    cfg = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, eos_token_id=2,
               bos_token_id=1)
    cfg.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    load_tokenizer(smollm2_path).hf.save_pretrained(out)
    return out
