"""The FFN block: the one place every family's feed-forward network runs.

Families build a `DenseFFN`; the sparse engine replaces it, layer by layer, with an FFN that
computes only the neurons its predictor selects. Both follow the `FFN` protocol.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

import torch

from ..ops import api, cpu
from ..ops.activations import activation, activation_id
from ..ops.criterion import scores as criterion_scores
from ..ops.linear import Linear


class FFN(Protocol):
    """Every entry point the decoder calls. out = residual + FFN(x): taking the residual lets
    an implementation fuse the add."""

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor: ...

    def add_one(self, h: np.ndarray, x: np.ndarray) -> bool:
        """Decode fast path: x += FFN(h) in place for one fp32 token, in one kernel call;
        False (nothing done) when this FFN has none for its current weights or strategy."""
        ...

    def add_batch(self, h: np.ndarray, x: np.ndarray) -> bool:
        """Batched decode: x[s] += FFN(h[s]) in place for (B, d) fp32 rows, each row exactly
        as `add_one` computes it, each weight read once; False (nothing done) when this FFN
        has no such kernel (the caller then runs `add_one` per row)."""
        ...

    def tensors(self) -> list[torch.Tensor]: ...


class DenseFFN:
    """Every neuron computed. Gated: down(act(gate x) * up x); plain: fc2(act(fc1 x)).

    `w_in` is (n_ff, d) for a plain FFN and (2 n_ff, d) for a gated one, gate rows first,
    so gate and up cost one GEMV; `w_out` is (d, n_ff).
    """

    def __init__(self, w_in: Linear, w_out: Linear, act: str, gated: bool, up_act: str | None = None):
        self.w_in, self.w_out = w_in, w_out
        self.act = activation(act)
        self.up_act = activation(up_act) if up_act else None
        self.gated = gated
        self.n_ff = w_out.in_features
        self._act_id = activation_id(act)
        self._up_act_id = activation_id(up_act)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN's neuron activations (T, n_ff): what the profiler and sparse engine look at."""
        h = self.w_in(x)
        if h.shape[0] == 1 and h.device.type == "cpu":  # decode: one numba call, no torch chain
            return self._hidden_one(h[0]).unsqueeze(0)
        if not self.gated:
            return self.act(h)
        gate, up = h[..., : self.n_ff], h[..., self.n_ff :]
        if self.up_act is not None:
            up = self.up_act(up)
        return self.act(gate) * up

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(act(gate x), up x) for a gated FFN, (act(fc1 x), None) for a plain one; torch ops,
        any batch size. Neuron values are a * u (or a)."""
        h = self.w_in(x)
        if not self.gated:
            return self.act(h), None
        up = h[..., self.n_ff :]
        return self.act(h[..., : self.n_ff]), self.up_act(up) if self.up_act is not None else up

    def down(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.w_out(h, residual=residual)

    def add_one(self, h: np.ndarray, x: np.ndarray) -> bool:
        """Decode: x += FFN(h) for one fp32 token in one kernel call (ops/decode.py). Returns
        False, doing nothing, when the weights are not ones the CPU kernels read."""
        w_in, w_out = self.w_in.w_np, self.w_out.w_np
        if w_in is None or w_out is None:
            return False
        api.dense_ffn_add(h, w_in, self.w_in.b_np, w_out, self.w_out.b_np, self.gated, self._act_id, self._up_act_id,
                          0, 0.0, x)
        return True

    def add_batch(self, h: np.ndarray, x: np.ndarray) -> bool:
        w_in, w_out = self.w_in.w_np, self.w_out.w_np
        if w_in is None or w_out is None:
            return False
        api.dense_ffn_add_batch(h, w_in, self.w_in.b_np, w_out, self.w_out.b_np, self.gated, self._act_id,
                                self._up_act_id, x)
        return True

    def _hidden_one(self, h: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            cpu.act_inplace(h.numpy(), self._act_id)
            return h
        out = torch.empty(self.n_ff, dtype=torch.float32)
        cpu.gated_act(h.numpy(), self.n_ff, self._act_id, self._up_act_id, out.numpy())
        return out

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.w_out(self.hidden(x), residual=residual)

    def tensors(self) -> list[torch.Tensor]:
        return self.w_in.tensors() + self.w_out.tensors()


def neuron_scores(a: torch.Tensor, u: torch.Tensor | None, criterion: str) -> torch.Tensor:
    """How strongly each neuron fires: |act(gate)| ("gate", CATS) or |act(gate) * up|
    ("gate_up"); for a plain FFN both are |act(fc1)| (ops/criterion.py)."""
    return criterion_scores(a, u, criterion)


class InstrumentedFFN:
    """A DenseFFN that reports neuron scores to an observer and, given a threshold, zeroes
    neurons whose score is <= it: the sparse model's exact definition ("oracle" activity)."""

    def __init__(self, ffn: DenseFFN, criterion: str, threshold: float | None = None,
                 observer: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                 predictor: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """`predictor(x) -> bool mask`: also zero the neurons it does not select (what the
        sparse engine computes: predicted AND above the threshold)."""
        self.ffn, self.criterion, self.threshold, self.observer = ffn, criterion, threshold, observer
        self.predictor = predictor

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        a, u = self.ffn.parts(x)
        h = a if u is None else a * u
        if self.observer is not None or self.threshold is not None:
            score = neuron_scores(a, u, self.criterion)
            if self.observer is not None:
                self.observer(x, score)
            if self.threshold is not None:
                h = h.masked_fill(score <= self.threshold, 0.0)
        if self.predictor is not None:
            h = h.masked_fill(~self.predictor(x), 0.0)
        return self.ffn.down(h, residual)

    def add_one(self, h: np.ndarray, x: np.ndarray) -> bool:
        return False  # observed and thresholded: always the torch route

    def add_batch(self, h: np.ndarray, x: np.ndarray) -> bool:
        return False

    def tensors(self) -> list[torch.Tensor]:
        return self.ffn.tensors()
