"""An FFN over a set of neuron rows, and the one place that picks how it is computed.

`FFNRows` holds a block of an FFN's neurons: gate (or fc1) rows, up rows, an fc1 bias and
the down projection transposed (one row per neuron), in one of two layouts:

* rows (the sparse layout): any subset of neurons is read in place by index;
* dense: gate and up in one (2n, d) matrix and the down projection untransposed (d, n),
  half weights in column panels, for blocks that always read every row (the dense FFN
  kernel reads them faster; see `use_dense_layout`).

`output` computes base + FFN over rows `idx` (None: all) for T tokens and picks the
backend: the numba kernels for a CPU block and a few tokens, torch otherwise (CUDA, the
CPU-backed GPU tier, batches). `add_into` is the numba path for callers that hold numpy
buffers (one decode token, no torch in the loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from . import block_lanes, cpu, decode, panels, quant, quant_sparse, quant_torch, sparse_cpu
from .activations import activation_id, maybe_activation
from .criterion import Criterion, apply as apply_criterion
from .numba_half import numpy_weights
from .torch_ops import matmul, sparse_col_axpy, sparse_gated_ffn, sparse_row_gemv

SMALL_BATCH = 4  # tokens up to which a CPU block runs the numba kernels, one token at a time
_ALL = np.zeros(0, dtype=np.int64)  # an empty index array means "all rows" to row_gemv


@dataclass(frozen=True)
class FFNSpec:
    """What a neuron computes: act(gate) * up_act(up) (gated) or act(fc1 + b) (plain), and
    the profile's threshold under which it counts as off."""

    act: str
    up_act: str | None
    gated: bool
    threshold: float = 0.0
    act_id: int = field(init=False)
    up_act_id: int = field(init=False)
    threshold32: np.float32 = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "act_id", activation_id(self.act))
        object.__setattr__(self, "up_act_id", activation_id(self.up_act))
        object.__setattr__(self, "threshold32", np.float32(self.threshold))

    def kernel_criterion(self, criterion: Criterion) -> int:
        return int(criterion.for_ffn(self.gated))


class FFNRows:
    """A block of n neurons' weights (see the module docstring) on one device."""

    def __init__(self, w_gate: torch.Tensor, w_up: torch.Tensor | None, b_in: torch.Tensor | None,
                 wt_down: torch.Tensor, numba_kernels: bool):
        self.w_gate, self.w_up, self.b_in, self.wt_down = w_gate, w_up, b_in, wt_down
        self.n = int(w_gate.shape[0])
        self.device = w_gate.device
        self.quant = quant.is_quantized(w_gate)  # GGUF blocks; the down projection then Q8_0 (quant_sparse.py)
        self.numba = numba_kernels and self.device.type == "cpu" and (cpu.supports(w_gate) or self.quant)
        self._b_np = cpu.NO_BIAS if b_in is None or not self.numba else b_in.numpy()
        # the numba kernels read quantized gate/up rows faster re-laid 16 blocks per vector
        self.blocked = (self.quant and self.numba and block_lanes.fits(w_gate)
                        and (w_up is None or (block_lanes.fits(w_up) and w_up.shape[2] == w_gate.shape[2])))
        if self.blocked:
            self.w_gate = w_gate = block_lanes.relay(w_gate)
            self.w_up = w_up = None if w_up is None else block_lanes.relay(w_up)
        self._np: tuple | None = None
        if self.numba:
            view = (lambda t: t.numpy()) if self.quant else numpy_weights
            self._np = (view(w_gate), None if w_up is None else view(w_up), view(wt_down))
        self.all_rows = torch.arange(self.n, dtype=torch.int64)
        self.all_rows_np = self.all_rows.numpy()
        self.dense_np: tuple[np.ndarray, np.ndarray] | None = None  # see use_dense_layout
        self.dense_panels: tuple[torch.Tensor, torch.Tensor] | None = None

    def use_dense_layout(self, place: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        """Re-lay the weights for a block that always reads every row: gate and up rows in one
        (2n, d) matrix and the down projection untransposed (d, n), as the dense FFN kernel
        reads them (its GEMV down projection beats the transposed AXPY); half weights in column
        panels (ops/panels.py). Memory stays the same. `place` puts new row-layout tensors in
        memory (huge pages; panels get them from to_panels)."""
        if not self.numba or self.dense_np is not None or self.quant:  # blocks cannot be transposed: rows
            return
        w_in = self.w_gate if self.w_up is None else torch.cat([self.w_gate, self.w_up])
        w_out = self.wt_down.t()
        if w_in.dtype != torch.float32 and panels.panel_width(w_in.shape[1]) and panels.panel_width(w_out.shape[1]):
            self.dense_panels = (panels.to_panels(w_in), panels.to_panels(w_out))
            self.w_gate = self.w_up = self.wt_down = None  # not kept: the panels replace them
            self._np = None
            self.dense_np = tuple(numpy_weights(p) for p in self.dense_panels)
            return
        w_in, w_out = place(w_in), place(w_out.contiguous())
        self.w_gate = w_in[: self.n]
        self.w_up = None if self.w_up is None else w_in[self.n :]
        self.wt_down = w_out.t()
        self.dense_np = (numpy_weights(w_in), numpy_weights(w_out))
        # rebuilt from the views, or the old arrays would keep the old memory alive
        self._np = (numpy_weights(self.w_gate), None if self.w_up is None else numpy_weights(self.w_up),
                    numpy_weights(self.wt_down))

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
        if self.quant:
            return quant.shape_of(self.wt_down)[1]
        return int(self.wt_down.shape[1])

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.w_gate, self.w_up, self.b_in, self.wt_down, *(self.dense_panels or ())) if t is not None]


