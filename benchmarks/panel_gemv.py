"""Row layout vs column panels for the dense decode GEMV, next to a torch.sum bus probe.

    .venv/bin/python benchmarks/panel_gemv.py [--rounds 30] [--dtype fp16]

For each shape, fp16/bf16 matrices are cycled (working set far above the LLC) and read by
the row-layout kernel (cpu.add_matvec, four row streams per thread) and the panel kernel
(panels.add_matvec_panels). Rounds interleave a 1 GiB torch.sum probe and every kernel,
so each round's numbers share the bus's phase (on the 2-core dev machine it moves between
~31-35 and ~45-57 GB/s within seconds); the table gives medians over all rounds and over
the rounds whose probe read above / below 40 GB/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from powerinfer.ops import cpu, panels
from powerinfer.ops.memory import on_huge_pages
from powerinfer.ops.numba_half import numpy_weights

SHAPES = {"7B attention 4096x4096": (4096, 4096, 32), "7B down 4096x11008": (4096, 11008, 12),
          "7B gate/up 11008x4096": (11008, 4096, 12), "SmolLM2 gate/up 3072x576": (3072, 576, 300)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    args = ap.parse_args()
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    cpu.set_threads(2)
    nt = panels.threads()
    probe = on_huge_pages(torch.ones(1 << 28))
    cases = {"torch.sum probe": (lambda: probe.sum(), probe.nbytes)}
    for name, (rows, cols, n) in SHAPES.items():
        mats = [torch.randn(rows, cols).to(dtype) for _ in range(n)]
        row_np = [numpy_weights(on_huge_pages(m)) for m in mats]
        pan_np = [numpy_weights(panels.to_panels(m)) for m in mats]
        del mats
        v, y = np.random.rand(cols).astype(np.float32), np.zeros(rows, np.float32)
        size = sum(w.nbytes for w in row_np)
        cases[f"{name} rows"] = ((lambda r=row_np, v=v, y=y: [cpu.add_matvec(w, v, cpu.NO_BIAS, y) for w in r]), size)
        cases[f"{name} panels"] = ((lambda p=pan_np, v=v, y=y: [panels.add_matvec_panels(w, v, cpu.NO_BIAS, y, nt)
                                                                 for w in p]), size)
    for fn, _ in cases.values():
        fn()
    gbs: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for k, (fn, size) in cases.items():
            t0 = time.perf_counter()
            fn()
            gbs[k].append(size / (time.perf_counter() - t0) / 1e9)
    bus = gbs["torch.sum probe"]
    fast = [i for i, b in enumerate(bus) if b > 40]
    slow = [i for i, b in enumerate(bus) if b <= 40]

    def med(xs: list[float], sel: list[int]) -> str:
        return f"{statistics.median([xs[i] for i in sel]):.1f}" if sel else "-"

    print(f"{args.dtype}, 2 threads, {args.rounds} rounds ({len(fast)} with the probe above 40 GB/s)\n")
    print("| case | GB/s, all rounds | probe > 40 | probe <= 40 |\n|---|---|---|---|")
    for k, xs in gbs.items():
        print(f"| {k} | {statistics.median(xs):.1f} | {med(xs, fast)} | {med(xs, slow)} |")


if __name__ == "__main__":
    main()
