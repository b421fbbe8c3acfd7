"""`powerinfer profile`: activation statistics of a model over a prompt set.

    powerinfer profile [-m MODEL] [--dataset sharegpt|PATH] [--prompts N] [--heldout N]
                       [--max-tokens T] [--target-sparsity S | --max-ppl-increase P] [-o DIR]
    powerinfer profile --report DIR
    powerinfer profile --synthetic [-m MODEL | --layers L --ffn N] [--sparsity S]
                       [--hot-fraction F --hot-coverage C] -o DIR
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import BadArgumentError
from ..units import parse_size
from ..offline.profile import make_profile, model_shape_dict
from .common import add_model_arguments, load_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--dataset", default="sharegpt", help="sharegpt (default), a .txt file or a .jsonl file")
    p.add_argument("--prompts", type=int, default=256, help="prompts to profile (default 256)")
    p.add_argument("--heldout", type=int, default=32, help="disjoint held-out prompts for perplexity (default 32)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per prompt (default 256)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--target-sparsity", type=float, default=None,
                   help="per-layer thresholds for this share of inactive neurons (default 0.5 for SiLU/GELU "
                        "models; ReLU models use output > 0)")
    g.add_argument("--max-ppl-increase", type=float, default=None,
                   help="search the sparsest thresholds with held-out perplexity within (1+P) x dense")
    p.add_argument("--criterion", choices=["gate_up", "gate"], default="gate_up",
                   help="neuron score: |act(gate)*up| (default) or |act(gate)| (CATS)")
    p.add_argument("--eval-sparsities", default="", help="also measure held-out perplexity at these, e.g. 0.5,0.7,0.9")
    p.add_argument("--sample-tokens", type=int, default=8192, help="training samples kept per layer")
    p.add_argument("--sample-bytes", default="2GiB", help="cap on the samples' disk size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", default=None, help="output directory (default: the model's cache dir)")
    p.add_argument("--force", action="store_true", help="overwrite an existing profile in --output")
    p.add_argument("--report", metavar="DIR", default=None, help="print the per-layer table and write the plot")
    p.add_argument("--synthetic", action="store_true", help="write synthetic power-law statistics instead")
    p.add_argument("--layers", type=int, default=None, help="--synthetic: layers (default: the model's)")
    p.add_argument("--ffn", type=int, default=None, help="--synthetic: neurons per layer (default: the model's)")
    p.add_argument("--sparsity", type=float, default=0.9, help="--synthetic: mean sparsity (default 0.9)")
    p.add_argument("--hot-fraction", type=float, default=0.2, help="--synthetic: hot share of neurons (0.2)")
    p.add_argument("--hot-coverage", type=float, default=0.8, help="--synthetic: their share of activations (0.8)")


def default_profile_dir(model_path: str) -> str:
    from ..paths import content_hash, model_cache_dir

    return str(model_cache_dir(content_hash(model_path)) / "profile")


def _check_output(path: str, force: bool, user_given: bool) -> None:
    if user_given:  # the cache directory is ours: replaced as needed
        from ..offline.stats import ARTEFACT
        from ..paths import check_output_dir

        check_output_dir(path, force, "-o", ARTEFACT)


def run(args: argparse.Namespace) -> int:
    from ..offline.report import report

    if args.report:
        print(report(args.report))
        return 0
    if args.synthetic:
        return run_synthetic(args)
    if args.prompts < 1 or args.heldout < 0 or args.max_tokens < 2:
        raise BadArgumentError("need --prompts >= 1, --heldout >= 0 and --max-tokens >= 2")
    if args.target_sparsity is not None and not 0 <= args.target_sparsity < 1:
        raise BadArgumentError("--target-sparsity must be in [0, 1)")
    if args.max_ppl_increase is not None and not 0 <= args.max_ppl_increase < float("inf"):  # NaN too
        raise BadArgumentError("--max-ppl-increase must be a finite number >= 0")
    if args.sample_tokens < 0 or args.seed < 0:
        raise BadArgumentError("--sample-tokens and --seed must be >= 0")
    try:
        evals = tuple(float(s) for s in args.eval_sparsities.split(",") if s.strip())
    except ValueError:
        raise BadArgumentError(f"--eval-sparsities {args.eval_sparsities!r}: give numbers in [0, 1), "
                               "comma-separated") from None
    if not all(0 <= e < 1 for e in evals):
        raise BadArgumentError(f"--eval-sparsities {args.eval_sparsities!r}: each must be in [0, 1)")
    from ..offline.profile import ProfileSettings, is_relu_family

    if args.output:
        _check_output(args.output, args.force, True)
    lm = load_from_args(args)
    out_dir = args.output or default_profile_dir(lm.path)
    _check_output(out_dir, args.force, args.output is not None)
    target = args.target_sparsity
    if target is None and args.max_ppl_increase is None and not is_relu_family(lm.model):
        target = 0.5
    settings = ProfileSettings(criterion=args.criterion, target_sparsity=target,
                               max_ppl_increase=args.max_ppl_increase, sample_tokens=args.sample_tokens,
                               sample_bytes=parse_size(args.sample_bytes), seed=args.seed, eval_sparsities=evals)
    prof = make_profile(lm, args.dataset, args.prompts, args.heldout, args.max_tokens, settings, out_dir,
                        weights=args.dtype, in_cache=args.output is None)
    n_profile = prof.manifest["dataset"]["n_profile"]
    q = prof.manifest.get("quality", {})
    mean_sparsity = sum(l.sparsity for l in prof.layers) / len(prof.layers)
    print(f"profiled {prof.manifest['tokens']} tokens over {n_profile} prompts; mean sparsity "
          f"{mean_sparsity:.3f}; top-20% share {sum(l.coverage(0.2) for l in prof.layers) / len(prof.layers):.3f}"
          + "".join(f"; {k} {v:.3f}" for k, v in q.items())
          + f"; counting pass {prof.manifest['counting_tokens_per_s']:.0f} tok/s")
    print(f"wrote {out_dir}", file=sys.stderr)
    return 0


def run_synthetic(args: argparse.Namespace) -> int:
    from ..offline.synthetic import synthetic_profile

    layers, ffn, model_info = args.layers, args.ffn, {}
    if (layers is not None and layers < 1) or (ffn is not None and ffn < 1) or args.seed < 0:
        raise BadArgumentError("--layers and --ffn must be >= 1, --seed >= 0")
    if layers is None or ffn is None:
        from ..loader import read_model, resolve_model_path
        from ..paths import content_hash

        path = resolve_model_path(args.model)
        margs, _ = read_model(path)
        layers, ffn = layers or margs.n_layers, ffn or margs.ffn_dim
        model_info = {"hash": content_hash(path), "path": os.path.abspath(path), "family": margs.family,
                      "n_layers": margs.n_layers, "d_model": margs.d_model, "n_ff": margs.ffn_dim,
                      "name": os.path.basename(path), "shape": model_shape_dict(margs, path)}
        if (layers, ffn) != (margs.n_layers, margs.ffn_dim):
            raise BadArgumentError("--layers/--ffn differ from the model's shape; omit -m for a shape-only profile")
    if not args.output:
        raise BadArgumentError("--synthetic needs -o DIR")
    _check_output(args.output, args.force, True)
    prof = synthetic_profile(layers, ffn, sparsity=args.sparsity, hot_fraction=args.hot_fraction,
                             hot_coverage=args.hot_coverage, seed=args.seed)
    if model_info:
        prof.manifest["model"] = model_info
    from ..offline.stats import ARTEFACT
    from ..paths import staged_dir

    with staged_dir(args.output, ARTEFACT) as tmp:
        prof.save(tmp)
    print(f"wrote synthetic profile ({layers} layers x {ffn} neurons) to {args.output}")
    return 0
