"""The typed packed manifest (formats/packed.py): written and read by one module; every
missing or mistyped field is refused in one line that names it."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from powerinfer.formats.packed import (LayerInfo, LayerPredictor, PackedManifest, PackedModelError, PlacementSummary,
                                       PredictorsSummary, ShardInfo, Source, read_manifest, write_manifest)
from powerinfer.models.base import ModelArgs, rope_inv_freq


def valid_manifest() -> PackedManifest:
    args = ModelArgs("llama", vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=24,
                     max_seq_len=64, rope_inv_freq=rope_inv_freq(8, 10000.0))
    layers = [LayerInfo(0, 8, 16, 0.1, LayerPredictor(4, 0.5, 0.95, 0.6, 0.7)), LayerInfo(1, 0, 24, 0.2, None)]
    return PackedManifest(Source("/m.gguf", "ab" * 16), "llama", asdict(args), "fp32", "gate_up",
                          PlacementSummary("rtx4090", 1 << 30, True, 1, False, 8, 12.5),
                          {"gpu": ShardInfo("gpu.safetensors", 100, 90, "h1"), "cpu": ShardInfo("cpu.safetensors", 200, 190)},
                          layers, PredictorsSummary(0.05, "p"), "ph", {"dtype": "fp32"}, "qh")


def leaves(data, prefix=""):
    """(path, key chain) of every field in the JSON document, nested objects and lists included."""
    if isinstance(data, dict):
        for k, v in data.items():
            path = f"{prefix}.{k}" if prefix else k
            yield path, (k,)
            for sub, chain in leaves(v, path):
                yield sub, (k,) + chain
    elif isinstance(data, list):
        for i, v in enumerate(data):
            for sub, chain in leaves(v, f"{prefix}[{i}]"):
                yield sub, (i,) + chain


def edited(data, chain, value=None, delete=False):
    doc = json.loads(json.dumps(data))
    node = doc
    for key in chain[:-1]:
        node = node[key]
    if delete:
        del node[chain[-1]]
    else:
        node[chain[-1]] = value
    return doc


def test_round_trip(tmp_path):
    m = valid_manifest()
    write_manifest(str(tmp_path), m)
    assert read_manifest(str(tmp_path)) == m


# fields a manifest may leave out (they have defaults) and free-form ones (checked elsewhere)
OPTIONAL = {"predictors", "profile_hash", "prepare_request", "predictors_hash", "hash", "predictor", "hardware",
            "budget", "dense_on_gpu", "offload_gpu_layers", "offload_head_on_gpu", "gpu_neurons",
            "predicted_tokens_per_s", "param_ratio"}
FREE_FORM = ("args.", "prepare_request.")


def test_every_missing_or_mistyped_field_is_refused_in_one_line(tmp_path):
    data = asdict(valid_manifest())
    checked = 0
    for path, chain in leaves(data):
        if path.startswith(FREE_FORM) or path in ("format", "format_version"):
            continue
        name = path.replace("[", ".").split(".")[-1].rstrip("]")
        value = json.loads(json.dumps(data))
        for key in chain:
            value = value[key]
        wrong = [] if isinstance(value, (dict, list)) and path.startswith(("shards", "layers")) and name.isdigit() else [
            {"x": 1} if not isinstance(value, dict) else "text"]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            wrong.append("12")
        if isinstance(value, str):
            wrong.append(12)
        if isinstance(value, bool):
            wrong.append(1)
        cases = [("missing", edited(data, chain, delete=True))] if name not in OPTIONAL and not path.startswith(
            ("shards.gpu.", "shards.cpu.")) or path in ("shards.gpu.file", "shards.cpu.bytes") else []
        cases += [(f"wrong {w!r}", edited(data, chain, w)) for w in wrong]
        for what, doc in cases:
            if isinstance(chain[-1], int):
                continue
            (tmp_path / "manifest.json").write_text(json.dumps(doc))
            with pytest.raises(PackedModelError) as e:
                read_manifest(str(tmp_path))
            msg = str(e.value)
            assert "\n" not in msg
            assert f"field {path}" in msg, (what, path, msg)
            checked += 1
    assert checked > 60


@pytest.mark.parametrize("field,value,match", [
    ("format_version", "1", 'version "1" is not'),
    ("format_version", 2, "version 2 is not"),
    ("criterion", "sometimes", "criterion must be"),
])
def test_bad_versions_and_values(tmp_path, field, value, match):
    data = asdict(valid_manifest())
    data[field] = value
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(PackedModelError, match=match):
        read_manifest(str(tmp_path))


def test_nan_and_layer_order_are_refused(tmp_path):
    data = asdict(valid_manifest())
    data["layers"][1]["threshold"] = float("nan")
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(PackedModelError, match=r"layers\[1\]\.threshold must be a finite number"):
        read_manifest(str(tmp_path))
    data = asdict(valid_manifest())
    data["layers"][1]["layer"] = 5
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(PackedModelError, match=r"layers\[1\]\.layer is 5"):
        read_manifest(str(tmp_path))


@pytest.mark.parametrize("field,value,match", [
    ("n_heads", 0, "n_heads must be a positive integer"),
    ("n_kv_heads", 3, "n_kv_heads .3. must divide"),
    ("d_model", "16", "d_model must be a positive integer"),
    ("rope_inv_freq", [1.0], "rope_inv_freq must hold"),
    ("colour", "red", "args.colour is not a model argument"),
])
def test_model_args_are_checked(field, value, match):
    args = dict(valid_manifest().args)
    args[field] = value
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_dict(args)
