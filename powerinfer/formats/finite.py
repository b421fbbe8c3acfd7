"""Weights that are NaN or Inf are refused where they are read, naming the tensor.

One NaN in a weight spreads through every later activation and surfaces, if at all, as a
crash or garbage far from its cause. The check is one reduction per tensor (or one byte per
quantized block); its cost is measured in docs/BENCHMARKS.md.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..errors import ModelFileError


def is_finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` (float, or quantized blocks) is finite."""
    from ..ops import quant

    if isinstance(t, quant.QuantParts):
        return all(is_finite(p) for p in t.parts)
    if quant.is_quantized(t):
        return not quant.has_nonfinite_scales(t)
    if not t.is_floating_point() or t.numel() == 0:
        return True
    # amax/amin propagate NaN and show +-Inf, without a temporary the size of the tensor
    return bool(torch.isfinite(t.amax()) and torch.isfinite(t.amin()))


def check_finite(tensors: Iterable[tuple[str, torch.Tensor | None]], source: str) -> None:
    """Raise a one-line ModelFileError for the first tensor holding NaN or Inf."""
    for name, t in tensors:
        if t is not None and not is_finite(t):
            raise ModelFileError(f"{source}: tensor {name} holds NaN or Inf values; the file is corrupt")
