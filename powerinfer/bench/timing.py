"""Timing helpers shared by the benchmarks: medians over repeats, memory bandwidth, LLC size."""

from __future__ import annotations

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


def memory_read_bandwidth(n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of a parallel reduction over a buffer far larger than the caches."""
    buf = torch.ones(n_bytes // 4, dtype=torch.float32)
    return n_bytes / median_time(lambda: buf.sum(), repeats)
