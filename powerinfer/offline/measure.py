"""Measure this machine for the solver's cost model: memory bandwidth, GEMV throughput, and
the GPU's memory, bandwidth, FLOPs and PCIe when torch sees one."""

from __future__ import annotations

import os
import platform

from ..hardware import HardwareProfile


def measure_hardware() -> HardwareProfile:
    """Memory bandwidth and GEMV throughput of this CPU; the GPU's when torch sees one."""
    import torch

    from ..timing import median_time, memory_read_bandwidth
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
