"""Whether a layer's predictor can pay for itself, decided from the profile before training.

A predicted layer reads the predictor's weights and then the rows it selects, scattered, at
`sparse_efficiency` of the bandwidth a dense pass reaches; the dense FFN reads every row.
So a predictor that selects a share f of the neurons pays only when

    predictor bytes / FFN bytes + f / sparse_efficiency < 1,

and the engine bypasses any predictor that selects PREDICTOR_BYPASS or more (engine/plan.py).
f is not known before training, but the profile bounds it: a predictor with recall r selects
at least the active share a times r (perfect precision), and no more than the share a
static choice of the hottest neurons needs to cover r of the activations (no input
information used). Trained predictors close only part of that gap on flat activation
statistics (SmolLM2: a = 0.6-0.7, static 0.9-0.97, trained 0.86-0.97, see
docs/BENCHMARKS.md), so the estimate keeps GAP_KEPT of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..hardware import HardwareProfile
from .stats import LayerStats, Profile
from .train import TrainSettings, start_rank

GAP_KEPT = 0.8  # share of the (static - perfect) gap a trained predictor still selects


@dataclass(frozen=True)
class Worth:
    """One layer's verdict: the estimated predicted share, the predictor's cost as a share of
    the FFN's bytes, and whether it pays."""

    layer: int
    active: float
    static: float
    estimated: float
    predictor_cost: float
    pays: bool


def static_fraction(stats: LayerStats, recall: float) -> float:
    """The share of neurons, hottest first, whose activations make up `recall` of all."""
    counts = np.sort(stats.counts.astype(np.float64))[::-1]
    total = counts.sum()
    if total == 0:
        return 0.0
    k = int(np.searchsorted(np.cumsum(counts) / total, recall)) + 1
    return min(k, stats.n_ff) / stats.n_ff


def layer_worth(i: int, stats: LayerStats, d_model: int, gated: bool, hw: HardwareProfile, s: TrainSettings,
                bypass: float) -> Worth:
    active = 1.0 - stats.sparsity
    floor = active * s.recall
    static = max(static_fraction(stats, s.recall), floor)
    estimated = floor + GAP_KEPT * (static - floor)
    rank = start_rank(d_model, stats.sparsity, stats.gini, s)
    ffn_params = (3 if gated else 2) * d_model * stats.n_ff
    cost = rank * (d_model + stats.n_ff) / ffn_params
    pays = estimated < bypass and cost + estimated / hw.sparse_efficiency < 1.0
    return Worth(i, active, static, estimated, cost, pays)


def layers_worth_training(profile: Profile, d_model: int, gated: bool, hw: HardwareProfile, s: TrainSettings,
                          bypass: float) -> list[Worth]:
    """Every layer's verdict (see the module docstring)."""
    return [layer_worth(i, st, d_model, gated, hw, s, bypass) for i, st in enumerate(profile.layers)]
