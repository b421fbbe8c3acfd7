"""Synthetic power-law activation statistics for any model shape.

SmolLM2's activations are nearly flat; the solver and the engine must still be exercised on
the skew the paper reports for large ReLU models. Model: in every layer neuron i (in a
random order per layer) fires with probability p_i = c * rank_i^(-alpha), rank 1..n_ff.
`alpha` is solved so the hottest `hot_fraction` of neurons carry `hot_coverage` of all
activations (the paper: a small fraction covers ~80%), `c` so the mean firing rate is
1 - sparsity, with p capped at 1; counts are Binomial(tokens, p_i).
"""

from __future__ import annotations

import numpy as np

from ..errors import BadArgumentError
from .stats import LayerStats, Profile


def _probabilities(n_ff: int, sparsity: float, alpha: float) -> np.ndarray:
    w = np.arange(1, n_ff + 1, dtype=np.float64) ** -alpha
    target = (1 - sparsity) * n_ff
    lo, hi = 0.0, 1e12  # scale so sum(min(c w, 1)) = target
    for _ in range(200):
        c = (lo + hi) / 2
        if np.minimum(c * w, 1.0).sum() < target:
            lo = c
        else:
            hi = c
    return np.minimum(lo * w, 1.0)


def _coverage(p: np.ndarray, hot_fraction: float) -> float:
    k = max(1, int(round(hot_fraction * len(p))))
    return float(np.sort(p)[::-1][:k].sum() / p.sum())


def solve_alpha(n_ff: int, sparsity: float, hot_fraction: float, hot_coverage: float) -> float:
    """The exponent giving the requested coverage (coverage grows with alpha)."""
    lo, hi = 0.0, 8.0
    if _coverage(_probabilities(n_ff, sparsity, hi), hot_fraction) < hot_coverage:
        raise BadArgumentError(f"coverage {hot_coverage} by the top {hot_fraction:.0%} is unreachable at "
                               f"sparsity {sparsity} (firing rates cap at 1)")
    for _ in range(60):
        mid = (lo + hi) / 2
        if _coverage(_probabilities(n_ff, sparsity, mid), hot_fraction) < hot_coverage:
            lo = mid
        else:
            hi = mid
    return hi


def synthetic_profile(n_layers: int, n_ff: int, tokens: int = 100_000, sparsity: float = 0.9,
                      hot_fraction: float = 0.2, hot_coverage: float = 0.8, seed: int = 0,
                      layer_jitter: float = 0.1) -> Profile:
    """A Profile whose layers follow the power law above; each layer's sparsity and coverage
    vary by up to +-layer_jitter (relative) around the targets so layers differ."""
    if not 0 <= sparsity < 1 or not 0 < hot_fraction < 1 or not hot_fraction < hot_coverage < 1:
        raise BadArgumentError("need 0 <= sparsity < 1 and 0 < hot_fraction < hot_coverage < 1")
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(n_layers):
        s = float(np.clip(sparsity * (1 + rng.uniform(-layer_jitter, layer_jitter) * (1 - sparsity)), 0, 0.999))
        cov = float(np.clip(hot_coverage * (1 + rng.uniform(-layer_jitter, layer_jitter) / 2), hot_fraction + 1e-3,
                            0.999))
        try:
            alpha = solve_alpha(n_ff, s, hot_fraction, cov)
        except BadArgumentError:
            alpha = solve_alpha(n_ff, s, hot_fraction, hot_coverage)
        p = _probabilities(n_ff, s, alpha)[rng.permutation(n_ff)]
        layers.append(LayerStats(rng.binomial(tokens, p).astype(np.int64), tokens, 0.0))
    params = dict(n_layers=n_layers, n_ff=n_ff, tokens=tokens, sparsity=sparsity, hot_fraction=hot_fraction,
                  hot_coverage=hot_coverage, seed=seed, layer_jitter=layer_jitter)
    return Profile(layers=layers, manifest={"synthetic": params, "tokens": tokens, "criterion": "synthetic"})
