"""A layer's activation predictor, in packed row order, on the CPU or the GPU tier.

logits = W2 relu(W1 x + b1) + b2; a neuron is predicted active when its logit exceeds the
threshold. Output rows are in packed order (GPU tier rows, then CPU tier rows; see
engine/hybrid.py), so the active set splits into the two tiers with one binary search.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..ops import sparse_cpu, torch_ops

_INDEX_PROBE = np.zeros(0, dtype=np.int64)  # the predictor kernels return indices of this dtype
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
            # W2 transposed, (rank, n): the logits as AXPYs over neurons that vectorise; the rank
            # padded with zero rows
            w1p, b1p, self._w2t = sparse_cpu.pad_rank(self.w1.numpy(), self.b1.numpy(),
                                                      self.w2.t().contiguous().numpy())
            # W2 itself becomes a view of that copy: one copy held, not two (a rank-1024 7B
            # predictor is 45 MB a layer)
            self.w2 = torch.from_numpy(self._w2t[:self.w1.shape[0]]).t()
            self._np = (w1p, b1p, self.b2.numpy())
            self._hidden = np.empty((1, w1p.shape[0]), dtype=np.float32)
            self._logits = np.empty((1, self.w2.shape[0]), dtype=np.float32)
            self._small = self.w1.numel() + self.w2.numel() <= SMALL_PREDICTOR

    def _device_logits(self, x: torch.Tensor) -> torch.Tensor:
        return torch_ops.predictor_logits(self.w1, self.b1, self.w2, self.b2, x.to(self.device))

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
        idx = torch_ops.threshold_to_index(logits, self._thr_dev)
        return idx, idx.cpu()

    def active_np(self, x: np.ndarray) -> np.ndarray:
        """`active` for a CPU predictor and one fp32 token (d,) as numpy, without torch."""
        w1, b1, b2 = self._np
        kernel = sparse_cpu.predict_active_small if self._small else sparse_cpu.predict_active
        idx = kernel(w1, b1, self._w2t, b2, x, np.float32(self.threshold), self._hidden[0], self._logits[0], _INDEX_PROBE)
        if self.observe is not None:
            self.observe(self._logits.copy())
        return idx

    def tensors(self) -> list[torch.Tensor]:
        return [self.w1, self.b1, self.w2, self.b2]
