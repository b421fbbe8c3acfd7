"""Pack and the hybrid engine: packed models equal the dense ones they come from (oracle,
ReLU, plain and gated FFNs), tiers split the work exactly, selective sync, and refusals."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import powerinfer
from cli_helpers import run_cli, run_cli_here
from powerinfer.data import load_prompts
from powerinfer.engine.packed import PackedModelError, load_packed, read_manifest
from powerinfer.errors import BadArgumentError
from powerinfer.offline.pack import pack_model
from powerinfer.offline.profile import ProfileSettings, instrumented, profile_model
from powerinfer.offline.stats import LayerStats, Profile
from powerinfer.offline.train import LayerPredictor, Predictors, TrainSettings, train_predictors
from powerinfer.paths import content_hash
from tiny_models import build_tiny, build_tokenized_llama

N_FF = 64
LAYERS = 3


def texts(n: int = 24) -> list[str]:
    return [p.text for p in load_prompts("sharegpt")[:n]]


def make_placement(model_hash: str, sets, offload_layers: int = 0) -> dict:
    return {"format": "powerinfer-placement", "model_hash": model_hash, "dense_on_gpu": False,
            "baselines": {"offload": {"gpu_layers": offload_layers}},
            "layers": [{"gpu_neurons": [int(i) for i in s]} for s in sets]}


def placements(model_hash: str, n_layers: int = LAYERS, n_ff: int = N_FF) -> dict[str, dict]:
    rng = np.random.default_rng(1)
    split = [rng.choice(n_ff, n_ff // 3, replace=False) for _ in range(n_layers)]
    mixed = [range(n_ff)] + [[]] * (n_layers - 2) + [split[-1]]
    return {"all_cpu": make_placement(model_hash, [[]] * n_layers),
            "all_gpu": make_placement(model_hash, [range(n_ff)] * n_layers),
            "split": make_placement(model_hash, split),
            "mixed": make_placement(model_hash, mixed)}


def build_pipeline(root, smollm2_path, act: str, target_sparsity: float | None) -> SimpleNamespace:
    path = build_tokenized_llama(root / "m", smollm2_path, hidden_act=act, num_hidden_layers=LAYERS,
                                 intermediate_size=N_FF)
    lm = powerinfer.load(str(path))
    h = content_hash(str(path))
    prof = profile_model(lm, texts(), [], 64, ProfileSettings(target_sparsity=target_sparsity, sample_tokens=4000),
                         str(root / "profile"), {"model": {"hash": h}})
    preds = train_predictors(prof, lm.model.num_parameters(),
                             TrainSettings(recall=0.95, budget=1.0, r_min=4, r_max=32, epochs=8, seed=0))
    return SimpleNamespace(path=str(path), lm=lm, hash=h, profile=prof, preds=preds, root=root)


@pytest.fixture(scope="module")
def relu(tmp_path_factory, smollm2_path):
    return build_pipeline(tmp_path_factory.mktemp("hybrid-relu"), smollm2_path, "relu", None)


@pytest.fixture(scope="module")
def silu(tmp_path_factory, smollm2_path):
    return build_pipeline(tmp_path_factory.mktemp("hybrid-silu"), smollm2_path, "silu", 0.5)


def packed(p: SimpleNamespace, name: str, placement: dict | None, predictors=True, **kw) -> str:
    out = str(p.root / f"packed-{name}")
    if not os.path.isdir(out):
        pack_model(p.path, out, p.profile, p.preds if predictors else None, placement, "fp32", **kw)
    return out


def load(path: str, tier: str = "cpu", **kw):
    """load_packed with the GPU tier on `tier`; on CUDA in fp32 (its default there is fp16),
    so that comparisons with the fp32 dense model stay tight."""
    return load_packed(path, gpu_device=tier, gpu_dtype="fp32" if tier == "cuda" else None, **kw)


def prompt_ids(lm) -> torch.Tensor:
    return torch.tensor(lm.tokenizer.encode("Hello there! Tell me about the ocean and its tides, please."))


def decode_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits after each token, fed one token at a time (the decode path)."""
    cache = model.new_cache(len(ids) + 1)
    return torch.stack([model.forward(t[None], cache) for t in ids])


