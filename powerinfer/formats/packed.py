"""The packed model's manifest: typed records, one reader and one writer.

`offline/pack.py` writes it and `engine/packed.py` reads it, both through this module, so
the two cannot drift. Every field is checked on read against its declared type; a missing
or mistyped field is refused in one line that names it (`layers[3].predictor.threshold`).
The measured sparse-vs-dense check that `prepare` makes after packing lives beside it in
`check.json` (`SparseCheck`), so the manifest is written once, by `pack`.
"""

from __future__ import annotations

import json
import math
import os
import types
import typing
from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass
from typing import Any, TypeVar

from ..errors import PowerInferError
from ..paths import Artefact, write_json

FORMAT = "powerinfer-packed"
FORMAT_VERSION = 1
# Bumped when packing writes something new into a still-loadable format, so that `prepare`
# repacks its cached model (3: predictors are optional per layer).
PACK_REVISION = 3
SHARDS = ("gpu", "cpu")
MANIFEST = "manifest.json"
CHECK = "check.json"
# what a packed model's folder may hold (prepare adds check.json)
ARTEFACT = Artefact(FORMAT, "packed model", frozenset({MANIFEST, CHECK, "gpu.safetensors", "cpu.safetensors",
                                                       "tokenizer"}))
MODES = ("sparse", "oracle", "dense", "offload")


class PackedModelError(PowerInferError):
    """A packed model directory is missing, corrupt, or made for another model."""


@dataclass
class Source:
    path: str
    hash: str


@dataclass
class ShardInfo:
    file: str
    bytes: int
    tensor_bytes: int
    hash: str | None = None


@dataclass
class LayerPredictor:
    """A layer's trained predictor: its rank, logit threshold, validation recall and
    precision, and the share of neurons it asks for on the validation set."""

    rank: int
    threshold: float
    recall: float
    precision: float
    predicted_fraction: float


@dataclass
class LayerInfo:
    layer: int
    n_gpu: int
    n_cpu: int
    threshold: float  # the profile's activation threshold (criterion score)
    predictor: LayerPredictor | None = None  # None: not trained (could not pay, see offline/worth.py)


@dataclass
class PlacementSummary:
    hardware: str = "none"
    budget: int = 0
    dense_on_gpu: bool = False
    offload_gpu_layers: int = 0
    offload_head_on_gpu: bool = False
    gpu_neurons: int = 0
    predicted_tokens_per_s: float | None = None


@dataclass
class PredictorsSummary:
    param_ratio: float | None = None
    profile_hash: str | None = None


@dataclass
class PackedManifest:
    """Everything the engine needs to know about a packed model besides its tensors."""

    source: Source
    family: str
    args: dict[str, Any]  # ModelArgs as a dict; checked by models.base.ModelArgs.from_manifest
    dtype: str
    criterion: str
    placement: PlacementSummary
    shards: dict[str, ShardInfo]
    layers: list[LayerInfo]
    predictors: PredictorsSummary | None = None
    profile_hash: str | None = None
    prepare_request: dict[str, Any] | None = None  # what `prepare` asked for (its cache key)
    predictors_hash: str | None = None
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def has_predictors(self) -> bool:
        return any(layer.predictor is not None for layer in self.layers)


@dataclass
class SparseCheck:
    """What `prepare` measured for `--mode auto`: decode tok/s and held-out perplexity of
    the sparse and the dense engine here, and the choice made from them."""

    tokens_per_s: dict[str, float]
    perplexity: dict[str, float]
    auto_mode: str
    quality_slack: float
    min_speedup: float
    note: str = ""  # said to the user when auto picks dense (e.g. every layer computes the dense FFN)


