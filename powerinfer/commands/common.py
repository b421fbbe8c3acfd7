"""Flags shared by the subcommands that load a model and sample from it."""

from __future__ import annotations

import argparse
import sys

from ..engine.sample import SamplingParams
from ..loader import DTYPES, LoadedModel, load


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="a .gguf file or HF model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="compute dtype (default fp32)")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=256, help="tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty,
                          args.seed).validate()


def load_from_args(args: argparse.Namespace) -> LoadedModel:
    print(f"loading {args.model or 'the embedded default model'} ...", file=sys.stderr, flush=True)
    return load(args.model, dtype=args.dtype, threads=args.threads)
