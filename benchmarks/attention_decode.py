"""Decode attention for one token (`ops/cpu.attend_all`, used by one-token and batched decode)
over 16 to 2000 cached positions: microseconds per token-layer and nanoseconds per
(query head, position), SmolLM2's shape (9 query heads, 3 KV heads of 64), 1 and 2 threads.

    python benchmarks/attention_decode.py [--lengths 16,256,1024,2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit

from powerinfer.ops.cpu import attend_all

N_HEADS, N_KV, HEAD_DIM = 9, 3, 64
LAYERS = 30  # SmolLM2's: each layer's cache is its own, so a token reads 30 of them


@njit
def _layers(calls, qkv, pos, cos, sin, k, v, out):
    # a token's attention in every layer, `calls` times, inside numba (the Python call costs
    # more than a short context's attention)
    for _ in range(calls):
        for layer in range(k.shape[0]):
            attend_all(qkv, pos, cos, sin, k[layer], v[layer], N_HEADS, N_KV, HEAD_DIM, np.float32(0.125), True, out,
                       0, np.float32(0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16,256,1024,2000")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    top = max(int(n) for n in args.lengths.split(","))
    qkv = rng.standard_normal((N_HEADS + 2 * N_KV) * HEAD_DIM).astype(np.float32)
    k = rng.standard_normal((LAYERS, N_KV, top, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((LAYERS, N_KV, top, HEAD_DIM)).astype(np.float32)
    angles = np.outer(np.arange(top), 1 / 10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    out = np.zeros(N_HEADS * HEAD_DIM, dtype=np.float32)
    _layers(1, qkv, 0, cos, sin, k, v, out)
    print("| positions | threads | us per layer | ns per (query head, position) |\n|---|---|---|---|")
    for length in (int(n) for n in args.lengths.split(",")):
        for threads in (1, 2):
            numba.set_num_threads(threads)
            calls = max(2, 20_000 // length)
            best = float("inf")
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                _layers(calls, qkv, length - 1, cos, sin, k, v, out)
                best = min(best, (time.perf_counter() - t0) / calls / LAYERS)
            print(f"| {length} | {threads} | {best * 1e6:.1f} | {best * 1e9 / length / N_HEADS:.2f} |")


if __name__ == "__main__":
    main()
