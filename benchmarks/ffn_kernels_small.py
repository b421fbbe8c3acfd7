"""FFN kernels at SmolLM2's shape (d 576, FFN 1536, bf16, 30 layers cycled so the caches
do not serve the weights): the dense route (GEMV + activation + GEMV) against the fused
sparse gated kernel over all rows, and the single sparse ops against the dense GEMV.

    python benchmarks/ffn_kernels_small.py
"""
import time, torch, numpy as np
from powerinfer.ops import sparse_cpu, cpu
from powerinfer.ops.numba_half import numpy_weights
torch.set_num_threads(2); cpu.set_threads(2)
L, d, n = 30, 576, 1536
W_in = [numpy_weights(torch.randn(2*n, d).bfloat16()) for _ in range(L)]
W_out = [numpy_weights(torch.randn(d, n).bfloat16()) for _ in range(L)]
G = [numpy_weights(torch.randn(n, d).bfloat16()) for _ in range(L)]
U = [numpy_weights(torch.randn(n, d).bfloat16()) for _ in range(L)]
D = [numpy_weights(torch.randn(n, d).bfloat16()) for _ in range(L)]
x = np.random.randn(1, d).astype(np.float32)
h2 = np.empty(2*n, np.float32); hh = np.empty(n, np.float32); out = np.empty(d, np.float32)
idx = np.arange(n, dtype=np.int64)
def bench(name, fn, reps=30):
    for l in range(L): fn(l)
    t0 = time.perf_counter()
    for _ in range(reps):
        for l in range(L): fn(l)
    dt = (time.perf_counter() - t0) / reps / L * 1e6
    print(f"{name}: {dt:.1f} us/layer = {3*n*d*2/dt/1e3:.1f} GB/s")
def dense(l):
    cpu.gemv_kernel(W_in[l], x[0], cpu.NO_BIAS, cpu.NO_BIAS, h2)
    cpu.gated_act(h2, n, 0, -1, hh)
    cpu.gemv_kernel(W_out[l], hh, cpu.NO_BIAS, cpu.NO_BIAS, out)
bench("dense 3 calls", dense)
def fused(l):
    o = np.zeros((1, d), np.float32); h = np.empty((1, n), np.float32)
    sparse_cpu.gated_ffn(G[l], U[l], D[l], x, idx, 0, -1, 2, np.float32(0.01), 2, h, o, False)
bench("gated_ffn all", fused)
def empty(l):
    cpu.gemv_kernel(W_in[l][:8], x[0], cpu.NO_BIAS, cpu.NO_BIAS, h2[:8])
bench("tiny parallel call (overhead)", empty)
out2 = np.empty((1, n), np.float32)
def rg(l): sparse_cpu.row_gemv(G[l], x, idx, cpu.NO_BIAS, -1, out2)
def gk(l): cpu.gemv_kernel(G[l], x[0], cpu.NO_BIAS, cpu.NO_BIAS, hh)
a = np.random.randn(1, n).astype(np.float32)
o2 = np.zeros((1, d), np.float32)
def ca(l): sparse_cpu.col_axpy(D[l], a, idx, 2, o2, False)
def go(l): cpu.gemv_kernel(W_out[l], hh, cpu.NO_BIAS, cpu.NO_BIAS, out)
for name, fn in [("row_gemv idx", rg), ("gemv_kernel G", gk), ("col_axpy all", ca), ("gemv W_out", go)]:
    for l in range(L): fn(l)
    t0 = time.perf_counter()
    for _ in range(30):
        for l in range(L): fn(l)
    dt = (time.perf_counter() - t0) / 30 / L * 1e6
    print(f"{name}: {dt:.1f} us = {n*d*2/dt/1e3:.1f} GB/s")
