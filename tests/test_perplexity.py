"""`powerinfer perplexity` against transformers scoring the same chunks (the oracle), and
its bad input."""

from __future__ import annotations

import math
import re

import pytest
import torch
from cli_helpers import assert_clean_error, run_cli_here

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "Perplexity measures how well a model predicts text; "
        "lower is better, and the same text and chunking make engines comparable. ") * 8


def oracle_perplexity(model_dir, text: str, ctx: int, chunks: int) -> float:
    """llama-perplexity's scoring with transformers' own model: BOS first, second halves."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bos = model.config.bos_token_id
    add_bos = tok("a")["input_ids"][0] == bos
    ids = ([bos] if add_bos else []) + tok(text, add_special_tokens=False)["input_ids"]
    nll, n = 0.0, 0
    for c in range(min(chunks, len(ids) // ctx)):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if add_bos:
            chunk[0] = bos
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([chunk])).logits[0].double(), -1)
        first = ctx // 2
        nll -= logp[first:-1].gather(1, torch.tensor(chunk[first + 1:])[:, None]).sum().item()
        n += ctx - first - 1
    return math.exp(nll / n)


def test_perplexity_command_equals_transformers(chat_model_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    r = run_cli_here("perplexity", "-m", str(chat_model_dir), "-f", str(text), "-c", "32", "--chunks", "3",
                "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    got = float(re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", r.stdout).group(1))
    assert "3 chunks of 32 tokens" in r.stdout and "perplexity" in r.stderr  # the progress bar
    assert got == pytest.approx(oracle_perplexity(chat_model_dir, TEXT, 32, 3), rel=1e-4)


@pytest.mark.parametrize("flags,fragment", [
    (["-c", "2"], "-c must be"),
    (["-c", "4096"], "the model's context"),
    (["--chunks", "0"], "--chunks"),
])
def test_perplexity_bad_input(chat_model_dir, tmp_path, flags, fragment):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    assert_clean_error(run_cli_here("perplexity", "-m", str(chat_model_dir), "-f", str(text), *flags), fragment)


def test_perplexity_refuses_a_missing_binary_or_too_short_file(chat_model_dir, tmp_path):
    assert_clean_error(run_cli_here("perplexity", "-m", str(chat_model_dir), "-f", str(tmp_path / "nope.txt")),
                       "No such file")
    (tmp_path / "bin.txt").write_bytes(b"caf\xe9 \xff\xfe")
    assert_clean_error(run_cli_here("perplexity", "-m", str(chat_model_dir), "-f", str(tmp_path / "bin.txt")), "not UTF-8")
    (tmp_path / "short.txt").write_text("Too short.")
    assert_clean_error(run_cli_here("perplexity", "-m", str(chat_model_dir), "-f", str(tmp_path / "short.txt"), "-c", "60"),
                       "fewer than one chunk")


@pytest.mark.parametrize("metadata, adds", [
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm"}, False),  # converter files of SmolLM2's vocab
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.add_bos_token": True}, True),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe"}, True),  # Llama 3
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"}, False),
    ({"tokenizer.ggml.model": "llama"}, True),  # sentencepiece
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.add_bos_token": False}, False),
])
def test_bos_follows_llama_cpp_defaults(metadata, adds):
    """A GGUF without tokenizer.ggml.add_bos_token gets llama.cpp's default for its vocabulary
    (llama-vocab.cpp), so that both engines score the same token sequence."""
    from powerinfer.engine.perplexity import gguf_adds_bos

    assert gguf_adds_bos(metadata) is adds
