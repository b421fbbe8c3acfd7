"""Tiny random-weight checkpoints of every family, made with transformers' own classes."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96


def _configs() -> dict:
    from transformers import (FalconConfig, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, OPTConfig,
                              Phi3Config, Qwen2Config, Qwen3Config)

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
        # windows of 4 and caps of a few units, so that both change the tiny model's outputs
        # query_pre_attn_scalar = head_dim as in the released 2B and 9B: llama.cpp's converter drops it
        "gemma2": Gemma2Config(**llama, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                               attn_logit_softcapping=1.5, final_logit_softcapping=3.0),
        "gemma2_query_scalar": Gemma2Config(**llama, head_dim=16, sliding_window=4, query_pre_attn_scalar=20,
                                            attn_logit_softcapping=1.5, final_logit_softcapping=3.0),
        # six layers: Gemma 3's pattern (five windowed, then a global one), as llama.cpp assumes it
        "gemma3": Gemma3TextConfig(**{**llama, "num_hidden_layers": 6}, head_dim=24, sliding_window=4,
                                   query_pre_attn_scalar=24, final_logit_softcapping=3.0,
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1000000.0}}),
        # Phi-3-mini-4k's shape: a sliding window (4 here, so that it bites)
        "phi3": Phi3Config(**llama, sliding_window=4, pad_token_id=0, eos_token_id=2, bos_token_id=1),
        # Phi-3-mini-128k's LongRoPE (short factors below original_max_position_embeddings; 256 of
        # them, as llama.cpp sizes a context at least 256 and picks long factors above the original)
        "phi3_longrope": Phi3Config(**{**llama, "max_position_embeddings": 1024}, pad_token_id=0, eos_token_id=2,
                                    bos_token_id=1, original_max_position_embeddings=256,
                                    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                     "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                     "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
        "opt": OPTConfig(**opt),
        "opt_proj_postnorm": OPTConfig(**{**opt, "word_embed_proj_dim": 32}, do_layer_norm_before=False),
        "opt_proj_prenorm": OPTConfig(**{**opt, "word_embed_proj_dim": 48}),
        # num_kv_heads=1 as Falcon-7B's config implies it (transformers ignores it under multi_query;
        # llama.cpp's converter reads it)
        "falcon_mq_parallel": FalconConfig(**falcon, multi_query=True, parallel_attn=True, bias=False, num_kv_heads=1),
        "falcon_sequential_bias": FalconConfig(**falcon, multi_query=False, parallel_attn=False, bias=True),
        "falcon_new_arch": FalconConfig(**falcon, new_decoder_architecture=True, num_kv_heads=2),
        "falcon_new_arch_1ln": FalconConfig(**falcon, new_decoder_architecture=True, num_kv_heads=2,
                                            num_ln_in_parallel_attn=1),
    }


TINY_MODELS = sorted(_configs())


def _widen(config, hidden: int) -> None:
    """Every projection `hidden` wide (4 heads of hidden/4, an FFN twice as wide), so that
    llama.cpp's K-quants (256-wide blocks) apply to every weight row."""
    config.hidden_size, config.intermediate_size = hidden, 2 * hidden
    if hasattr(config, "ffn_hidden_size"):  # Falcon: 4 * hidden, as llama.cpp's converter assumes
        config.ffn_hidden_size = 4 * hidden
    head_dim = hidden // config.num_attention_heads
    if getattr(config, "head_dim", None) and not isinstance(getattr(type(config), "head_dim", None), property):
        config.head_dim = head_dim
    if getattr(config, "query_pre_attn_scalar", None):
        config.query_pre_attn_scalar = head_dim
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":  # one factor per rotated pair
        rope["short_factor"] = [1.0 + 0.1 * i / (head_dim // 16) for i in range(head_dim // 2)]
        rope["long_factor"] = [2.0 + 0.5 * i / (head_dim // 16) for i in range(head_dim // 2)]


def build_tiny(name: str, out: Path, tokenizer=None, hidden: int | None = None) -> Path:
    """Save tiny model `name` (random weights, seed 0) as an HF directory under `out`; with an
    HF `tokenizer`, sized for its vocabulary and saved with it (what a GGUF converter needs);
    with `hidden`, widened to that width (see _widen)."""
    from transformers import AutoModelForCausalLM

    config = _configs()[name]
    if hidden is not None:
        _widen(config, hidden)
    if tokenizer is not None:
        config.vocab_size = len(tokenizer)
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        config.pad_token_id = None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; scale up so differences would show
        for p in model.parameters():
            if p.dim() >= 1:
                p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    path = out / name
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
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
