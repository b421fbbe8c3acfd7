"""The hybrid sparse FFN: each layer's neurons split across a GPU tier and a CPU tier.

A packed model stores every layer's neurons in *packed order*: the GPU tier's rows first,
then the CPU tier's, each tier hottest-first. The predictor's output rows are permuted the
same way, so an active packed index k is GPU row k when k < n_gpu and CPU row k - n_gpu
otherwise: splitting the active set is one binary search.

Decode (one token) of a `PredictedFFN`:
1. predictor logits -> active set, in packed order;
2. split by the neuron tables into the GPU part and the CPU part;
3. the GPU part is handed to the GPU tier's executor, one worker thread (on CUDA it launches
   the gather kernels; without one the GPU tier is a second set of CPU tensors computed by
   the same torch code, so that path runs in CI) while the calling thread computes the CPU
   part; the torch ops release the GIL, so both really run at once;
4. merge: out = residual + output bias + CPU part + GPU part. Selective sync: a tier with no
   active neuron is not run, and when the CPU part is empty nothing waits for it.

An `AllRowsFFN` computes every neuron under a criterion (the oracle's true activations, or
none: the dense FFN). Which class a layer gets is decided once, by the load plan (plan.py).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ..ops import cpu, ffn_rows
from ..ops.criterion import Criterion
from ..ops.ffn_rows import FFNRows, FFNSpec
from .plan import LayerPlan, Strategy
from .predictor import Predictor


@dataclass
class FFNStats:
    """What the FFNs computed at decode, summed over layers and tokens (for --stats)."""

    layer_calls: int = 0
    neurons: int = 0  # neurons that exist in the layers called
    active_gpu: int = 0
    active_cpu: int = 0
    synced: int = 0  # layer calls where both tiers ran and were merged
    skipped_sync: int = 0  # layer calls where one tier had nothing to do
    per_token_active: list[float] = field(default_factory=list)
    _token_active: int = 0
    _token_neurons: int = 0

    def record(self, n_gpu: int, n_cpu: int, neurons: int, both: bool) -> None:
        self.layer_calls += 1
        self.neurons += neurons
        self.active_gpu += n_gpu
        self.active_cpu += n_cpu
        self._token_active += n_gpu + n_cpu
        self._token_neurons += neurons
        if both:
            self.synced += 1
        else:
            self.skipped_sync += 1

    def end_token(self) -> None:
        if self._token_neurons:
            self.per_token_active.append(self._token_active / self._token_neurons)
        self._token_active = self._token_neurons = 0

    @property
    def active_fraction(self) -> float:
        return (self.active_gpu + self.active_cpu) / max(self.neurons, 1)

    @property
    def gpu_share(self) -> float:
        """The paper's "GPU share of neuron load": active neurons computed by the GPU tier."""
        return self.active_gpu / max(self.active_gpu + self.active_cpu, 1)

    def reset(self) -> None:
        self.__init__()


class Tier(FFNRows):
    """One tier's rows of one layer (ops/ffn_rows.py) and its neuron table (tier row ->
    original neuron index)."""

    def __init__(self, name: str, w_gate: torch.Tensor, w_up: torch.Tensor | None, b_in: torch.Tensor | None,
                 wt_down: torch.Tensor, neurons: torch.Tensor, numba_kernels: bool):
        super().__init__(w_gate, w_up, b_in, wt_down, numba_kernels)
        self.name = name
        self.neurons = neurons


