"""When a neuron counts as off: the threshold criterion, one enum and one reference formula.

A gated neuron's value is a * u with a = act(gate x) and u = up x (or up_act(up x)); a plain
FFN's is a = act(fc1 x). The profile calibrates a per-layer threshold t, and a neuron is off
when its score is <= t:

* GATE    (CATS): score |a|; the kernels then skip the neuron's up row as well;
* GATE_UP:        score |a * u| (|a| for a plain FFN, which has no u);
* NONE:           never off (the dense model).

The numba kernels compare against the integer values (`criterion == GATE`), the torch
paths call `apply`; `scores` is the formula both are tested against.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from ..errors import BadArgumentError


class Criterion(IntEnum):
    NONE = 0
    GATE = 1
    GATE_UP = 2

    @classmethod
    def parse(cls, value: "str | int | Criterion") -> "Criterion":
        """From a name ("none", "gate", "gate_up") or a value; one-line error otherwise."""
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise BadArgumentError(f"criterion must be one of {', '.join(NAMES)}, not {value!r}") from None
        try:
            return cls(int(value))
        except ValueError:
            raise BadArgumentError(f"criterion must be one of {', '.join(NAMES)}, not {value!r}") from None

    @property
    def label(self) -> str:
        return self.name.lower()

    def for_ffn(self, gated: bool) -> "Criterion":
        """The criterion as the kernels apply it: a plain FFN has no up part, so both of its
        criteria read |a|, which the kernels call GATE."""
        return self if gated or self is Criterion.NONE else Criterion.GATE


NAMES = tuple(c.label for c in Criterion)
# plain ints for numba kernels (a global IntEnum member is not a compile-time constant there)
NONE, GATE, GATE_UP = int(Criterion.NONE), int(Criterion.GATE), int(Criterion.GATE_UP)


def scores(a: torch.Tensor, u: torch.Tensor | None, criterion: "Criterion | str") -> torch.Tensor:
    """How strongly each neuron fires under `criterion`: |a| (GATE, or no u) or |a * u|."""
    c = Criterion.parse(criterion)
    if c is Criterion.NONE:
        raise BadArgumentError("the criterion 'none' scores nothing")
    if c is Criterion.GATE or u is None:
        return a.abs()
    return (a * u).abs()


def apply(h: torch.Tensor, a: torch.Tensor, criterion: "Criterion | int", threshold: float) -> torch.Tensor:
    """Neuron values h (= a * u, or a) with the neurons that are off under `criterion` zeroed;
    `a` is the activated gate. The reference every backend's thresholding follows."""
    c = Criterion(int(criterion))
    if c is Criterion.NONE:
        return h
    score = a.abs() if c is Criterion.GATE else h.abs()
    return torch.where(score <= threshold, torch.zeros_like(h), h)
