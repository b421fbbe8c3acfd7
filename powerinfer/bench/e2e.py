"""End-to-end decode speed and quality: dense, sparse and oracle engines and transformers.

    powerinfer bench e2e [-m MODEL] [--dtype bf16] [--outputs 128,512] [--per-group 1] [--rounds 1] [-o results.json]

ShareGPT prompts (first user turn, through the chat template) grouped by input length
(short < 64 tokens, medium 64-255, long 256-1023), as the paper evaluates; for each group
and output length every engine decodes greedily the same prompts (EOS ignored, so all make
the same number of tokens), engines alternating prompt by prompt. Quality is measured on
the profile's held-out prompts (`train --eval`'s method): perplexity and 128-token greedy
agreement of dense, oracle and predicted (= what the sparse engine computes) variants.
The model must have been prepared (`powerinfer prepare`), or it is prepared first.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

GROUPS = {"short": (8, 64), "medium": (64, 256), "long": (256, 1024)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="weight dtype (default bf16)")
    p.add_argument("--outputs", default="128,512", help="output lengths (default 128,512)")
    p.add_argument("--per-group", type=int, default=1, help="prompts per input-length group (default 1)")
    p.add_argument("--rounds", type=int, default=1,
                   help="times each prompt is decoded by every engine, engines alternating (default 1); the median counts")
    p.add_argument("--engines", default="dense,sparse,oracle,transformers")
    p.add_argument("--quality-prompts", type=int, default=16, help="held-out prompts for perplexity (0 = skip)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-o", "--output", default=None, help="also write the results as JSON here")
    p.add_argument("--force", action="store_true", help="overwrite an existing --output file")


def grouped_prompts(tokenizer, per_group: int) -> dict[str, list[list[int]]]:
    from ..data import load_prompts

    out: dict[str, list[list[int]]] = {g: [] for g in GROUPS}
    for p in load_prompts("sharegpt")[1000:]:  # away from the profile's usual picks
        ids = tokenizer.encode_chat([{"role": "user", "content": p.text}])
        for g, (lo, hi) in GROUPS.items():
            if lo <= len(ids) < hi and len(out[g]) < per_group:
                out[g].append(ids)
        if all(len(v) >= per_group for v in out.values()):
            break
    return out


def run(args: argparse.Namespace) -> int:
    from ..engine.packed import load_packed
    from ..errors import BadArgumentError, PowerInferError, require
    from ..loader import DTYPES, load
    from ..offline.prepare import PrepareSettings, prepare
    from ..paths import check_output_file, write_json
    from ..timing import decode_round, load_transformers, transformers_round

    try:
        outputs = [int(x) for x in args.outputs.split(",") if x.strip()]
    except ValueError:
        raise BadArgumentError(f"--outputs {args.outputs!r}: give whole numbers, comma-separated") from None
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - {"dense", "sparse", "oracle", "transformers"}
    if unknown or not outputs or min(outputs) < 1 or args.per_group < 1 or args.rounds < 1:
        raise BadArgumentError(f"bad --engines/--outputs/--per-group/--rounds ({', '.join(sorted(unknown))})")
    require(args.threads >= 1 and args.quality_prompts >= 0, "--threads must be >= 1 and --quality-prompts >= 0")
    if args.output:
        check_output_file(args.output, args.force, "--output")
    torch.set_num_threads(args.threads)
    packed_dir = prepare(args.model, PrepareSettings())
    dense = load(args.model, dtype=args.dtype, threads=args.threads)
    models = {"dense": dense.model}
    packed = {}
    for mode in ("sparse", "oracle"):
        if mode in engines:
            packed[mode] = load_packed(packed_dir, mode=mode, dtype=args.dtype, threads=args.threads)
            models[mode] = packed[mode].model
    hf = load_transformers(dense.path, DTYPES[args.dtype]) if "transformers" in engines else None
    prompts = grouped_prompts(dense.tokenizer, args.per_group)
    for m in models.values():  # warm-up: numba compilation, allocator
        decode_round(m, prompts["short"][0], 4)
    if hf is not None:
        transformers_round(hf, prompts["short"][0], 4)
    results = {"model": dense.path, "dtype": args.dtype, "threads": args.threads, "rounds": args.rounds, "groups": {}}
    active = []
    for g, plist in prompts.items():
        for n in outputs:
            speeds: dict[str, list[float]] = {e: [] for e in engines}
            for ids in [ids for ids in plist for _ in range(args.rounds)]:
                for e in engines:
                    if e == "transformers":
                        speeds[e].append(transformers_round(hf, ids, n)[1])
                    else:
                        if e == "sparse":
                            packed[e].ffn_stats.reset()
                        speeds[e].append(decode_round(models[e], ids, n)[1])
                        if e == "sparse":
                            active.append(packed[e].ffn_stats.active_fraction)
            row = {e: statistics.median(v) for e, v in speeds.items()}
            # ratios of measurements taken back to back (same prompt, one after the other):
            # the machine's drift cancels better than in a ratio of medians
            row["paired"] = {f"sparse/{e}": statistics.median(s / o for s, o in zip(speeds["sparse"], speeds[e]))
                             for e in ("dense", "transformers") if "sparse" in speeds and e in speeds}
            row["input_tokens"] = [len(i) for i in plist]
            results["groups"][f"{g}/{n}"] = row
            print(f"{g:>6} input, {n} output: " + ", ".join(f"{e} {row[e]:.1f}" for e in engines) + " tok/s",
                  file=sys.stderr, flush=True)
    results["sparse_active_fraction"] = statistics.mean(active) if active else None
    if args.quality_prompts > 0:
        from ..offline.evaluate import bypassed_layers, evaluate_predictors
        from ..offline.stats import Profile
        from ..offline.train import Predictors
        from ..paths import content_hash, model_cache_dir

        cache = model_cache_dir(content_hash(dense.path))
        prof = Profile.load(str(cache / "profile"))
        try:
            preds = Predictors.load(str(cache / "predictors"))
        except PowerInferError:  # prepare trained none (no layer's predictor could pay)
            preds = Predictors([None] * len(prof.layers), {})
        engine = packed.get("sparse")
        bypass, exact = (None, None) if engine is None else bypassed_layers(engine.packed.plan)
        q = evaluate_predictors(dense, prof, preds, args.quality_prompts, bypass=bypass, exact=exact)
        results["quality"] = {"perplexity": q["perplexity"], "greedy_agreement": q["greedy_agreement"],
                              "prompts": q["prompts"], "tokens": q["tokens"],
                              "predictor_bypassed_layers": sum(bypass) if bypass else 0}
    print(format_results(results, engines))
    if args.output:
        write_json(args.output, results)
    return 0


def format_results(r: dict, engines: list[str]) -> str:
    lines = [f"model {r['model']}, {r['dtype']} weights, {r['threads']} threads; decode tok/s (median over prompts and "
             "rounds); ratios: median of the per-prompt ratios (engines run back to back per prompt)", "",
             "| input / output | " + " | ".join(engines) + " | sparse vs dense | sparse vs transformers |",
             "|---|" + "---|" * (len(engines) + 2)]
    for key, row in r["groups"].items():
        paired = row.get("paired", {})
        vs_d = paired.get("sparse/dense", float("nan"))
        vs_t = paired.get("sparse/transformers", float("nan"))
        lines.append(f"| {key} ({'/'.join(map(str, row['input_tokens']))} in) | "
                     + " | ".join(f"{row[e]:.1f}" for e in engines) + f" | {vs_d:.2f}x | {vs_t:.2f}x |")
    if r.get("sparse_active_fraction") is not None:
        lines.append(f"\nsparse engine: {r['sparse_active_fraction']:.3f} of FFN neurons computed per decode token")
    if "quality" in r:
        q = r["quality"]
        ppl, ag = q["perplexity"], q["greedy_agreement"]
        lines.append(f"held-out ({q['prompts']} prompts, {q['tokens']} tokens): perplexity dense {ppl['dense']:.3f}, "
                     f"oracle {ppl['oracle']:.3f} ({ppl['oracle'] / ppl['dense'] - 1:+.1%}), sparse "
                     f"{ppl['predicted']:.3f} ({ppl['predicted'] / ppl['dense'] - 1:+.1%}); 128-token greedy agreement "
                     f"oracle {ag['oracle']:.3f}, sparse {ag['predicted']:.3f}"
                     + (f" (predictor bypassed in {q['predictor_bypassed_layers']} dense-ish layers)"
                        if q.get("predictor_bypassed_layers") else ""))
    return "\n".join(lines)
