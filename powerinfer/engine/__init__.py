"""The online engine: KV cache, FFN blocks, sampling and the generation loop."""
