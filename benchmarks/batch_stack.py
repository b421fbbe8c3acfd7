"""A batched decode step through every layer in one numba call vs one call per kernel per layer.

    python benchmarks/batch_stack.py [--model FILE.gguf] [--batches 2,4,8] [--rounds 6] [--steps 32]

Both paths run the same kernels (batch_decode.layer_stack calls the per-layer batch path's
four kernels inside numba), so their logits are equal to the bit; they alternate per round in
one process. B sequences each get their own cache after prompts of 20 + 3b tokens.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

import powerinfer
from powerinfer.models import batch
from powerinfer.paths import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--batches", default="2,4,8")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    m = powerinfer.load(args.model or default_model_path(), dtype="native").model
    vocab = m.args.vocab_size

    def rate(B: int, stack: bool) -> float:
        m.stack_decode = stack
        caches = [m.new_cache(40 + 3 * B + args.steps) for _ in range(B)]
        for b, c in enumerate(caches):
            m.forward(torch.arange(3, 3 + 20 + 3 * b) % vocab, c)
        toks = [5] * B
        batch.decode_step(m, toks, caches)
        t = time.perf_counter()
        for _ in range(args.steps):
            batch.decode_step(m, toks, caches)
        return B * args.steps / (time.perf_counter() - t)

    print("| B | one call tok/s | per layer tok/s | ratio per round (median, range) |")
    print("|---|---|---|---|")
    for B in (int(b) for b in args.batches.split(",")):
        rate(B, True)
        rate(B, False)
        r: dict[bool, list[float]] = {True: [], False: []}
        for k in range(args.rounds):
            for s in (True, False) if k % 2 == 0 else (False, True):
                r[s].append(rate(B, s))
        rt = [a / b for a, b in zip(r[True], r[False])]
        print(f"| {B} | {statistics.median(r[True]):.1f} | {statistics.median(r[False]):.1f} | "
              f"{statistics.median(rt):.3f} ({min(rt):.3f}-{max(rt):.3f}) |")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
