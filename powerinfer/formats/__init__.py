"""Checkpoint readers: GGUF files, HF directories (config.json + safetensors)."""
