"""`powerinfer bench TARGET`: speed measurements (see docs/BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import importlib

TARGETS = {"ops": ("powerinfer.bench.ops", "sparse operators vs dense GEMV and index_select"),
           "e2e": ("powerinfer.bench.e2e", "decode speed and quality: dense, sparse, oracle, transformers"),
           "relu7b": ("powerinfer.bench.relu7b", "ReluLLaMA-7B-shaped planted model: dense vs sparse vs the bandwidth bound"),
           "hybrid": ("powerinfer.bench.hybrid", "hybrid GPU/CPU engine vs whole-layer offload at one VRAM budget")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="target", required=True, metavar="TARGET")
    for name, (module_name, help_text) in TARGETS.items():
        module = importlib.import_module(module_name)
        q = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(q)
        q.set_defaults(_bench=module.run)


def run(args: argparse.Namespace) -> int:
    return args._bench(args)
