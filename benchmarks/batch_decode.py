"""Batched decode: aggregate tok/s of one decode step for B sequences (models/batch.py)
against B = 1, per weight format, rounds alternating between the formats; peak RSS.

    python benchmarks/batch_decode.py [--model PATH] [--dtypes native,bf16] [--batches 1,2,4,8]

Each sequence has its own KV cache at a 64-token context; the step is timed over 24 steps,
the median of 3 rounds reported.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

import powerinfer
from powerinfer.engine.generate import warm_up
from powerinfer.models.batch import decode_step


def step_seconds(model, B: int, steps: int = 24) -> float:
    caches = [model.new_cache(64 + steps + 2) for _ in range(B)]
    for b, c in enumerate(caches):
        model.forward(torch.arange(3, 3 + 64) + b, c)
    decode_step(model, [5] * B, caches)  # first call: typed lists, rope table
    t0 = time.perf_counter()
    for i in range(steps):
        decode_step(model, [7 + i] * B, caches)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="native,bf16")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-dtype", default="fp32", choices=["fp32", "fp16"], help="KV cache dtype")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    models = {d: powerinfer.load(args.model, dtype=d, threads=args.threads, kv_dtype=args.kv_dtype).model
              for d in dtypes}
    for m in models.values():
        warm_up(m)
    times: dict[tuple[str, int], list[float]] = {(d, b): [] for d in dtypes for b in batches}
    for _ in range(3):  # rounds alternate between the formats, so drift hits each alike
        for d in dtypes:
            for b in batches:
                times[d, b].append(step_seconds(models[d], b))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\nmodel {args.model or 'embedded SmolLM2-135M'}; threads {args.threads}; peak RSS {rss:.2f} GiB "
          f"(all formats loaded)\n")
    print("| weights | B | step ms | aggregate tok/s | vs B=1 |\n|---|---|---|---|---|")
    for d in dtypes:
        one = statistics.median(times[d, batches[0]]) / batches[0]
        for b in batches:
            s = statistics.median(times[d, b])
            print(f"| {d} | {b} | {s * 1e3:.1f} | {b / s:.1f} | {one * b / s:.2f}x |")


if __name__ == "__main__":
    main()
