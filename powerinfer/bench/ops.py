"""`powerinfer bench ops`: sparse operators vs the dense GEMV and the index_select route.

At LLaMA-7B's FFN shape (11008 neurons x 4096) with enough matrices cycled that the
working set is at least 4x the last-level cache, for each active fraction: the dense torch
GEMV over all rows, our sparse op over the active rows, and `W.index_select(0, idx) @ x`.
Reports time, speedup over dense, and effective bandwidth (bytes of active rows / time)
next to the memory bandwidth measured in the same run, and plots speedup vs fraction.

`--device cuda` runs the same table with CUDA tensors: the GPU tier's torch ops
(ops/gpu.py) against cuBLAS's dense GEMV, the working set sized by the GPU's L2 cache and
the bandwidth probe a device-memory read, every timing closed by a device synchronize.
`--device cpu` (the default) times the numba CPU kernels.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import BadArgumentError, require
from ..loader import DTYPES, parse_dtype
from ..ops import api as sparse, sparse_cpu
from ..ops import torch_ops as torch_backend
from ..ops.memory import on_huge_pages
from ..ops.numba_half import numpy_weights
from ..paths import check_output_file, save_figure
from ..timing import BusProbe, last_level_cache_bytes, median_time

FRACTIONS = (0.05, 0.10, 0.20, 0.30, 1.00)
INDEX_SETS = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=11008, help="neurons per matrix (default 11008)")
    p.add_argument("--cols", type=int, default=4096, help="model width (default 4096)")
    p.add_argument("--dtypes", default="fp32,bf16", help="weight dtypes, comma-separated")
    p.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu (numba kernels, default) or cuda (the GPU tier's ops)")
    p.add_argument("--plot", default=None,
                   help="PNG to write ('' = none; default bench_ops.png, bench_ops_cuda.png for cuda)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --plot file")


def _cycle(fns):
    def run():
        for f in fns:
            f()
    return run


def _synced(fn, device: torch.device):
    """fn, then a wait for the device (a CUDA launch returns before the kernel has run)."""
    if device.type != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize(device)
    return run


def cache_bytes(device: torch.device) -> int:
    """The last-level cache the working set must dwarf: the CPU's LLC or the GPU's L2."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20))
    return last_level_cache_bytes()


