"""From a path (or nothing: the embedded default model) to a runnable model + tokenizer."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import BadArgumentError, ModelFileError
from .formats.finite import check_finite
from .formats.gguf import GGUF_MAGIC, open_gguf
from .formats.hf import open_hf_dir
from .models import family_module
from .models.base import Model, ModelArgs
from .ops import cpu
from .ops.memory import drop_file_cache
from .paths import default_model_path, looks_like_hub_id, resolve_hub_id
from .tokenizer import Tokenizer, load_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NATIVE = "native"  # each tensor in its stored format: GGUF quantized blocks stay blocks (ops/quant.py)


@dataclass
class LoadedModel:
    """A model ready to generate: weights, tokenizer (None when the checkpoint has none) and,
    for a packed model, the hybrid engine's state (`packed`: manifest, load plan, stats)."""

    model: Model
    tokenizer: Tokenizer | None
    path: str
    packed: Any = None  # engine.packed.PackedEngine

    @property
    def ffn_stats(self) -> Any:
        """The packed engine's decode statistics (engine.hybrid.FFNStats); None when dense."""
        return None if self.packed is None else self.packed.stats

    @property
    def args(self) -> ModelArgs:
        return self.model.args


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype, or None for `native` (every tensor as stored)."""
    if isinstance(name, torch.dtype):
        return name
    if name == NATIVE or name is None:
        return None
    if name not in DTYPES:
        raise BadArgumentError(f"unknown dtype {name!r} (choose {', '.join([*DTYPES, NATIVE])})")
    return DTYPES[name]


KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def parse_kv_dtype(name: str | torch.dtype) -> torch.dtype:
    """The KV cache dtype for `--kv-dtype` (fp32 or fp16)."""
    if isinstance(name, torch.dtype) and name in KV_DTYPES.values():
        return name
    if name not in KV_DTYPES:
        raise BadArgumentError(f"unknown KV cache dtype {name!r} (choose {', '.join(KV_DTYPES)})")
    return KV_DTYPES[name]


def resolve_model_path(path: str | None) -> str:
    """The model path as given (a hub id `org/name` resolved through the Hugging Face cache),
    or the embedded default; refuse what is not a model."""
    if path is None:
        return default_model_path()
    if looks_like_hub_id(path):
        path = resolve_hub_id(path)
    if not os.path.exists(path):
        raise ModelFileError(f"{path}: no such file or directory")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelFileError(f"{path}: not a GGUF file or HF model directory")
    return path


def read_model(path: str, native: bool = False) -> tuple[ModelArgs, dict[str, torch.Tensor | None]]:
    """`open_model` without the page releaser."""
    args, state, _ = open_model(path, native)
    return args, state


def open_model(path: str, native: bool = False) -> tuple[ModelArgs, dict[str, torch.Tensor | None],
                                                         Callable[[torch.Tensor], None] | None]:
    """Model arguments, canonical state dict and page releaser of a GGUF file or HF
    directory: float weights in their stored dtype (F16 stays 16-bit: half the memory of
    fp32), quantized ones dequantized to fp32, or with `native` kept as blocks where the
    kernels read the format (ops/quant.py; others dequantized to bf16, said in one line).
    Consumers convert to the dtype they run in; the releaser (GGUF only, else None) drops
    the file's pages under a state tensor once it has been copied."""
    if os.path.isdir(path):
        ckpt = open_hf_dir(path)
        family = family_module(str(ckpt.config.get("model_type", "")))
        config = os.path.join(path, "config.json")
        args = _checked_args(lambda: family.args_from_hf(ckpt.config), ckpt.tensor_names(), config)
        state = _built(lambda: family.state_from_hf(ckpt, args), config)
        _check_state(args, state, path, config)
        return args, state, None
    g = open_gguf(path, native=native)
    family = family_module(g.architecture, gguf=True)
    args = _checked_args(lambda: family.args_from_gguf(g), g.tensor_names(), f"{path}: the GGUF metadata")
    state = _built(lambda: family.state_from_gguf(g, args), f"{path}: the GGUF metadata")
    _check_state(args, state, path, f"{path}: the GGUF metadata")
    if g.dequantized:
        print(f"note: {path}: dequantized to bf16 (no native kernel for it yet): {'; '.join(sorted(g.dequantized))}",
              file=sys.stderr)
    return args, state, g.release_copied


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:blk|layers|h)\.(\d+)\.")


