"""`powerinfer train`: per-layer activation predictors from a profile's samples.

    powerinfer train [-m MODEL] [--profile DIR] [--recall 0.95] [--budget 0.10] [-o DIR]
    powerinfer train --eval DIR [-m MODEL] [--profile DIR]
"""

from __future__ import annotations

import argparse
import os

from ..errors import BadArgumentError
from .common import add_model_arguments, load_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--profile", default=None, help="profile directory (default: the model's cache dir)")
    p.add_argument("--recall", type=float, default=0.95, help="recall target per layer (default 0.95)")
    p.add_argument("--recall-margin", type=float, default=0.015,
                   help="set thresholds for recall + margin on validation, for unseen prompts (default 0.015)")
    p.add_argument("--budget", type=float, default=0.10, help="max predictor/model parameter ratio (default 0.10)")
    p.add_argument("--tolerance", type=float, default=0.02, help="precision change that counts (default 0.02)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--unweighted", action="store_true",
                   help="plain class-weighted loss (default: also weight each miss by the neuron's true score)")
    p.add_argument("--magnitude-power", type=float, default=1.0,
                   help="misses weigh (score / mean score)^P (default 1; 2 favours strong activations more)")
    p.add_argument("--magnitude-cap", type=float, default=20.0, help="largest miss weight (default 20)")
    p.add_argument("--mass-recall", type=float, default=0.99,
                   help="make the heaviest-missed neurons always-on until each layer keeps this share of the "
                        "activation mass (default 0.99; 0 = off; not with --unweighted)")
    p.add_argument("--max-forced", type=float, default=0.05,
                   help="at most this share of a layer's neurons made always-on (default 0.05)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", default=None, help="output directory (default: the model's cache dir)")
    p.add_argument("--force", action="store_true", help="overwrite predictors in --output")
    p.add_argument("--eval", metavar="DIR", default=None, help="evaluate the predictors in DIR instead of training")
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for --eval (default 16)")
    p.add_argument("--gen-tokens", type=int, default=128, help="greedy tokens for the agreement (default 128)")


def run(args: argparse.Namespace) -> int:
    from ..offline.stats import Profile
    from ..offline.train import Predictors, TrainSettings, file_hash, model_scores, train_predictors
    from ..paths import content_hash, model_cache_dir, write_json

    if not 0 < args.recall < 1:
        raise BadArgumentError("--recall must be in (0, 1)")
    # conditions written so that NaN fails them
    if not (0 < args.magnitude_power < float("inf") and args.magnitude_cap >= 1):
        raise BadArgumentError("--magnitude-power must be a finite number > 0 and --magnitude-cap >= 1")
    if not (0 <= args.recall_margin < 1 and 0 <= args.tolerance < 1):
        raise BadArgumentError("--recall-margin and --tolerance must be in [0, 1)")
    if args.epochs < 1 or args.seed < 0 or args.eval_prompts < 1 or args.gen_tokens < 1:
        raise BadArgumentError("need --epochs, --eval-prompts and --gen-tokens >= 1 and --seed >= 0")
    if not 0 <= args.mass_recall <= 1 or not 0 <= args.max_forced <= 1:
        raise BadArgumentError("--mass-recall and --max-forced must be in [0, 1]")
    if not 0 < args.budget <= 1:
        raise BadArgumentError("--budget must be in (0, 1]")
    lm = load_from_args(args)
    model_hash = content_hash(lm.path)
    cache = model_cache_dir(model_hash)
    profile = Profile.load(args.profile or str(cache / "profile"), model_hash=model_hash)
    if args.eval:
        from ..offline.evaluate import evaluate_predictors

        preds = Predictors.load(args.eval, model_hash, file_hash(os.path.join(profile.path, "stats.safetensors")))
        result = evaluate_predictors(lm, profile, preds, args.eval_prompts, gen_tokens=args.gen_tokens)
        write_json(os.path.join(args.eval, "eval.json"), result)
        print("| layer | rank | recall | precision | predicted / actual active |\n|---|---|---|---|---|")
        for l in result["layers"]:
            print(f"| {l['layer']} | {l['rank']} | {l['recall']:.3f} | {l['precision']:.3f} | {l['predicted_active']:.2f} |")
        ppl, agree = result["perplexity"], result["greedy_agreement"]
        print(f"\nheld-out: {result['prompts']} prompts, {result['tokens']} tokens")
        for v in ("dense", "oracle", "predicted"):
            print(f"{v}: perplexity {ppl[v]:.3f}, greedy agreement {agree[v]:.3f} over {result['gen_tokens']} tokens "
                  f"x {result['agreement_prompts']} prompts")
        return 0
    out = args.output or str(cache / "predictors")
    if args.output:
        from ..offline.train import ARTEFACT
        from ..paths import check_output_dir

        check_output_dir(out, args.force, "-o", ARTEFACT)
    settings = TrainSettings(recall=args.recall, recall_margin=args.recall_margin, budget=args.budget,
                             tolerance=args.tolerance, epochs=args.epochs, seed=args.seed,
                             magnitude_power=args.magnitude_power, magnitude_cap=args.magnitude_cap,
                             mass_recall=args.mass_recall, max_forced=args.max_forced)
    scores = None if args.unweighted else model_scores(lm.model, profile.criterion)
    preds = train_predictors(profile, lm.model.num_parameters(), settings, scores)
    preds.save(out, in_cache=args.output is None)
    print("| layer | rank | threshold | recall | mass recall | always-on | precision | predicted sparsity "
          "| true sparsity |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, p in enumerate(preds.layers):
        if p is None:
            print(f"| {i} | - | not trained | | | | | | |")
            continue
        mass = "-" if p.mass_recall is None else f"{p.mass_recall:.3f}"
        print(f"| {i} | {p.rank} | {p.threshold:.3f} | {p.recall:.3f} | {mass} | {len(p.forced)} | "
              f"{p.precision:.3f} | {p.predicted_sparsity:.3f} | {p.true_sparsity:.3f} |")
    m = preds.manifest
    print(f"\npredictors: {m['predictor_params']} parameters = {m['param_ratio']:.2%} of the model's "
          f"{m['model_params']}; wrote {out}")
    return 0
