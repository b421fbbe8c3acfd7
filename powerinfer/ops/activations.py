"""The one registry of FFN activations: each name's torch function and its kernel id.

The numba kernels branch on a small integer (`ops/cpu._act`), the torch paths call the
function; both are looked up here, so a name means the same thing on every backend.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import UnsupportedModelError


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# kernel ids: 0 SiLU, 1 ReLU, 2 exact GELU, 3 tanh-approximated GELU (see ops/cpu._act)
_REGISTRY: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
    "silu": (F.silu, 0),
    "swish": (F.silu, 0),
    "relu": (F.relu, 1),
    "gelu": (F.gelu, 2),
    "gelu_new": (_gelu_tanh, 3),
    "gelu_pytorch_tanh": (_gelu_tanh, 3),
    "gelu_fast": (_gelu_tanh, 3),
}
NO_ACTIVATION = -1  # the kernels' id for "no activation" (e.g. the up projection of SwiGLU)


def _entry(name: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    if name not in _REGISTRY:
        raise UnsupportedModelError(f"activation {name!r} is not supported (known: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[name]


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The torch function of activation `name` (refused with one line when unknown)."""
    return _entry(name)[0]


def maybe_activation(name: str | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`activation(name)`, or None for no activation."""
    return None if name is None else activation(name)


def activation_id(name: str | None) -> int:
    """The numba kernels' id of activation `name`; NO_ACTIVATION for None."""
    return NO_ACTIVATION if name is None else _entry(name)[1]


def known() -> list[str]:
    return sorted(_REGISTRY)
