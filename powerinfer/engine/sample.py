"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..errors import BadArgumentError


MAX_TEMPERATURE = 2.0  # OpenAI's limit; beyond it sampling is noise


@dataclass
class SamplingParams:
    """How to pick the next token. temperature 0 is greedy (the other knobs are then moot
    except repetition_penalty)."""

    temperature: float = 0.8
    top_k: int = 0  # 0 = off
    top_p: float = 0.95  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; >1 discourages tokens already seen
    seed: int | None = None

    def validate(self) -> "SamplingParams":
        """Refuse values out of range: one table for the CLI and the server (OpenAI's ranges
        where OpenAI defines the parameter: temperature 0..2, top_p (0, 1], a 64-bit seed)."""
        # Written so that NaN fails every check (NaN compares false), not just negatives.
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise BadArgumentError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature}")
        if self.top_k < 0:
            raise BadArgumentError("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise BadArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise BadArgumentError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise BadArgumentError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.seed is not None and not -2**63 <= self.seed < 2**63:
            raise BadArgumentError(f"seed must be a 64-bit signed integer, got {self.seed}")
        return self


class Sampler:
    """Callable (logits, seen token ids) -> next token id, with its own seeded generator."""

    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed % 2**64)  # torch takes 0..2**64-1

    def __call__(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> int:
        p = self.params
        logits = logits.float()
        if p.repetition_penalty != 1.0 and seen is not None and seen.numel():
            logits = apply_repetition_penalty(logits, seen, p.repetition_penalty)
        if p.temperature == 0:
            return int(torch.argmax(logits))
        probs = filtered_probs(logits / p.temperature, p.top_k, p.top_p, p.min_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty as in transformers: divide positive logits, multiply negative ones."""
    ids = torch.unique(seen)
    scores = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(scores > 0, scores / penalty, scores * penalty)
    return logits


def filtered_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Softmax of `logits` restricted by top-k, then top-p (nucleus), then min-p."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop_sorted = (torch.cumsum(sorted_probs, 0) - sorted_probs) >= top_p
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), 0.0)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs / probs.sum()
