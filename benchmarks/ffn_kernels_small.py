"""FFN kernels at SmolLM2's shape (d 576, FFN 1536, bf16, 30 layers cycled so the caches
do not serve the weights): the one-call dense FFN (ops/decode.py) against the fused sparse
gated kernel over all rows and over a 93% set (what SmolLM2's predictors select), and the
single sparse ops against the dense GEMV. Rounds alternate; best of five per round.

    python benchmarks/ffn_kernels_small.py
"""
import time

import numpy as np
import torch

from powerinfer.ops import cpu, decode, panels, sparse_cpu
from powerinfer.ops.numba_half import numpy_weights

torch.set_num_threads(2)
cpu.set_threads(2)
nt = panels.threads()
L, d, n = 30, 576, 1536
rng = np.random.default_rng(0)
W_in = [numpy_weights(torch.randn(2 * n, d).bfloat16()) for _ in range(L)]
W_out = [numpy_weights(torch.randn(d, n).bfloat16()) for _ in range(L)]
G = [numpy_weights(torch.randn(n, d).bfloat16()) for _ in range(L)]
U = [numpy_weights(torch.randn(n, d).bfloat16()) for _ in range(L)]
D = [numpy_weights(torch.randn(n, d).bfloat16()) for _ in range(L)]
x = np.random.randn(1, d).astype(np.float32)
hh = np.empty(n, np.float32)
out = np.zeros(d, np.float32)
idx = np.arange(n, dtype=np.int64)
idx93 = np.sort(rng.choice(n, int(0.93 * n), replace=False)).astype(np.int64)
a = np.random.randn(1, n).astype(np.float32)
o2 = np.zeros((1, d), np.float32)
ffn_bytes = 3 * n * d * 2


def dense_ffn(l):
    decode.dense_ffn(x[0], W_in[l], cpu.NO_BIAS, W_out[l], cpu.NO_BIAS, True, 0, -1, 0, np.float32(0.0), out, panels.threads())


def fused(ix):
    def run(l):
        h = np.empty((1, ix.shape[0]), np.float32)
        sparse_cpu.gated_ffn(G[l], U[l], D[l], x, ix, 0, -1, 2, np.float32(0.01), 2, h, o2, True)
    return run


cases = [
    ("dense FFN, one call", dense_ffn, ffn_bytes),
    ("gated_ffn all rows", fused(idx), ffn_bytes),
    ("gated_ffn 93% rows", fused(idx93), ffn_bytes * 0.93),
    ("tiny parallel call (overhead)", lambda l: panels.gemv_any(W_in[l][:8], x[0], cpu.NO_BIAS, cpu.NO_BIAS, hh[:8], nt), 0),
    ("row_gemv all rows", lambda l: sparse_cpu.row_gemv(G[l], x, idx, cpu.NO_BIAS, -1, a), n * d * 2),
    ("gemv_any (dense GEMV, rows)", lambda l: panels.gemv_any(G[l], x[0], cpu.NO_BIAS, cpu.NO_BIAS, hh, nt), n * d * 2),
    ("col_axpy all rows", lambda l: sparse_cpu.col_axpy(D[l], a, idx, 2, o2, False), n * d * 2),
    ("gemv W_out (dense down)", lambda l: panels.gemv_any(W_out[l], hh, cpu.NO_BIAS, cpu.NO_BIAS, out, nt), n * d * 2),
]
results = {name: [] for name, _, _ in cases}
for fn in (c[1] for c in cases):
    for l in range(L):
        fn(l)
for _ in range(3):
    for name, fn, _ in cases:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for l in range(L):
                fn(l)
            best = min(best, (time.perf_counter() - t0) / L)
        results[name].append(best)
for name, _, nbytes in cases:
    t = sorted(results[name])[1]
    bw = f" = {nbytes / t / 1e9:.1f} GB/s" if nbytes else ""
    print(f"{name}: {t * 1e6:.1f} us/layer{bw}")