def _checked_args(make: Callable[[], ModelArgs], tensor_names: list[str], source: str) -> ModelArgs:
    """The family's ModelArgs, refused in one line naming `source` (config.json or the GGUF
    metadata) when its sizes are impossible or its layer count is not the weights' one:
    such a config would otherwise surface as a missing tensor or a division by zero."""
    try:
        args = make()
    except ModelFileError as e:  # config_object's: say which config.json
        raise ModelFileError(f"{source}: {str(e).removeprefix('config.json: ')}") from None
    except ZeroDivisionError:
        raise ModelFileError(f"{source}: a head count or size is zero") from None
    except (TypeError, ValueError, KeyError) as e:
        raise ModelFileError(f"{source}: cannot read the model's sizes ({e})") from None
    try:
        args.validate(ModelFileError, where="")
    except ModelFileError as e:
        raise ModelFileError(f"{source}: {e}") from None
    layers = {int(m.group(1)) for name in tensor_names if (m := _LAYER_INDEX.search(name))}
    if layers and max(layers) + 1 != args.n_layers:
        raise ModelFileError(f"{source}: says {args.n_layers} layers, the weights hold {max(layers) + 1}")
    return args


def _built(make: Callable[[], dict], source: str) -> dict:
    """The family's state dict; a reshape that the sizes make impossible is the config's fault."""
    try:
        return make()
    except RuntimeError as e:
        raise ModelFileError(f"{source}: the sizes disagree with the weights ({str(e).splitlines()[0]})") from None


def _check_state(args: ModelArgs, state: dict, path: str, source: str) -> None:
    problem = args.shape_problem(state)
    if problem:
        raise ModelFileError(f"{source}: the sizes disagree with the weights ({problem})")
    check_finite(state.items(), path)


def model_files(path: str) -> list[str]:
    """The files a model is read from: the GGUF file, or a directory's safetensors files."""
    if os.path.isfile(path):
        return [path]
    return [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]


def set_threads(threads: int | None) -> None:
    """Use `threads` CPU threads for torch and the numba kernels (None: leave as is)."""
    if threads is not None:
        if threads < 1:
            raise BadArgumentError("threads must be >= 1")
        torch.set_num_threads(threads)
        cpu.set_threads(threads)


def load(path: str | None = None, dtype: str | torch.dtype = "native", threads: int | None = None,
         with_tokenizer: bool = True, kv_dtype: str | torch.dtype = "fp32") -> LoadedModel:
    """Load a model for generation. `path`: .gguf file, HF directory, or None for the default.
    `dtype`: native (the default, as the CLI: each tensor as the file stores it, GGUF quantized
    blocks stay blocks, F16 stays fp16), or fp32, bf16, fp16 (weights converted). `kv_dtype`:
    the KV cache's, fp32 (default) or fp16 (half the memory and attention reads)."""
    set_threads(threads)
    kv = parse_kv_dtype(kv_dtype)
    path = resolve_model_path(path)
    torch_dtype = parse_dtype(dtype)
    args, state, release = open_model(path, native=torch_dtype is None)
    model = Model(args, state, torch_dtype, release=release)
    model.kv_dtype = kv
    del state  # the last references to the mapped file: its cached pages can go now
    drop_file_cache(*model_files(path))
    tokenizer = load_tokenizer(path, args.eos_token_ids) if with_tokenizer else None
    return LoadedModel(model=model, tokenizer=tokenizer, path=path)