def bus_probe(device: torch.device) -> Callable[[], float]:
    """A quick read of the device's memory bus (bytes/s), cheap enough to take between the
    timings it is compared with: the CPU's BusProbe (one pass of each method over 1 GiB),
    or on CUDA the best of three full reductions of a device buffer of 4 GiB, or a quarter
    of the free memory on a smaller GPU (at least 8x its L2, so the cache cannot serve it)."""
    if device.type != "cuda":
        return BusProbe().read
    free, _ = torch.cuda.mem_get_info(device)
    n_bytes = max(8 * cache_bytes(device), min(4 << 30, free // 4))
    buf = torch.ones(n_bytes // 2, dtype=torch.float16, device=device)

    def read() -> float:
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            buf.sum()
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return buf.nbytes / best
    read()
    return read


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _sparse_ops(mats, device: torch.device, cols: int, k: int, torch_ops: bool):
    """A maker of the (row, col) callables for one (matrix, index set): the numba kernels, or
    with `torch_ops` the GPU tier's torch ops on `device` (CUDA, or the CPU in tests)."""
    coef = np.random.default_rng(0).standard_normal((1, k)).astype(np.float32)
    if torch_ops:
        coef_t = torch.from_numpy(coef).to(device)

        def make(w, s):
            return (lambda: torch_backend.sparse_row_gemv(w, x_dev, s), lambda: torch_backend.sparse_col_axpy(w, coef_t, s))
        x_dev = torch.randn(1, cols, device=device)
        return make
    out = np.empty((1, k), dtype=np.float32)
    acc = np.zeros((1, cols), dtype=np.float32)
    chunks = sparse_cpu.default_chunks()
    x_np = torch.randn(1, cols).numpy()
    views = {id(w): numpy_weights(w) for w in mats}

    def make(w, s):
        v, s_np = views[id(w)], s.numpy()
        return (lambda: sparse_cpu.row_gemv(v, x_np, s_np, sparse.NO_BIAS, -1, out),
                lambda: sparse_cpu.col_axpy(v, coef, s_np, chunks, acc, False))
    return make


def bench_dtype(dtype: torch.dtype, rows: int, cols: int, fractions: list[float], repeats: int,
                device: torch.device | None = None, torch_ops: bool | None = None,
                probe: Callable[[], float] | None = None) -> list[dict]:
    """One table row per fraction; `torch_ops` (default: on CUDA) times the GPU tier's ops.

    Each of `repeats` rounds times the dense GEMV, the sparse row GEMV and the column AXPY
    side by side, with a read of the bus (`probe()`, bytes/s) before and after each sparse
    op. A round's speedups and % of the bus pair timings taken a fraction of a second apart,
    and the row reports their medians: this machine's bus drifts between phases within a
    run (33 vs 50+ GB/s), and a probe or a dense baseline from another phase would misjudge
    the op."""
    device = device or torch.device("cpu")
    torch_ops = device.type == "cuda" if torch_ops is None else torch_ops
    elem = torch.tensor([], dtype=dtype).element_size()
    n_mats = max(4, math.ceil(4 * cache_bytes(device) / (rows * cols * elem)))
    mats = [on_huge_pages(torch.randn(rows, cols, device=device).to(dtype)) for _ in range(n_mats)]  # huge pages: CPU only
    x_t = torch.randn(cols, device=device).to(dtype)
    dense = _synced(_cycle([lambda w=w: F.linear(x_t, w) for w in mats]), device)
    results = []
    probe = probe or (lambda: float("nan"))
    for frac in fractions:
        k = max(1, round(frac * rows))
        # A fresh active set per call: with one set reused, a small fraction's rows of all
        # the matrices fit in the LLC and the numbers would measure the cache, not DRAM.
        index_sets = [torch.sort(torch.randperm(rows)[:k]).values.to(device) for _ in range(INDEX_SETS)]
        pairs = [(w, s) for w in mats for s in index_sets]
        make = _sparse_ops(mats, device, cols, k, torch_ops)
        ops = [make(w, s) for w, s in pairs]
        calls = len(pairs)
        row = _synced(_cycle([r for r, _ in ops]), device)
        col = _synced(_cycle([c for _, c in ops]), device)
        for fn in (dense, row, col):  # compile, fault in
            fn()
        active_bytes = k * cols * elem
        rounds = []
        for _ in range(repeats):
            dense_s = _seconds(dense) / n_mats
            bus_a = probe()
            row_s = _seconds(row) / calls
            bus_b = probe()
            col_s = _seconds(col) / calls
            bus_c = probe()
            rounds.append(dict(dense_us=dense_s * 1e6, row_us=row_s * 1e6, col_us=col_s * 1e6,
                               row_speedup=dense_s / row_s, col_speedup=dense_s / col_s,
                               row_bus=active_bytes / row_s / ((bus_a + bus_b) / 2),
                               col_bus=active_bytes / col_s / ((bus_b + bus_c) / 2),
                               bus_gbs=(bus_a + bus_b + bus_c) / 3e9))
        med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        sel_t = median_time(_synced(_cycle([lambda w=w, s=s: w.index_select(0, s) @ x_t for w, s in pairs]), device),
                            repeats) / calls
        results.append(dict(med, dtype=str(dtype).replace("torch.", ""), fraction=frac, k=k,
                            index_select_us=sel_t * 1e6, index_select_speedup=med["dense_us"] / (sel_t * 1e6),
                            row_gbs=active_bytes / med["row_us"] / 1e3, col_gbs=active_bytes / med["col_us"] / 1e3,
                            working_set_mb=n_mats * rows * cols * elem / 1e6))
    return results


def plot(results: list[dict], path: str, title: str = "Sparse FFN operators, 11008 x 4096") -> None:
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
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise BadArgumentError(f"unknown --device {name!r} (cpu or cuda)") from None
    if device.type not in ("cpu", "cuda"):
        raise BadArgumentError(f"unknown --device {name!r} (cpu or cuda)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BadArgumentError("--device cuda asked for, but torch sees no CUDA device")
    return device


def parse_fractions(text: str) -> list[float]:
    """--fractions: comma-separated active fractions, each in (0, 1]."""
    try:
        fractions = [float(f) for f in text.split(",")]
    except ValueError:
        raise BadArgumentError(f"--fractions {text!r}: give numbers in (0, 1], comma-separated") from None
    require(all(0 < f <= 1 for f in fractions), f"--fractions {text!r}: each must be in (0, 1]")
    return fractions


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    require(args.rows >= 1 and args.cols >= 1, "--rows and --cols must be >= 1")
    require(args.repeats >= 1, "--repeats must be >= 1")
    require(args.threads is None or args.threads >= 1, "--threads must be >= 1")
    fractions = parse_fractions(args.fractions)
    path = args.plot if args.plot is not None else f"bench_ops{'_cuda' if device.type == 'cuda' else ''}.png"
    if path:
        check_output_file(path, args.force, "--plot")
    if args.threads:
        torch.set_num_threads(args.threads)
        sparse._set_threads(args.threads)
    results = []
    dtypes = args.dtypes.split(",")
    for name in dtypes:
        if name not in DTYPES:
            raise BadArgumentError(f"unknown dtype {name!r}")
    probe = bus_probe(device)
    for name in dtypes:
        results += bench_dtype(parse_dtype(name), args.rows, args.cols, fractions, args.repeats, device, probe=probe)
    where = (f"{torch.cuda.get_device_name(device)}: device memory read (best of 3)" if device.type == "cuda"
             else f"threads {torch.get_num_threads()}: memory read (fastest of three parallel reads of 1 GiB)")
    buses = [r["bus_gbs"] for r in results]
    print(f"\nshape {args.rows} x {args.cols}; {where} before and after each sparse op's timing in each of "
          f"{args.repeats} rounds; a cell is the median over rounds (speedups and % of the bus paired within a "
          f"round): bus {min(buses):.1f}-{max(buses):.1f} GB/s; "
          f"{'L2' if device.type == 'cuda' else 'LLC'} {cache_bytes(device) >> 20} MiB\n")
    print("| dtype | active | bus GB/s | dense torch us | sparse row us | speedup | GB/s (% of bus) | "
          "sparse col AXPY us | speedup | GB/s (% of bus) | index_select us | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['dtype']} | {r['fraction']:.0%} | {r['bus_gbs']:.1f} | {r['dense_us']:.0f} | {r['row_us']:.0f} | "
              f"{r['row_speedup']:.2f}x | {r['row_gbs']:.1f} ({r['row_bus']:.0%}) | {r['col_us']:.0f} | "
              f"{r['col_speedup']:.2f}x | {r['col_gbs']:.1f} ({r['col_bus']:.0%}) | {r['index_select_us']:.0f} | "
              f"{r['index_select_speedup']:.2f}x |")
    print("\nworking set per dtype: " + ", ".join(sorted({f"{r['dtype']} {r['working_set_mb']:.0f} MB" for r in results})))
    if path:
        plot(results, path, f"Sparse FFN operators, {args.rows} x {args.cols}" + (", CUDA" if device.type == "cuda" else ""))
        print(f"plot: {path}")
    return 0
