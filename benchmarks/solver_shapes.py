"""Placement solver on the paper's model shapes with synthetic power-law statistics.

    python benchmarks/solver_shapes.py [--hardware rtx4090] [--budget 22GiB] [--time-limit 10]

Per shape: solve time, HiGHS gap, distance to the LP relaxation bound, and the cost model's
predicted decode tokens/s for the ILP placement, the greedy top-K placement and llama.cpp-
style whole-layer offloading at the same budget.
Synthetic statistics: `synthetic_profile(sparsity=0.9, hot_fraction=0.2, hot_coverage=0.8)`
(the hottest 20% of neurons carry 80% of activations; 10% of neurons fire per token).
"""

from __future__ import annotations

import argparse
import time

from powerinfer.hardware import KNOWN_SHAPES, dense_offload_time, load_hardware
from powerinfer.offline.solve import build_problem, greedy, solve_auto
from powerinfer.offline.synthetic import synthetic_profile
from powerinfer.units import parse_size

# weights as the paper ran them on the 4090 where they fit, INT4 (q4_0) where fp16 cannot
CASES = [("llama-7b", "fp16"), ("llama-13b", "fp16"), ("llama-70b", "q4_0"), ("falcon-40b", "fp16"),
         ("opt-30b", "fp16"), ("opt-66b", "q4_0"), ("opt-175b", "q4_0")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="rtx4090")
    ap.add_argument("--budget", default="22GiB")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--group-size", type=int, default=64)
    args = ap.parse_args()
    hw = load_hardware(args.hardware)
    budget = parse_size(args.budget)
    print(f"hardware {hw.name}, budget {args.budget}, group size {args.group_size}\n")
    print("| shape | weights | attention on | groups | solve s | HiGHS gap | vs LP bound | ILP tok/s | greedy tok/s "
          "| offload tok/s (GPU layers) | ILP / offload | GPU share of load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, dtype in CASES:
        shape = KNOWN_SHAPES[name]
        prof = synthetic_profile(shape.n_layers, shape.n_ff, sparsity=0.9, hot_fraction=0.2, hot_coverage=0.8, seed=0)
        t0 = time.perf_counter()
        problem, p = solve_auto(lambda dense: build_problem(prof, shape, hw, budget, dtype, args.group_size,
                                                            dense_on_gpu=dense), "time", args.time_limit)
        seconds = time.perf_counter() - t0
        g = greedy(problem)
        off_t, off_layers = dense_offload_time(shape, hw, dtype, budget)
        gpu_load = sum(float(problem.loads[l][: int((len(x) + args.group_size - 1) // args.group_size)].sum())
                       for l, x in enumerate(p.gpu_neurons))
        total = sum(float(loads.sum()) for loads in problem.loads)
        rel = (p.objective - p.lp_bound) / p.lp_bound
        print(f"| {name} | {dtype} | {'GPU' if problem.dense_on_gpu else 'CPU'} | {sum(len(x) for x in problem.loads)} "
              f"| {seconds:.2f} | {p.gap:.2e} | {rel:.3%} | {1 / p.predicted_time:.2f} | {1 / g.predicted_time:.2f} "
              f"| {1 / off_t:.2f} ({off_layers}/{shape.n_layers}) | {off_t / p.predicted_time:.2f}x | {gpu_load / total:.3f} |")


if __name__ == "__main__":
    main()
