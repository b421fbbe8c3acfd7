"""Perplexity of a text, scored as llama.cpp's `llama-perplexity` scores it, so that numbers
compare across engines and quantizations: the text is tokenized once, cut into chunks of
`ctx` tokens, each chunk's first token is replaced by BOS (when the model adds one), each
chunk runs from an empty cache, and only the second half of each chunk is scored (the first
half is its context)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import BadArgumentError
from ..loader import LoadedModel


@dataclass
class Perplexity:
    perplexity: float
    stderr: float  # of the perplexity, from the spread of the token log-likelihoods
    chunks: int
    tokens_scored: int
    text_tokens: int


# byte-level BPE pre-tokenizers for which llama.cpp adds BOS when the file does not say
# (llama-vocab.cpp: the LLAMA3 group, tekken, chameleon); every other BPE vocabulary adds none
BPE_PRE_WITH_BOS = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                              "jina-v5-nano", "tekken", "chameleon"})


def gguf_adds_bos(metadata: dict) -> bool:
    """Whether llama.cpp starts a text with BOS for a GGUF with this metadata: the file's
    tokenizer.ggml.add_bos_token, else its default for the vocabulary type."""
    if "tokenizer.ggml.add_bos_token" in metadata:
        return bool(metadata["tokenizer.ggml.add_bos_token"])
    model = metadata.get("tokenizer.ggml.model")
    if model == "gpt2":
        return metadata.get("tokenizer.ggml.pre") in BPE_PRE_WITH_BOS
    return model in ("llama", "bert")


def adds_bos(lm: LoadedModel) -> bool:
    """Whether the model's tokenizer starts a text with BOS (GGUF: tokenizer.ggml.add_bos_token,
    as llama.cpp reads it; an HF tokenizer: whether its encoding does)."""
    bos = lm.args.bos_token_id
    if bos is None:
        return False
    if os.path.isfile(lm.path):
        from ..formats.gguf_check import read_header

        return gguf_adds_bos(read_header(lm.path, os.path.getsize(lm.path)).metadata)
    ids = lm.tokenizer.hf("a")["input_ids"]
    return bool(ids) and ids[0] == bos


def perplexity(lm: LoadedModel, text: str, ctx: int = 512, max_chunks: int | None = None,
               progress: Callable[[int, int, float], None] | None = None) -> Perplexity:
    """Score `text` with `lm` (see the module docstring); `progress(chunk, chunks, running
    ppl)` is called after each chunk."""
    if lm.tokenizer is None:
        raise BadArgumentError(f"{lm.path}: the model has no tokenizer")
    if ctx < 4 or ctx > lm.args.max_seq_len:
        raise BadArgumentError(f"-c must be in 4..{lm.args.max_seq_len} (the model's context), got {ctx}")
    from ..tokenizer import check_text

    check_text(text, "the text")
    bos = adds_bos(lm)
    ids = ([lm.args.bos_token_id] if bos else []) + list(lm.tokenizer.hf(text, add_special_tokens=False)["input_ids"])
    n = len(ids) // ctx if max_chunks is None else min(max_chunks, len(ids) // ctx)
    if n < 1:
        raise BadArgumentError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx} (lower -c)")
    model, first = lm.model, ctx // 2
    nll = []
    for c in range(n):
        chunk = list(ids[c * ctx:(c + 1) * ctx])
        if bos:
            chunk[0] = lm.args.bos_token_id
        with torch.inference_mode():
            logits = model.forward(torch.tensor(chunk), model.new_cache(ctx), all_logits=True)
        logp = torch.log_softmax(logits.double(), dim=-1)
        targets = torch.tensor(chunk[first + 1:])
        nll.append(-logp[first:-1].gather(1, targets[:, None]).squeeze(1))
        if progress is not None:
            progress(c + 1, n, math.exp(torch.cat(nll).mean().item()))
    values = torch.cat(nll)
    mean = values.mean().item()
    spread = values.std().item() / math.sqrt(len(values)) if len(values) > 1 else 0.0
    ppl = math.exp(mean)
    return Perplexity(ppl, ppl * spread, n, len(values), len(ids))
