"""Short prompts: prefill through the torch ops vs through the batched decode kernels
(models/batch.py, `prefill_short`), alternating in one process (two rounds, median of 5
prefills per path and round, the better round reported); also the logits' largest
difference and how often their argmax agrees (the prompts are arbitrary token ids).

    python benchmarks/short_prefill.py [--model PATH] [--dtype native] [--tokens 2,4,8,16,24,32] [--up-to 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import powerinfer
from powerinfer.models import batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF or HF model (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="native")
    ap.add_argument("--tokens", default="2,4,8,16,24,32", help="prompt lengths, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--up-to", type=int, default=64,
                    help="let prompts up to this length take the decode kernels (the engine's cut-off: "
                         "models/batch.py SHORT_PREFILL_MAX)")
    args = ap.parse_args()
    batch.SHORT_PREFILL_MAX = args.up_to
    model = powerinfer.load(args.model, dtype=args.dtype, threads=args.threads).model
    print("| prompt tokens | torch ops ms | decode kernels ms | ratio | max logit difference | argmax agrees |")
    print("|---|---|---|---|---|---|")
    for n in (int(v) for v in args.tokens.split(",")):
        ids = torch.arange(n) % 1000 + 100
        best: dict[bool, float] = {}
        logits: dict[bool, torch.Tensor] = {}
        for short in (False, True, False, True):
            model.short_prefill = short
            times = []
            for _ in range(5):
                cache = model.new_cache(n + 1)
                t0 = time.perf_counter()
                logits[short] = model.forward(ids, cache, all_logits=True)
                times.append(time.perf_counter() - t0)
            best[short] = min(best.get(short, float("inf")), statistics.median(times))
        model.short_prefill = True
        diff = (logits[True] - logits[False]).abs().max().item()
        agree = (logits[True].argmax(-1) == logits[False].argmax(-1)).float().mean().item()
        print(f"| {n} | {best[False] * 1e3:.2f} | {best[True] * 1e3:.2f} | {best[False] / best[True]:.2f}x | "
              f"{diff:.2e} | {agree:.2f} |")


if __name__ == "__main__":
    main()
