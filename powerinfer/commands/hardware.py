"""`powerinfer hardware`: show the built-in hardware profiles, or measure this machine."""

from __future__ import annotations

import argparse
import json


from ..hardware import BUILTIN
from ..offline.measure import measure_hardware
from ..paths import check_output_file, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--measure", action="store_true", help="measure this machine and write a profile")
    p.add_argument("-o", "--output", default="hardware.json", help="where --measure writes (default hardware.json)")
    p.add_argument("--force", action="store_true")
    p.add_argument("--show", default=None, help="print one profile (built-in name or file)")


def run(args: argparse.Namespace) -> int:
    if args.measure:
        check_output_file(args.output, args.force, "-o")
        prof = measure_hardware()
        write_json(args.output, prof.to_dict())
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
