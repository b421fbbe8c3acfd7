"""The default model's text splits into the token ids llama.cpp gives for the same GGUF file.

The expected ids were produced by llama.cpp's `llama-tokenize -m SmolLM2-135M-Instruct.Q4_1.gguf
-p TEXT --ids` (llama.cpp as vendored in llama-cpp-python 0.3.36): the file names the
`smollm` pre-tokenizer, which cuts every digit apart (as SmolLM2's own tokenizer.json does).
"""

from __future__ import annotations

from powerinfer.tokenizer import load_tokenizer

TEXT = "TERMS AND CONDITIONS\n\n  0. Definitions, 29 June 2007; call 555-1234 or x1000."
LLAMA_CPP_IDS = [8978, 5247, 7485, 26819, 39892, 32, 30, 39331, 28, 216, 34, 41, 4019, 216, 34, 32, 32, 39, 43, 946,
                 216, 37, 37, 37, 29, 33, 34, 35, 36, 355, 1792, 33, 32, 32, 32, 30]


def test_default_model_tokenizes_as_llama_cpp(smollm2_path):
    first = load_tokenizer(smollm2_path)  # built from the metadata, or read back from the cache
    again = load_tokenizer(smollm2_path)  # read back from the cache
    assert first.encode(TEXT, add_special_tokens=False) == LLAMA_CPP_IDS
    assert again.encode(TEXT, add_special_tokens=False) == LLAMA_CPP_IDS
    assert again.decode(LLAMA_CPP_IDS) == TEXT
