"""The quantized decode GEMV per GGUF format and layout, next to a bus probe.

    .venv/bin/python benchmarks/quant_gemv.py [--rounds 10] [--formats Q4_0,Q4_1,...] [--batch 1]

Layouts: "rows" (the file's blocks, `quant.add_matvec_q` / `batch_decode.add_matvec_q`) and,
for Q4_0/Q4_1/Q8_0, "lanes" (16 rows interleaved, `lanes.add_matvec_lanes` /
`lanes.add_matvec_lanes_batch`), measured side by side in every round.

For each format, random blocks of a 4096x4096 matrix (the 7B attention shape) are cycled
(working set above the LLC) and multiplied by one vector (or, with --batch B, by B vectors
through the batched kernel `batch_decode.add_matvec_q`). Rounds interleave a 1 GiB torch.sum
probe and every format, so each round's numbers share the bus's phase. Reported: medians
of G weights/s (per vector: B vectors count B times) and GB/s of blocks read, and the share
of the probe's bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from powerinfer.ops import batch_decode, cpu, lanes, quant

ROWS = COLS = 4096


def random_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes with small valid fp16 scales (the kernels' speed does not depend
    on the values)."""
    per, nbytes = quant.FORMATS[fmt]
    q = rng.integers(0, 256, (rows, cols // per, nbytes), dtype=np.uint8)
    scales = np.frombuffer(np.array([0.01, 0.004], dtype=np.float16).tobytes(), dtype=np.uint8)
    if fmt == "Q6_K":
        q[:, :, 208:210] = scales[:2]
    else:
        q[:, :, 0:4] = scales
    return q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--formats", default=",".join(quant.FORMATS))
    ap.add_argument("--batch", type=int, default=1, help="vectors per call (>1: the batched kernel)")
    args = ap.parse_args()
    cpu.set_threads(2)
    rng = np.random.default_rng(0)
    probe = torch.ones(1 << 28)
    cases = {"torch.sum probe": (lambda: probe.sum(), probe.nbytes, 0)}
    B = args.batch
    for fmt in args.formats.split(","):
        per, nbytes = quant.FORMATS[fmt]
        n = max(2, int(256e6 // (ROWS * COLS // per * nbytes)))
        mats = [random_blocks(fmt, ROWS, COLS, rng) for _ in range(n)]
        size = sum(m.nbytes for m in mats)
        V, Y = rng.standard_normal((B, COLS)).astype(np.float32), np.zeros((B, ROWS), np.float32)
        if B == 1:
            fn = (lambda mats=mats, V=V, Y=Y: [quant.add_matvec_q(w, V[0], cpu.NO_BIAS, Y[0], 2) for w in mats])
        else:
            fn = (lambda mats=mats, V=V, Y=Y: [batch_decode.add_matvec_q(w, V, cpu.NO_BIAS, Y, 2) for w in mats])
        cases[fmt] = (fn, size, n * ROWS * COLS * B)
        if fmt in lanes.FORMATS:
            lm = [lanes.interleave(torch.from_numpy(m)).numpy() for m in mats]
            if B == 1:
                fn = (lambda lm=lm, V=V, Y=Y: [lanes.add_matvec_lanes(w, V[0], cpu.NO_BIAS, Y[0], 2) for w in lm])
            else:
                fn = (lambda lm=lm, V=V, Y=Y: [lanes.add_matvec_lanes_batch(w, V, cpu.NO_BIAS, Y, 2) for w in lm])
            cases[fmt + " lanes"] = (fn, size, n * ROWS * COLS * B)
    for fn, _, _ in cases.values():
        fn()  # compile
    secs: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for k, (fn, _, _) in cases.items():
            t0 = time.perf_counter()
            fn()
            secs[k].append(time.perf_counter() - t0)
    bus = [probe.nbytes / s / 1e9 for s in secs["torch.sum probe"]]
    print(f"{ROWS}x{COLS}, {B} vector(s) per call, 2 threads, {args.rounds} rounds; bus probe median "
          f"{statistics.median(bus):.1f} GB/s\n")
    print("| format | G weights/s | GB/s of blocks | % of the round's probe |")
    print("|---|---|---|---|")
    for k, (fn, size, weights) in cases.items():
        if not weights:
            continue
        gws = statistics.median(weights / s / 1e9 for s in secs[k])
        gbs = [size / s / 1e9 for s in secs[k]]
        share = statistics.median(g / b for g, b in zip(gbs, bus))
        print(f"| {k} | {gws:.1f} | {statistics.median(gbs):.1f} | {100 * share:.0f}% |")


if __name__ == "__main__":
    main()
