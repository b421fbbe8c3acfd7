"""prepare's decision, before training, of which layers' predictors can pay (offline/worth.py)."""

from __future__ import annotations

import numpy as np

from powerinfer.engine.plan import PREDICTOR_BYPASS
from powerinfer.hardware import load_hardware
from powerinfer.offline.stats import LayerStats, Profile
from powerinfer.offline.train import TrainSettings
from powerinfer.offline.worth import layers_worth_training, static_fraction

N_FF, D, TOKENS = 1536, 576, 1000


def flat(active: float) -> LayerStats:
    """Every neuron fires about as often (SmolLM2-like): no hot set to exploit."""
    rng = np.random.default_rng(0)
    return LayerStats(rng.binomial(TOKENS, active, N_FF).astype(np.int64), TOKENS, 0.0)


def power_law(active: float) -> LayerStats:
    """A few hot neurons carry most activations (ReLU-family-like)."""
    p = 1.0 / np.arange(1, N_FF + 1) ** 1.2
    p = np.minimum(p / p.mean() * active, 1.0)
    return LayerStats((p * TOKENS).astype(np.int64), TOKENS, 0.0)


def test_static_fraction():
    assert abs(static_fraction(flat(0.6), 0.95) - 0.95) < 0.02  # flat: a static choice needs 95% of the neurons
    assert static_fraction(power_law(0.1), 0.95) < 0.8


def test_flat_layers_do_not_pay_and_sparse_power_law_ones_do():
    prof = Profile([flat(0.65), flat(0.3), power_law(0.1), flat(0.9)], {})
    worth = layers_worth_training(prof, D, True, load_hardware("cpu"), TrainSettings(), PREDICTOR_BYPASS)
    # without a hot set a predictor closes too little of the gap to its static choice, even at 30% active
    assert [w.pays for w in worth] == [False, False, True, False]
    for w in worth:  # the estimate lies between perfect precision and the static choice
        assert w.active * 0.95 - 1e-9 <= w.estimated <= max(w.static, w.active * 0.95) + 1e-9
        assert 0 < w.predictor_cost < 1
