"""The offline profiler: counts against brute force, calibrated thresholds, files, datasets."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_helpers import run_cli_here
import torch
from tiny_models import build_tokenized_llama

import powerinfer
from powerinfer.data import file_prompts, iter_json_array, sharegpt_prompts, split_prompts
from powerinfer.errors import BadArgumentError
from powerinfer.offline.profile import ProfileSettings, profile_model, tokenize
from powerinfer.offline.stats import LayerStats, Profile, ProfileError
from powerinfer.offline.synthetic import synthetic_profile

TEXTS = ["The quick brown fox jumps over the lazy dog near the river bank.",
         "Explain how photosynthesis works in simple terms for a child.",
         "Write a short poem about the ocean, the moon and the tides.",
         "What are the main differences between Python lists and tuples?",
         "List three ways to improve sleep quality and why they work."]



@pytest.fixture(scope="module")
def relu_model(tmp_path_factory, smollm2_path):
    return build_tokenized_llama(tmp_path_factory.mktemp("relu") / "m", smollm2_path, hidden_act="relu",
                                 num_hidden_layers=3)


def test_relu_counts_equal_brute_force(relu_model, tmp_path):
    """ReLU model: a neuron is active when relu(gate) > 0; count it with HF hooks directly."""
    from transformers import AutoModelForCausalLM

    lm = powerinfer.load(str(relu_model))
    prof = profile_model(lm, TEXTS, [], 64, ProfileSettings(target_sparsity=None, sample_tokens=10_000),
                         str(tmp_path / "p"), {"model": {"hash": "x"}})
    ref = AutoModelForCausalLM.from_pretrained(relu_model).eval()
    expected = [torch.zeros(64, dtype=torch.long) for _ in range(3)]

    def counter(i):
        def hook(module, inputs, output):  # must return None, or it would replace the output
            expected[i].add_((output[0] > 0).sum(0))
        return hook

    hooks = [layer.mlp.act_fn.register_forward_hook(counter(i)) for i, layer in enumerate(ref.model.layers)]
    n_tokens = 0
    with torch.no_grad():
        for tokens in tokenize(lm, TEXTS, 64):
            ref(tokens[None])
            n_tokens += len(tokens)
    for h in hooks:
        h.remove()
    assert prof.manifest["criterion"] == "gate" and prof.thresholds == [0.0, 0.0, 0.0]
    for i, layer in enumerate(prof.layers):
        assert layer.tokens == n_tokens
        assert np.array_equal(layer.counts, expected[i].numpy())
    # every token fits the reservoir, so the sampled masks add up to the counts exactly
    assert prof.manifest["samples"]["count"] == n_tokens
    for i in range(3):
        mask = np.unpackbits(np.load(tmp_path / "p" / "samples" / f"mask.{i}.npy"), axis=1)[:, :64]
        assert np.array_equal(mask.sum(0), prof.layers[i].counts)
        x = np.load(tmp_path / "p" / "samples" / f"x.{i}.npy")
        assert x.shape == (n_tokens, 32) and np.isfinite(x).all() and np.abs(x).sum() > 0


@pytest.mark.parametrize("target", [0.3, 0.7])
def test_calibrated_threshold_hits_target_sparsity_on_smollm2(smollm2_path, tmp_path, target):
    lm = powerinfer.load(smollm2_path)
    texts = [p.text for p in split_prompts(sharegpt_prompts(), 6, 0, seed=1)[0]]
    prof = profile_model(lm, texts, [], 48, ProfileSettings(target_sparsity=target, sample_tokens=0),
                         str(tmp_path / "p"), {"model": {"hash": "x"}})
    assert prof.manifest["criterion"] == "gate_up"
    for layer in prof.layers:
        assert abs(layer.sparsity - target) < 0.01, layer.sparsity
        assert layer.threshold > 0


def test_ppl_search_respects_the_allowed_increase(tmp_path, smollm2_path):
    path = build_tokenized_llama(tmp_path / "silu", smollm2_path)
    lm = powerinfer.load(str(path))
    prof = profile_model(lm, TEXTS[:3], TEXTS[3:], 64,
                         ProfileSettings(target_sparsity=None, max_ppl_increase=0.05, sample_tokens=0),
                         str(tmp_path / "p"), {"model": {"hash": "x"}})
    q = prof.manifest["quality"]
    assert q["sparse_ppl"] <= q["dense_ppl"] * 1.05
    assert 0 <= prof.manifest["target_sparsity"] < 0.95


def test_profile_roundtrip_layer_order_and_rejections(tmp_path):
    layers = [LayerStats(np.full(7, i, dtype=np.int64), 100 + i, 0.1 * i) for i in range(12)]
    Profile(layers, {"model": {"hash": "abc"}}).save(str(tmp_path))
    back = Profile.load(str(tmp_path), model_hash="abc")
    for i in range(12):  # layer 10 stays layer 10 (the reference sorted names as strings)
        assert back.layers[i].counts[0] == i and back.layers[i].tokens == 100 + i
        assert back.layers[i].threshold == pytest.approx(0.1 * i)
    with pytest.raises(ProfileError, match="made for model abc"):
        Profile.load(str(tmp_path), model_hash="other")
    stats = tmp_path / "stats.safetensors"
    stats.write_bytes(stats.read_bytes()[:-40])
    with pytest.raises(ProfileError, match="corrupt"):
        Profile.load(str(tmp_path))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ProfileError, match="corrupt manifest"):
        Profile.load(str(tmp_path))
    with pytest.raises(ProfileError, match="not a profile directory"):
        Profile.load(str(tmp_path / "nowhere"))


def test_metrics_on_known_counts():
    flat = LayerStats(np.full(10, 5, dtype=np.int64), 10, 0.0)
    assert flat.sparsity == pytest.approx(0.5) and flat.gini == pytest.approx(0.0)
    assert flat.coverage(0.2) == pytest.approx(0.2)
    skewed = LayerStats(np.array([100] + [0] * 9, dtype=np.int64), 100, 0.0)
    assert skewed.coverage(0.1) == 1.0 and skewed.gini == pytest.approx(0.9)


def test_json_array_decoder_never_yields_a_partial_object():
    objs = [{"id": i, "conversations": [{"from": "human", "value": f"q{i} " * i}]} for i in range(30)]
    text, ends = "[\n", []
    for i, o in enumerate(objs):
        text += ("" if i == 0 else ",\n") + json.dumps(o)
        ends.append(len(text))
    text += "\n]"
    for cut in range(0, len(text) + 1, 7):
        # exactly the objects that end before the cut, none partial
        assert list(iter_json_array(text[:cut])) == [o for o, e in zip(objs, ends) if e <= cut]


def test_sharegpt_package_loads_whole_conversations():
    prompts = sharegpt_prompts()
    assert len(prompts) > 17_000
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.text.strip() for p in prompts)
    a, b = split_prompts(prompts, 50, 20, seed=3)
    assert not {p.id for p in a} & {p.id for p in b}
    assert [p.id for p in split_prompts(prompts, 50, 20, seed=3)[0]] == [p.id for p in a]


def test_text_and_jsonl_datasets(tmp_path):
    (tmp_path / "a.txt").write_text("first paragraph\nstill first\n\nsecond one\n\n\n")
    assert [p.text for p in file_prompts(str(tmp_path / "a.txt"))] == ["first paragraph\nstill first", "second one"]
    (tmp_path / "b.jsonl").write_text('{"text": "hello"}\n\n{"prompt": "world"}\n')
    assert [p.text for p in file_prompts(str(tmp_path / "b.jsonl"))] == ["hello", "world"]
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\n{"other": 1}\n')
    with pytest.raises(BadArgumentError, match="c.jsonl:2"):
        file_prompts(str(tmp_path / "c.jsonl"))


def test_synthetic_power_law_matches_its_parameters():
    prof = synthetic_profile(4, 4096, tokens=50_000, sparsity=0.9, hot_fraction=0.2, hot_coverage=0.8, seed=1,
                             layer_jitter=0.0)
    for layer in prof.layers:
        assert layer.sparsity == pytest.approx(0.9, abs=0.005)
        assert layer.coverage(0.2) == pytest.approx(0.8, abs=0.01)
    assert not np.array_equal(np.argsort(prof.layers[0].counts), np.argsort(prof.layers[1].counts))


def test_cli_profile_report_and_no_silent_overwrite(relu_model, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    out = tmp_path / "prof"
    r = run_cli_here("profile", "-m", str(relu_model), "--dataset", str(data), "--prompts", "3", "--heldout", "2",
                "--max-tokens", "32", "--target-sparsity", "0.6", "--eval-sparsities", "0.8", "-o", str(out))
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dataset"]["n_profile"] == 3 and set(manifest["quality"]) >= {"dense_ppl", "sparse_ppl", "ppl@0.8"}
    split = json.loads((out / "split.json").read_text())
    assert len(split["profile"]) == 3 and not set(split["profile"]) & set(split["heldout"])
    r = run_cli_here("profile", "-m", str(relu_model), "--dataset", str(data), "--prompts", "3", "--heldout", "0",
                "-o", str(out))
    assert r.returncode == 2 and "--force" in r.stderr
    r = run_cli_here("profile", "--report", str(out))
    assert r.returncode == 0 and "| 2 |" in r.stdout and (out / "activation_distribution.png").stat().st_size > 1000
    r = run_cli_here("profile", "--synthetic", "--layers", "3", "--ffn", "256", "-o", str(tmp_path / "syn"))
    assert r.returncode == 0, r.stderr
    assert Profile.load(str(tmp_path / "syn")).layers[2].n_ff == 256