# -- the op ------------------------------------------------------------------------------------
def output(rows: FFNRows, spec: FFNSpec, x: torch.Tensor, idx: torch.Tensor | None, criterion: Criterion,
           base: torch.Tensor | None = None) -> torch.Tensor:
    """base + the FFN over `rows`' neurons `idx` (None = all) for x (T, d); fp32 (T, d_out) on
    the CPU. The backend is chosen here: numba for a CPU block and up to SMALL_BATCH tokens,
    torch (on the block's device) otherwise."""
    if rows.numba and x.shape[0] <= SMALL_BATCH:
        out = _output_buffer(rows, x.shape[0], base)
        xs = x.contiguous().numpy()
        if idx is None and rows.dense_np is not None:
            for t in range(x.shape[0]):
                add_dense_into(rows, spec, xs[t], criterion, cpu.NO_BIAS, out[t])
        else:
            add_into(rows, spec, xs, rows.all_rows_np if idx is None else idx.numpy(), criterion, out)
        return torch.from_numpy(out)
    if rows.quant:
        out = (_quant_batch if rows.numba else _quant_torch)(rows, spec, x, idx, criterion)
        return out if base is None else out.add_(base)
    xd = x.to(rows.device, non_blocking=True)
    if idx is None:
        out = _torch_dense(rows, spec, xd, criterion)
    else:
        out = _torch_sparse(rows, spec, xd, idx.to(rows.device, non_blocking=True), criterion)
    out = out.to("cpu")
    return out if base is None else out.add_(base)


def add_into(rows: FFNRows, spec: FFNSpec, x: np.ndarray, idx: np.ndarray, criterion: Criterion,
             out: np.ndarray) -> None:
    """out (T, d_out) += the FFN over `rows`' neurons `idx` for x (T, d): numba, row layout."""
    wg, wu, wd = rows._np
    c = spec.kernel_criterion(criterion)
    chunks = sparse_cpu.default_chunks()
    if rows.quant:
        h = np.empty((x.shape[0], idx.shape[0]), dtype=np.float32)
        quant_sparse.ffn_rows_q(wg, wg if wu is None else wu, wd, x, idx.astype(np.int64, copy=False), spec.gated,
                                rows._b_np, spec.act_id, spec.up_act_id, c, spec.threshold32, chunks, h, out,
                                rows.blocked)
        return
    if spec.gated:
        h = np.empty((x.shape[0], idx.shape[0]), dtype=np.float32)
        sparse_cpu.gated_ffn(wg, wu, wd, x, idx, spec.act_id, spec.up_act_id, c, spec.threshold32, chunks, h, out, True)
    else:
        a = np.empty((x.shape[0], idx.shape[0]), dtype=np.float32)
        sparse_cpu.row_gemv(wg, x, idx if idx.shape[0] < rows.n else _ALL, rows._b_np, spec.act_id, a)
        if c:
            a[np.abs(a) <= spec.threshold] = 0.0
        sparse_cpu.col_axpy(wd, a, idx, chunks, out, True)