@pytest.mark.parametrize("placement", ["all_cpu", "all_gpu", "split", "mixed"])
def test_relu_oracle_equals_dense_for_every_placement(relu, placement, gpu_tier):
    plm = load(packed(relu, placement, placements(relu.hash)[placement]), gpu_tier, mode="oracle")
    ids = prompt_ids(relu.lm)
    dense = relu.lm.model
    ref = dense.forward(ids, dense.new_cache(64), all_logits=True)
    out = plm.model.forward(ids, plm.model.new_cache(64), all_logits=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(decode_logits(plm.model, ids), decode_logits(dense, ids), atol=2e-5, rtol=1e-5)
    kw = dict(max_tokens=16, temperature=0)
    assert powerinfer.generate(plm, "The sea is", **kw) == powerinfer.generate(relu.lm, "The sea is", **kw)


@pytest.mark.parametrize("placement", ["all_cpu", "split"])
def test_silu_oracle_and_sparse_equal_the_instrumented_reference(silu, placement, gpu_tier):
    """Oracle = dense with neurons at or below the calibrated threshold zeroed; sparse =
    additionally only the predicted ones (what `train --eval` measures), token by token."""
    ids = prompt_ids(silu.lm)
    model, prof = silu.lm.model, silu.profile
    with instrumented(model, prof.criterion, prof.thresholds):
        ref_oracle = model.forward(ids, model.new_cache(64), all_logits=True)
        ref_oracle_decode = decode_logits(model, ids)
    with instrumented(model, prof.criterion, prof.thresholds, predictors=[p.active for p in silu.preds.layers]):
        ref_sparse = decode_logits(model, ids)
    dense = model.forward(ids, model.new_cache(64), all_logits=True)
    path = packed(silu, placement, placements(silu.hash)[placement])
    oracle = load(path, gpu_tier, mode="oracle").model
    torch.testing.assert_close(oracle.forward(ids, oracle.new_cache(64), all_logits=True), ref_oracle,
                               atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(decode_logits(oracle, ids), ref_oracle_decode, atol=2e-5, rtol=1e-5)
    sparse_lm = load(path, gpu_tier, mode="sparse", predictor_bypass=None)
    sparse = sparse_lm.model
    torch.testing.assert_close(decode_logits(sparse, ids), ref_sparse, atol=5e-5, rtol=1e-5)
    # the sparse model skips neurons, and the thresholds and predictors really change the output
    # (random weights: the predictors are barely better than chance, so they skip few)
    assert sparse_lm.ffn_stats.active_fraction < 0.98
    assert not torch.allclose(ref_oracle, dense, atol=1e-3)
    assert not torch.allclose(ref_sparse, ref_oracle_decode, atol=1e-3)
    # dense mode on the packed model is the dense model; prefill in sparse mode is dense too
    d = load(path, gpu_tier, mode="dense").model
    torch.testing.assert_close(d.forward(ids, d.new_cache(64), all_logits=True), dense, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(sparse.forward(ids, sparse.new_cache(64), all_logits=True), dense, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("mode,placement", [("sparse", "all_cpu"), ("sparse", "split"), ("dense", "all_cpu")])
def test_batched_decode_of_a_packed_model_equals_each_sequence_alone(silu, mode, placement, monkeypatch):
    """Server batches on the hybrid engine. Per-token rows: a batched step's row equals that
    sequence decoded alone (fp32 weights: exactly)."""
    from powerinfer.engine.hybrid import PredictedFFN

    monkeypatch.setattr(PredictedFFN, "batch_rows", "per_token")
    model = load(packed(silu, placement, placements(silu.hash)[placement]), mode=mode, predictor_bypass=None).model
    ids = prompt_ids(silu.lm)
    check_batch_rows(model, [ids[:9], ids[3:5], ids[5:12]], [ids[-4:], ids[:4], ids[4:8]])


def check_batch_rows(model, prompts, feeds) -> None:
    solo = []
    for p, f in zip(prompts, feeds):
        c = model.new_cache(16)
        model.forward(p, c)
        solo.append([model.forward(t[None], c) for t in f])
    caches = [model.new_cache(16) for _ in prompts]
    for p, c in zip(prompts, caches):
        model.forward(p, c)
    for step in range(len(feeds[0])):
        rows = model.decode([int(f[step]) for f in feeds], caches)
        for b in range(len(prompts)):
            assert torch.equal(rows[b], solo[b][step]), (b, step)


def test_batched_sparse_decode_on_the_union_of_predicted_rows(silu, monkeypatch):
    """The union path reads each predicted row once for the batch; sequences with the same
    input (the same predicted sets) then get exactly their solo output."""
    from powerinfer.engine.hybrid import PredictedFFN
    from powerinfer.ops import ffn_rows

    monkeypatch.setattr(PredictedFFN, "batch_rows", "union")
    batches = []
    real = ffn_rows.add_into
    monkeypatch.setattr(ffn_rows, "add_into", lambda rows, spec, x, *a: (batches.append(x.shape[0]),
                                                                          real(rows, spec, x, *a))[1])
    sparse_lm = load(packed(silu, "all_cpu", placements(silu.hash)["all_cpu"]), mode="sparse", predictor_bypass=None)
    ids = prompt_ids(silu.lm)
    check_batch_rows(sparse_lm.model, [ids[:7]] * 3, [ids[7:11]] * 3)
    assert 3 in batches  # the rows were computed once for the three sequences
    # distinct sequences: the union holds more than each one's own set
    sparse_lm.ffn_stats.reset()
    caches = [sparse_lm.model.new_cache(8) for _ in range(3)]
    for i, c in enumerate(caches):
        sparse_lm.model.forward(ids[i:i + 4], c)
    out = sparse_lm.model.decode([int(ids[5]), int(ids[9]), int(ids[2])], caches)
    assert torch.isfinite(out).all() and sparse_lm.ffn_stats.active_fraction > 0


@pytest.mark.parametrize("placement", ["all_cpu", "split"])
def test_dense_ish_layers_bypass_their_predictor(silu, placement, monkeypatch):
    """A layer whose predictor computes at least `predictor_bypass` of the neurons (on the
    training validation set) runs in sparse mode as the oracle does: every gate/up row, the
    true activations choosing the down rows, the predictor never called. Wholly on the CPU it
    runs the dense FFN kernel, which reads every down row anyway: then it is exact (dense)."""
    from powerinfer.engine.plan import PREDICTOR_BYPASS, Strategy
    from powerinfer.engine.predictor import Predictor

    ids = prompt_ids(silu.lm)
    path = packed(silu, placement, placements(silu.hash)[placement])
    fractions = [layer.predictor.predicted_fraction for layer in read_manifest(path).layers]
    assert all(0.0 < f <= 1.0 for f in fractions)
    default = load_packed(path, mode="sparse")
    assert ([l.strategy is not Strategy.PREDICTED for l in default.packed.plan.layers]
            == [f >= PREDICTOR_BYPASS for f in fractions])
    oracle_logits = decode_logits(load_packed(path, mode="oracle").model, ids)
    predicted_logits = decode_logits(load_packed(path, mode="sparse", predictor_bypass=None).model, ids)
    monkeypatch.setattr(Predictor, "active", lambda *a: pytest.fail("predictor called"))
    monkeypatch.setattr(Predictor, "active_np", lambda *a: pytest.fail("predictor called"))
    bypassed_lm = load_packed(path, mode="sparse", predictor_bypass=0.0)
    bypassed = bypassed_lm.model
    plan = bypassed_lm.packed.plan
    assert all(l.strategy is not Strategy.PREDICTED for l in plan.layers)
    exact = placement == "all_cpu"
    assert [l.strategy is Strategy.DENSE for l in plan.layers] == [exact] * len(bypassed.layers)
    assert all(l.ffn.predictor is None for l in bypassed.layers)  # no memory spent on bypassed predictors
    expected = decode_logits(silu.lm.model, ids) if exact else oracle_logits
    torch.testing.assert_close(decode_logits(bypassed, ids), expected, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(expected, predicted_logits, atol=1e-3)
    assert exact != torch.allclose(expected, oracle_logits, atol=1e-4)  # exact: the threshold is not applied
    assert bypassed_lm.ffn_stats.active_fraction == 1.0  # every gate/up row is read
    model, prof = silu.lm.model, silu.profile
    thresholds = [None] * len(prof.thresholds) if exact else prof.thresholds
    with instrumented(model, prof.criterion, thresholds):  # a few tokens: the dense kernel per token
        short_ref = model.forward(ids[:3], model.new_cache(64), all_logits=True)
    torch.testing.assert_close(bypassed.forward(ids[:3], bypassed.new_cache(64), all_logits=True), short_ref,
                               atol=2e-5, rtol=1e-5)
    assert not torch.allclose(predicted_logits, oracle_logits, atol=1e-3)


def test_all_cpu_decode_takes_the_one_call_path(silu, monkeypatch):
    """With the GPU tier empty, decode runs each FFN as one kernel call (`add_one`), not
    through the two-tier route; with a split it still goes through the tiers."""
    from powerinfer.engine.hybrid import TieredFFN

    ids = prompt_ids(silu.lm)[:6]
    calls = []
    original = TieredFFN.run_tiers
    monkeypatch.setattr(TieredFFN, "run_tiers", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    for placement, expect_tiers in (("all_cpu", False), ("split", True)):
        calls.clear()
        lm = load_packed(packed(silu, placement, placements(silu.hash)[placement]), mode="sparse", predictor_bypass=None)
        model = lm.model
        decode_logits(model, ids)
        assert bool(calls) == expect_tiers, placement
        assert lm.ffn_stats.layer_calls == len(ids) * len(model.layers)


@pytest.mark.parametrize("placement", ["all_cpu", "split"])
def test_relu7b_calibration_reaches_the_target_share(silu, placement, gpu_tier):
    """bench relu7b shifts planted predictors until the sparse model computes the target share
    of neurons; it must see the predictor on every decode route (one-call and two-tier, and
    on CUDA the device predictor)."""
    from powerinfer.bench.relu7b import calibrate_active_share

    lm = load(packed(silu, placement, placements(silu.hash)[placement]), gpu_tier, mode="sparse",
              predictor_bypass=None)
    model = lm.model
    share = calibrate_active_share(model, 0.3, n=8, max_passes=3)
    assert 0.0 < share < 1.0
    lm.ffn_stats.reset()
    decode_logits(model, prompt_ids(silu.lm))
    assert abs(lm.ffn_stats.active_fraction - 0.3) < 0.12, lm.ffn_stats.active_fraction


def test_split_computes_each_active_neuron_exactly_once(silu, gpu_tier):
    split = load(packed(silu, "split", placements(silu.hash)["split"]), gpu_tier, mode="sparse",
                 predictor_bypass=None).model
    single = load(packed(silu, "all_cpu", placements(silu.hash)["all_cpu"]), gpu_tier, mode="sparse",
                  predictor_bypass=None).model  # the same predictor device: the same active sets
    g = torch.Generator().manual_seed(0)
    for layer_s, layer_1 in zip(split.layers, single.layers):
        fs, f1 = layer_s.ffn, layer_1.ffn
        assert fs.gpu.n > 0 and fs.cpu.n > 0 and f1.gpu.n == 0
        for _ in range(5):
            x = torch.randn(1, silu.lm.args.d_model, generator=g)
            gi, ci = fs.split(fs.predictor.active(x))
            ids_split = torch.cat([fs.gpu.neurons[gi], fs.cpu.neurons[ci]])
            ids_single = f1.cpu.neurons[f1.predictor.active(x)]
            assert len(set(ids_split.tolist())) == len(ids_split)  # nothing twice
            assert set(ids_split.tolist()) == set(ids_single.tolist())  # nothing dropped
            assert len(gi) > 0 and len(ci) > 0
            c = fs.criterion
            gpu_part = fs.tier_output(fs.gpu, x, gi, c)
            cpu_part = fs.tier_output(fs.cpu, x, ci, c)
            whole = f1.tier_output(f1.cpu, x, f1.split(f1.predictor.active(x))[1], c)
            torch.testing.assert_close(gpu_part + cpu_part, whole, atol=1e-5, rtol=1e-5)


class CountingExecutor:
    """Stands in for the GPU tier's executor to count the hand-offs (and run them inline)."""

    def __init__(self):
        self.submits = 0

    def submit(self, fn, *args):
        from concurrent.futures import Future

        self.submits += 1
        f = Future()
        f.set_result(fn(*args))
        return f


def test_selective_sync_skips_the_merge_when_the_cpu_part_is_empty(relu, gpu_tier):
    ids = prompt_ids(relu.lm)
    all_gpu_lm = load(packed(relu, "all_gpu", placements(relu.hash)["all_gpu"]), gpu_tier, mode="sparse",
                      predictor_bypass=None)
    all_gpu = all_gpu_lm.model
    ex = CountingExecutor()
    for layer in all_gpu.layers:
        layer.ffn.executor = ex
    decode_logits(all_gpu, ids)
    st = all_gpu_lm.ffn_stats
    assert st.layer_calls == LAYERS * len(ids) and st.synced == 0 and st.skipped_sync == st.layer_calls
    assert ex.submits == 0 and st.active_cpu == 0 and st.gpu_share == 1.0
    split_lm = load(packed(relu, "split", placements(relu.hash)["split"]), gpu_tier, mode="sparse",
                    predictor_bypass=None)
    split, stats = split_lm.model, split_lm.ffn_stats
    ex = CountingExecutor()
    for layer in split.layers:
        layer.ffn.executor = ex
    decode_logits(split, ids)
    assert stats.synced > 0 and ex.submits == stats.synced
    assert 0 < stats.gpu_share < 1
    assert len(stats.per_token_active) == len(ids)


def test_offload_mode_puts_whole_layers_on_the_gpu_tier(relu, gpu_tier):
    pl = placements(relu.hash)["split"]
    pl["baselines"]["offload"]["gpu_layers"] = 2
    m = load(packed(relu, "split-offload", pl), gpu_tier, mode="offload").model
    assert [(l.ffn.gpu.n, l.ffn.cpu.n) for l in m.layers] == [(N_FF, 0), (N_FF, 0), (0, N_FF)]
    assert m.layers[2].ffn.cpu.dense_np is not None  # the baseline's CPU layer runs the dense FFN kernel
    assert m.lm_head.w_np is not None  # the baseline's budget did not hold the head: it stays on the CPU
    assert all(l.ffn.predictor is None for l in m.layers)  # every neuron is computed: no predictor memory
    ids = prompt_ids(relu.lm)
    torch.testing.assert_close(decode_logits(m, ids), decode_logits(relu.lm.model, ids), atol=2e-5, rtol=1e-5)
    check_batch_rows(m, [ids[:9], ids[3:5], ids[5:12]], [ids[-4:], ids[:4], ids[4:8]])  # a server batch, too


@pytest.mark.parametrize("name", ["opt", "falcon_sequential_bias", "qwen3", "gemma2", "gemma3", "phi3",
                                  "gguf:falcon_new_arch"])
def test_families_oracle_and_sparse(tmp_path, name):
    """OPT (ReLU, fc1/fc2 biases), Falcon (GELU), Qwen3 (q/k norms, gated SiLU), Gemma 2/3
    (GELU-tanh, post-norms, windows, soft-caps) and Phi-3 (fused weights), and a Falcon GGUF
    made by llama.cpp's converter: oracle at threshold 0 is dense; sparse equals the
    instrumented reference with the same (random) predictors."""
    if name.startswith("gguf:"):
        from converter import convert_tiny

        path = convert_tiny(name[5:], tmp_path)[1]
    else:
        path = build_tiny(name, tmp_path)
    lm = powerinfer.load(str(path), with_tokenizer=False)
    a = lm.args
    h = content_hash(str(path))
    g = torch.Generator().manual_seed(0)
    prof = Profile([LayerStats(np.random.default_rng(i).integers(0, 100, a.ffn_dim).astype(np.int64), 100, 0.0)
                    for i in range(a.n_layers)], {"model": {"hash": h}, "criterion": "gate"})
    prof.save(str(tmp_path / "profile"))
    prof = Profile.load(str(tmp_path / "profile"))
    layers = [LayerPredictor(torch.randn(8, a.d_model, generator=g), torch.zeros(8), torch.randn(a.ffn_dim, 8, generator=g),
                             torch.zeros(a.ffn_dim), 0.5, 1.0, 1.0, 0.5, 0.5, {}) for _ in range(a.n_layers)]
    preds = Predictors(layers, {"model_hash": h})
    rng = np.random.default_rng(0)
    pl = make_placement(h, [rng.choice(a.ffn_dim, a.ffn_dim // 2, replace=False) for _ in range(a.n_layers)])
    out = str(tmp_path / "packed")
    pack_model(str(path), out, prof, preds, pl, "fp32")
    ids = torch.arange(1, 20)
    ref = decode_logits(lm.model, ids)
    oracle = load_packed(out, mode="oracle", with_tokenizer=False).model
    torch.testing.assert_close(decode_logits(oracle, ids), ref, atol=2e-5, rtol=1e-5)
    with instrumented(lm.model, "gate", prof.thresholds, predictors=[p.active for p in layers]):
        ref_sparse = decode_logits(lm.model, ids)
    sparse_lm = load_packed(out, mode="sparse", with_tokenizer=False, predictor_bypass=None)
    sparse = sparse_lm.model
    torch.testing.assert_close(decode_logits(sparse, ids), ref_sparse, atol=5e-5, rtol=1e-5)
    assert 0.2 < sparse_lm.ffn_stats.active_fraction < 0.8
    # all on the CPU: oracle, dense and bypassed sparse re-lay the tier for the dense FFN kernel
    # (fc1 and fc2 biases included) and still equal the dense model
    out_cpu = str(tmp_path / "packed-cpu")
    pack_model(str(path), out_cpu, prof, preds, None, "fp32")
    for mode, kw in (("oracle", {}), ("dense", {}), ("sparse", {"predictor_bypass": 0.0})):
        m = load_packed(out_cpu, mode=mode, with_tokenizer=False, **kw).model
        assert all(l.ffn.cpu.dense_np is not None and l.ffn.gpu.n == 0 for l in m.layers), mode
        torch.testing.assert_close(decode_logits(m, ids), ref, atol=2e-5, rtol=1e-5)
        for prompt in (ids, ids[:3]):  # torch batches; a few tokens: the dense kernel per token
            torch.testing.assert_close(m.forward(prompt, m.new_cache(64), all_logits=True),
                                       lm.model.forward(prompt, lm.model.new_cache(64), all_logits=True),
                                       atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["oracle", "offload"])
def test_dense_parts_and_kv_cache_on_the_gpu_tier_equal_dense(relu, mode, gpu_tier):
    """A placement with dense_on_gpu puts attention and the (tied) LM head on the GPU tier
    (offload: the offloaded layers' attention and the head its baseline placed), --kv-on-gpu
    the KV cache; the GPU tier's torch
    code then serves them (here on CPU tensors) and the model still equals the dense one."""
    placement = {**placements(relu.hash)["split"], "dense_on_gpu": True,
                 "baselines": {"offload": {"gpu_layers": 2, "head_on_gpu": True}}}
    plm = load(packed(relu, "split-dense-on-gpu", placement), gpu_tier, mode=mode, kv_on_gpu=True)
    model = plm.model
    expect = [True] * LAYERS if mode == "oracle" else [True, True, False]
    assert [layer.attn.qkv.w_np is None for layer in model.layers] == expect
    assert model.lm_head.w_np is None and model.tier.kv
    cache = model.new_cache(4)
    assert all(k is None for k in cache.k_np)
    ids = prompt_ids(relu.lm)
    dense = relu.lm.model
    ref = dense.forward(ids, dense.new_cache(64), all_logits=True)
    torch.testing.assert_close(model.forward(ids, model.new_cache(64), all_logits=True), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(decode_logits(model, ids), decode_logits(dense, ids), atol=2e-5, rtol=1e-5)
    kw = dict(max_tokens=12, temperature=0)
    assert powerinfer.generate(plm, "The sea is", **kw) == powerinfer.generate(relu.lm, "The sea is", **kw)
    # without --kv-on-gpu the cache stays in CPU memory (and the CPU attention kernel serves it)
    cpu_kv = load(packed(relu, "split-dense-on-gpu", placement), gpu_tier, mode=mode).model
    assert all(k is not None for k in cpu_kv.new_cache(4).k_np)
    torch.testing.assert_close(decode_logits(cpu_kv, ids), decode_logits(dense, ids), atol=2e-5, rtol=1e-5)


def test_kv_cache_on_a_half_tier_is_fp16_as_budgeted(relu):
    """--kv-on-gpu with a half GPU tier (CUDA's default; here bf16 on CPU tensors): the tier's
    cache is fp16, as the placement solver counts it (offline/solve.py), and the model stays
    close to dense; the CPU caches follow --kv-dtype."""
    placement = {**placements(relu.hash)["split"], "dense_on_gpu": True}
    path = packed(relu, "split-dense-on-gpu-half", placement)
    model = load_packed(path, mode="oracle", gpu_device="cpu", gpu_dtype="bf16", kv_on_gpu=True).model
    cache = model.new_cache(8)
    assert all(k.dtype == torch.float16 for k in cache.k + cache.v)
    ids = prompt_ids(relu.lm)
    dense = relu.lm.model
    torch.testing.assert_close(decode_logits(model, ids), decode_logits(dense, ids), atol=0.05, rtol=0.05)
    cpu_kv = load_packed(path, mode="oracle", gpu_device="cpu", kv_dtype="fp16").model.new_cache(8)
    assert all(k.dtype == torch.float16 for k in cpu_kv.k) and all(k is not None for k in cpu_kv.k_np)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("mode", ["oracle", "sparse", "offload"])
def test_cuda_tier_in_its_default_half_dtype_runs_close_to_dense(relu, mode):
    """On CUDA the GPU tier of an fp32 packed model holds fp16 weights (and attention and the
    LM head with dense_on_gpu, and the KV cache): logits stay close to the fp32 dense model's."""
    placement = {**placements(relu.hash)["split"], "dense_on_gpu": True,
                 "baselines": {"offload": {"gpu_layers": 2, "head_on_gpu": True}}}
    model = load_packed(packed(relu, "split-dense-on-gpu", placement), mode=mode, gpu_device="cuda", kv_on_gpu=True).model
    assert model.layers[0].ffn.gpu.w_gate.dtype == torch.float16 and model.layers[0].ffn.gpu.device.type == "cuda"
    ids = prompt_ids(relu.lm)
    ref = decode_logits(relu.lm.model, ids)
    out = decode_logits(model, ids)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() < 0.05 * ref.abs().max() + 1e-3
    if mode != "sparse":  # every neuron computed: the same next tokens nearly everywhere
        assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_bf16_packed_model_runs_close_to_fp32(relu):
    path = packed(relu, "all_cpu", placements(relu.hash)["all_cpu"])
    ids = prompt_ids(relu.lm)
    ref = decode_logits(load_packed(path, mode="sparse", predictor_bypass=None).model, ids)
    half = decode_logits(load_packed(path, mode="sparse", dtype="bf16", predictor_bypass=None).model, ids)
    assert (half.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
    assert torch.allclose(half, ref, atol=0.5)


def test_corrupt_and_mismatched_packed_models_are_refused(relu, tmp_path):
    src = packed(relu, "split", placements(relu.hash)["split"])
    bad = str(tmp_path / "bad")

    def fresh() -> str:
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(src, bad)
        return bad

    with pytest.raises(PackedModelError, match="not this one"):
        load_packed(src, model_hash="0" * 32)
    with open(os.path.join(fresh(), "cpu.safetensors"), "r+b") as f:
        f.truncate(1000)
    with pytest.raises(PackedModelError, match="truncated"):
        load_packed(bad)
    p = os.path.join(fresh(), "gpu.safetensors")
    data = bytearray(open(p, "rb").read())
    data[-10] ^= 0xFF
    open(p, "wb").write(bytes(data))
    with pytest.raises(PackedModelError, match="corrupt"):
        load_packed(bad)
    open(os.path.join(fresh(), "manifest.json"), "w").write("{not json")
    with pytest.raises(PackedModelError, match="corrupt manifest"):
        load_packed(bad)
    with pytest.raises(PackedModelError, match="not a packed model"):
        load_packed(str(tmp_path))
    m = json.load(open(os.path.join(fresh(), "manifest.json")))
    m["args"]["d_model"] = 48
    json.dump(m, open(os.path.join(bad, "manifest.json"), "w"))
    with pytest.raises(PackedModelError, match="shape"):
        load_packed(bad)
    no_preds = packed(relu, "no-preds", None, predictors=False)
    with pytest.raises(BadArgumentError, match="without predictors"):
        load_packed(no_preds, mode="sparse", predictor_bypass=None)
    load_packed(no_preds, mode="oracle")  # fine without predictors


def test_pack_refuses_mismatched_inputs_and_never_overwrites(relu, tmp_path):
    other = make_placement("f" * 32, [[]] * LAYERS)
    with pytest.raises(BadArgumentError, match="solved for model"):
        pack_model(relu.path, str(tmp_path / "a"), relu.profile, relu.preds, other)
    with pytest.raises(BadArgumentError, match="layers"):
        pack_model(relu.path, str(tmp_path / "a"), relu.profile, relu.preds, make_placement(relu.hash, [[]] * 2))
    with pytest.raises(BadArgumentError, match="distinct"):
        pack_model(relu.path, str(tmp_path / "a"), relu.profile, relu.preds, make_placement(relu.hash, [[0, 0]] * 3))
    short = Predictors(relu.preds.layers[:2], {"model_hash": relu.hash})
    with pytest.raises(BadArgumentError, match="predictors do not match"):
        pack_model(relu.path, str(tmp_path / "a"), relu.profile, short)
    existing = packed(relu, "all_cpu", placements(relu.hash)["all_cpu"])
    before = os.path.getmtime(os.path.join(existing, "cpu.safetensors"))
    with pytest.raises(BadArgumentError, match="--force"):
        pack_model(relu.path, existing, relu.profile, relu.preds)
    assert os.path.getmtime(os.path.join(existing, "cpu.safetensors")) == before


def test_budgets_the_machine_cannot_hold_are_refused(relu, monkeypatch):
    import powerinfer.engine.packed as pk

    monkeypatch.setattr(pk, "available_ram", lambda: 1000)
    with pytest.raises(BadArgumentError, match="GiB are available"):
        load_packed(packed(relu, "all_cpu", placements(relu.hash)["all_cpu"]))
    r = run_cli("prepare", "-m", relu.path, "--hardware", "rtx4090", "--vram-budget", "30GiB")
    assert r.returncode == 2 and "is not within" in r.stderr and "Traceback" not in r.stderr


def test_cli_pack_generate_stats_and_prepare_cache(relu, tmp_path, monkeypatch):
    pl = tmp_path / "placement.json"
    pl.write_text(json.dumps(placements(relu.hash)["split"]))
    out = tmp_path / "cli-packed"
    r = run_cli_here("pack", "-m", relu.path, "--profile", relu.profile.path, "--predictors", "none", "--placement", str(pl),
                "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "GPU-tier neurons" in r.stdout
    r = run_cli_here("generate", "-m", relu.path, "--packed", str(out), "--mode", "oracle", "-p", "Hi", "-n", "4",
                "--temperature", "0", "--stats")
    assert r.returncode == 0, r.stderr
    assert "engine: oracle, GPU tier on cpu" in r.stdout and "GPU share of neuron load" in r.stdout
    r = run_cli_here("generate", "-m", relu.path, "--packed", str(out), "--mode", "oracle", "-p", "Hi", "-n", "4",
                "--temperature", "0", "--stats", "--kv-on-gpu")
    assert r.returncode == 0, r.stderr
    assert "(with KV cache)" in r.stdout
    # refusals (--kv-on-gpu without the packed engine, an unprepared sparse mode, a missing
    # packed model): tests/test_bad_input_corpus.py, in process
    # prepare: the whole pipeline, then a second run that reuses everything
    r = run_cli_here("prepare", "-m", relu.path, "--prompts", "8", "--heldout", "2", "--max-tokens", "32",
                "--target-sparsity", "0.3", "--predictors", "all")
    assert r.returncode == 0, r.stderr
    assert "prepared:" in r.stdout and "no GPU" in r.stderr
    r = run_cli_here("prepare", "-m", relu.path, "--prompts", "8", "--heldout", "2", "--max-tokens", "32",
                "--target-sparsity", "0.3", "--predictors", "all")
    assert r.returncode == 0 and "up to date" in r.stderr and "profiling" not in r.stderr
    # predictors replaced in the cache since (as `powerinfer train` does): prepare repacks with them
    from powerinfer.offline.train import Predictors
    from powerinfer.paths import model_cache_dir

    pdir = str(model_cache_dir(relu.hash) / "predictors")
    preds = Predictors.load(pdir)
    preds.layers[0].threshold += 0.25
    preds.save(pdir)
    r = run_cli_here("prepare", "-m", relu.path, "--prompts", "8", "--heldout", "2", "--max-tokens", "32",
                "--target-sparsity", "0.3", "--predictors", "all")
    assert r.returncode == 0 and "up to date" not in r.stderr and "reusing the predictors" in r.stderr
    from powerinfer.formats.packed import read_check
    from powerinfer.offline.prepare import default_packed_dir

    repacked = read_manifest(default_packed_dir(relu.hash))
    assert repacked.layers[0].predictor.threshold == pytest.approx(preds.layers[0].threshold)
    check = read_check(default_packed_dir(relu.hash))
    assert check.auto_mode in ("sparse", "dense")
    # measured, or nothing to measure: every layer computes the dense FFN (said so in the note)
    assert set(check.tokens_per_s) == {"dense", "sparse"} or (
        check.auto_mode == "dense" and "computes the dense model" in check.note and not check.tokens_per_s)
    r = run_cli_here("generate", "-m", relu.path, "-p", "Hi", "-n", "4", "--temperature", "0", "--stats")
    assert r.returncode == 0, r.stderr
    assert f"engine: {check.auto_mode}" in r.stdout  # what prepare measured to be better
    if check.auto_mode == "dense":
        assert "using dense" in r.stderr
    r = run_cli_here("generate", "-m", relu.path, "-p", "Hi", "-n", "4", "--temperature", "0", "--stats", "--mode", "sparse")
    assert r.returncode == 0 and "engine: sparse" in r.stdout
    r = run_cli_here("generate", "-m", relu.path, "-p", "Hi", "-n", "4", "--temperature", "0", "--stats", "--mode", "dense")
    assert r.returncode == 0 and "engine: dense" in r.stdout


# the serial small path, the parallel one, and the parallel one with a rank padded to 48 and
# a last chunk of neurons cut short
@pytest.mark.parametrize("rank,n_ff", [(8, 96), (64, 4096), (37, 5000)])
def test_predictor_active_set_equals_torch(rank, n_ff):
    from powerinfer.engine.predictor import SMALL_PREDICTOR, Predictor

    g = torch.Generator().manual_seed(rank)
    d = 48
    w1, b1 = torch.randn(rank, d, generator=g), torch.randn(rank, generator=g)
    w2, b2 = torch.randn(n_ff, rank, generator=g), torch.randn(n_ff, generator=g)
    p = Predictor(w1, b1, w2, b2, threshold=0.5)
    assert p._small == (w1.numel() + w2.numel() <= SMALL_PREDICTOR)
    for _ in range(3):
        x = torch.randn(1, d, generator=g)
        logits = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1, b1)), w2, b2)[0]
        expected = torch.nonzero(logits > 0.5).flatten()
        got = p.active(x)
        near = (logits - 0.5).abs() < 1e-4  # float rounding may flip these, nothing else
        assert set(got.tolist()) ^ set(expected.tolist()) <= set(torch.nonzero(near).flatten().tolist())
        assert torch.equal(got, torch.sort(got).values) and 0 < len(got) < n_ff


def test_huge_page_copies_are_equal_contiguous_and_skip_small_tensors():
    from powerinfer.ops.memory import HUGE_PAGE, on_huge_pages

    big = torch.randn(2048, 4096)
    h = on_huge_pages(big)
    assert torch.equal(h, big) and h.is_contiguous() and h.dtype == big.dtype
    assert h.data_ptr() != big.data_ptr() and h.data_ptr() % HUGE_PAGE == 0
    small = torch.randn(16, 16)
    assert on_huge_pages(small) is small


def test_outputs_never_destroy_what_we_did_not_write(relu, tmp_path):
    """pack into a folder holding the user's files is refused, --force or not, and the files
    stay; an empty folder is used; our own packed model is replaced only with --force."""
    from powerinfer.paths import check_output_dir

    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    (mine / "sub" / "mine.txt").write_text("me too")
    for force in (False, True):
        with pytest.raises(BadArgumentError, match="other files in it"):
            pack_model(relu.path, str(mine), relu.profile, relu.preds, force=force)
        r = run_cli("pack", "-m", relu.path, "--profile", relu.profile.path, "--predictors", "none", "-o", str(mine),
                    *(["--force"] if force else []))
        assert r.returncode == 2 and "other files in it" in r.stderr and "Traceback" not in r.stderr
    assert (mine / "notes.txt").read_text() == "keep me" and (mine / "sub" / "mine.txt").read_text() == "me too"
    empty = tmp_path / "empty"
    empty.mkdir()
    pack_model(relu.path, str(empty), relu.profile, None)
    assert read_manifest(str(empty)).layers
    with pytest.raises(BadArgumentError, match="already holds a packed model"):
        pack_model(relu.path, str(empty), relu.profile, None)
    pack_model(relu.path, str(empty), relu.profile, None, force=True)
    (empty / "notes.txt").write_text("mine, in the packed model's folder")
    with pytest.raises(BadArgumentError, match="and other files .notes.txt"):  # --force replaces only ours
        pack_model(relu.path, str(empty), relu.profile, None, force=True)
    assert (empty / "notes.txt").read_text().startswith("mine") and read_manifest(str(empty)).layers
    (tmp_path / "file").write_text("x")
    from powerinfer.offline.stats import ARTEFACT as PROFILE
    from powerinfer.offline.train import ARTEFACT as PREDICTORS

    for artefact in (PROFILE, PREDICTORS):
        with pytest.raises(BadArgumentError, match="is a file"):
            check_output_dir(str(tmp_path / "file"), True, "-o", artefact)
        with pytest.raises(BadArgumentError, match="other files in it"):
            check_output_dir(str(mine), True, "-o", artefact)
        check_output_dir(str(tmp_path / "new"), False, "-o", artefact)


def test_a_failed_write_leaves_the_old_artefact_and_no_debris(relu, tmp_path, monkeypatch):
    """Outputs are written into a temporary folder beside the target and renamed into place:
    a pack that fails half-way leaves the previous packed model as it was, and nothing else."""
    import safetensors.torch

    out = tmp_path / "packed"
    pack_model(relu.path, str(out), relu.profile, None)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    calls = []

    def failing_save(tensors, file, *a, **k):
        calls.append(file)
        if len(calls) == 2:  # the second shard: the first is already on disk
            raise OSError("disk full (simulated)")
        return real_save(tensors, file, *a, **k)

    real_save = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    with pytest.raises(OSError, match="simulated"):
        pack_model(relu.path, str(out), relu.profile, None, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packed"]  # no temporary folder left behind


def test_a_cpu_predictor_holds_one_copy_of_w2():
    """W2 is kept transposed for the kernels and W2 itself is a view of that copy: equal to
    what was given, no second copy, and the torch route computes the same logits."""
    from powerinfer.engine.predictor import Predictor

    g = torch.Generator().manual_seed(5)
    w1, b1, w2, b2 = (torch.randn(*s, generator=g) for s in ((37, 64), (37,), (500, 37), (500,)))
    p = Predictor(w1, b1, w2, b2, 0.0)
    assert torch.equal(p.w2, w2)
    assert p.w2.untyped_storage().data_ptr() == torch.from_numpy(p._w2t).untyped_storage().data_ptr()
    x = torch.randn(1, 64, generator=g)
    want = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1, b1)), w2, b2)
    torch.testing.assert_close(p._device_logits(x), want, rtol=1e-5, atol=1e-4)
