"""Batched sparse decode: the union of the batch's predicted rows (each read once) against
each sequence's own rows (read once per sequence), on the planted ReluLLaMA-7B-shaped model
of `powerinfer bench relu7b`; the dense engine's batched step for reference. Rounds
alternate the strategies.

    python benchmarks/batch_sparse.py [--layers 4] [--sparsity 0.9] [--batches 1,4,8] [--dir DIR]

Prints aggregate decode tok/s per batch size and strategy, and the rows each strategy
computes per token (the union's share of the per-token sets' total).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from powerinfer.bench import relu7b
from powerinfer.engine.hybrid import PredictedFFN
from powerinfer.engine.packed import load_packed
from powerinfer.loader import load


def step_seconds(model, B: int, steps: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    vocab = model.args.vocab_size
    caches = [model.new_cache(16 + steps + 2) for _ in range(B)]
    for c in caches:  # distinct contexts, so that the predicted sets differ between sequences
        model.forward(torch.from_numpy(rng.integers(3, vocab, 16)), c)
    model.decode(rng.integers(3, vocab, B).tolist(), caches)
    t0 = time.perf_counter()
    for _ in range(steps):
        model.decode(rng.integers(3, vocab, B).tolist(), caches)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    relu7b.add_arguments(ap)
    ap.add_argument("--batches", default="1,4,8")
    ap.set_defaults(layers=4, tokens=8, rounds=3)
    args = ap.parse_args()
    relu7b.check_planted_args(args)
    torch.set_num_threads(args.threads)
    shape = relu7b.shape_of(args)
    batches = [int(b) for b in args.batches.split(",")]
    with relu7b.work_dir(args.dir, "batch-sparse-") as root:
        gguf_path, packed_dir, _ = relu7b.planted_model(args, shape, root, src=relu7b.tokenizer_source())
        sparse_lm = load_packed(packed_dir, mode="sparse", dtype=relu7b.engine_dtype(args), threads=args.threads,
                                with_tokenizer=False, predictor_bypass=None)
        sparse = sparse_lm.model
        relu7b.calibrate_active_share(sparse, 1 - args.sparsity, n=16)
        dense = load(gguf_path, dtype=relu7b.engine_dtype(args), threads=args.threads, with_tokenizer=False).model
        engines = {"dense": (dense, None), "sparse per_token": (sparse, "per_token"), "sparse union": (sparse, "union")}
        times = {(e, b): [] for e in engines for b in batches}
        rows = {(e, b): [] for e in engines for b in batches}
        for _ in range(args.rounds):
            for b in batches:
                for name, (model, strategy) in engines.items():
                    if strategy:
                        PredictedFFN.batch_rows = strategy
                    sparse_lm.ffn_stats.reset()
                    times[name, b].append(step_seconds(model, b, args.tokens))
                    if strategy:
                        rows[name, b].append(sparse_lm.ffn_stats.active_fraction)
        PredictedFFN.batch_rows = "auto"
    print(f"\nplanted d {shape.d}, {shape.n_ff} neurons, {args.layers} layers, {args.dtype}, {args.threads} threads, "
          f"sparsity {args.sparsity}; median of {args.rounds} rounds x {args.tokens} steps\n")
    print("| engine | B | step ms | aggregate tok/s | vs B=1 | neurons computed per token |\n|---|---|---|---|---|---|")
    for name in engines:
        one = statistics.median(times[name, batches[0]]) / batches[0]
        for b in batches:
            s = statistics.median(times[name, b])
            share = f"{statistics.median(rows[name, b]):.3f}" if rows[name, b] else "all"
            print(f"| {name} | {b} | {s * 1e3:.0f} | {b / s:.2f} | {one * b / s:.2f}x | {share} |")


if __name__ == "__main__":
    main()
