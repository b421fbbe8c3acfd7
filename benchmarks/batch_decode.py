"""Batched decode: aggregate tok/s of one decode step for B sequences (models/batch.py)
against B = 1, per weight format and KV cache dtype, rounds alternating between them; peak RSS.

    python benchmarks/batch_decode.py [--model PATH] [--dtypes native,bf16] [--batches 1,2,4,8]
        [--kv-dtypes fp32,fp16] [--context 64]

Each sequence has its own KV cache at a `--context`-token context; the step is timed over 24
steps, the median of 3 rounds reported.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

import powerinfer
from powerinfer.engine.generate import warm_up
from powerinfer.loader import KV_DTYPES
from powerinfer.models.batch import decode_step


def step_seconds(model, B: int, context: int, kv_dtype: str, steps: int = 24) -> float:
    model.kv_dtype = KV_DTYPES[kv_dtype]
    caches = [model.new_cache(context + steps + 2) for _ in range(B)]
    for b, c in enumerate(caches):
        model.forward(torch.arange(3, 3 + context) + b, c)
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
    ap.add_argument("--kv-dtypes", default="fp32", help="KV cache dtypes (fp32, fp16), alternating")
    ap.add_argument("--context", type=int, default=64, help="each sequence's context before the timed steps")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    kvs = args.kv_dtypes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    models = {d: powerinfer.load(args.model, dtype=d, threads=args.threads).model for d in dtypes}
    for m in models.values():
        warm_up(m)
    times: dict[tuple[str, str, int], list[float]] = {(d, k, b): [] for d in dtypes for k in kvs for b in batches}
    for _ in range(3):  # rounds alternate between the formats, so drift hits each alike
        for d in dtypes:
            for b in batches:
                for k in kvs:
                    times[d, k, b].append(step_seconds(models[d], b, args.context, k))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\nmodel {args.model or 'embedded SmolLM2-135M'}; threads {args.threads}; context {args.context}; "
          f"peak RSS {rss:.2f} GiB (all formats loaded)\n")
    print("| weights | KV cache | B | step ms | aggregate tok/s | vs B=1 |\n|---|---|---|---|---|---|")
    for d in dtypes:
        for k in kvs:
            one = statistics.median(times[d, k, batches[0]]) / batches[0]
            for b in batches:
                s = statistics.median(times[d, k, b])
                print(f"| {d} | {k} | {b} | {s * 1e3:.1f} | {b / s:.1f} | {one * b / s:.2f}x |")


if __name__ == "__main__":
    main()
