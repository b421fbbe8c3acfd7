"""Every family with a GGUF architecture, from files made by llama.cpp's own converter
(convert_hf_to_gguf.py) out of tiny random HF checkpoints: logits against transformers on the
HF checkpoint, greedy tokens, the tokenizer and chat template read from the file, and native
Q8_0 weights against the same file dequantized."""

from __future__ import annotations

import shutil

import pytest
import torch
from converter import convert, require_converter, spm_tokenizer
from tiny_models import build_tiny

from powerinfer.loader import load

# the converter takes gpt2-style tokenizers only when it recognises their pre-tokenizer, and
# these families' paths want a SentencePiece tokenizer.model first: they get one trained here
SPM_FAMILIES = {"gemma2", "qwen2", "phi3", "phi3_longrope"}
CONVERTED = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi3_longrope"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (HF dir, F32 GGUF path), built once per module and family."""
    require_converter()
    root = tmp_path_factory.mktemp("converted")
    made: dict = {}

    def get(name: str, outtype: str = "f32"):
        key = (name, outtype)
        if key not in made:
            hf_dir = root / name
            if not hf_dir.exists():
                if name in SPM_FAMILIES:
                    spm_dir = root / f"spm-{name}"
                    tokenizer = spm_tokenizer(spm_dir, dummy_prefix=not name.startswith("gemma"))
                    build_tiny(name, root, tokenizer)
                    shutil.copy(spm_dir / "tokenizer.model", hf_dir)
                else:
                    from powerinfer.paths import default_model_path
                    from powerinfer.tokenizer import load_tokenizer

                    build_tiny(name, root, load_tokenizer(default_model_path()).hf)
            made[key] = hf_dir, convert(hf_dir, root / f"{name}.{outtype}.gguf", outtype)
        return made[key]

    return get


def reference_tokens(name: str, hf_dir, text: str) -> list[int]:
    """The source tokenizer's ids for `text`: SentencePiece itself on the tokenizer.model the
    converter read (BOS first), or the checkpoint's tokenizer.json through transformers."""
    if name in SPM_FAMILIES:
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
        return [sp.bos_id()] + sp.encode(text)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)(text).input_ids


def hf_logits(hf_dir, tokens):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref, ref(tokens[None]).logits[0]


@pytest.mark.parametrize("name", CONVERTED)
def test_converter_gguf_matches_transformers(name, converted):
    hf_dir, gguf = converted(name)
    lm = load(str(gguf))
    model, tok = lm.model, lm.tokenizer
    text = "Explain in three sentences why the sky is blue."
    tokens = torch.tensor(tok.encode(text))
    ref, expected = hf_logits(hf_dir, tokens)
    assert len(tokens) >= 8
    # prefill, then cached decode steps: the windowed layers (window 4) see both paths
    cache = model.new_cache(len(tokens) + 4)
    got = [model.forward(tokens[:5], cache, all_logits=True)]
    got += [model.forward(tokens[i : i + 1], cache, all_logits=True) for i in range(5, len(tokens))]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)

    assert tokens.tolist() == reference_tokens(name, hf_dir, text)
    assert tok.has_chat_template
    prompt = tok.chat_prompt([{"role": "user", "content": "hi"}])
    assert "hi" in prompt and prompt != "hi"

    from powerinfer.engine.generate import generate_step
    from powerinfer.engine.sample import Sampler, SamplingParams

    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        want = ref.generate(tokens[None], attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                            max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(tokens):].tolist()
    assert list(generate_step(model, tokens.tolist(), Sampler(SamplingParams(temperature=0)), 12)) == want


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_converter_q8_0_native_matches_dequantized(name, converted):
    """The converter's Q8_0 file run on its blocks equals the same file widened to fp32."""
    _, gguf = converted(name, "q8_0")
    native = load(str(gguf), dtype="native", with_tokenizer=False).model
    widened = load(str(gguf), dtype="fp32", with_tokenizer=False).model
    assert any(t.dtype == torch.uint8 for t in native.tensors())
    tokens = torch.arange(3, 15)
    a = native.forward(tokens, native.new_cache(12), all_logits=True)
    b = widened.forward(tokens, widened.new_cache(12), all_logits=True)
    torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-3)
