"""`powerinfer bench hybrid`: the hybrid engine against the llama.cpp-style offload baseline at
one VRAM budget, on bench relu7b's planted ReluLLaMA-7B-shaped model.

    powerinfer bench hybrid [--layers 8] [--vram-fraction 0.4] [--hardware auto] [--gpu-device DEV]
                            [--tokens 32] [--rounds 3] [-t THREADS] [--dir DIR]

Both engines get the same GPU budget, `--vram-fraction` of the model's 16-bit weights:

* hybrid (`--mode sparse`): the solver's placement for this machine's cost model: hot
  neurons (and attention and the LM head where that pays) on the GPU, cold neurons on the
  CPU; the predictors pick each token's neurons and both tiers compute at once;
* offload (`--mode offload`): whole layers on the GPU while they fit the budget after the LM
  head, the rest dense on the CPU, as llama.cpp's `-ngl` does.

With `--dtype q4_0` the planted file is Q4_0 and both engines keep its blocks (on the GPU
each matmul widens them on the device, ops/quant_torch.py); the budget is then the fraction
of the Q4_0 weights.

Rounds alternate the engines (the bus drifts within minutes); the table gives decode tok/s,
the GPU share of the hybrid engine's neuron load, and the GPU bytes each engine holds. With
a CUDA device the hardware profile is measured here (`--hardware auto`). Without one the GPU
tier is a second set of CPU tensors and the cost model a built-in GPU (auto: rtx4090): every
code path runs, but the speeds say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from tqdm import tqdm

from ..paths import write_json
from ..units import format_size
from . import relu7b


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8; ReluLLaMA-7B has 32)")
    p.add_argument("--vram-fraction", type=float, default=0.4,
                   help="GPU budget as a share of the model's 16-bit weights (default 0.4)")
    p.add_argument("--hardware", default="auto",
                   help="cost model for the solver: built-in name or file (default: measured with CUDA, else rtx4090)")
    p.add_argument("--gpu-device", default=None, help="the GPU tier's device (default: cuda when present, else cpu)")
    p.add_argument("--sparsity", type=float, default=0.9, help="mean share of inactive neurons (default 0.9)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "q4_0"], default="fp16",
                   help="weight dtype (default fp16; q4_0: a Q4_0 file, blocks kept in both tiers)")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens per round (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="offload/hybrid round pairs, alternating (default 3)")
    p.add_argument("--rank", type=int, default=16, help="predictor rank (default 16)")
    p.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1, help="CPU threads (default: all cores)")
    p.add_argument("--dir", default=None, help="where to write the GGUF and packed model (default: a temp dir)")
    relu7b.add_shape_arguments(p)


def hardware_for(name: str, device: torch.device):
    """The solver's cost model: `name`, or with auto the measured machine (CUDA) or rtx4090."""
    from ..hardware import load_hardware

    if name != "auto":
        return load_hardware(name)
    if device.type == "cuda":
        from ..offline.measure import measure_hardware as measure

        return measure()
    return load_hardware("rtx4090")


