"""Write tiny HF llama/qwen2 checkpoints as GGUF files the way llama.cpp's converter does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp stores llama q/k rows interleaved (convert_hf_to_gguf.LlamaModel.permute)
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_gguf(hf_dir: Path, out: Path, arch: str = "llama", raw_types: dict[str, int] | None = None,
                f16: bool = False, tokenizer_from: str | None = None, quantized: dict[str, int] | None = None) -> Path:
    """Convert the tiny HF model in `hf_dir` to GGUF; `raw_types` forces a tensor's GGML type
    (zero bytes); `quantized` stores a tensor quantized to a type by gguf's quantizer;
    `f16` stores the matrices as F16 (norms stay F32, as llama.cpp's converter does);
    `tokenizer_from` copies the tokenizer.* metadata of that GGUF file (same vocabulary)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    sd = {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if tokenizer_from:
        for key, field in gguf.GGUFReader(tokenizer_from).fields.items():
            if key.startswith("tokenizer."):
                w.add_key_value(key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if "lm_head.weight" in sd and not cfg.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for i in range(cfg.num_hidden_layers):
        for hf_name, g_name in names.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{hf_name}.{kind}"
                if key not in sd:
                    continue
                t = sd[key]
                if arch == "llama" and g_name in ("attn_q", "attn_k"):
                    t = _permute(t, cfg.num_attention_heads if g_name == "attn_q" else cfg.num_key_value_heads)
                tensors[f"blk.{i}.{g_name}.{kind}"] = t
    for name, t in tensors.items():
        if raw_types and name in raw_types:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_types[name])]
            raw = np.zeros((t.shape[0], t.shape[-1] // block * type_size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=raw_types[name])
        elif quantized and name in quantized:
            qtype = gguf.GGMLQuantizationType(quantized[name])
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t, dtype=np.float32), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float16 if f16 and t.ndim == 2 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def tiny_gguf_config(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    extra = {"head_dim": 24} if arch == "qwen3" else {}
    torch.manual_seed(0)
    return cls(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=arch != "llama", **extra)
