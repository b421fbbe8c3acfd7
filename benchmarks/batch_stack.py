"""A batched decode step: one team region for every layer, one numba call for every layer,
and one call per kernel per layer, side by side.

    python benchmarks/batch_stack.py [--model FILE.gguf] [--batches 2,4,8] [--rounds 6] [--steps 32]

All three run the same kernels' arithmetic (ops/batch_team.py; batch_decode.layer_stack calls
the per-layer batch path's four kernels inside numba), so their logits are equal to the bit;
they alternate per round in one process. B sequences each get their own cache after prompts
of 20 + 3b tokens. The team needs every matrix in lanes (the default model's Q4_1 is).
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

    modes = ("team region", "one call", "per layer")

    def rate(B: int, mode: str) -> float:
        m.stack_decode = mode != "per layer"
        if m.stack_decode and m._layer_stack() is not None:
            m._layer_stack().team = mode == "team region"
        caches = [m.new_cache(40 + 3 * B + args.steps) for _ in range(B)]
        for b, c in enumerate(caches):
            m.forward(torch.arange(3, 3 + 20 + 3 * b) % vocab, c)
        toks = [5] * B
        batch.decode_step(m, toks, caches)
        t = time.perf_counter()
        for _ in range(args.steps):
            batch.decode_step(m, toks, caches)
        return B * args.steps / (time.perf_counter() - t)

    print("| B | team region tok/s | one call tok/s | per layer tok/s | team / one call | one call / per layer |")
    print("|---|---|---|---|---|---|")
    for B in (int(b) for b in args.batches.split(",")):
        for mode in modes:
            rate(B, mode)
        r: dict[str, list[float]] = {mode: [] for mode in modes}
        for k in range(args.rounds):
            for mode in modes if k % 2 == 0 else modes[::-1]:
                r[mode].append(rate(B, mode))

        def ratio(a: str, b: str) -> str:
            rt = [x / y for x, y in zip(r[a], r[b])]
            return f"{statistics.median(rt):.3f} ({min(rt):.3f}-{max(rt):.3f})"

        med = {mode: statistics.median(v) for mode, v in r.items()}
        print(f"| {B} | {med['team region']:.1f} | {med['one call']:.1f} | {med['per layer']:.1f} | "
              f"{ratio('team region', 'one call')} | {ratio('one call', 'per layer')} |")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
