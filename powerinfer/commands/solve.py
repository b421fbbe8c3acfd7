"""`powerinfer solve`: place neurons on GPU/CPU under a VRAM budget (ILP over the cost model).

    powerinfer solve [-m MODEL] [--profile DIR] [--hardware NAME|FILE] [--vram-budget SIZE]
                     [--shape NAME] [--explain] -o FILE
"""

from __future__ import annotations

import argparse
import os

from ..errors import BadArgumentError
from ..hardware import KNOWN_SHAPES, load_hardware, offload_baseline, split_types
from ..offline.solve import shape_from_manifest
from ..paths import check_output_file, write_json
from ..units import format_size, parse_size


def _weight_type(value: str) -> str:
    try:
        split_types(value)
    except BadArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="model whose profile to use (default: embedded model)")
    p.add_argument("--profile", default=None, help="profile directory (default: the model's cache dir)")
    p.add_argument("--shape", default=None, choices=sorted(KNOWN_SHAPES),
                   help="model shape for a shape-only (synthetic) profile")
    p.add_argument("--hardware", default="rtx4090", help="built-in (rtx4090, rtx2080ti, h200, cpu) or a JSON/TOML file")
    p.add_argument("--vram-budget", default=None, help="GPU bytes to use, e.g. 6GiB (default: all of the GPU)")
    p.add_argument("--weights", default="fp16", type=_weight_type,
                   help="weight storage type on the GPU: fp32, fp16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, "
                        "q6_k, or ROWS+DOWN for a native pack (q4_k+q8_0: gate/up rows q4_k, down column q8_0; "
                        "default fp16)")
    p.add_argument("--group-size", type=int, default=64, help="neurons per ILP decision (default 64)")
    p.add_argument("--objective", choices=["time", "impact"], default="time",
                   help="minimise predicted time (default) or maximise GPU activation mass (the paper's)")
    p.add_argument("--time-limit", type=float, default=10.0, help="solver seconds (default 10)")
    p.add_argument("--context", type=int, default=2048, help="context length the KV cache is sized for")
    p.add_argument("--kv-on-gpu", action="store_true", help="count the KV cache in the GPU budget")
    p.add_argument("--attention", choices=["auto", "gpu", "cpu"], default="auto",
                   help="where attention and the LM head live (auto: GPU when they leave half the budget)")
    p.add_argument("--predictor-rank", type=int, default=128, help="predictor hidden size to reserve GPU memory for")
    p.add_argument("--explain", action="store_true", help="print the per-layer table")
    p.add_argument("-o", "--output", default=None, help="placement JSON (default: the model's cache dir)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --output file")


def run(args: argparse.Namespace) -> int:
    from ..offline.solve import build_problem, explain, greedy, placement_document, solve, solve_auto
    from ..offline.stats import Profile

    if args.group_size < 1 or args.context < 1 or args.predictor_rank < 0:
        raise BadArgumentError("need --group-size >= 1, --context >= 1 and --predictor-rank >= 0")
    if not 0 < args.time_limit < float("inf"):  # NaN too
        raise BadArgumentError("--time-limit must be a finite number of seconds > 0")
    if args.output is not None:
        check_output_file(args.output, args.force, "-o")  # before minutes of solving
    hw = load_hardware(args.hardware)
    budget = parse_size(args.vram_budget) if args.vram_budget is not None else hw.gpu_memory
    model_hash = None
    if args.shape:
        shape = KNOWN_SHAPES[args.shape]
        if not args.profile:
            raise BadArgumentError("--shape needs --profile DIR (e.g. from `powerinfer profile --synthetic`)")
        profile = Profile.load(args.profile)
    else:
        from ..commands.profile import default_profile_dir
        from ..loader import resolve_model_path
        from ..paths import content_hash

        path = resolve_model_path(args.model) if (args.model or not args.profile) else None
        model_hash = content_hash(path) if path else None
        profile_dir = args.profile or default_profile_dir(path)
        profile = Profile.load(profile_dir, model_hash=model_hash)
        model_hash = model_hash or profile.model_hash
        shape = shape_from_manifest(profile.manifest)
        if shape is None:
            raise BadArgumentError(f"{profile_dir}: the profile records no model shape; pass --shape")
    def build(dense_on_gpu: bool):
        return build_problem(profile, shape, hw, budget, args.weights, args.group_size, args.context, args.kv_on_gpu,
                             dense_on_gpu, args.predictor_rank)

    if args.attention == "auto":
        problem, best = solve_auto(build, args.objective, args.time_limit)
    else:
        problem = build(args.attention == "gpu")
        best = solve(problem, args.objective, args.time_limit)
    others = {"greedy": greedy(problem)}
    if args.objective == "time":
        others["ilp-impact"] = solve(problem, "impact", args.time_limit)
    doc = placement_document(problem, best, others, offload_baseline(shape, hw, args.weights, budget, args.context),
                             model_hash, profile.path)
    out = args.output
    if out is None:
        from ..paths import model_cache_dir

        out = str(model_cache_dir(model_hash or "shape-" + shape.name) / f"placement-{hw.name}-{budget}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_json(out, doc, indent=None)
    if args.explain:
        print(explain(doc))
    b = doc["budget"]
    sol = doc["solution"]
    print(f"{shape.name} on {hw.name}, budget {format_size(budget)} (mandatory {format_size(sum(b['mandatory'].values()))},"
          f" neurons {format_size(b['neurons'])}, free {format_size(b['free'])})")
    gap = "n/a" if sol["gap"] is None else f"{sol['gap']:.2e}"
    print(f"ILP ({args.objective}): {sol['tokens_per_s']:.2f} tok/s predicted, solved in {sol['solve_seconds']:.2f} s, "
          f"gap {gap}, LP bound {sol['lp_bound']:.6g}, objective {sol['objective']:.6g}")
    for name, o in doc["baselines"].items():
        print(f"  {name}: {o['tokens_per_s']:.2f} tok/s" + (f" ({o['gpu_layers']} GPU layers)" if "gpu_layers" in o else ""))
    print(f"GPU share of neuron load: {doc['gpu_share_of_neuron_load']:.3f}; wrote {out}")
    return 0
