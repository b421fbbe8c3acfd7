"""Where a batched decode step's time goes: each phase of the one-region batched step
(ops/batch_team.py) timed per rank, its work and its waits, for B sequences at a context.

    python benchmarks/batch_phases.py [--model PATH] [--batches 4,8] [--context 32] [--steps 24]

How: the rank loop's source is copied with a cycle-counter read (x86 TSC, `llvm.readcyclecounter`)
around each phase's shares (work), its wait for the phase before (await) and its wait for the
others' shares (next); the copy replaces `batch_team.layer_stack_team` in this process only.
The counter is converted to ms by a calibration against `time.perf_counter`. The instrumented
step runs a little slower than the plain one (`batch_decode.py` times that); the shares are
what this is for. The rewrite checks that it found each of the nine phases' points, so a
change to batch_team.py that moves them fails here instead of timing nothing.
"""

from __future__ import annotations

import argparse
import re
import time
import types
from pathlib import Path

import numpy as np
import torch
from llvmlite import ir
from numba import njit
from numba import types as nb_types
from numba.extending import intrinsic

import powerinfer
import powerinfer.ops.batch_team as batch_team
from powerinfer.engine.generate import warm_up
from powerinfer.models.batch import decode_step

PHASES = ["norms + records (QKV)", "QKV groups", "attention items", "merges + records (O)", "output groups",
          "FFN norms + records", "gate/up groups", "neuron values + records (down)", "down groups"]
WORK, AWAIT, NEXT = 0, 1, 2


@intrinsic
def _clock(typingctx):
    """The CPU's cycle counter (rdtsc on x86)."""
    def codegen(context, builder, sig, args):
        fn = builder.module.declare_intrinsic("llvm.readcyclecounter", fnty=ir.FunctionType(ir.IntType(64), []))
        return builder.call(fn, [])

    return nb_types.int64(), codegen


def instrumented_source() -> str:
    """batch_team.py with PROF[rank, phase, WORK | AWAIT | NEXT] += counter ticks around each
    phase's shares and waits (PROF: an extra first argument of both functions)."""
    src = Path(batch_team.__file__).read_text().replace("from .", "from powerinfer.ops.")
    out, phase, found = [], None, {WORK: set(), AWAIT: set(), NEXT: set()}
    for line in src.splitlines():
        m = re.search(r"# (\d): ", line)
        if m:
            phase = int(m.group(1))
        indent = line[:len(line) - len(line.lstrip())]
        if re.match(r"\s*await_phase\(sync, ph", line) and not line.strip().startswith("if"):
            out += [f"{indent}_t = _clock()", line, f"{indent}PROF[rank, {phase}, {AWAIT}] += _clock() - _t"]
            found[AWAIT].add(phase)
            continue
        if re.match(r"\s*r = next_share\(sync, ph", line):
            out += [f"{indent}_t = _clock()", line, f"{indent}PROF[rank, {phase}, {NEXT}] += _clock() - _t"]
            found[NEXT].add(phase)
            continue
        if re.match(r"\s*finish\(sync, ph", line):
            out += [f"{indent}PROF[rank, {phase}, {WORK}] += _clock() - _w", line]
            found[WORK].add(phase)
            continue
        out.append(line)
        if line.strip() == "while r >= 0:":
            out.append(indent + "    _w = _clock()")
    # every phase's work and next-share wait; every phase's await but the first (its wait for
    # the layer before sits under an `if i > 0`, still matched)
    for kind, phases in found.items():
        if phases != set(range(len(PHASES))):
            raise SystemExit(f"batch_phases: ops/batch_team.py changed shape (timing points of kind {kind} found "
                             f"for phases {sorted(phases)}); update this script")
    src = "\n".join(out)
    src = src.replace("def _rank_layers(rank, size, sync,", "def _rank_layers(PROF, rank, size, sync,")
    src = src.replace("_rank_layers(np.int64(rank), T, sync,", "_rank_layers(PROF, np.int64(rank), T, sync,")
    src = src.replace("def layer_stack_team(X,", "def layer_stack_team(PROF, X,")
    return src.replace("cache=True", "cache=False")


def ticks_per_second() -> float:
    clock = njit(lambda: _clock())
    clock()
    t0, c0 = time.perf_counter(), clock()
    time.sleep(0.2)
    return (clock() - c0) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--batches", default="4,8")
    ap.add_argument("--context", type=int, default=32, help="each sequence's context before the timed steps")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    prof = np.zeros((64, len(PHASES), 3), dtype=np.int64)
    module = types.ModuleType("batch_team_timed")
    module.__dict__["_clock"] = _clock
    exec(compile(instrumented_source(), "batch_team_timed", "exec"), module.__dict__)
    batch_team.layer_stack_team = lambda *a: module.layer_stack_team(prof, *a)
    model = powerinfer.load(args.model, dtype="native", threads=args.threads).model
    warm_up(model)
    rate = ticks_per_second()
    print(f"model {args.model or 'embedded SmolLM2-135M'}; threads {args.threads}; context {args.context}; "
          f"{args.steps} steps; counter {rate / 1e9:.2f} GHz")
    for B in [int(b) for b in args.batches.split(",")]:
        caches = [model.new_cache(args.context + args.steps + 2) for _ in range(B)]
        for b, c in enumerate(caches):
            model.forward(torch.arange(3, 3 + args.context) + b, c)
        decode_step(model, [5] * B, caches)  # compiles the timed copy on the first B
        prof[:] = 0
        t0 = time.perf_counter()
        for i in range(args.steps):
            decode_step(model, [7 + i] * B, caches)
        step_ms = (time.perf_counter() - t0) / args.steps * 1e3
        ms = prof[:args.threads].astype(float) / rate / args.steps * 1e3  # (ranks, phases, kinds)
        print(f"\nB = {B}: step {step_ms:.2f} ms (instrumented)\n")
        print("| phase | work ms per rank | share of the ranks' work | await ms | next-share wait ms |")
        print("|---|---|---|---|---|")
        work = ms[:, :, WORK].mean(axis=0)
        for p, name in enumerate(PHASES):
            print(f"| {name} | {work[p]:.2f} | {work[p] / work.sum():.0%} | {ms[:, p, AWAIT].mean():.2f} | "
                  f"{ms[:, p, NEXT].mean():.2f} |")
        waits = ms[:, :, AWAIT].sum(axis=1).mean(), ms[:, :, NEXT].sum(axis=1).mean()
        print(f"| all | {work.sum():.2f} | 100% | {waits[0]:.2f} | {waits[1]:.2f} |")
        print(f"\noutside the region (embedding, LM head, the step's Python): "
              f"{step_ms - work.sum() - sum(waits):.2f} ms of the {step_ms:.2f} ms step")


if __name__ == "__main__":
    main()
