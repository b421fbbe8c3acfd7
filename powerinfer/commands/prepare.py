"""`powerinfer prepare`: profile, train, solve and pack a model once, cached per model.

    powerinfer prepare [-m MODEL] [--hardware auto|NAME|FILE] [--vram-budget SIZE] [--dtype fp32|bf16|fp16]
                       [--predictors auto|all|none]

Afterwards `generate`, `chat` and `serve` use the packed model automatically.
"""

from __future__ import annotations

import argparse

from ..errors import BadArgumentError
from ..loader import DTYPES, NATIVE, set_threads
from ..units import format_size, parse_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="a .gguf file or HF model directory (default: embedded model)")
    p.add_argument("--hardware", default="auto",
                   help="auto (default: cpu without CUDA, else measured), a built-in name or a JSON/TOML file")
    p.add_argument("--vram-budget", default=None, help="GPU bytes to use, e.g. 6GiB (default: all of the GPU)")
    p.add_argument("--dtype", choices=[*DTYPES, NATIVE], default="fp32",
                   help="packed weight dtype (default fp32); native keeps a GGUF's quantized blocks")
    p.add_argument("--dataset", default="sharegpt", help="profiling prompts: sharegpt (default), .txt or .jsonl")
    p.add_argument("--prompts", type=int, default=256, help="prompts to profile (default 256)")
    p.add_argument("--heldout", type=int, default=32, help="held-out prompts for the sparsity search (default 32)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per prompt (default 256)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--target-sparsity", type=float, default=None, help="fixed per-layer sparsity target")
    g.add_argument("--max-ppl-increase", type=float, default=0.01,
                   help="sparsest thresholds with held-out perplexity within (1+P) x dense (default 0.01)")
    p.add_argument("--recall", type=float, default=0.95, help="predictor recall target (default 0.95)")
    p.add_argument("--predictors", choices=["auto", "all", "none"], default="auto",
                   help="which layers get a trained predictor: auto (default) those where the profile says one can "
                        "pay; all; none")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")


def run(args: argparse.Namespace) -> int:
    from ..offline.prepare import PrepareSettings, prepare

    if args.prompts < 1 or args.heldout < 1 or args.max_tokens < 2:
        raise BadArgumentError("need --prompts >= 1, --heldout >= 1 and --max-tokens >= 2")
    if not 0 < args.recall < 1:
        raise BadArgumentError("--recall must be in (0, 1)")
    if args.target_sparsity is not None and not 0 <= args.target_sparsity < 1:
        raise BadArgumentError("--target-sparsity must be in [0, 1)")
    if not 0 <= args.max_ppl_increase < float("inf"):  # NaN too
        raise BadArgumentError("--max-ppl-increase must be a finite number >= 0")
    set_threads(args.threads)
    budget = parse_size(args.vram_budget) if args.vram_budget is not None else None
    s = PrepareSettings(hardware=args.hardware, vram_budget=budget, dtype=args.dtype, dataset=args.dataset,
                        prompts=args.prompts, heldout=args.heldout, max_tokens=args.max_tokens,
                        target_sparsity=args.target_sparsity,
                        max_ppl_increase=None if args.target_sparsity is not None else args.max_ppl_increase,
                        recall=args.recall, predictors=args.predictors)
    out = prepare(args.model, s)
    from ..formats.packed import read_manifest

    m = read_manifest(out)
    pl = m.placement
    trained = sum(layer.predictor is not None for layer in m.layers)
    print(f"prepared: {out} ({pl.hardware}, GPU budget {format_size(pl.budget)}, "
          f"{pl.gpu_neurons} GPU-tier neurons, {m.dtype} weights, predictors in {trained} of {len(m.layers)} layers)")
    return 0