def model_shape(layers: int, shape: relu7b.Shape, vocab: int):
    from ..hardware import ModelShape

    return ModelShape("planted", layers, shape.d, shape.n_ff, shape.heads, shape.heads, shape.d // shape.heads, vocab)


def solver_weights(dtype: str) -> str:
    """The solver's weight type for the GPU tier: 16-bit rows, or a native Q4_0 pack's Q4_0
    gate/up rows beside its down projection requantized to Q8_0 (offline/pack.py)."""
    return "q4_0+q8_0" if dtype == "q4_0" else "fp16"


def placer(mshape, hw, budget: int, rank: int, out: str, weights: str = "fp16"):
    """place(profile, model_hash) -> the solver's placement document (also written to `out`).
    `weights` is every matrix's type in the planted file (all Q4_0 or all fp16), so the
    solver's bytes for attention and the LM head are exact too."""
    from ..hardware import offload_baseline
    from ..offline.solve import build_problem, greedy, placement_document, solve_auto

    def place(profile, model_hash: str) -> dict:
        problem, best = solve_auto(lambda dense: build_problem(profile, mshape, hw, budget, weights,
                                                               dense_on_gpu=dense, predictor_rank=rank))
        doc = placement_document(problem, best, {"greedy": greedy(problem)},
                                 offload_baseline(mshape, hw, weights, budget), model_hash, profile.path)
        doc["hardware"] = {"name": hw.name}
        write_json(out, doc, indent=None)
        return doc
    return place


def gpu_tier_bytes(model) -> int:
    """Weight bytes a loaded packed model keeps on its GPU tier: FFN rows, the dense parts the
    tier holds, and predictors on a CUDA device."""
    def size(ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    tier, n = model.tier, 0
    for i, layer in enumerate(model.layers):
        n += size(layer.ffn.gpu.tensors())
        if tier.attention_on_tier(i):
            n += size(layer.attn.qkv.tensors() + layer.attn.o.tensors())
        p = layer.ffn.predictor
        if p is not None and p.device.type == "cuda":
            n += size(p.tensors())
    if tier.head:
        n += size(model.lm_head.tensors())
    return n


def run(args: argparse.Namespace) -> int:
    from ..engine.packed import load_packed, resolve_gpu_device
    from ..errors import BadArgumentError
    from ..hardware import weight_bytes
    from ..offline.solve import mandatory_gpu_bytes

    relu7b.check_planted_args(args)
    if not 0 < args.vram_fraction < 1:
        raise BadArgumentError("--vram-fraction must be between 0 and 1 (the model does not fit, by design)")
    torch.set_num_threads(args.threads)
    shape = relu7b.shape_of(args)
    device = resolve_gpu_device(args.gpu_device)
    src = relu7b.tokenizer_source()
    vocab = relu7b.vocab_size(src)
    relu7b.check_memory(args.layers, vocab, shape)
    hw = hardware_for(args.hardware, device)
    if not hw.has_gpu:
        raise BadArgumentError(f"hardware {hw.name!r} has no GPU: the hybrid engine has nothing to place on one")
    solver_type = solver_weights(args.dtype)
    weights = int(relu7b.model_bytes(args.layers, vocab, shape) * weight_bytes(solver_type) / 2)
    budget = int(args.vram_fraction * weights)
    mshape = model_shape(args.layers, shape, vocab)
    need = sum(mandatory_gpu_bytes(mshape, solver_type, 0, False, False, args.rank, hw.runtime_buffers).values())
    if budget < need:  # before minutes of writing and packing
        raise BadArgumentError(f"--vram-fraction {args.vram_fraction} gives {budget / 2**20:.0f} MiB, less than the "
                               f"{need / 2**20:.0f} MiB the GPU must hold before any neuron (runtime buffers, "
                               "predictors); raise it")
    with relu7b.work_dir(args.dir, "hybrid-") as root:
        place = placer(mshape, hw, budget, args.rank, os.path.join(root, "placement.json"), solver_type)
        _, packed_dir, _ = relu7b.planted_model(args, shape, root, place, src)

        def load(mode: str):
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            lm = load_packed(packed_dir, mode=mode, dtype=relu7b.engine_dtype(args), threads=args.threads,
                             gpu_device=str(device), with_tokenizer=False, predictor_bypass=None)
            used = torch.cuda.memory_allocated(device) - before if device.type == "cuda" else None
            return lm, used

        hybrid_lm, hybrid_alloc = load("sparse")
        hybrid, stats = hybrid_lm.model, hybrid_lm.ffn_stats
        calibrated = relu7b.calibrate_active_share(hybrid, 1 - args.sparsity, n=args.tokens)
        offload_lm, offload_alloc = load("offload")
        offload = offload_lm.model
        relu7b.decode_speed(offload, 2), relu7b.decode_speed(hybrid, 2)  # warm-up
        speeds: dict[str, list[float]] = {"offload": [], "hybrid": []}
        shares, active = [], []
        half = max(1, args.tokens // 2)
        for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
            # offload, hybrid, offload (half the tokens each): drift within a round weighs on both
            before = relu7b.decode_speed(offload, half)
            stats.reset()
            speeds["hybrid"].append(relu7b.decode_speed(hybrid, args.tokens))
            shares.append(stats.gpu_share)
            active.append(stats.active_fraction)
            speeds["offload"].append(statistics.harmonic_mean([before, relu7b.decode_speed(offload, half)]))
        placement = hybrid_lm.packed.manifest.placement
        where = (torch.cuda.get_device_name(device) if device.type == "cuda"
                 else "no CUDA device: the GPU tier is CPU tensors, so these speeds say nothing about a GPU")
        print(f"\nplanted d {shape.d}, {shape.n_ff} neurons, {args.layers} layers, {args.dtype}; {where}; cost model "
              f"{hw.name}; budget {format_size(budget)} = {args.vram_fraction:.0%} of {format_size(weights)}; "
              f"{args.threads} CPU threads; {statistics.mean(active):.3f} of FFN neurons computed per token (calibrated to "
              f"{calibrated:.3f}); median of {args.rounds} rounds x {args.tokens} tokens\n")
        print("| engine | decode tok/s | GPU tier weights | on the GPU | placement |\n|---|---|---|---|---|")
        for name, model, alloc, what in (
                ("offload", offload, offload_alloc,
                 f"{placement.offload_gpu_layers} whole layers, LM head {'GPU' if placement.offload_head_on_gpu else 'CPU'}"),
                ("hybrid", hybrid, hybrid_alloc,
                 f"{placement.gpu_neurons} hot neurons, dense parts {'GPU' if placement.dense_on_gpu else 'CPU'}; "
                 f"GPU share of neuron load {statistics.median(shares):.2f}")):
            on_gpu = "n/a" if alloc is None else format_size(alloc)
            print(f"| {name} | {statistics.median(speeds[name]):.2f} | {format_size(gpu_tier_bytes(model))} | "
                  f"{on_gpu} | {what} |")
        ratios = [h / o for o, h in zip(speeds["offload"], speeds["hybrid"])]
        print(f"\nhybrid / offload: {statistics.median(ratios):.2f}x per round median ({min(ratios):.2f}-{max(ratios):.2f}x); "
              f"solver predicted {placement.predicted_tokens_per_s or float('nan'):.1f} tok/s for the hybrid placement; "
              + (f"packed model: {packed_dir}" if args.dir else "the planted model's files are removed (--dir keeps them)"),
              file=sys.stdout)
        return 0
