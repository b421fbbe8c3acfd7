"""The fused gated FFN at ReluLLaMA-7B's shape (4096 x 11008, fp16, 8 layers' matrices cycled
so the caches do not serve them), one decode token, 1,100 random sorted neurons (10%) of which
about half fire (random weights): every row read (criterion none), off neurons' down rows
skipped (gate_up), and the gate criterion a ReLU model is profiled with (up and down rows read
only for neurons whose ReLU(gate) > 0, exact at threshold 0). Rounds alternate; median of 36.

    python benchmarks/relu_gate_criterion.py
"""
import statistics
import time

import numpy as np
import torch

from powerinfer.ops import cpu, sparse_cpu
from powerinfer.ops.activations import activation_id
from powerinfer.ops.criterion import Criterion
from powerinfer.ops.memory import on_huge_pages
from powerinfer.ops.numba_half import numpy_weights

torch.manual_seed(0)
cpu.set_threads(2)
L, N, D, K = 8, 11008, 4096, 1100
CRITERIA = {c.label: int(c) for c in (Criterion.NONE, Criterion.GATE_UP, Criterion.GATE)}
mats = [tuple(numpy_weights(on_huge_pages((torch.randn(N, D) * s).half())) for s in (D**-0.5, D**-0.5, 0.01))
        for _ in range(L)]
x = np.random.randn(1, D).astype(np.float32)
relu = activation_id("relu")
rng = np.random.default_rng(0)


def median_us(criterion: int, calls: int = 40) -> float:
    times = []
    for r in range(calls):
        g, u, d = mats[r % L]
        idx = np.sort(rng.choice(N, K, replace=False)).astype(np.int64)
        h, out = np.empty((1, K), np.float32), np.zeros((1, D), np.float32)
        t0 = time.perf_counter()
        sparse_cpu.gated_ffn(g, u, d, x, idx, relu, -1, criterion, np.float32(0.0), 2, h, out, True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[4:]) * 1e6


for c in CRITERIA.values():
    median_us(c, 8)  # compile and warm up
print("| round | " + " | ".join(f"{name} us" for name in CRITERIA) + " |\n|---|---|---|---|")
for rnd in range(3):
    print(f"| {rnd + 1} | " + " | ".join(f"{median_us(c):.0f}" for c in CRITERIA.values()) + " |", flush=True)
