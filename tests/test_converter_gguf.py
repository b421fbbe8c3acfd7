"""Every family with a GGUF architecture, from files made by llama.cpp's own converter
(convert_hf_to_gguf.py) out of tiny random HF checkpoints: logits against transformers on the
HF checkpoint, greedy tokens, the tokenizer and chat template read from the file, and native
Q8_0 weights against the same file dequantized."""

from __future__ import annotations

import pytest
import torch
from converter import SPM_FAMILIES, convert_tiny, require_converter

from powerinfer.loader import load

CONVERTED = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi3_longrope", "falcon_mq_parallel",
             "falcon_new_arch", "falcon_new_arch_1ln"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(name, outtype) -> (HF dir, GGUF path), made once per module."""
    require_converter()
    root = tmp_path_factory.mktemp("converted")
    made: dict = {}

    def get(name: str, outtype: str = "f32"):
        if (name, outtype) not in made:
            made[name, outtype] = convert_tiny(name, root, outtype)
        return made[name, outtype]

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
    # a second load reads the tokenizer saved by the first: it must split text the same way
    from powerinfer.tokenizer import load_tokenizer

    longer = "The GNU General Public License, version 3 (29 June 2007):\n\n  free   software\tfor all. 12345"
    assert load_tokenizer(str(gguf)).encode(longer) == reference_tokens(name, hf_dir, longer)
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


@pytest.mark.parametrize("name", CONVERTED)  # fused phi3 tensors cut as blocks, q/k norms, windows on blocks
def test_converter_q8_0_native_matches_dequantized(name, converted):
    """The converter's Q8_0 file run on its blocks is the same file widened to fp32, but for
    the int8 rounding of the activations (about 1/254 of each 32 values' largest): logits
    on average within 0.5% of their range (5% at most) and the same next tokens but for near-ties."""
    _, gguf = converted(name, "q8_0")
    native = load(str(gguf), dtype="native", with_tokenizer=False).model
    widened = load(str(gguf), dtype="fp32", with_tokenizer=False).model
    assert any(t.dtype == torch.uint8 for t in native.tensors())
    tokens = torch.arange(3, 15)
    a = native.forward(tokens, native.new_cache(12), all_logits=True)
    b = widened.forward(tokens, widened.new_cache(12), all_logits=True)
    span = b.max() - b.min()
    assert (a - b).abs().mean() < 0.005 * span and (a - b).abs().max() < 0.05 * span
    # the same next tokens, but for near-ties: where the choices part, the widened logit of
    # the native choice is within 1% of the range of the best
    chosen = b.gather(-1, a.argmax(-1, keepdim=True)).squeeze(-1)
    assert (b.max(-1).values - chosen).max() <= 0.01 * span
    assert (a.argmax(-1) == b.argmax(-1)).sum() >= len(tokens) - 2


def test_a_failed_conversion_says_why_and_the_next_one_runs(tmp_path, converted):
    """The shared converter process reports a job's failure with the converter's own words and
    stays usable (tests/converter_worker.py)."""
    from converter import convert

    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    with pytest.raises(AssertionError, match="NoSuchForCausalLM"):
        convert(tmp_path, tmp_path / "no.gguf")
    _, gguf = converted("llama")
    assert load(str(gguf), with_tokenizer=False).model is not None


@pytest.mark.parametrize("name", ["qwen2", "gemma2", "phi3", "mistral"])  # Qwen2, Gemma, sentencepiece, a renamed type
def test_the_tokenizer_is_built_as_autotokenizer_builds_it(name, converted, tmp_path):
    """`load_tokenizer` picks the tokenizer class without AutoTokenizer's slow read of the whole
    config (powerinfer.tokenizer._tokenizer_from_gguf): the same class and the same saved files."""
    from transformers import AutoTokenizer

    from powerinfer.formats.gguf_check import read_header
    from powerinfer.tokenizer import _tokenizer_from_gguf

    _, gguf = converted(name)
    ours = _tokenizer_from_gguf(str(gguf), read_header(str(gguf), gguf.stat().st_size).metadata)
    auto = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert type(ours) is type(auto)
    ours.save_pretrained(tmp_path / "ours")
    auto.save_pretrained(tmp_path / "auto")
    saved = sorted(p.name for p in (tmp_path / "auto").iterdir())
    assert saved == sorted(p.name for p in (tmp_path / "ours").iterdir())
    for file in saved:
        assert (tmp_path / "ours" / file).read_bytes() == (tmp_path / "auto" / file).read_bytes(), file
