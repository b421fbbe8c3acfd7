"""The real embedded SmolLM2-135M GGUF against transformers loading the same file."""

from __future__ import annotations

import os
import re

import pytest
import torch

import powerinfer


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return powerinfer.load(smollm2_path)


@pytest.fixture(scope="module")
def ours_fp32(smollm2_path):
    return powerinfer.load(smollm2_path, dtype="fp32")


@pytest.fixture(scope="module")
def oracle(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_path),
                                                gguf_file=os.path.basename(smollm2_path),
                                                dtype=torch.float32).eval()


def test_config_read_from_gguf(ours):
    a = ours.args
    assert (a.n_layers, a.d_model, a.ffn_dim, a.n_heads, a.n_kv_heads, a.vocab_size) == (30, 576, 1536, 9, 3, 49152)
    assert a.tie_embeddings and a.act == "silu"


def test_logits_match_transformers(ours, ours_fp32, oracle):
    """Dequantized to fp32, our model code equals transformers' on the same file (prefill, then
    decode steps); on the file's own blocks (int8 activations, as llama.cpp) the logits stay
    near and pick the same tokens but for near-ties."""
    ids = ours.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    tokens = torch.tensor(ids)
    with torch.no_grad():
        expected = oracle(tokens[None]).logits[0]
    for lm, exact in ((ours_fp32, True), (ours, False)):
        cache = lm.model.new_cache(len(ids))
        got = torch.cat([lm.model.forward(tokens[:-3], cache, all_logits=True)] +
                        [lm.model.forward(tokens[i : i + 1], cache, all_logits=True)
                         for i in range(len(ids) - 3, len(ids))])
        if exact:
            torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
            assert torch.equal(got.argmax(-1), expected.argmax(-1))
        else:
            assert (got - expected).abs().mean() < 0.5 and (got - expected).abs().max() < 2.5
            # the same tokens, but for near-ties: where the pick differs, the oracle's logit
            # of our pick is within 0.75 of its best (at the int8 activations' error)
            picked = got.argmax(-1)
            shortfall = expected.max(-1).values - expected.gather(1, picked[:, None])[:, 0]
            assert (shortfall < 0.75).all() and (picked == expected.argmax(-1)).float().mean() >= 0.9


def test_greedy_continuation_names_paris(ours):
    text = powerinfer.generate(ours, "The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in text


def test_chat_template_and_eos(ours):
    tok = ours.tokenizer
    prompt = tok.chat_prompt([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>") and prompt.rstrip().endswith("<|im_start|>assistant")
    responses = list(powerinfer.stream_generate(ours, "Say hello.", max_tokens=200, temperature=0, chat=True))
    assert responses[-1].finish_reason == "stop"  # ended by <|im_end|>, not by the length limit
    assert "<|im_end|>" not in "".join(r.text for r in responses)


def test_our_gguf_header_reader_equals_the_gguf_package(smollm2_path):
    """formats/gguf_check.py reads the header itself (50x faster than gguf.GGUFReader on this
    vocabulary): every metadata value and every tensor's type, shape, offset and bytes must
    be what the gguf package's reader gives."""
    import gguf
    import numpy as np

    from powerinfer.formats.gguf import open_gguf

    ours = open_gguf(smollm2_path)
    theirs = gguf.GGUFReader(smollm2_path)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its pseudo-fields
    assert fields.keys() == ours.metadata.keys()
    for key, value in fields.items():
        assert ours.metadata[key] == pytest.approx(value) if isinstance(value, float) else ours.metadata[key] == value
        assert type(ours.metadata[key]) is type(value), key
    assert len(theirs.tensors) == len(ours.tensor_names()) == 272
    for t in theirs.tensors:
        mine = ours._tensors[t.name]
        assert (mine.tensor_type, mine.shape, mine.data_offset) == (t.tensor_type, [int(d) for d in t.shape],
                                                                    int(t.data_offset))
        assert mine.data.shape == t.data.shape and np.array_equal(mine.data.view(np.uint8), t.data.view(np.uint8))


@pytest.mark.parametrize("data,message", [
    (b"\x02\0\0\0\0\0\0\0ab\x03\0\0\0\0\0\0\0cde", None),
    (b"\x02\0\0\0\0\0\0\0ab\x03\0", "the length of tokens[1] is cut short (needs 8 bytes at byte 10"),
    (b"\x02\0\0\0\0\0\0\0ab\x05\0\0\0\0\0\0\0cd", "tokens[1] is cut short (needs 5 bytes at byte 18"),
    (b"\x02\0\0\0\0\0\0\0ab\x03\0\0\0\0\0\0\0c\xffd", "corrupt GGUF file: tokens[1] is not UTF-8 text"),
    (b"\0\0\0\0\0\0\0\x01", "corrupt GGUF file: tokens[0] claims 72057594037927936 bytes"),
])
def test_string_arrays_are_read_whole_or_refused_by_name(data, message):
    """A vocabulary's strings are read in one loop (formats/gguf_check.py): each string cut
    short, not UTF-8, or claiming more bytes than a file has is refused by its index."""
    from powerinfer.errors import ModelFileError
    from powerinfer.formats.gguf_check import _Cursor

    c = _Cursor(data, "f.gguf")
    if message is None:
        assert c.strings(2, "tokens") == ["ab", "cde"] and c.pos == len(data)
        return
    with pytest.raises(ModelFileError, match=re.escape(message)):
        c.strings(2, "tokens")
