"""`powerinfer hardware`: show the built-in hardware profiles, or measure this machine."""

from __future__ import annotations

import argparse
import json
import os
import platform

from ..errors import BadArgumentError
from ..hardware import BUILTIN, HardwareProfile
from ..paths import check_output_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--measure", action="store_true", help="measure this machine and write a profile")
    p.add_argument("-o", "--output", default="hardware.json", help="where --measure writes (default hardware.json)")
    p.add_argument("--force", action="store_true")
    p.add_argument("--show", default=None, help="print one profile (built-in name or file)")


def measure() -> HardwareProfile:
    """Memory bandwidth and GEMV throughput of this CPU; the GPU's when torch sees one."""
    import torch

    from ..bench.timing import median_time, memory_read_bandwidth
    from ..ops.numba_half import numpy_weights
    from ..ops.panels import gemv

    # the typical pass, not the best: the cost model predicts what decode sustains, and the
    # best single pass of this machine's bus can read half again as much as a decode round
    bw = memory_read_bandwidth(statistic="median")
    w = torch.randn(8192, 4096)
    x = torch.randn(4096)
    w_np = numpy_weights(w)
    gemv_s = median_time(lambda: gemv(w_np, x), 5)
    flops = 2 * w.numel() / gemv_s
    total_mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu_mem, gpu_bw, gpu_flops, pcie = 0, 0.0, 0.0, 0.0
    if torch.cuda.is_available():
        gpu_mem = torch.cuda.get_device_properties(0).total_memory
        a = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
        t = median_time(lambda: (a.sum(), torch.cuda.synchronize()), 5)
        gpu_bw = a.nbytes / t
        m = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
        t = median_time(lambda: (m @ m, torch.cuda.synchronize()), 5)
        gpu_flops = 2 * 8192**3 / t
        h = torch.empty(1 << 26, dtype=torch.float32).pin_memory()
        t = median_time(lambda: (h.to("cuda", non_blocking=True), torch.cuda.synchronize()), 5)
        pcie = h.nbytes / t
    return HardwareProfile(name=f"measured-{platform.node() or 'host'}", gpu_memory=gpu_mem, gpu_bandwidth=gpu_bw,
                           gpu_flops=gpu_flops, cpu_memory=total_mem, cpu_bandwidth=bw, cpu_flops=flops,
                           pcie_bandwidth=pcie, pcie_latency=10e-6 if gpu_mem else 0.0,
                           sync_overhead=20e-6 if gpu_mem else 0.0)


def run(args: argparse.Namespace) -> int:
    if args.measure:
        check_output_file(args.output, args.force, "-o")
        prof = measure()
        with open(args.output, "w") as f:
            json.dump(prof.to_dict(), f, indent=1)
        print(json.dumps(prof.to_dict(), indent=1))
        print(f"wrote {args.output}")
        return 0
    if args.show:
        from ..hardware import load_hardware

        print(json.dumps(load_hardware(args.show).to_dict(), indent=1))
        return 0
    for name, prof in BUILTIN.items():
        print(f"{name}: GPU {prof.gpu_memory / 2**30:.0f} GiB at {prof.gpu_bandwidth / 1e9:.0f} GB/s, "
              f"CPU {prof.cpu_bandwidth / 1e9:.0f} GB/s, PCIe {prof.pcie_bandwidth / 1e9:.0f} GB/s")
    return 0
