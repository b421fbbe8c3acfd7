"""`powerinfer generate`: one completion, streamed to stdout."""

from __future__ import annotations

import argparse
import sys

from ..engine.generate import stream_generate
from ..errors import BadArgumentError
from .common import add_model_arguments, add_sampling_arguments, load_from_args, sampling_params


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("-p", "--prompt", required=True, help="the prompt text")
    add_sampling_arguments(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--stats", action="store_true", help="print prefill and decode tokens/s")


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
    last = None
    for r in stream_generate(lm.model, lm.tokenizer, prompt, args.max_tokens, sampling, args.stop):
        sys.stdout.write(r.text)
        sys.stdout.flush()
        last = r
    sys.stdout.write("\n")
    if args.stats and last is not None:
        print_stats(last)
    return 0


def print_stats(r) -> None:
    print(f"prefill: {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tok/s | "
          f"decode: {r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s | finish: {r.finish_reason}")
