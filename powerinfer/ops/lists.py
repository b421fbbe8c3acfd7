"""numba typed lists of arrays, built in compiled code."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit, typeof
from numba.typed import List


@njit(cache=True)
def _from_tuple(arrays):
    out = List()
    for a in arrays:
        out.append(a)
    return out


def typed_list(arrays: Sequence[np.ndarray]) -> List:
    """`numba.typed.List(arrays)`, built by a cached kernel: from Python, List(...) compiles
    numba's list helpers anew in every process (~0.2 s an element type: ~0.45 s of a 5 s
    `generate`), and appends at ~10 us an element. Arrays of differing types (layouts,
    read-only flags) or none at all take List(...)."""
    if not arrays or len({typeof(a) for a in arrays}) != 1:
        return List(arrays)
    return _from_tuple(tuple(arrays))
