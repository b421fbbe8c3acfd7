"""`powerinfer generate`: one completion, streamed to stdout."""

from __future__ import annotations

import argparse
import sys

from ..engine.generate import stream_generate, warm_up
from ..errors import BadArgumentError
from .common import add_engine_arguments, add_model_arguments, add_sampling_arguments, load_from_args, sampling_params


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_engine_arguments(p)
    p.add_argument("-p", "--prompt", required=True, help="the prompt text")
    add_sampling_arguments(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--stats", action="store_true",
                   help="print prefill and decode tokens/s (after a warm-up pass, whose time is printed too)")


def run(args: argparse.Namespace) -> int:
    sampling = sampling_params(args)
    lm = load_from_args(args)
    if lm.tokenizer is None:
        raise BadArgumentError(f"{lm.path}: the model has no tokenizer")
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = lm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        sys.stdout.write(args.prompt)
    warm = warm_up(lm.model) if args.stats else None  # steady-state speeds, not one-time costs
    last = None
    stats = lm.ffn_stats
    if stats is not None:
        stats.reset()
    for r in stream_generate(lm.model, lm.tokenizer, prompt, args.max_tokens, sampling, args.stop):
        sys.stdout.write(r.text)
        sys.stdout.flush()
        last = r
    sys.stdout.write("\n")
    if args.stats and last is not None:
        print_stats(last, lm, warm)
    return 0


def print_stats(r, lm=None, warm_up_s: float | None = None) -> None:
    engine = "dense"
    packed = lm.packed if lm is not None else None
    if packed:
        engine = f"{packed.mode}, GPU tier on {packed.gpu_device}"
        tier = lm.model.tier
        on_tier = [name for name, on in (("attention", any(tier.attention_on_tier(i) for i in range(len(lm.model.layers)))),
                                         ("embeddings/LM head", tier.head), ("KV cache", tier.kv)) if on]
        engine += f" (with {', '.join(on_tier)})" if on_tier else ""
        engine += f"; {packed.plan.summary()}"
    print(f"engine: {engine} | prefill: {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tok/s | "
          f"decode: {r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s | finish: {r.finish_reason}"
          + (f" | warm-up before: {warm_up_s:.2f} s" if warm_up_s is not None else ""))
    stats = lm.ffn_stats if lm is not None else None
    if stats is not None and stats.layer_calls:
        per_token = " ".join(f"{f:.2f}" for f in stats.per_token_active[:16])
        more = " ..." if len(stats.per_token_active) > 16 else ""
        print(f"FFN neurons computed per decode token: {stats.active_fraction:.3f} of all "
              f"(per token: {per_token}{more}) | GPU share of neuron load: {stats.gpu_share:.3f} "
              f"(GPU tier {stats.active_gpu}, CPU tier {stats.active_cpu} neurons) | "
              f"layers merged {stats.synced}, sync skipped {stats.skipped_sync}")
