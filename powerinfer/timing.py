"""Timing helpers shared by prepare's check and the benchmarks: medians over repeats, decode
rounds, memory bandwidth, LLC size."""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache (sysfs), 32 MiB when it cannot be read."""
    best = 0
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        value = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        best = max(best, value)
    return best or 32 << 20


class BusProbe:
    """Parallel reads of a buffer far larger than the caches, by three methods: torch.sum,
    a numba prange sum, and the decode kernels' own matvec over the buffer read as fp16 rows
    (four sequential streams per thread). On the 2-core dev machine the fp32 sums alone read
    28.6-30.7 GB/s while the fp16 matvec read 31.0 and the dense relu7b decode 31.4: a bound
    the engine beats is no bound, so each pass takes the fastest method.

    The buffer and the compiled sum are made once, so `read()` (one pass of each method,
    ~0.1 s for 1 GiB) can run between the timings it is compared with: this machine's bus
    moves between phases (torch.sum sustained 33 GB/s over a second in one minute, 50-54 in
    another), so a probe taken seconds away from a timing can belong to another phase."""

    def __init__(self, n_bytes: int = 1 << 30):
        import numpy as np

        from .ops import cpu
        from .ops.memory import on_huge_pages

        buf = on_huge_pages(torch.ones(n_bytes // 4, dtype=torch.float32))  # as the weights are
        arr = buf.numpy()
        bits = arr.view(np.int16)
        # The matvec reads four streams a quarter of the rows apart; with 2^17 rows of 8 KiB
        # they sit exactly 256 MiB apart and the read runs at half speed (likely DRAM bank
        # conflicts: 1 GiB of fp16 rows, 131072 rows 15-17 GB/s, 131068 rows 28-31, same run),
        # so the probe drops a few rows. The 7B shape's matrices (wo, QKV, gate/up, down)
        # showed no such loss against padded copies.
        halves = bits[: (bits.shape[0] // 4096 - 4) * 4096].reshape(-1, 4096)  # the same bytes as fp16 rows
        v, y = np.ones(4096, dtype=np.float32), np.zeros(halves.shape[0], dtype=np.float32)
        total = _parallel_sum()
        self._buf = buf
        self.methods: list[tuple[Callable[[], object], int]] = [
            (lambda: buf.sum(), arr.nbytes), (lambda: total(arr), arr.nbytes),
            (lambda: cpu.add_matvec(halves, v, cpu.NO_BIAS, y), halves.nbytes)]
        for fn, _ in self.methods:  # compile and fault the pages in
            fn()

    def passes(self, repeats: int) -> list[list[float]]:
        """Bytes/s of `repeats` passes, per method."""
        rates = []
        for fn, size in self.methods:
            runs = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                runs.append(size / (time.perf_counter() - t0))
            rates.append(runs)
        return rates

    def read(self) -> float:
        """Bytes/s of one pass of each method, the fastest."""
        return max(r[0] for r in self.passes(1))


@functools.cache
def _parallel_sum():
    """The numba sum, compiled once per process (not once per probe)."""
    import numba
    import numpy as np

    @numba.njit(parallel=True, fastmath=True)
    def total(a):
        s = np.float32(0.0)
        for i in numba.prange(a.shape[0]):
            s += a[i]
        return s
    return total


def memory_read_bandwidth(n_bytes: int = 1 << 30, repeats: int = 7, statistic: str = "best") -> float:
    """Bytes/s of BusProbe's fastest method: the best of `repeats` passes (default), or with
    statistic="median" their median. The bus drifts between phases: compare like with like,
    a median probe with median timings, taken next to them (bench ops uses BusProbe.read
    between its timings)."""
    if statistic not in ("best", "median"):
        raise ValueError(f"statistic must be 'best' or 'median', not {statistic!r}")
    pick = max if statistic == "best" else statistics.median
    return max(pick(runs) for runs in BusProbe(n_bytes).passes(repeats))


def decode_round(model, ids: list[int], n: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of our engine: prefill `ids`, then `n` greedy steps."""
    from .engine.generate import prefill
    from .engine.sample import greedy

    cache = model.new_cache(len(ids) + n + 1)
    t0 = time.perf_counter()
    logits = prefill(model, torch.tensor(ids), cache)
    t1 = time.perf_counter()
    step = torch.empty(1, dtype=torch.long)
    for _ in range(n):
        step[0] = greedy(logits)  # as generation picks greedily (numpy: see engine/sample.py)
        logits = model.forward(step, cache)
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), n / (t2 - t1)


def transformers_round(hf, ids: list[int], n: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of transformers' greedy `generate` (EOS ignored); decode
    time is a full run minus a one-token run."""
    x = torch.tensor([ids])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0)
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        hf.generate(x, max_new_tokens=n + 1, min_new_tokens=n + 1, **kw)
        t2 = time.perf_counter()
    prefill_s = t1 - t0
    return len(ids) / prefill_s, n / ((t2 - t1) - prefill_s)


def load_transformers(path: str, dtype: torch.dtype):
    """transformers' model for our model path (GGUF file via `gguf_file=`, or HF directory)."""
    import os

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    if os.path.isfile(path):
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return hf.eval()
