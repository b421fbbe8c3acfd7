"""One decode attention head (`ops/cpu.attend_head`, used by one-token and batched decode)
over 16 to 1024 cached positions: microseconds per head and nanoseconds per position, one
thread, SmolLM2's shape (9 query heads, 3 KV heads of 64).

    python benchmarks/attention_head.py [--lengths 16,64,256,1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit

from powerinfer.ops.cpu import attend_head

N_HEADS, N_KV, HEAD_DIM = 9, 3, 64


@njit
def _heads(calls, qkv, pos, cos, sin, k, v, out):
    # every query head, `calls` times, inside numba: the Python call costs more than a short head
    for _ in range(calls):
        for h in range(N_HEADS):
            attend_head(h, qkv, pos, cos, sin, k, v, N_HEADS, N_KV, HEAD_DIM, np.float32(0.125), True, out, 0,
                        np.float32(0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16,64,256,1024")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    top = max(int(n) for n in args.lengths.split(","))
    qkv = rng.standard_normal((N_HEADS + 2 * N_KV) * HEAD_DIM).astype(np.float32)
    k = rng.standard_normal((N_KV, top, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((N_KV, top, HEAD_DIM)).astype(np.float32)
    angles = np.outer(np.arange(top), 1 / 10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    out = np.zeros(N_HEADS * HEAD_DIM, dtype=np.float32)
    _heads(1, qkv, 0, cos, sin, k, v, out)
    print("| positions | us per head | ns per position |\n|---|---|---|")
    for length in (int(n) for n in args.lengths.split(",")):
        calls = max(10, 200_000 // length)
        best = float("inf")
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            _heads(calls, qkv, length - 1, cos, sin, k, v, out)
            best = min(best, (time.perf_counter() - t0) / calls / N_HEADS)
        print(f"| {length} | {best * 1e6:.2f} | {best * 1e9 / length:.1f} |")


if __name__ == "__main__":
    main()
