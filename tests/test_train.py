"""Predictor training: planted learnable rules, adaptive sizing, the budget, file checks."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from powerinfer.offline.profile import Reservoir
from powerinfer.offline.stats import LayerStats, Profile
from powerinfer.offline.train import (PredictorError, Predictors, TrainSettings, evaluate, file_hash,
                                      train_predictors)

D, NFF, N = 32, 64, 3000


def planted(seed: int):
    """Layer 0: skewed and easy (8 hot neurons nearly always on, the rest on together when
    x0 > 1.2). Layer 1: flat and hard (neuron j on when w_j . x > 0, random w_j)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    y0 = torch.zeros(N, NFF, dtype=torch.bool)
    y0[:, :8] = torch.rand(N, 8, generator=g) < 0.97
    y0[:, 8:] = (x[:, :1] > 1.2)
    w = torch.randn(NFF, D, generator=torch.Generator().manual_seed(99))
    y1 = x @ w.t() > 0
    return x, [y0, y1]


def write_profile(path, x, masks) -> Profile:
    res = Reservoir(os.path.join(path, "samples"), N, len(masks), D, NFF, 0)
    res.plan(N)
    for i, m in enumerate(masks):
        res.write(i, x, m)
    res.flush()
    layers = [LayerStats(m.sum(0).numpy().astype(np.int64), N, 0.0) for m in masks]
    prof = Profile(layers, {"model": {"hash": "m" * 32}, "samples": {"count": N}})
    prof.save(str(path))
    return Profile.load(str(path))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = tmp_path_factory.mktemp("planted")
    x, masks = planted(0)
    prof = write_profile(path, x, masks)
    s = TrainSettings(recall=0.95, budget=1.0, r_min=2, r_max=64, epochs=40, patience=6, seed=0)
    return prof, train_predictors(prof, model_params=10**6, s=s), masks


def test_planted_rules_reach_the_recall_target_on_fresh_data(trained):
    prof, preds, _ = trained
    x, masks = planted(1)  # same rules, new inputs
    for p, y in zip(preds.layers, masks):
        assert p.recall >= 0.95  # on validation, by the choice of threshold
        m = evaluate(p.logits(x), y, p.threshold)
        assert m["recall"] >= 0.85 and m["precision"] > 1.5 * y.float().mean().item()


def test_sizing_gives_the_skewed_layer_a_smaller_predictor(trained):
    _, preds, _ = trained
    skewed, flat = preds.layers
    assert skewed.rank < flat.rank, (skewed.tried, flat.tried)


def test_budget_is_respected(trained, tmp_path):
    prof, preds, _ = trained
    model_params = 20_000
    tight = train_predictors(prof, model_params, TrainSettings(recall=0.95, budget=0.3, r_min=2, r_max=64, epochs=5))
    assert sum(p.n_params for p in tight.layers) <= 0.3 * model_params
    with pytest.raises(Exception, match="cannot fit"):
        train_predictors(prof, model_params, TrainSettings(recall=0.95, budget=0.01, r_min=2, r_max=4, epochs=2))


def test_saved_predictors_round_trip_and_refuse_mismatches(trained, tmp_path):
    prof, preds, _ = trained
    preds.save(str(tmp_path))
    profile_hash = file_hash(os.path.join(prof.path, "stats.safetensors"))
    back = Predictors.load(str(tmp_path), "m" * 32, profile_hash)
    x = torch.randn(5, D)
    for a, b in zip(preds.layers, back.layers):
        assert torch.equal(a.active(x), b.active(x)) and a.rank == b.rank
    with pytest.raises(PredictorError, match="trained for model"):
        Predictors.load(str(tmp_path), "other", profile_hash)
    with pytest.raises(PredictorError, match="another profile"):
        Predictors.load(str(tmp_path), "m" * 32, "0" * 32)
    st = tmp_path / "predictors.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    with pytest.raises(PredictorError, match="corrupt"):
        Predictors.load(str(tmp_path))
    with pytest.raises(PredictorError, match="no predictors"):
        Predictors.load(str(tmp_path / "nowhere"))


