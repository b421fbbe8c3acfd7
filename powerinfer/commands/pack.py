"""`powerinfer pack`: write the packed model directory the hybrid engine loads.

    powerinfer pack [-m MODEL] [--profile DIR] [--predictors DIR] [--placement FILE] [--dtype fp32|bf16|fp16|native] -o OUT
"""

from __future__ import annotations

import argparse
import json
import os

from ..errors import BadArgumentError
from ..loader import DTYPES, NATIVE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="a .gguf file or HF model directory (default: embedded model)")
    p.add_argument("--profile", default=None, help="profile directory (default: the model's cache dir)")
    p.add_argument("--predictors", default=None,
                   help="predictor directory (default: the model's cache dir if trained there; 'none' to omit)")
    p.add_argument("--placement", default=None, help="placement JSON from `powerinfer solve` (default: all neurons on the CPU)")
    p.add_argument("--dtype", choices=[*DTYPES, NATIVE], default="fp32",
                   help="weight dtype of the shards (default fp32); native keeps a GGUF's quantized blocks")
    p.add_argument("-o", "--output", required=True, help="output directory")
    p.add_argument("--force", action="store_true", help="overwrite a packed model in --output")


def run(args: argparse.Namespace) -> int:
    from ..loader import resolve_model_path
    from ..offline.pack import pack_model
    from ..offline.stats import Profile
    from ..offline.train import Predictors, file_hash
    from ..paths import content_hash, model_cache_dir

    path = resolve_model_path(args.model)
    model_hash = content_hash(path)
    cache = model_cache_dir(model_hash)
    profile = Profile.load(args.profile or str(cache / "profile"), model_hash=model_hash)
    profile_hash = file_hash(os.path.join(profile.path, "stats.safetensors"))
    predictors = None
    if args.predictors != "none":
        pdir = args.predictors or str(cache / "predictors")
        if args.predictors or os.path.isfile(os.path.join(pdir, "manifest.json")):
            predictors = Predictors.load(pdir, model_hash, profile_hash)
    placement = None
    if args.placement:
        try:
            with open(args.placement) as f:
                placement = json.load(f)
        except FileNotFoundError:
            raise BadArgumentError(f"{args.placement}: no such placement file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadArgumentError(f"{args.placement}: not valid JSON ({e})") from None
        if not isinstance(placement, dict):
            raise BadArgumentError(f"{args.placement}: not a powerinfer placement")
    m = pack_model(path, args.output, profile, predictors, placement, args.dtype, force=args.force)
    gpu = m.shards["gpu"].tensor_bytes / 2**20
    cpu = m.shards["cpu"].tensor_bytes / 2**20
    print(f"packed {m.family} ({len(m.layers)} layers, {m.placement.gpu_neurons} GPU-tier neurons, "
          f"predictors: {'yes' if predictors else 'no'}): gpu shard {gpu:.1f} MiB, cpu shard {cpu:.1f} MiB; "
          f"wrote {args.output}")
    return 0
