"""One quantized GEMV kept in L2, one thread: the kernel's arithmetic without the bus.

    .venv/bin/python benchmarks/gemv_in_cache.py [--format Q6_K] [--rows 256] [--cols 4096] [--lanes]

Random blocks (fp16 scales 0.01), 400 GEMVs per timing, best of 7; compare code versions by
running this in fresh processes, alternating (docs/BENCHMARKS.md, "Quantized GEMV").
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

import torch

from powerinfer.ops import lanes, quant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="Q6_K", choices=sorted(quant.FORMATS))
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--lanes", action="store_true", help="time the lanes layout (Q4_0, Q4_1, Q8_0, Q4_K)")
    a = ap.parse_args()
    numba.set_num_threads(1)
    per, bb = quant.FORMATS[a.format]
    rng = np.random.default_rng(0)
    q = rng.integers(0, 256, (a.rows, a.cols // per, bb), dtype=np.uint8)
    scale = np.frombuffer(np.array([0.01], dtype=np.float16).tobytes(), dtype=np.uint8)
    for off in quant.SCALE_OFFSETS[a.format]:
        q[:, :, off:off + 2] = scale
    v = rng.standard_normal(a.cols).astype(np.float32)
    out, bias = np.zeros(a.rows, dtype=np.float32), np.zeros(0, dtype=np.float32)
    kernel = quant.add_matvec_q
    if a.lanes:
        q, kernel = lanes.interleave(torch.from_numpy(q)).numpy(), lanes.add_matvec_lanes
    kernel(q, v, bias, out, 1)
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(400):
            kernel(q, v, bias, out, 1)
        best = min(best, (time.perf_counter() - t) / 400)
    print(f"{a.format}{' lanes' if a.lanes else ''} {a.rows}x{a.cols} in cache, 1 thread: {best * 1e6:.1f} us, "
          f"{a.rows * a.cols / best / 1e9:.2f} G weights/s")


if __name__ == "__main__":
    main()
