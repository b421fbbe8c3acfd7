"""The hybrid sparse FFN: each layer's neurons split across a GPU tier and a CPU tier.

A packed model stores every layer's neurons in *packed order*: the GPU tier's rows first,
then the CPU tier's, each tier hottest-first. The predictor's output rows are permuted the
same way, so an active packed index k is GPU row k when k < n_gpu and CPU row k - n_gpu
otherwise: splitting the active set is one binary search.

Decode (one token) per layer:
1. predictor logits -> active set (logits above the layer's threshold), in packed order;
2. split by the neuron tables into the GPU part and the CPU part;
3. the GPU part is handed to the GPU tier's executor, one worker thread: on a CUDA device it
   launches the gather kernels and copies the (d,) result back; without one, the GPU tier is
   a second set of CPU tensors computed by the same torch code (ops/gpu.py), so that path
   runs in CI. Meanwhile the calling thread computes the CPU part with the fused numba
   kernel (the torch ops release the GIL, so both really run at once);
4. merge: out = residual + output bias + CPU part + GPU part. Selective sync: a tier with
   no active neuron is not run, and when the CPU part is empty nothing waits for it.

Neurons the predictor selects are also dropped when their true score is at or below the
profile's threshold, as the sparse model is defined (see `InstrumentedFFN`). Modes:
"sparse" (the above), "oracle" (every neuron computed, those at or below the threshold
zeroed: the true activations, for quality checks), "dense" (every neuron, no threshold).
Prefill (several tokens) always runs dense and batched, per tier, with torch GEMMs.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..errors import BadArgumentError
from ..ops import cpu, decode, gpu, panels, sparse_cpu
from ..ops.numba_half import numpy_weights
from .ffn import activation

MODES = ("sparse", "oracle", "dense", "offload")
CRITERION_IDS = {"none": 0, "gate": 1, "gate_up": 2}


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


class Tier:
    """One tier's rows of one layer: gate (or fc1) and up rows, the transposed down
    projection, an optional fc1 bias and the neuron table (tier row -> original neuron)."""

    def __init__(self, name: str, w_gate: torch.Tensor, w_up: torch.Tensor | None, b_in: torch.Tensor | None,
                 wt_down: torch.Tensor, neurons: torch.Tensor, numba_kernels: bool):
        self.name = name
        self.w_gate, self.w_up, self.b_in, self.wt_down = w_gate, w_up, b_in, wt_down
        self.neurons = neurons
        self.n = int(neurons.shape[0])
        self.device = w_gate.device
        # the CPU tier on a CPU device runs the numba kernels; the GPU tier always the torch path
        self.numba = numba_kernels and self.device.type == "cpu" and cpu.supports(w_gate)
        if self.numba:
            self._np = (numpy_weights(w_gate), None if w_up is None else numpy_weights(w_up),
                        cpu.NO_BIAS if b_in is None else b_in.numpy(), numpy_weights(wt_down))
        self.all_rows = torch.arange(self.n, dtype=torch.int64)
        self.all_rows_np = self.all_rows.numpy()
        self.dense_np: tuple[np.ndarray, np.ndarray] | None = None  # see use_dense_layout
        self.dense_panels: tuple[torch.Tensor, torch.Tensor] | None = None

    def use_dense_layout(self, place: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        """Re-lay the weights for a tier that always reads every row (a CPU-only layer in
        dense, oracle or offload mode, or one that bypasses its predictor): gate and up rows in
        one (2n, d) matrix and the down projection untransposed (d, n), as the dense FFN kernel
        reads them; half weights in column panels (ops/panels.py), which its GEMVs read
        faster. Decode then runs `decode.dense_ffn` (the GEMV down projection beats the
        transposed AXPY: 51 vs 55-58 us per SmolLM2 layer); batches take the torch path, from
        row views of these (or, for panels, rows widened from them per batch, as half weights
        are widened anyway). Memory stays the same. `place` puts new row-layout tensors in
        memory (huge pages; panels get them from to_panels)."""
        if not self.numba or self.dense_np is not None:
            return
        w_in = self.w_gate if self.w_up is None else torch.cat([self.w_gate, self.w_up])
        w_out = self.wt_down.t()
        if w_in.dtype != torch.float32 and panels.panel_width(w_in.shape[1]) and panels.panel_width(w_out.shape[1]):
            self.dense_panels = (panels.to_panels(w_in), panels.to_panels(w_out))
            self.w_gate = self.w_up = self.wt_down = None  # not kept: the panels replace them
            self._np = (None, None, self._np[2], None)
            self.dense_np = tuple(numpy_weights(p) for p in self.dense_panels)
            return
        w_in, w_out = place(w_in), place(w_out.contiguous())
        self.w_gate = w_in[: self.n]
        self.w_up = None if self.w_up is None else w_in[self.n :]
        self.wt_down = w_out.t()
        self.dense_np = (numpy_weights(w_in), numpy_weights(w_out))
        # rebuilt from the views, or the old arrays would keep the old memory alive
        self._np = (numpy_weights(self.w_gate), None if self.w_up is None else numpy_weights(self.w_up),
                    self._np[2], numpy_weights(self.wt_down))

    def dense_rows(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(gate or fc1 rows (n, d), up rows or None, down transposed (n, d_out)) for the torch
        path: views of the weights, or fp32 rows widened from the panels."""
        if self.dense_panels is None:
            return self.w_gate, self.w_up, self.wt_down
        w_in = panels.rows_from_panels(self.dense_panels[0])
        up = w_in[self.n :] if w_in.shape[0] > self.n else None
        return w_in[: self.n], up, panels.rows_from_panels(self.dense_panels[1]).t()

    @property
    def out_features(self) -> int:
        if self.dense_panels is not None:
            return int(self.dense_panels[1].shape[1])  # panels of the down projection: (n / P, d_out, P)
        return int(self.wt_down.shape[1])

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.w_gate, self.w_up, self.b_in, self.wt_down, *(self.dense_panels or ())) if t is not None]


