"""The generation loop: batched prefill, then one token per decode step.

`generate_step` is the bare loop over token ids (a generator, as in mlx-lm); the sampler is
an injected callable. `stream_generate` adds text: detokenisation, stop strings, EOS, timing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..errors import BadArgumentError, ContextLengthError, NonFiniteError
from ..models.base import Model
from ..tokenizer import Tokenizer
from ..models.cache import KVCache
from .detokenize import StopMatcher, StreamingDetokenizer
from .sample import Sampler, SamplingParams, all_finite

PREFILL_CHUNK = 512  # bounds prefill activation memory for long prompts


def prefill(model: Model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run the prompt through the model in chunks; return the last position's logits."""
    logits = None
    for start in range(0, tokens.shape[0], PREFILL_CHUNK):
        logits = model.forward(tokens[start : start + PREFILL_CHUNK], cache)
    assert logits is not None
    return logits


def warm_up(model: Model, tokens: int = 6) -> float:
    """Run a short prompt and one decode step on a throwaway cache, so that one-time costs
    (compiled kernels loaded from numba's cache, torch's first GEMM, first touch of the
    weights' pages) are not counted as prefill or decode speed. Returns the seconds taken.
    The first prefill of a fresh process otherwise reads 3x slower than the next (SmolLM2,
    40 tokens: 84 vs 262-279 tok/s)."""
    t0 = time.perf_counter()
    cache = model.new_cache(tokens + 1)
    ids = torch.zeros(tokens, dtype=torch.long)
    prefill(model, ids, cache)
    model.forward(ids[:1], cache)
    return time.perf_counter() - t0


def generate_step(model: Model, prompt: list[int], sampler: Callable[[torch.Tensor, torch.Tensor], int],
                  max_tokens: int, cache: KVCache | None = None) -> Iterator[int]:
    """Yield up to `max_tokens` sampled token ids after `prompt` (the caller stops early)."""
    if not prompt:
        raise BadArgumentError("the prompt is empty")
    if cache is None:
        cache = model.new_cache(len(prompt) + max_tokens)
    seen = torch.empty(len(prompt) + max_tokens, dtype=torch.long)
    seen[: len(prompt)] = torch.tensor(prompt)
    n_seen = len(prompt)
    logits = prefill(model, seen[:n_seen].clone(), cache)
    step_input = torch.empty(1, dtype=torch.long)
    for i in range(max_tokens):
        if not all_finite(logits):  # a NaN would otherwise crash or sample garbage
            raise NonFiniteError(f"the model's output became NaN or Inf at token {i} of the generation "
                                 "(corrupt weights, or activations overflowing the weights' dtype)")
        token = sampler(logits, seen[:n_seen])
        yield token
        if i + 1 == max_tokens:
            return
        seen[n_seen] = token
        n_seen += 1
        step_input[0] = token
        logits = model.forward(step_input, cache)


@dataclass
class GenerationResponse:
    """One streamed step: the new text, the token, and running statistics."""

    text: str
    token: int | None
    finish_reason: str | None  # None while running, then "stop" or "length"
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float


def check_context(model: Model, prompt_len: int, max_tokens: int) -> int:
    """Refuse prompts that do not fit; clamp max_tokens to what the context leaves."""
    limit = model.args.max_seq_len
    if max_tokens < 0:
        raise BadArgumentError("max_tokens must be >= 0")
    if prompt_len >= limit:
        raise ContextLengthError(f"prompt has {prompt_len} tokens; the model's context is {limit} tokens")
    return min(max_tokens, limit - prompt_len)


class TextStream:
    """One generation's text side, token by token: detokenisation, stop strings, EOS, token
    counts and speeds. `stream_generate` and the server's batch engine both use it, so a
    completion's text and finish reason do not depend on which loop produced its tokens."""

    def __init__(self, tokenizer: Tokenizer, prompt_tokens: int, stop: list[str] | None = None):
        self.detok = StreamingDetokenizer(tokenizer)
        self.stops = StopMatcher(stop or [])
        self.eos = set(tokenizer.eos_token_ids)
        self.prompt_tokens = prompt_tokens
        self.t_start = time.perf_counter()
        self.t_first = self.t_start
        self.prompt_tps = 0.0
        self.n = 0  # tokens generated (EOS not counted)

    def response(self, text: str, token: int | None, finish: str | None) -> GenerationResponse:
        decode_s = time.perf_counter() - self.t_first
        tps = (self.n - 1) / decode_s if self.n > 1 and decode_s > 0 else 0.0
        return GenerationResponse(text, token, finish, self.prompt_tokens, self.n, self.prompt_tps, tps)

    def add(self, token: int) -> GenerationResponse:
        """The text `token` completes; finish_reason "stop" at EOS or a stop string."""
        if self.n == 0 and self.t_first == self.t_start:
            self.t_first = time.perf_counter()
            self.prompt_tps = self.prompt_tokens / max(self.t_first - self.t_start, 1e-9)
        if token in self.eos:
            return self.response(self.stops.flush(), token, "stop")
        self.n += 1
        text, stopped = self.stops.feed(self.detok.add(token))
        return self.response(text, token, "stop" if stopped else None)

    def end(self) -> GenerationResponse:
        """The last response when the token budget is spent: the text held back, "length"
        (or "stop" when that text completes a stop string)."""
        text, stopped = self.stops.feed(self.detok.flush())
        return self.response(text if stopped else text + self.stops.flush(), None, "stop" if stopped else "length")


def stream_generate(model: Model, tokenizer: Tokenizer, prompt: str | list[int], max_tokens: int = 256,
                    sampling: SamplingParams | None = None, stop: list[str] | None = None,
                    add_special_tokens: bool = True) -> Iterator[GenerationResponse]:
    """Generate text after `prompt` (text or token ids), yielding it as it is produced."""
    ids = tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise BadArgumentError("the prompt is empty")
    max_tokens = check_context(model, len(ids), max_tokens)
    sampler = Sampler(sampling or SamplingParams())
    stream = TextStream(tokenizer, len(ids), stop)
    if max_tokens == 0:
        yield stream.end()
        return
    for token in generate_step(model, ids, sampler, max_tokens):
        r = stream.add(token)
        yield r
        if r.finish_reason:
            return
    yield stream.end()


def generate(model: Model, tokenizer: Tokenizer, prompt: str | list[int], max_tokens: int = 256,
             sampling: SamplingParams | None = None, stop: list[str] | None = None) -> str:
    """The whole completion of `prompt` as one string."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens, sampling, stop))