class TieredFFN:
    """What every strategy shares: the two tiers, the merge and the statistics. Callable like
    `DenseFFN` (models/ffn.py): out = residual + FFN(x)."""

    def __init__(self, plan: LayerPlan, gpu_tier: Tier, cpu_tier: Tier, spec: FFNSpec, b_out: torch.Tensor | None,
                 stats: FFNStats, executor: ThreadPoolExecutor | None = None, last_layer: bool = False):
        self.plan = plan
        self.gpu, self.cpu = gpu_tier, cpu_tier
        self.spec = spec
        self.b_out = b_out
        self.stats = stats
        self.executor = executor
        self.last_layer = last_layer  # ends the token in the stats
        self.n_ff = gpu_tier.n + cpu_tier.n
        self.criterion = plan.criterion
        self.predictor: Predictor | None = None

    def _base(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
        """What the tiers' outputs are added to: the residual and the output bias."""
        if self.b_out is None:
            return residual
        return self.b_out.expand(x.shape[0], -1) if residual is None else residual + self.b_out

    def tensors(self) -> list[torch.Tensor]:
        extra = [] if self.predictor is None else self.predictor.tensors()
        return self.gpu.tensors() + self.cpu.tensors() + ([self.b_out] if self.b_out is not None else []) + extra

    @property
    def out_features(self) -> int:
        return self.cpu.out_features

    def add_batch(self, h: np.ndarray, x: np.ndarray) -> bool:
        """No batched kernel yet: a batch runs `add_one` per sequence (each its own rows)."""
        return False

    def split(self, packed_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Active packed indices -> (GPU tier rows, CPU tier rows)."""
        cut = int(torch.searchsorted(packed_idx, self.gpu.n))
        return packed_idx[:cut], packed_idx[cut:] - self.gpu.n

    def tier_output(self, tier: Tier, x: torch.Tensor, idx: torch.Tensor | None, criterion: Criterion,
                    base: torch.Tensor | None = None) -> torch.Tensor:
        """One tier's FFN output (T, d_out) on the CPU, over rows `idx` (None = all), plus `base`."""
        return ffn_rows.output(tier, self.spec, x, idx, criterion, base)

    def run_tiers(self, x: torch.Tensor, gpu_idx: torch.Tensor | None, cpu_idx: torch.Tensor | None,
                  criterion: Criterion, record: bool = False, base: torch.Tensor | None = None) -> torch.Tensor:
        """base + both tiers' FFN outputs over the given rows (None = all rows). The CPU tier
        accumulates straight into a copy of `base`, so the residual add costs no extra pass."""
        run_gpu = self.gpu.n > 0 and (gpu_idx is None or gpu_idx.numel() > 0)
        run_cpu = self.cpu.n > 0 and (cpu_idx is None or cpu_idx.numel() > 0)
        if record:
            n_g = 0 if not run_gpu else (self.gpu.n if gpu_idx is None else gpu_idx.numel())
            n_c = 0 if not run_cpu else (self.cpu.n if cpu_idx is None else cpu_idx.numel())
            self._record(n_g, n_c, run_gpu and run_cpu)
        future: Future | None = None
        gpu_out = None
        if run_gpu:
            if self.executor is not None and run_cpu:
                future = self.executor.submit(self.tier_output, self.gpu, x, gpu_idx, criterion)
            else:
                gpu_out = self.tier_output(self.gpu, x, gpu_idx, criterion)
        out = self.tier_output(self.cpu, x, cpu_idx, criterion, base) if run_cpu else None
        if future is not None:
            gpu_out = future.result()
        if out is None:
            out = (torch.zeros(x.shape[0], self.out_features, dtype=torch.float32) if base is None
                   else base.clone(memory_format=torch.contiguous_format))
        return out if gpu_out is None else out.add_(gpu_out)

    def _record(self, n_gpu: int, n_cpu: int, both: bool) -> None:
        self.stats.record(n_gpu, n_cpu, self.n_ff, both)
        if self.last_layer:
            self.stats.end_token()


class AllRowsFFN(TieredFFN):
    """Every neuron computed under the plan's criterion: the true activations (ALL_ROWS) or
    none (DENSE)."""

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.run_tiers(x, None, None, self.criterion, record=x.shape[0] == 1, base=self._base(x, residual))

    def add_one(self, h: np.ndarray, x: np.ndarray) -> bool:
        """Decode fast path: x += FFN(h) in place for one fp32 token, in one kernel call, when
        the whole layer is on the CPU tier. False (nothing done) when it does not apply."""
        tier = self.cpu
        if self.gpu.n or not tier.numba:
            return False
        if tier.dense_np is not None:  # every row, dense layout: the dense FFN kernel
            self._record(0, tier.n, False)
            b_out = cpu.NO_BIAS if self.b_out is None else self.b_out.numpy()
            ffn_rows.add_dense_into(tier, self.spec, h, self.criterion, b_out, x)
            return True
        if self.b_out is not None:
            return False
        self._record(0, tier.n, False)
        ffn_rows.add_into(tier, self.spec, h[None], tier.all_rows_np, self.criterion, x[None])
        return True


class PredictedFFN(TieredFFN):
    """Decode computes the neurons the predictor selects that are also above the threshold;
    batches (prefill) compute every row, dense."""

    def __init__(self, plan: LayerPlan, gpu_tier: Tier, cpu_tier: Tier, spec: FFNSpec, b_out: torch.Tensor | None,
                 stats: FFNStats, predictor: Predictor, executor: ThreadPoolExecutor | None = None,
                 last_layer: bool = False):
        super().__init__(plan, gpu_tier, cpu_tier, spec, b_out, stats, executor, last_layer)
        self.predictor = predictor

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        base = self._base(x, residual)
        if x.shape[0] != 1:
            return self.run_tiers(x, None, None, self.plan.prefill_criterion, base=base)
        on_device, on_host = self.predictor.active_on_device(x)
        gpu_idx, cpu_idx = self.split(on_host)
        if self.gpu.device == on_device.device:  # the GPU part's indices are already there
            gpu_idx = on_device[: gpu_idx.shape[0]]
        return self.run_tiers(x, gpu_idx, cpu_idx, self.criterion, record=True, base=base)

    def add_one(self, h: np.ndarray, x: np.ndarray) -> bool:
        """Decode fast path for a layer wholly on the CPU with a CPU predictor: x += FFN(h) in
        place, one kernel call. False (nothing done) when it does not apply."""
        tier = self.cpu
        if self.gpu.n or not tier.numba or self.b_out is not None or self.predictor.device.type != "cpu":
            return False
        idx = self.predictor.active_np(h)
        self._record(0, idx.shape[0], False)
        if idx.shape[0]:
            ffn_rows.add_into(tier, self.spec, h[None], idx, self.criterion, x[None])
        return True

    # Batched decode: "union" computes the union of the sequences' predicted rows for all of
    # them (each row read once); "per_token" each sequence's own rows (read again for each);
    # "auto" takes the union only when it is at most UNION_SHARE of the rows the per-token
    # sets read. Measured on the planted 7B shape (docs/BENCHMARKS.md, "Batched sparse
    # decode"): the union lost at 0.51 (B=4, 1.23x slower) and at 0.33 (B=8, 1.17x), its
    # rows' compute for every sequence costing more than the reads it saves.
    batch_rows = "auto"
    UNION_SHARE = 0.25

    def add_batch(self, h: np.ndarray, x: np.ndarray) -> bool:
        """x[s] += FFN(h[s]) for a batch on the union of the sequences' predicted rows, when
        that is cheaper than their own sets one by one. A sequence then also gets the neurons
        predicted for the others that pass its threshold (predictor misses for it, which the
        dense model has too), so its output may differ from its solo output, towards dense."""
        tier = self.cpu
        if (self.batch_rows == "per_token" or self.gpu.n or not tier.numba or self.b_out is not None
                or self.predictor.device.type != "cpu"):
            return False
        sets = [self.predictor.active_np(h[b]) for b in range(h.shape[0])]
        union = np.unique(np.concatenate(sets))
        if self.batch_rows == "auto" and union.shape[0] > self.UNION_SHARE * sum(s.shape[0] for s in sets):
            for b, idx in enumerate(sets):  # per token, without predicting again
                self._record(0, idx.shape[0], False)
                if idx.shape[0]:
                    ffn_rows.add_into(tier, self.spec, h[b:b + 1], idx, self.criterion, x[b:b + 1])
            return True
        for _ in sets:
            self._record(0, union.shape[0], False)
        if union.shape[0]:
            ffn_rows.add_into(tier, self.spec, h, union.astype(sets[0].dtype, copy=False), self.criterion, x)
        return True


def make_ffn(plan: LayerPlan, gpu_tier: Tier, cpu_tier: Tier, spec: FFNSpec, b_out: torch.Tensor | None,
             stats: FFNStats, predictor: Predictor | None, last_layer: bool) -> TieredFFN:
    """The FFN class the layer's plan names."""
    if plan.strategy is Strategy.PREDICTED:
        assert predictor is not None, "the plan predicts a layer without a predictor"
        return PredictedFFN(plan, gpu_tier, cpu_tier, spec, b_out, stats, predictor, last_layer=last_layer)
    return AllRowsFFN(plan, gpu_tier, cpu_tier, spec, b_out, stats, last_layer=last_layer)
