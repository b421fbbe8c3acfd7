"""`powerinfer bench ops`: sparse operators vs the dense GEMV and the index_select route.

At LLaMA-7B's FFN shape (11008 neurons x 4096) with enough matrices cycled that the
working set is at least 4x the last-level cache, for each active fraction: the dense torch
GEMV over all rows, our sparse op over the active rows, and `W.index_select(0, idx) @ x`.
Reports time, speedup over dense, and effective bandwidth (bytes of active rows / time)
next to the memory bandwidth measured in the same run, and plots speedup vs fraction.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
import torch.nn.functional as F

from ..loader import DTYPES, parse_dtype
from ..ops import sparse, sparse_cpu
from ..ops.memory import on_huge_pages
from ..ops.numba_half import numpy_weights
from .timing import last_level_cache_bytes, median_time, memory_read_bandwidth

FRACTIONS = (0.05, 0.10, 0.20, 0.30, 1.00)
INDEX_SETS = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=11008, help="neurons per matrix (default 11008)")
    p.add_argument("--cols", type=int, default=4096, help="model width (default 4096)")
    p.add_argument("--dtypes", default="fp32,bf16", help="weight dtypes, comma-separated")
    p.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--plot", default="docs/bench_ops.png", help="PNG to write ('' = none)")


def _cycle(fns):
    def run():
        for f in fns:
            f()
    return run


def bench_dtype(dtype: torch.dtype, rows: int, cols: int, fractions: list[float], repeats: int) -> list[dict]:
    elem = torch.tensor([], dtype=dtype).element_size()
    n_mats = max(4, math.ceil(4 * last_level_cache_bytes() / (rows * cols * elem)))
    mats = [on_huge_pages(torch.randn(rows, cols).to(dtype)) for _ in range(n_mats)]
    views = [numpy_weights(w) for w in mats]
    x = torch.randn(cols)
    x_np = x[None].numpy()
    x_t = x.to(dtype)
    dense_t = median_time(_cycle([lambda w=w: F.linear(x_t, w) for w in mats]), repeats) / n_mats
    results = []
    for frac in fractions:
        k = max(1, round(frac * rows))
        # A fresh active set per call: with one set reused, a small fraction's rows of all
        # the matrices fit in the LLC and the numbers would measure the cache, not DRAM.
        index_sets = [torch.sort(torch.randperm(rows)[:k]).values for _ in range(INDEX_SETS)]
        pairs = [(i, w, v, s) for i, (w, v) in enumerate(zip(mats, views)) for s in index_sets]
        out = np.empty((1, k), dtype=np.float32)
        coef = np.random.default_rng(0).standard_normal((1, k)).astype(np.float32)
        acc = np.zeros((1, cols), dtype=np.float32)
        chunks = sparse_cpu.default_chunks()
        calls = len(pairs)
        row_t = median_time(_cycle([lambda v=v, s=s: sparse_cpu.row_gemv(v, x_np, s.numpy(), sparse.NO_BIAS, -1, out)
                                    for _, _, v, s in pairs]), repeats) / calls
        col_t = median_time(_cycle([lambda v=v, s=s: sparse_cpu.col_axpy(v, coef, s.numpy(), chunks, acc, False)
                                    for _, _, v, s in pairs]), repeats) / calls
        sel_t = median_time(_cycle([lambda w=w, s=s: w.index_select(0, s) @ x_t for _, w, _, s in pairs]),
                            repeats) / calls
        active_bytes = k * cols * elem
        results.append(dict(dtype=str(dtype).replace("torch.", ""), fraction=frac, k=k, dense_us=dense_t * 1e6,
                            row_us=row_t * 1e6, col_us=col_t * 1e6, index_select_us=sel_t * 1e6,
                            row_speedup=dense_t / row_t, col_speedup=dense_t / col_t,
                            index_select_speedup=dense_t / sel_t, row_gbs=active_bytes / row_t / 1e9,
                            col_gbs=active_bytes / col_t / 1e9, working_set_mb=n_mats * rows * cols * elem / 1e6))
    return results


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    fracs = sorted({r["fraction"] for r in results})
    ax.plot(fracs, [1 / f for f in fracs], "k:", label="ideal 1/fraction")
    ax.plot(fracs, [0.8 / f for f in fracs], color="0.6", ls="--", label="target 0.8/fraction")
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        rs = [r for r in results if r["dtype"] == dtype]
        ax.plot([r["fraction"] for r in rs], [r["row_speedup"] for r in rs], "o-", label=f"sparse row GEMV {dtype}")
        ax.plot([r["fraction"] for r in rs], [r["col_speedup"] for r in rs], "s-", label=f"sparse column AXPY {dtype}")
        ax.plot([r["fraction"] for r in rs], [r["index_select_speedup"] for r in rs], "x--",
                label=f"index_select @ x {dtype}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("active fraction of neurons")
    ax.set_ylabel("speedup over dense torch GEMV")
    ax.set_title("Sparse FFN operators, 11008 x 4096")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
        sparse._set_threads(args.threads)
    bandwidth = memory_read_bandwidth() / 1e9
    fractions = [float(f) for f in args.fractions.split(",")]
    results = []
    for name in args.dtypes.split(","):
        if name not in DTYPES:
            from ..errors import BadArgumentError

            raise BadArgumentError(f"unknown dtype {name!r}")
        results += bench_dtype(parse_dtype(name), args.rows, args.cols, fractions, args.repeats)
    print(f"\nshape {args.rows} x {args.cols}; memory read bandwidth (best parallel read of 1 GiB): {bandwidth:.1f} GB/s; "
          f"threads {torch.get_num_threads()}; LLC {last_level_cache_bytes() >> 20} MiB\n")
    print("| dtype | active | dense torch us | sparse row us | speedup | GB/s (% of mem) | sparse col AXPY us | "
          "speedup | GB/s (% of mem) | index_select us | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['dtype']} | {r['fraction']:.0%} | {r['dense_us']:.0f} | {r['row_us']:.0f} | {r['row_speedup']:.2f}x | "
              f"{r['row_gbs']:.1f} ({r['row_gbs'] / bandwidth:.0%}) | {r['col_us']:.0f} | {r['col_speedup']:.2f}x | "
              f"{r['col_gbs']:.1f} ({r['col_gbs'] / bandwidth:.0%}) | {r['index_select_us']:.0f} | "
              f"{r['index_select_speedup']:.2f}x |")
    print("\nworking set per dtype: " + ", ".join(sorted({f"{r['dtype']} {r['working_set_mb']:.0f} MB" for r in results})))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0
