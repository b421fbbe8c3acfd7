"""`pack`: write a model in the layout the hybrid engine loads directly.

A packed model directory holds:

* `manifest.json`: format version, the source model's hash and path, family and ModelArgs,
  weight dtype, the profile's criterion and per-layer thresholds, predictor ranks and
  thresholds, a placement summary, and each shard's size and hash;
* `gpu.safetensors`: what the placement puts on the GPU: the hot neurons' FFN rows, the
  predictors and, when the placement says so, attention and the other dense parts;
* `cpu.safetensors`: the cold neurons' rows and everything else;
* `tokenizer/`: the source model's tokenizer, so the packed model needs nothing else.

Per layer and tier: `layers.L.ffn.T.gate` (gate rows, or fc1 rows of a plain FFN),
`.up`, `.b_in` (fc1 bias), `.down_t` (the down projection transposed: one row per neuron)
and `.neurons` (tier row -> original neuron index), rows hottest first. Predictor output
rows are permuted into packed order (GPU rows, then CPU rows), see engine/hybrid.py.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import numpy as np
import torch
from tqdm import tqdm

from ..errors import BadArgumentError, UnsupportedModelError
from ..formats.packed import (ARTEFACT, SHARDS, LayerInfo, LayerPredictor, PackedManifest, PlacementSummary,
                              PredictorsSummary, ShardInfo, Source, write_manifest)
from ..loader import DTYPES, NATIVE, read_model, resolve_model_path
from ..models.base import ModelArgs
from ..ops import quant
from ..paths import check_output_dir, content_hash, staged_dir
from .stats import Profile
from .train import Predictors


def _is_ffn_key(key: str) -> bool:
    return key.startswith("layers.") and ".ffn." in key


def gpu_neuron_sets(placement: dict | None, n_layers: int, n_ff: int, model_hash: str) -> list[np.ndarray]:
    """Per layer, the original neuron indices the placement puts on the GPU (validated)."""
    if placement is None:
        return [np.zeros(0, dtype=np.int64) for _ in range(n_layers)]
    if placement.get("format") != "powerinfer-placement":
        raise BadArgumentError("the placement file is not a powerinfer placement (from `powerinfer solve`)")
    if placement.get("model_hash") not in (None, model_hash):
        raise BadArgumentError(f"the placement was solved for model {placement.get('model_hash')}, not this one "
                               f"({model_hash})")
    layers = placement.get("layers", [])
    if len(layers) != n_layers:
        raise BadArgumentError(f"the placement has {len(layers)} layers, the model {n_layers}")
    out = []
    for i, layer in enumerate(layers):
        g = np.asarray(layer.get("gpu_neurons", []), dtype=np.int64)
        if g.size and (g.min() < 0 or g.max() >= n_ff or len(np.unique(g)) != g.size):
            raise BadArgumentError(f"placement layer {i}: GPU neurons must be distinct indices in [0, {n_ff})")
        out.append(np.sort(g))
    return out


def hot_first(counts: np.ndarray, members: np.ndarray) -> np.ndarray:
    """`members` ordered by activation count, hottest first (ties by index)."""
    return members[np.argsort(-counts[members], kind="stable")]


def pack_model(model_path: str | None, out_dir: str, profile: Profile, predictors: Predictors | None = None,
               placement: dict | None = None, dtype: str = "fp32", force: bool = False,
               prepare_request: dict | None = None, predictors_hash: str | None = None) -> PackedManifest:
    """Write the packed model to `out_dir`; returns the manifest. A layer whose predictor is
    None (prepare skipped training it) is packed without one. `prepare_request` and
    `predictors_hash` record what `prepare` packed it for (its cache key).

    `dtype` native keeps the source's formats: GGUF quantized gate/up rows stay blocks
    (gathering rows keeps blocks intact) and the transposed down projection, whose blocks a
    transpose breaks, is requantized to Q8_0 (ops/quant_sparse.py)."""
    if dtype not in DTYPES and dtype != NATIVE:
        raise BadArgumentError(f"unknown dtype {dtype!r} (choose {', '.join([*DTYPES, NATIVE])})")
    check_output_dir(out_dir, force, "-o", ARTEFACT)
    if profile.criterion not in ("none", "gate", "gate_up"):  # a synthetic profile: counts for `solve` only
        raise BadArgumentError(f"{profile.path}: a {profile.criterion} profile has no thresholds measured on the "
                               "model; pack needs one from `powerinfer profile -m MODEL`")
    path = resolve_model_path(model_path)
    model_hash = content_hash(path)
    if profile.model_hash not in (None, model_hash):
        raise BadArgumentError(f"the profile is of model {profile.model_hash}, not this one ({model_hash})")
    args, state = read_model(path, native=dtype == NATIVE)
    L, n_ff = args.n_layers, args.ffn_dim
    if len(profile.layers) != L or any(s.n_ff != n_ff for s in profile.layers):
        raise BadArgumentError(f"the profile's layers do not match the model ({L} layers of {n_ff} neurons)")
    if predictors is not None:
        if predictors.manifest.get("model_hash") not in (None, model_hash):
            raise BadArgumentError("the predictors were trained for another model")
        if len(predictors.layers) != L or any(p is not None and (p.w2.shape[0] != n_ff or p.w1.shape[1] != args.d_model)
                                              for p in predictors.layers):
            raise BadArgumentError(f"the predictors do not match the model ({L} layers, d={args.d_model}, {n_ff} neurons)")
    if args.gated_ffn and any(state.get(f"layers.{i}.ffn.b_in") is not None for i in range(L)):
        raise UnsupportedModelError("gated FFNs with gate/up biases are not supported by the sparse engine")
    gpu_sets = gpu_neuron_sets(placement, L, n_ff, model_hash)
    dense_on_gpu = bool(placement.get("dense_on_gpu", False)) if placement else False
    wdtype = DTYPES.get(dtype)  # None: native, each tensor as stored

    def as_packed(t: torch.Tensor) -> torch.Tensor:
        return (t if wdtype is None or quant.is_quantized(t) else t.to(wdtype)).contiguous()

    shards: dict[str, dict[str, torch.Tensor]] = {"gpu": {}, "cpu": {}}
    dense_shard = shards["gpu" if dense_on_gpu else "cpu"]
    for key, t in state.items():
        if t is None or _is_ffn_key(key):
            continue
        if isinstance(t, quant.QuantParts):  # each part in its blocks, as KEY.partJ (engine/packed.py)
            for j, part in enumerate(t.parts):
                dense_shard[f"{key}.part{j}"] = part.contiguous()
            continue
        # matrices in the packed dtype; norms and biases (1-D) stay fp32, as the engine keeps them
        dense_shard[key] = as_packed(t) if t.dim() >= 2 else t.float().contiguous()
    layer_info = []
    for i in tqdm(range(L), desc="pack", unit="layer"):
        p = f"layers.{i}.ffn."
        w_in, w_out, b_in = state[p + "w_in"], state[p + "w_out"], state.get(p + "b_in")
        w_out_rows = quant.widen(w_out) if quant.is_quantized(w_out) else w_out  # transposed below
        if state.get(p + "b_out") is not None:
            dense_shard[p + "b_out"] = state[p + "b_out"].float().contiguous()
        counts = profile.layers[i].counts
        on_gpu = np.zeros(n_ff, dtype=bool)
        on_gpu[gpu_sets[i]] = True
        tables = {"gpu": hot_first(counts, np.flatnonzero(on_gpu)), "cpu": hot_first(counts, np.flatnonzero(~on_gpu))}
        for tier, rows in tables.items():
            r = torch.from_numpy(rows)
            sh, q = shards[tier], f"{p}{tier}."
            sh[q + "gate"] = as_packed(w_in[r])
            if args.gated_ffn:
                sh[q + "up"] = as_packed(w_in[n_ff + r])
            elif b_in is not None:
                sh[q + "b_in"] = b_in[r].float().contiguous()
            down_t = w_out_rows[:, r].t()
            if quant.is_quantized(w_out):  # requantized rows; an empty tier keeps the layout too
                sh[q + "down_t"] = (quant.quantize_q8_0(down_t) if len(r)
                                    else torch.zeros(0, down_t.shape[1] // 32, 34, dtype=torch.uint8))
            else:
                sh[q + "down_t"] = as_packed(down_t)
            sh[q + "neurons"] = r.clone()
        pr = None if predictors is None else predictors.layers[i]
        if pr is not None:
            perm = torch.from_numpy(np.concatenate([tables["gpu"], tables["cpu"]]))
            sh = shards["gpu"]
            sh[f"layers.{i}.predictor.w1"] = pr.w1.float().contiguous()
            sh[f"layers.{i}.predictor.b1"] = pr.b1.float().contiguous()
            sh[f"layers.{i}.predictor.w2"] = pr.w2.float()[perm].contiguous()
            sh[f"layers.{i}.predictor.b2"] = pr.b2.float()[perm].contiguous()
        layer_info.append(LayerInfo(i, int(len(tables["gpu"])), int(len(tables["cpu"])), float(profile.thresholds[i]),
                                    None if pr is None else LayerPredictor(
                                        pr.rank, float(pr.threshold), float(pr.recall), float(pr.precision),
                                        1.0 - float(pr.predicted_sparsity))))
    with staged_dir(out_dir, ARTEFACT) as tmp:
        return _write_packed(tmp, shards, path, args, model_hash, dtype, profile, predictors, placement, dense_on_gpu,
                             layer_info, prepare_request, predictors_hash)


def _write_packed(tmp: str, shards: dict, path: str, args: ModelArgs, model_hash: str, dtype: str, profile: Profile,
                  predictors: Predictors | None, placement: dict | None, dense_on_gpu: bool, layer_info: list,
                  prepare_request: dict | None, predictors_hash: str | None) -> PackedManifest:
    from safetensors.torch import save_file

    shard_info = {}
    for name in SHARDS:
        file = os.path.join(tmp, f"{name}.safetensors")
        save_file(shards[name], file)
        shard_info[name] = ShardInfo(f"{name}.safetensors", os.path.getsize(file),
                                     sum(t.numel() * t.element_size() for t in shards[name].values()),
                                     content_hash(file))  # loading compares it (memoised by size+mtime)
    _save_tokenizer(path, args.eos_token_ids, os.path.join(tmp, "tokenizer"))
    offload = (placement or {}).get("baselines", {}).get("offload", {})
    pl = placement or {}
    manifest = PackedManifest(
        source=Source(os.path.abspath(path), model_hash), family=args.family, args=asdict(args), dtype=dtype,
        criterion=profile.criterion, profile_hash=_profile_hash(profile),
        predictors=None if predictors is None else PredictorsSummary(
            predictors.manifest.get("param_ratio"), predictors.manifest.get("profile_hash")),
        placement=PlacementSummary(
            hardware=pl.get("hardware", {}).get("name", "none"), budget=int(pl.get("budget", {}).get("total", 0)),
            dense_on_gpu=dense_on_gpu, offload_gpu_layers=int(offload.get("gpu_layers", 0)),
            offload_head_on_gpu=bool(offload.get("head_on_gpu", False)),
            gpu_neurons=int(sum(layer.n_gpu for layer in layer_info)),
            predicted_tokens_per_s=pl.get("predicted_tokens_per_s")),
        shards=shard_info, layers=layer_info, prepare_request=prepare_request, predictors_hash=predictors_hash)
    write_manifest(tmp, manifest)
    return manifest


def _profile_hash(profile: Profile) -> str | None:
    stats = os.path.join(profile.path, "stats.safetensors") if profile.path else None
    if stats and os.path.isfile(stats):
        from .train import file_hash

        return file_hash(stats)
    return None


def _save_tokenizer(model_path: str, eos: list[int], out: str) -> None:
    from ..tokenizer import load_tokenizer

    from ..errors import PowerInferError

    try:
        tok = load_tokenizer(model_path, eos)
    except PowerInferError:  # a model without a usable tokenizer still packs (token ids only)
        tok = None
    if tok is not None:
        tok.hf.save_pretrained(out)