def add_dense_into(rows: FFNRows, spec: FFNSpec, h: np.ndarray, criterion: Criterion, b_out: np.ndarray,
                   x: np.ndarray) -> None:
    """x (d_out,) += a dense-layout block's FFN of one token h (d,), every row (+ b_out)."""
    b_in = cpu.NO_BIAS if spec.gated else rows._b_np  # gated blocks have no input bias
    decode.dense_ffn(h, rows.dense_np[0], b_in, rows.dense_np[1], b_out, spec.gated, spec.act_id, spec.up_act_id,
                     spec.kernel_criterion(criterion), spec.threshold32, x, panels.threads())


def _output_buffer(rows: FFNRows, T: int, base: torch.Tensor | None) -> np.ndarray:
    """A fresh (T, d_out) fp32 buffer to accumulate into: zeros, or a copy of `base`."""
    if base is None:
        return np.zeros((T, rows.out_features), dtype=np.float32)
    return np.array(base.expand(T, -1).numpy(), dtype=np.float32, order="C")


def _values(spec: FFNSpec, g: torch.Tensor, u: torch.Tensor | None, criterion: Criterion) -> torch.Tensor:
    a = maybe_activation(spec.act)(g)
    if u is None:
        h = a
    else:
        up_act = maybe_activation(spec.up_act)
        h = a * (up_act(u) if up_act is not None else u)
    return apply_criterion(h, a, spec.kernel_criterion(criterion), spec.threshold)


def _quant_batch(rows: FFNRows, spec: FFNSpec, x: torch.Tensor, idx: torch.Tensor | None,
                 criterion: Criterion) -> torch.Tensor:
    """A batch over a CPU block's quantized rows (prefill): the block kernels over every row,
    neurons outside `idx` zeroed."""
    mm = block_lanes.matmul if rows.blocked else quant.matmul
    g = mm(rows.w_gate, x, rows.b_in)
    u = mm(rows.w_up, x) if spec.gated else None
    h = _values(spec, g, u, criterion)
    if idx is not None:
        keep = torch.zeros(rows.n, dtype=torch.bool)
        keep[idx] = True
        h = h * keep
    return quant.matmul_t(rows.wt_down, h)


def _quant_torch(rows: FFNRows, spec: FFNSpec, x: torch.Tensor, idx: torch.Tensor | None,
                 criterion: Criterion) -> torch.Tensor:
    """The FFN over quantized rows with torch ops on the rows' device (the GPU tier): only the
    rows of `idx` (all when None) widened (ops/quant_torch.py), then fp32 GEMMs."""
    dev = rows.device
    xd = x.to(dev, non_blocking=True).float()
    i = None if idx is None else idx.to(dev, non_blocking=True)
    g = xd @ quant_torch.rows(rows.w_gate, i).t()
    if rows.b_in is not None:
        g = g + (rows.b_in.float() if i is None else rows.b_in.float()[i])
    u = xd @ quant_torch.rows(rows.w_up, i).t() if spec.gated else None
    return (_values(spec, g, u, criterion) @ quant_torch.rows(rows.wt_down, i)).to("cpu")


def _torch_dense(rows: FFNRows, spec: FFNSpec, x: torch.Tensor, criterion: Criterion) -> torch.Tensor:
    w_gate, w_up, wt_down = rows.dense_rows()
    g = matmul(x, w_gate.t())
    if rows.b_in is not None:
        g = g + rows.b_in.float()
    u = matmul(x, w_up.t()) if spec.gated else None
    return matmul(_values(spec, g, u, criterion), wt_down)


def _torch_sparse(rows: FFNRows, spec: FFNSpec, x: torch.Tensor, idx: torch.Tensor, criterion: Criterion) -> torch.Tensor:
    c = spec.kernel_criterion(criterion)
    if spec.gated:
        out, _ = sparse_gated_ffn(rows.w_gate, rows.w_up, rows.wt_down, x, idx, spec.act, spec.up_act, c,
                                  spec.threshold)
        return out
    g = sparse_row_gemv(rows.w_gate, x, idx, rows.b_in)
    return sparse_col_axpy(rows.wt_down, _values(spec, g, None, criterion), idx)
