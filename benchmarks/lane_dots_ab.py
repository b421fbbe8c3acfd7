"""The lane dots (ops/lane_ir.py) of the work tree against those of a git revision, side by
side in one process: each version's dots compiled into the same prange GEMV over random
blocks, rounds alternating, so that the machine's phases (a third on the 2-core dev machines)
fall on both alike. Checks that both give the same bits, then prints G MAC/s and the per-round
ratio new / old per format, shape and batch (batches in passes of --vectors vectors: four as
AVX2 runs them, eight as VNNI does; `lanes.MAX_VECTORS`).

    python benchmarks/lane_dots_ab.py [--base HEAD] [--formats Q4_0,Q4_1,Q8_0,Q4_K,Q6_K]
        [--batches 1,4,8] [--vectors 4] [--rounds 15]

Shapes: 4096 x 4096 (7B attention; eight matrices cycled, streamed from memory) and 2048 x
768 (in L2/L3, as a small model's matrices are).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch
from numba import njit, prange

from powerinfer.ops import block_ir, lane_ir, lanes, symbols
from quant_gemv import random_blocks  # benchmarks/, beside this script

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ((4096, 4096, 8), (2048, 768, 1))  # rows, cols, matrices cycled


def module_at(revision: str):
    """ops/lane_ir.py as of `revision`, loaded beside the current one (its C functions not
    exported: only `_lane_dots` is used)."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:powerinfer/ops/lane_ir.py"],
                         capture_output=True, text=True, check=True).stdout
    src = src.split("# The dots as C functions")[0]  # the per-format intrinsics, not the exports
    mod = type(sys)("powerinfer.ops.lane_ir_base")
    mod.__package__ = "powerinfer.ops"
    exec(compile(src, f"lane_ir@{revision}", "exec"), mod.__dict__)
    return mod


def gemv(module, bb: int, V: int):
    """A prange GEMV over a lanes matrix with `module`'s V-vector dots: out[j] += W qa[j] for
    every vector j of qa, V at a time (the batch a multiple of V)."""
    dots = module._lane_dots(bb, V)
    acts = ", ".join(f"a + {j} * sa" for j in range(V))
    outs = ", ".join(f"o + {j} * so + 64 * g" for j in range(V))
    src = f"""
def run(w, qa, out):
    base, gs, sa, so = w.ctypes.data, w.strides[0], qa.strides[0], out.strides[0]
    for p in range(qa.shape[0] // {V}):
        a, o = qa.ctypes.data + {V} * p * sa, out.ctypes.data + {V} * p * so
        for g in prange(w.shape[0]):
            dots(base + g * gs, w.shape[1], ({acts},), ({outs},))
"""
    scope = {"dots": dots, "prange": prange}
    exec(src, scope)  # numba needs the V-tuples spelled out
    return njit(parallel=True)(scope["run"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the old lane_ir.py")
    ap.add_argument("--formats", default="Q4_0,Q4_1,Q8_0,Q4_K,Q6_K")
    ap.add_argument("--batches", default="1,4,8", help="vectors per GEMV: 1 or multiples of --vectors")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--vectors", type=int, default=4, help="vectors per pass of a batch: 2, 4 or 8 (VNNI)")
    args = ap.parse_args()
    export = symbols.export
    symbols.export = lambda *a, **k: None
    try:
        versions = {"old": module_at(args.base), "new": lane_ir}
    finally:
        symbols.export = export
    numba.set_num_threads(2)
    rng = np.random.default_rng(0)
    print(f"lane dots: work tree (new) vs {args.base} (old), ISA {block_ir._isa()}, 2 threads, "
          f"{args.rounds} rounds alternating, batches in passes of {args.vectors} vectors\n")
    print("| format | shape | B | old G MAC/s | new G MAC/s | new / old (median of rounds) | range |")
    print("|---|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        for rows, cols, n in SHAPES:
            mats = [lanes.interleave(torch.from_numpy(random_blocks(fmt, rows, cols, rng))).numpy() for _ in range(n)]
            bb = int(mats[0].shape[3])
            for B in (int(b) for b in args.batches.split(",")):
                qa = np.stack([block_ir.quantize_acts(rng.standard_normal(cols).astype(np.float32),
                                                      lane_ir.LAST_AXIS[bb]) for _ in range(B)])
                runs, outs = {}, {}
                for name, mod in versions.items():
                    runs[name] = gemv(mod, bb, min(B, args.vectors))
                    outs[name] = np.zeros((B, rows), np.float32)
                    for w in mats:
                        runs[name](w, qa, outs[name])  # compiles
                if not np.array_equal(outs["old"], outs["new"]):
                    sys.exit(f"{fmt} B={B}: the two versions give different results")
                reps = 3 if n > 1 else 100
                secs = {name: [] for name in versions}
                out = np.zeros((B, rows), np.float32)
                for r in range(args.rounds):
                    for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            for w in mats:
                                runs[name](w, qa, out)
                        secs[name].append(time.perf_counter() - t0)
                macs = rows * cols * n * B * reps
                g = {name: macs / statistics.median(s) / 1e9 for name, s in secs.items()}
                ratio = sorted(o / w for o, w in zip(secs["old"], secs["new"]))
                print(f"| {fmt} | {rows} x {cols} | {B} | {g['old']:.1f} | {g['new']:.1f} | "
                      f"{statistics.median(ratio):.2f}x | {ratio[0]:.2f}-{ratio[-1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
