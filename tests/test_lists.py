"""Typed lists of arrays built by a cached kernel (ops/lists.py): the same numba type and
items as numba.typed.List(...) from Python, which the decode kernels' cached compiles key on."""

from __future__ import annotations

import numpy as np
from numba import typeof
from numba.typed import List

from powerinfer.ops.lists import typed_list


def test_typed_list_is_numba_s_list_of_the_same_arrays():
    frozen = np.arange(3, dtype=np.float32)
    frozen.setflags(write=False)
    for arrays in ([np.full(4, i, np.float32) for i in range(30)],
                   [np.full((2, 3, 4, 5), i, np.uint8) for i in range(8)],
                   [frozen, frozen]):
        got = typed_list(arrays)
        assert typeof(got) == typeof(List(arrays))
        assert len(got) == len(arrays) and all(g is not None and np.shares_memory(g, a) for g, a in zip(got, arrays))


def test_no_arrays_take_numba_s_own_list():
    assert len(typed_list([])) == 0