T = TypeVar("T")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str, error: type[PowerInferError]) -> Any:
    """`value` checked against type `tp` (nested dataclasses built); error names `where`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        last: PowerInferError | None = None
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, where, error)
            except PowerInferError as e:
                last = e
        assert last is not None
        raise last
    if tp is Any:
        return value
    if is_dataclass(tp):
        if not isinstance(value, dict):
            raise error(f"field {where} must be an object, got {json.dumps(value)[:40]}")
        return _build(tp, value, where, error)
    if origin is list:
        if not isinstance(value, list):
            raise error(f"field {where} must be a list, got {json.dumps(value)[:40]}")
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{where}[{i}]", error) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise error(f"field {where} must be an object, got {json.dumps(value)[:40]}")
        _, item = typing.get_args(tp)
        return {k: _convert(v, item, f"{where}.{k}", error) for k, v in value.items()}
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          str: lambda v: isinstance(v, str)}[tp]
    if not ok(value):
        raise error(f"field {where} must be {'a finite number' if tp is float else 'a ' + _type_name(tp)}, "
                    f"got {json.dumps(value)[:40]}")
    return float(value) if tp is float else value


def _build(cls: type[T], data: dict, where: str, error: type[PowerInferError]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        name = f"{where}.{f.name}" if where else f.name
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise error(f"field {name} is missing")
            continue
        kwargs[f.name] = _convert(data[f.name], hints[f.name], name, error)
    return cls(**kwargs)


def from_dict(cls: type[T], data: Any, error: type[PowerInferError] = PackedModelError) -> T:
    """A `cls` record from JSON data, every field type-checked (usable for other manifests)."""
    return _convert(data, cls, cls.__name__, error)


def _read_json(path: str, missing: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise PackedModelError(missing) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PackedModelError(f"{path}: corrupt manifest ({e})") from None


def read_manifest(directory: str) -> PackedManifest:
    """The packed model's manifest at `directory`, validated; PackedModelError otherwise."""
    if not os.path.isdir(directory):
        raise PackedModelError(f"{directory}: no such packed model directory; run `powerinfer prepare` or `pack`")
    path = os.path.join(directory, MANIFEST)
    data = _read_json(path, f"{directory}: not a packed model (no {MANIFEST})")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PackedModelError(f"{path}: not a powerinfer packed-model manifest")
    if data.get("format_version") != FORMAT_VERSION:
        raise PackedModelError(f"{path}: packed format version {json.dumps(data.get('format_version'))} is not "
                               f"the version this program reads ({FORMAT_VERSION}); pack the model again")

    class _Error(PackedModelError):
        def __init__(self, message: str):
            super().__init__(f"{path}: {message}")

    manifest = _build(PackedManifest, data, "", _Error)
    _check_consistency(manifest, path)
    return manifest


def _check_consistency(m: PackedManifest, path: str) -> None:
    for name in SHARDS:
        if name not in m.shards:
            raise PackedModelError(f"{path}: field shards.{name} is missing")
    for i, layer in enumerate(m.layers):
        if layer.layer != i:
            raise PackedModelError(f"{path}: field layers[{i}].layer is {layer.layer}, expected {i}")
        if layer.n_gpu < 0 or layer.n_cpu < 0:
            raise PackedModelError(f"{path}: field layers[{i}] has a negative neuron count")
    if m.criterion not in ("none", "gate", "gate_up"):
        raise PackedModelError(f"{path}: field criterion must be none, gate or gate_up, got {m.criterion!r}")
    if m.dtype not in ("fp32", "bf16", "fp16", "native"):
        raise PackedModelError(f"{path}: field dtype must be fp32, bf16, fp16 or native, got {m.dtype!r}")
    if len(m.layers) != m.args.get("n_layers"):
        raise PackedModelError(f"{path}: field layers lists {len(m.layers)} layers, args.n_layers says "
                               f"{m.args.get('n_layers')}")


def write_manifest(directory: str, manifest: PackedManifest) -> None:
    write_json(os.path.join(directory, MANIFEST), asdict(manifest))


def read_check(directory: str) -> SparseCheck | None:
    """`prepare`'s measured check beside the manifest; None when there is none (or it is
    unreadable: it is remade by the next `prepare`)."""
    path = os.path.join(directory, CHECK)
    if not os.path.isfile(path):
        return None
    try:
        return from_dict(SparseCheck, _read_json(path, ""))
    except PackedModelError:
        return None


def write_check(directory: str, check: SparseCheck) -> None:
    tmp = os.path.join(directory, CHECK + ".tmp")
    with open(tmp, "w") as f:
        json.dump(asdict(check), f, indent=1)
    os.replace(tmp, os.path.join(directory, CHECK))


__all__ = ["FORMAT", "FORMAT_VERSION", "PACK_REVISION", "SHARDS", "MODES", "PackedModelError", "Source",
           "ShardInfo", "LayerPredictor", "LayerInfo", "PlacementSummary", "PredictorsSummary", "PackedManifest",
           "SparseCheck", "read_manifest", "write_manifest", "read_check", "write_check", "from_dict"]