class HybridFFN:
    """A layer's FFN over two tiers (see the module docstring). Callable like `DenseFFN`."""

    def __init__(self, gpu_tier: Tier, cpu_tier: Tier, b_out: torch.Tensor | None, act: str, up_act: str | None,
                 gated: bool, criterion: str, threshold: float, predictor: "Predictor | None", mode: str,
                 executor: ThreadPoolExecutor | None, stats: FFNStats, last_layer: bool = False,
                 predictor_bypass: bool = False):
        if mode not in MODES:
            raise BadArgumentError(f"unknown mode {mode!r} (choose {', '.join(MODES)})")
        if mode == "sparse" and predictor is None:
            raise BadArgumentError("--mode sparse needs predictors; this packed model has none (run `powerinfer prepare`)")
        self.gpu, self.cpu = gpu_tier, cpu_tier
        self.b_out = b_out
        self.act_name, self.up_act_name = act, up_act
        self.act, self.up_act = activation(act), activation(up_act) if up_act else None
        self.act_id = cpu.ACT_IDS[act]
        self.up_act_id = cpu.ACT_IDS[up_act] if up_act else -1
        self.gated = gated
        self.criterion = criterion
        self.criterion_id = CRITERION_IDS[criterion if gated else ("gate" if criterion != "none" else "none")]
        self.threshold = float(threshold)
        self._threshold32 = np.float32(threshold)
        self.predictor = predictor
        self.mode = mode
        # sparse mode, predictor bypassed (see load_packed): every gate/up row, true activations
        self.predictor_bypass = predictor_bypass and mode == "sparse"
        # ... and when the whole layer runs the dense FFN kernel, which reads every down row
        # whatever the activations, the threshold would cost quality and save nothing: such a
        # layer computes the exact FFN
        self.bypass_exact = self.predictor_bypass and gpu_tier.n == 0 and cpu_tier.dense_np is not None
        # the criterion when every row is computed: the true activations in oracle mode and
        # for a bypassed predictor (unless exact), none in dense and offload mode (and sparse prefill)
        thresholded = mode == "oracle" or (self.predictor_bypass and not self.bypass_exact)
        self.all_rows_criterion = self.criterion_id if thresholded else 0
        self.executor = executor
        self.stats = stats
        self.last_layer = last_layer  # ends the token in the stats
        self.n_ff = gpu_tier.n + cpu_tier.n

    # -- the public protocol ------------------------------------------------------------
    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        base = residual  # what the tiers' outputs are added to: the residual and the output bias
        if self.b_out is not None:
            base = self.b_out.expand(x.shape[0], -1) if base is None else base + self.b_out
        if x.shape[0] == 1 and self.mode == "sparse" and not self.predictor_bypass:
            on_device, on_host = self.predictor.active_on_device(x)
            gpu_idx, cpu_idx = self.split(on_host)
            if self.gpu.device == on_device.device:  # the GPU part's indices are already there
                gpu_idx = on_device[: gpu_idx.shape[0]]
            return self.run_tiers(x, gpu_idx, cpu_idx, self.criterion_id, record=True, base=base)
        return self.run_tiers(x, None, None, self.all_rows_criterion, record=x.shape[0] == 1, base=base)

    def add_one(self, h: np.ndarray, x: np.ndarray) -> bool:
        """Decode fast path: x += FFN(h) in place for one fp32 token (d,), in one kernel call,
        when the whole layer is on the CPU tier (GPU tier empty, CPU predictor). Returns False,
        doing nothing, when it does not apply; `__call__` then takes the general route."""
        tier = self.cpu
        if self.gpu.n or not tier.numba:
            return False
        if tier.dense_np is not None:  # every row, dense layout: the dense FFN kernel
            self._record(0, tier.n, False)
            b_out = cpu.NO_BIAS if self.b_out is None else self.b_out.numpy()
            self._dense_into(tier, h, self.all_rows_criterion, b_out, x)
            return True
        if self.b_out is not None:
            return False
        if self.mode == "sparse" and not self.predictor_bypass:
            if self.predictor is None or self.predictor.device.type != "cpu":
                return False
            idx = self.predictor.active_np(h)
            criterion = self.criterion_id
        else:
            idx = tier.all_rows_np
            criterion = self.all_rows_criterion
        self._record(0, idx.shape[0], False)
        if idx.shape[0]:
            self._numba_into(tier, h[None], idx, criterion, x[None])
        return True

    def tensors(self) -> list[torch.Tensor]:
        extra = [] if self.predictor is None else self.predictor.tensors()
        return self.gpu.tensors() + self.cpu.tensors() + ([self.b_out] if self.b_out is not None else []) + extra

    # -- pieces, public for tests and benchmarks ------------------------------------------
    def split(self, packed_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Active packed indices -> (GPU tier rows, CPU tier rows)."""
        cut = int(torch.searchsorted(packed_idx, self.gpu.n))
        return packed_idx[:cut], packed_idx[cut:] - self.gpu.n

    def run_tiers(self, x: torch.Tensor, gpu_idx: torch.Tensor | None, cpu_idx: torch.Tensor | None,
                  criterion: int, record: bool = False, base: torch.Tensor | None = None) -> torch.Tensor:
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
            out = torch.zeros(x.shape[0], self.out_features, dtype=torch.float32) if base is None else base.clone(memory_format=torch.contiguous_format)
        return out if gpu_out is None else out.add_(gpu_out)

    @property
    def out_features(self) -> int:
        return self.cpu.out_features

    def tier_output(self, tier: Tier, x: torch.Tensor, idx: torch.Tensor | None, criterion: int,
                    base: torch.Tensor | None = None) -> torch.Tensor:
        """One tier's FFN output (T, d_out) on the CPU, over rows `idx` (None = all), plus `base`."""
        if tier.numba and x.shape[0] <= 4:
            if tier.dense_np is not None and idx is None:
                return self._dense_layout_tokens(tier, x, criterion, base)
            return self._numba_tier(tier, x, tier.all_rows if idx is None else idx, criterion, base)
        xd = x.to(tier.device, non_blocking=True)
        if idx is None:
            out = self._torch_dense(tier, xd, criterion)
        else:
            out = self._torch_sparse(tier, xd, idx.to(tier.device, non_blocking=True), criterion)
        out = out.to("cpu")
        return out if base is None else out.add_(base)

    def _record(self, n_gpu: int, n_cpu: int, both: bool) -> None:
        self.stats.record(n_gpu, n_cpu, self.n_ff, both)
        if self.last_layer:
            self.stats.end_token()

    def _dense_layout_tokens(self, tier: Tier, x: torch.Tensor, criterion: int, base: torch.Tensor | None) -> torch.Tensor:
        """Every row of a dense-layout tier for a few tokens: the dense FFN kernel per token."""
        out = self._output_buffer(x.shape[0], base)
        xs = x.contiguous().numpy()
        for t in range(x.shape[0]):
            self._dense_into(tier, xs[t], criterion, cpu.NO_BIAS, out[t])
        return torch.from_numpy(out)

    def _output_buffer(self, T: int, base: torch.Tensor | None) -> np.ndarray:
        """A fresh (T, d_out) fp32 buffer for a numba tier to accumulate into: zeros, or a copy
        of `base` (the caller's, so never written)."""
        if base is None:
            return np.zeros((T, self.out_features), dtype=np.float32)
        return np.array(base.expand(T, -1).numpy(), dtype=np.float32, order="C")

    def _dense_into(self, tier: Tier, h: np.ndarray, criterion: int, b_out: np.ndarray, x: np.ndarray) -> None:
        """x (d_out,) += a dense-layout tier's FFN of one token h (d,), every row (+ b_out)."""
        b_in = cpu.NO_BIAS if self.gated or tier.b_in is None else tier._np[2]  # gated tiers have no input bias
        decode.dense_ffn(h, tier.dense_np[0], b_in, tier.dense_np[1], b_out, self.gated, self.act_id, self.up_act_id,
                         criterion, self._threshold32, x, panels.threads())

    def _numba_tier(self, tier: Tier, x: torch.Tensor, idx: torch.Tensor, criterion: int,
                    base: torch.Tensor | None) -> torch.Tensor:
        out = self._output_buffer(x.shape[0], base)
        self._numba_into(tier, x.contiguous().numpy(), idx.numpy(), criterion, out)
        return torch.from_numpy(out)

    def _numba_into(self, tier: Tier, x: np.ndarray, idx: np.ndarray, criterion: int, out: np.ndarray) -> None:
        """out (T, d_out) += the tier's FFN over its rows `idx` for x (T, d), numba kernels."""
        wg, wu, b_in, wd = tier._np
        chunks = sparse_cpu.default_chunks()
        if self.gated:
            h = np.empty((x.shape[0], idx.shape[0]), dtype=np.float32)
            sparse_cpu.gated_ffn(wg, wu, wd, x, idx, self.act_id, self.up_act_id, criterion,
                                 self._threshold32, chunks, h, out, True)
        else:
            a = np.empty((x.shape[0], idx.shape[0]), dtype=np.float32)
            # an empty index array means "all rows" to row_gemv, which is what idx holds then
            sparse_cpu.row_gemv(wg, x, idx if idx.shape[0] < tier.n else _ALL, b_in, self.act_id, a)
            if criterion:
                a[np.abs(a) <= self.threshold] = 0.0
            sparse_cpu.col_axpy(wd, a, idx, chunks, out, True)

    def _values(self, g: torch.Tensor, u: torch.Tensor | None, criterion: int) -> torch.Tensor:
        a = self.act(g)
        if u is None:
            h = a
        else:
            h = a * (self.up_act(u) if self.up_act is not None else u)
        if criterion == 1:
            h = torch.where(a.abs() <= self.threshold, torch.zeros_like(h), h)
        elif criterion == 2:
            h = torch.where(h.abs() <= self.threshold, torch.zeros_like(h), h)
        return h

    def _torch_dense(self, tier: Tier, x: torch.Tensor, criterion: int) -> torch.Tensor:
        w_gate, w_up, wt_down = tier.dense_rows()
        g = gpu._matmul(x, w_gate.t())
        if tier.b_in is not None:
            g = g + tier.b_in.float()
        u = gpu._matmul(x, w_up.t()) if self.gated else None
        return gpu._matmul(self._values(g, u, criterion), wt_down)

    def _torch_sparse(self, tier: Tier, x: torch.Tensor, idx: torch.Tensor, criterion: int) -> torch.Tensor:
        if self.gated:
            out, _ = gpu.sparse_gated_ffn(tier.w_gate, tier.w_up, tier.wt_down, x, idx, self.act_name,
                                          self.up_act_name, criterion, self.threshold)
            return out
        g = gpu.sparse_row_gemv(tier.w_gate, x, idx, tier.b_in)
        return gpu.sparse_col_axpy(tier.wt_down, self._values(g, None, criterion), idx)


_ALL = np.zeros(0, dtype=np.int64)
SMALL_PREDICTOR = 1 << 17  # parameters up to which one serial call beats the parallel kernels


class Predictor:
    """One layer's activation predictor, rows in packed order: logits = W2 relu(W1 x + b1) + b2;
    active = logits > threshold."""

    def __init__(self, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, threshold: float):
        self.w1, self.b1, self.w2, self.b2 = (t.float().contiguous() for t in (w1, b1, w2, b2))
        self.threshold = float(threshold)
        self.device = self.w1.device
        # called with each token's logits (1, n) as numpy on every route, when set (calibration)
        self.observe: Callable[[np.ndarray], None] | None = None
        self._thr_dev = torch.tensor(self.threshold, device=self.device)
        if self.device.type == "cpu":
            self._np = (self.w1.numpy(), self.b1.numpy(), self.w2.numpy(), self.b2.numpy())
            self._hidden = np.empty((1, self.w1.shape[0]), dtype=np.float32)
            self._logits = np.empty((1, self.w2.shape[0]), dtype=np.float32)
            self._thr = np.array([self.threshold], dtype=np.float32)
            self._small = self.w1.numel() + self.w2.numel() <= SMALL_PREDICTOR
            self._w2t = self.w2.t().contiguous().numpy() if self._small else None  # (rank, n) for the serial path

    def _device_logits(self, x: torch.Tensor) -> torch.Tensor:
        return gpu.predictor_logits(self.w1, self.b1, self.w2, self.b2, x.to(self.device))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._device_logits(x).cpu()

    def active(self, x: torch.Tensor) -> torch.Tensor:
        """Sorted int64 packed indices of the neurons predicted active for one token."""
        return self.active_on_device(x)[1]

    def active_on_device(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices where the predictor runs, the same on the CPU): a device predictor
        thresholds where its logits are and only the indices travel to the host, once."""
        if self.device.type == "cpu":
            idx = torch.from_numpy(self.active_np(x.contiguous().numpy()[0]))
            return idx, idx
        logits = self._device_logits(x)
        if self.observe is not None:
            self.observe(logits.float().cpu().numpy())
        idx = gpu.threshold_to_index(logits, self._thr_dev)
        return idx, idx.cpu()

    def active_np(self, x: np.ndarray) -> np.ndarray:
        """`active` for a CPU predictor and one fp32 token (d,) as numpy, without torch."""
        w1, b1, w2, b2 = self._np
        if self._small:
            idx = sparse_cpu.predict_active_small(w1, b1, self._w2t, b2, x, np.float32(self.threshold),
                                                  self._hidden[0], self._logits[0], _ALL)
        else:
            sparse_cpu.row_gemv(w1, x[None], _ALL, b1, cpu.ACT_IDS["relu"], self._hidden)
            sparse_cpu.row_gemv(w2, self._hidden, _ALL, b2, -1, self._logits)
            idx = sparse_cpu.threshold_to_index(self._logits, self._thr, _ALL)
        if self.observe is not None:
            self.observe(self._logits.copy())
        return idx

    def tensors(self) -> list[torch.Tensor]:
        return [self.w1, self.b1, self.w2, self.b2]
