"""Streaming text equals decoding all tokens at once; stop strings cut exactly."""

from __future__ import annotations

import pytest

from powerinfer.engine.detokenize import StopMatcher, StreamingDetokenizer
from powerinfer.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return load_tokenizer(smollm2_path)


def test_streamed_text_equals_full_decode(tok):
    text = "Héllo, wörld! 你好世界 🚀🚀 emoji and   spaces\nnew line"
    ids = tok.encode(text, add_special_tokens=False)
    d = StreamingDetokenizer(tok)
    streamed = "".join(d.add(i) for i in ids) + d.flush()
    assert streamed == tok.decode(ids) == text


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["</end>"])
    out = []
    for piece in ["Hello </", "e", "nd> tail"]:
        text, stopped = m.feed(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "Hello " and stopped


def test_stop_matcher_releases_false_alarms():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("ART") == ("START", False)
    assert m.flush() == ""


def test_stop_string_ends_generation(smollm2_path):
    import powerinfer

    lm = powerinfer.load(smollm2_path)
    full = powerinfer.generate(lm, "The capital of France is", max_tokens=12, temperature=0)
    word = full.split()[1]
    cut = list(powerinfer.stream_generate(lm, "The capital of France is", max_tokens=12, temperature=0, stop=[word]))
    assert cut[-1].finish_reason == "stop"
    assert "".join(r.text for r in cut) == full[: full.index(word)]