def test_cli_train_and_eval_end_to_end(tmp_path, smollm2_path):
    import json

    from cli_helpers import run_cli_here as cli
    from tiny_models import build_tokenized_llama

    model = build_tokenized_llama(tmp_path / "m", smollm2_path)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"Sample prompt number {i} about topic {i * 7 % 13} and more "
                                                  f"words to make it long enough {i}."}) for i in range(40)))
    r = cli("profile", "-m", str(model), "--dataset", str(data), "--prompts", "30", "--heldout", "6",
            "--max-tokens", "40", "--target-sparsity", "0.5", "-o", str(tmp_path / "prof"))
    assert r.returncode == 0, r.stderr
    r = cli("train", "-m", str(model), "--profile", str(tmp_path / "prof"), "--epochs", "5", "-o", str(tmp_path / "pred"))
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "pred" / "manifest.json").read_text())
    assert manifest["param_ratio"] <= 0.10 and len(manifest["layers"]) == 2
    r = cli("train", "-m", str(model), "--profile", str(tmp_path / "prof"), "--eval", str(tmp_path / "pred"),
            "--eval-prompts", "4", "--gen-tokens", "8")
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "pred" / "eval.json").read_text())
    assert set(result["perplexity"]) == {"dense", "oracle", "predicted"}
    assert result["greedy_agreement"]["dense"] == 1.0 and 0 <= result["greedy_agreement"]["predicted"] <= 1
    r = cli("train", "-m", str(model), "--profile", str(tmp_path / "prof"), "-o", str(tmp_path / "pred"))
    assert r.returncode == 2 and "--force" in r.stderr


def test_magnitude_weighting_spends_a_small_predictor_on_the_strong_activations():
    """Half the neurons fire strongly, half weakly, each half on its own input direction; a
    rank-2 predictor cannot learn both. Weighted by score it captures more activation mass
    at the same count-recall target than the plain class-weighted loss."""
    from powerinfer.offline.train import magnitude_weights, size_layer

    g = torch.Generator().manual_seed(0)
    n, d = 4000, 16
    x = torch.randn(n, d, generator=g)
    a, b = torch.randn(d, generator=g), torch.randn(d, generator=g)
    strong = (x @ a > 0.5)[:, None].expand(n, 32)
    weak = (x @ b > 0.5)[:, None].expand(n, 32)
    y = torch.cat([strong, weak], 1)
    score = torch.cat([torch.full((n, 32), 10.0), torch.full((n, 32), 0.1)], 1) * y
    s = TrainSettings(recall=0.6, recall_margin=0.0, r_min=1, r_max=1, epochs=15, patience=15, seed=0)
    x_new = torch.randn(2000, d, generator=torch.Generator().manual_seed(1))
    y_new = torch.cat([(x_new @ a > 0.5)[:, None].expand(-1, 32), (x_new @ b > 0.5)[:, None].expand(-1, 32)], 1)
    mass = torch.cat([torch.full((2000, 32), 10.0), torch.full((2000, 32), 0.1)], 1) * y_new

    def captured(p):
        pred = p.logits(x_new) > p.threshold
        return float((mass * pred).sum() / mass.sum())

    plain = size_layer(x, y, 0.5, 0.0, s)[1]
    weighted = size_layer(x, y, 0.5, 0.0, s, score=score)[1]
    assert captured(weighted) > 0.9 and captured(weighted) > captured(plain) + 0.2, (captured(weighted), captured(plain))
    w = magnitude_weights(score, y, 20.0)
    assert torch.all(w[~y] == 1) and abs(float(w[y].mean()) - 1) < 0.2 and float(w[y].max()) <= 20


def test_rare_heavy_neuron_is_made_always_on(tmp_path):
    """Neuron 0 fires at random (no input predicts it) on 5% of tokens but carries most of the
    activation mass; the others follow the input. Count recall alone would let it go, losing
    the mass; forcing makes it always-on, recall and mass recall both reach their targets,
    and the choice survives saving and loading."""
    from powerinfer.offline.train import ALWAYS_ON, size_layer

    g = torch.Generator().manual_seed(0)
    n, d, n_ff = 4000, 16, 64
    x = torch.randn(n, d, generator=g)
    w = torch.randn(n_ff, d, generator=torch.Generator().manual_seed(5))
    y = x @ w.t() > 0
    y[:, 0] = torch.rand(n, generator=g) < 0.05
    score = y.float()
    score[:, 0] *= 5000.0
    # magnitude_cap 1: training itself ignores the scores, so only the forcing can save the mass
    s = TrainSettings(recall=0.9, r_min=4, r_max=8, epochs=15, seed=0, mass_recall=0.98, max_forced=0.05,
                      magnitude_cap=1.0)
    tried = size_layer(x, y, 0.5, 0.0, s, score=score)
    p = next(iter(tried.values()))
    assert p.forced == [0] and float(p.b2[0]) == ALWAYS_ON
    assert p.mass_recall >= 0.98 and p.recall >= 0.9
    assert bool(p.active(torch.randn(50, d)).all(0)[0])
    off = size_layer(x, y, 0.5, 0.0, TrainSettings(**{**s.__dict__, "mass_recall": 0.0}), score=score)
    q = next(iter(off.values()))
    assert q.forced == [] and q.mass_recall < 0.9  # what the forcing fixed
    preds = Predictors([p], {"model_hash": "m" * 32, "profile_hash": "p"})
    preds.save(str(tmp_path / "preds"))
    back = Predictors.load(str(tmp_path / "preds")).layers[0]
    assert back.forced == [0] and back.mass_recall == p.mass_recall
