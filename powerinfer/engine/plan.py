"""The load plan: how each layer of a packed model runs, decided once at load.

From the manifest, the mode and the device, each layer gets one strategy:

* PREDICTED: decode asks the layer's predictor which neurons fire and computes those that
  are also above the profile's threshold (the sparse model); prefill computes every row.
* ALL_ROWS: every neuron computed, those at or below the threshold zeroed (the true
  activations): `--mode oracle`, and sparse layers that bypass their predictor while
  part of the layer is on the GPU tier.
* DENSE: every neuron, no threshold (the dense model): `--mode dense` and `offload`, and
  sparse layers that bypass their predictor wholly on the CPU: the dense FFN kernel reads
  every down row anyway there, so the threshold would cost quality and save nothing.

A sparse layer bypasses its predictor when it has none (prepare found it could not pay) or
when the predictor asks for at least `predictor_bypass` of the neurons on the validation
set: on the CPU, skipping a few percent of the rows does not pay for the predictor and the
irregular row set (measurements in docs/BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..errors import BadArgumentError
from ..formats.packed import MODES, PackedManifest
from ..ops.criterion import Criterion

# Predicted share of the neurons from which a sparse layer bypasses its predictor.
PREDICTOR_BYPASS = 0.85


class Strategy(Enum):
    PREDICTED = "predicted"
    ALL_ROWS = "all_rows"
    DENSE = "dense"


@dataclass(frozen=True)
class LayerPlan:
    """How one layer's FFN runs: its strategy, the threshold criterion its decode applies,
    how many neurons each tier holds, and whether the CPU tier takes the dense layout."""

    layer: int
    strategy: Strategy
    criterion: Criterion
    n_gpu: int
    n_cpu: int
    dense_layout: bool
    reason: str

    @property
    def prefill_criterion(self) -> Criterion:
        """Batches (prefill) compute every row: thresholded as decode is, except a predicted
        layer, whose prefill is dense."""
        return Criterion.NONE if self.strategy is Strategy.PREDICTED else self.criterion


@dataclass(frozen=True)
class LoadPlan:
    """Every layer's plan and where the dense parts (attention, LM head, KV cache) live."""

    mode: str
    layers: tuple[LayerPlan, ...]
    attention_on_gpu: tuple[bool, ...]
    head_on_gpu: bool
    kv_on_gpu: bool

    def count(self, strategy: Strategy) -> int:
        return sum(layer.strategy is strategy for layer in self.layers)

    @property
    def computes_dense_model(self) -> bool:
        """Whether every layer computes the exact dense FFN (sparse mode that gains nothing)."""
        return self.count(Strategy.DENSE) == len(self.layers)

    def summary(self) -> str:
        """One line for the user: how many layers run which way, and why when not predicted."""
        parts = [f"{self.count(s)} {s.value.replace('_', ' ')}" for s in Strategy if self.count(s)]
        text = f"{self.mode} mode, {len(self.layers)} layers: " + ", ".join(parts)
        if self.mode == "sparse" and self.computes_dense_model:
            reasons = sorted({layer.reason for layer in self.layers})
            text += " -- the sparse engine computes the dense model here (" + "; ".join(reasons) + ")"
        return text


def _layer_plan(m: PackedManifest, i: int, mode: str, predictor_bypass: float | None,
                offload_layers: int) -> LayerPlan:
    info = m.layers[i]
    n_ff = info.n_gpu + info.n_cpu
    n_gpu, n_cpu = info.n_gpu, info.n_cpu
    if mode == "offload":  # llama.cpp-style: whole layers on the GPU tier, the rest on the CPU
        n_gpu, n_cpu = (n_ff, 0) if i < offload_layers else (0, n_ff)
    criterion = Criterion.parse(m.criterion)
    if mode in ("dense", "offload"):
        strategy, reason = Strategy.DENSE, f"--mode {mode}"
    elif mode == "oracle":
        strategy, reason = Strategy.ALL_ROWS, "--mode oracle"
    elif info.predictor is None:
        strategy, reason = Strategy.ALL_ROWS, "no predictor (prepare found it could not pay)"
    elif predictor_bypass is not None and info.predictor.predicted_fraction >= predictor_bypass:
        strategy = Strategy.ALL_ROWS
        reason = f"the predictor asks for >= {predictor_bypass:.0%} of the neurons"
    else:
        strategy, reason = Strategy.PREDICTED, "predictor"
    if strategy is Strategy.ALL_ROWS and mode == "sparse" and n_gpu == 0:
        strategy = Strategy.DENSE  # wholly on the CPU: the dense kernel reads every row anyway
        reason += "; all on the CPU, so exact"
    if strategy is Strategy.DENSE:
        criterion = Criterion.NONE
    return LayerPlan(i, strategy, criterion, n_gpu, n_cpu, dense_layout=n_gpu == 0 and strategy is not Strategy.PREDICTED,
                     reason=reason)


def make_plan(m: PackedManifest, n_layers: int, mode: str, kv_on_gpu: bool = False,
              predictor_bypass: float | None = PREDICTOR_BYPASS) -> LoadPlan:
    """The plan for running the packed model `m` in `mode` (sparse, oracle, dense, offload)."""
    if mode not in MODES:
        raise BadArgumentError(f"unknown mode {mode!r} (choose {', '.join(MODES)})")
    if len(m.layers) != n_layers:
        raise BadArgumentError(f"the manifest describes {len(m.layers)} layers, the model has {n_layers}")
    if mode == "sparse" and not m.has_predictors() and predictor_bypass is None:
        raise BadArgumentError("this model was packed without predictors; --mode sparse with the bypass off needs them")
    offload = m.placement.offload_gpu_layers
    layers = tuple(_layer_plan(m, i, mode, predictor_bypass, offload) for i in range(n_layers))
    dense_on_gpu = m.placement.dense_on_gpu
    if mode == "offload":  # the LM head where the offload baseline's budget put it
        attention = tuple(i < offload for i in range(n_layers))
        head = m.placement.offload_head_on_gpu
    else:
        attention, head = (dense_on_gpu,) * n_layers, dense_on_gpu
    return LoadPlan(mode, layers, attention, head, kv_on_gpu)
