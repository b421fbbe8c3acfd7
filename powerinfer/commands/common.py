"""Flags shared by the subcommands that load a model and sample from it."""

from __future__ import annotations

import argparse
import sys

from ..engine.sample import SamplingParams
from ..errors import BadArgumentError
from ..loader import DTYPES, KV_DTYPES, NATIVE, LoadedModel, load, resolve_model_path


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="a .gguf file or HF model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--dtype", choices=[*DTYPES, NATIVE], default=NATIVE,
                   help="weight dtype: native (default: as the file stores them, GGUF quantized blocks kept), "
                        "or fp32, bf16, fp16 (converted at load)")
    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="fp32",
                   help="KV cache dtype: fp32 (default) or fp16 (half the cache's memory and the attention's "
                        "reads, as llama.cpp's default; keys and values rounded to fp16)")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Which engine runs the model: the packed hybrid one (after `powerinfer prepare`) or dense."""
    p.add_argument("--mode", choices=["auto", "sparse", "oracle", "dense", "offload"], default="auto",
                   help="auto (default): sparse when the model has been prepared, else dense; oracle: true "
                        "activations under the thresholds; offload: whole layers on the GPU tier (llama.cpp-style)")
    p.add_argument("--packed", default=None, help="packed model directory (default: the one `prepare` made)")
    p.add_argument("--gpu-device", default=None, choices=["cuda", "cpu"],
                   help="device of the GPU tier (default: cuda when present, else a CPU-backed tier)")
    p.add_argument("--kv-on-gpu", action="store_true",
                   help="keep the KV cache on the GPU tier instead of in CPU memory (packed engine)")


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
    """The sampling flags, checked before anything is loaded (chat would otherwise meet a
    bad value only at its first message)."""
    from ..tokenizer import check_text

    if args.max_tokens < 0:
        raise BadArgumentError("max_tokens must be >= 0")
    for text in [getattr(args, "prompt", None) or "", getattr(args, "system", None) or "", *(args.stop or [])]:
        check_text(text, "the prompt" if text is getattr(args, "prompt", None) else "a --stop or --system text")
    return SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty,
                          args.seed).validate()


def load_from_args(args: argparse.Namespace) -> LoadedModel:
    """The dense model, or with engine arguments (`add_engine_arguments`) the packed one."""
    mode = getattr(args, "mode", "dense")
    packed = getattr(args, "packed", None)
    if mode != "dense" or packed:
        explicit = packed is not None
        packed = packed or _prepared_dir(args.model, required=mode != "auto")
        if packed and mode == "auto" and not explicit:
            packed = _auto_choice(packed)
        if packed:
            from ..engine.packed import load_packed
            from ..paths import content_hash

            model_hash = content_hash(resolve_model_path(args.model)) if args.model else None
            mode = "sparse" if mode == "auto" else mode
            print(f"loading the packed model {packed} (mode {mode}) ...", file=sys.stderr, flush=True)
            return load_packed(packed, mode=mode, dtype=args.dtype, threads=args.threads,
                               gpu_device=args.gpu_device, model_hash=model_hash,
                               kv_on_gpu=getattr(args, "kv_on_gpu", False), kv_dtype=getattr(args, "kv_dtype", "fp32"))
    if getattr(args, "kv_on_gpu", False):
        if mode == "dense":
            raise BadArgumentError("--kv-on-gpu needs the packed engine; the dense engine keeps everything on the CPU "
                                   "(use --mode sparse, oracle or offload after `powerinfer prepare`)")
        print("note: --kv-on-gpu has no effect with the dense engine", file=sys.stderr)
    print(f"loading {args.model or 'the embedded default model'} ...", file=sys.stderr, flush=True)
    return load(args.model, dtype=args.dtype, threads=args.threads, kv_dtype=getattr(args, "kv_dtype", "fp32"))


def _auto_choice(packed: str) -> str | None:
    """The prepared model, unless `prepare` measured the sparse engine to be slower or worse
    than dense on this machine (then None: the dense engine)."""
    from ..formats.packed import read_check

    check = read_check(packed)
    if check is None or check.auto_mode == "sparse":
        return packed
    if check.note:
        print(f"note: {check.note}; using dense (--mode sparse forces the packed engine)", file=sys.stderr)
        return None
    tps, ppl = check.tokens_per_s, check.perplexity
    why = f"sparse decode {tps.get('sparse', 0):.1f} vs dense {tps.get('dense', 0):.1f} tok/s"
    if ppl:
        why += f", held-out perplexity {ppl.get('sparse', 0):.2f} vs {ppl.get('dense', 0):.2f}"
    print(f"note: prepare measured the sparse engine no better than dense here ({why}); using dense "
          "(--mode sparse forces it)", file=sys.stderr)
    return None


def _prepared_dir(model: str | None, required: bool) -> str | None:
    import os

    from ..offline.prepare import default_packed_dir
    from ..paths import content_hash

    d = default_packed_dir(content_hash(resolve_model_path(model)))
    if os.path.isfile(os.path.join(d, "manifest.json")):
        return d
    if required:
        raise BadArgumentError(f"{model or 'the default model'} has not been prepared; run `powerinfer prepare"
                               f"{' -m ' + model if model else ''}` first (or use --mode dense)")
    return None
