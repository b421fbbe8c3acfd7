"""Dense engine vs transformers `generate`, side by side in one run, same model and dtype.

    python benchmarks/dense_vs_transformers.py [--model PATH] [--dtypes fp32,bf16] [--tokens 64]

Measures prefill tok/s on a 128-token prompt and greedy decode tok/s, alternating the two
engines over several rounds (the machine is noisy) and reporting medians and the ratio.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import powerinfer
from powerinfer.timing import decode_round, load_transformers, transformers_round
from powerinfer.loader import DTYPES

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based inks and a wooden press adapted from wine making. ") * 20


def prompt_ids(lm, n: int) -> list[int]:
    ids = lm.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per round")
    ap.add_argument("--prompt", type=int, default=128, help="prefill prompt length")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.dtypes.split(","):
        lm = powerinfer.load(args.model, dtype=name, threads=args.threads)
        hf = load_transformers(lm.path, DTYPES[name])
        ids = prompt_ids(lm, args.prompt)
        decode_round(lm.model, ids, 4), transformers_round(hf, ids, 4)  # warm-up (numba compile, allocator)
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(decode_round(lm.model, ids, args.tokens))
            theirs.append(transformers_round(hf, ids, args.tokens))
        med = lambda xs, i: statistics.median(x[i] for x in xs)
        rows.append((name, med(ours, 0), med(theirs, 0), med(ours, 1), med(theirs, 1)))
        del lm, hf
    print(f"\nmodel: {args.model or 'embedded SmolLM2-135M-Instruct Q4_1 GGUF'}; threads {args.threads}; "
          f"prompt {args.prompt} tokens; decode {args.tokens} tokens; median of {args.rounds} alternating rounds\n")
    print("| dtype | prefill ours tok/s | prefill transformers | ratio | decode ours tok/s | decode transformers | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, po, pt, do, dt in rows:
        print(f"| {name} | {po:.1f} | {pt:.1f} | {po / pt:.2f}x | {do:.1f} | {dt:.1f} | {do / dt:.2f}x |")


if __name__ == "__main__":
    main()
