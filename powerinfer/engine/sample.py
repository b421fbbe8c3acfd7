"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import BadArgumentError


MAX_TEMPERATURE = 2.0  # OpenAI's limit; beyond it sampling is noise


# The per-token checks below run in numpy: torch's elementwise ops on a vocabulary's logits
# (~50k values) go to torch's own OpenMP pool, whose threads wake beside numba's still
# spinning ones after every decode kernel; measured 65-80 us per isfinite().all() and
# 50-65 us per argmax there, against 7-9 us in numpy (docs/BENCHMARKS.md, "Serving").
def _host(logits: torch.Tensor) -> np.ndarray:
    """fp32 logits as a numpy array (copied from a GPU tensor; a view of a CPU one)."""
    return logits.detach().float().cpu().numpy()


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """For logits (B, vocab): whether each row is free of NaN and Inf."""
    return np.isfinite(_host(logits)).all(axis=-1).tolist()


def all_finite(logits: torch.Tensor) -> bool:
    """Whether the logits hold no NaN or Inf."""
    return bool(np.isfinite(_host(logits)).all())


def greedy(logits: torch.Tensor) -> int:
    """The first index of the largest logit (torch.argmax's choice), for finite logits."""
    return int(np.argmax(_host(logits)))


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
            return greedy(logits)
        tokens, probs = _filtered(_host(logits) / np.float32(p.temperature), p.top_k, p.top_p, p.min_p)
        return _draw(tokens, probs, self.generator)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty as in transformers: divide positive logits, multiply negative ones."""
    ids = torch.unique(seen)
    scores = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(scores > 0, scores / penalty, scores * penalty)
    return logits


def filtered_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Softmax of `logits` restricted by top-k, then top-p (nucleus), then min-p."""
    tokens, probs = _filtered(_host(logits), top_k, top_p, min_p)
    out = torch.zeros(logits.shape[-1], dtype=torch.float32)
    out[torch.from_numpy(tokens)] = torch.from_numpy(probs)
    return out


# Sampling runs in numpy on the tokens that can still be drawn: torch.sort of a 49k
# vocabulary took 3.5 ms and torch.multinomial 1 ms per token on the CPU, more than a
# SmolLM2 decode step (docs/BENCHMARKS.md, "Serving").
def _filtered(z: np.ndarray, top_k: int, top_p: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, their probabilities summing to 1) left by top-k, top-p and min-p after a
    softmax of logits z."""
    z = np.asarray(z, dtype=np.float32)
    V = z.shape[-1]
    if top_k and top_k < V:
        kth = np.partition(z, V - top_k)[V - top_k]
        z = np.where(z < kth, np.float32(-np.inf), z)
    e = np.exp(z - z.max())
    probs = e / e.sum()
    tokens = _nucleus(probs, top_p) if top_p < 1.0 else np.flatnonzero(probs)
    kept = probs[tokens]
    if min_p > 0.0:
        big = kept >= np.float32(min_p) * probs.max()
        tokens, kept = tokens[big], kept[big]
    return tokens, kept / kept.sum()


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of most probable tokens whose mass reaches top_p: in
    descending order, a token stays while the tokens before it hold less than top_p (the
    first always stays). Only the tokens above a cut-off are sorted (a prefix of that
    order), the cut-off lowered until the set ends inside them."""
    cut = float(probs.max()) * 1e-3
    while True:
        cand = np.flatnonzero(probs > cut) if cut > 0.0 else np.arange(probs.shape[0])
        order = cand[np.argsort(-probs[cand], kind="stable")]
        sorted_probs = probs[order]
        keep = (np.cumsum(sorted_probs) - sorted_probs) < top_p
        if cut == 0.0 or not keep[-1]:  # the set ends before the last candidate
            return order[keep]
        cut = cut * 1e-3 if cut > 1e-30 else 0.0


def _draw(tokens: np.ndarray, probs: np.ndarray, generator: torch.Generator) -> int:
    """A token drawn from `tokens` with `probs` (sums to 1) with the seeded generator, by
    inverse CDF."""
    cdf = np.cumsum(probs, dtype=np.float64)
    u = torch.rand(1, generator=generator, dtype=torch.float64).item()
    j = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(tokens[min(j, tokens.shape[0] - 1)])
