"""The placement ILP: exact on brute-forceable instances, bounded by greedy and the LP, never
over budget, bytes that match real tensors, layers in integer order, clear refusals."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from cli_helpers import run_cli_here
import torch

from powerinfer.errors import BadArgumentError
from powerinfer.hardware import BUILTIN, ModelShape, shape_of_args
from powerinfer.offline.solve import brute_force, build_problem, gpu_bytes, greedy, placement_document, solve
from powerinfer.offline.stats import LayerStats, Profile
from powerinfer.offline.synthetic import synthetic_profile

TINY = ModelShape("tiny", n_layers=3, d_model=64, n_ff=12, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=100)
# a "GPU" slow enough that tiny shapes are not all overhead, with real-looking ratios
HW = replace(BUILTIN["rtx4090"], gpu_memory=2**30, gpu_layer_overhead=2e-9, cpu_layer_overhead=1e-9,
             sync_overhead=3e-9, pcie_latency=1e-9, gpu_bandwidth=50e9, cpu_bandwidth=5e9)


def random_profile(seed: int, shape: ModelShape = TINY) -> Profile:
    rng = np.random.default_rng(seed)
    layers = [LayerStats(rng.integers(0, 1000, shape.n_ff) * rng.integers(0, 2, shape.n_ff), 1000, 0.0)
              for _ in range(shape.n_layers)]
    return Profile(layers, {})


def problem_for(profile, budget_neurons: int, shape=TINY, group_size=3, dense_on_gpu=True):
    base = build_problem(profile, shape, HW, 2**29, "fp16", group_size=group_size, context=16, predictor_rank=4,
                         dense_on_gpu=dense_on_gpu)
    mandatory = sum(base.mandatory.values())
    return build_problem(profile, shape, HW, mandatory + budget_neurons * base.neuron_bytes, "fp16",
                         group_size=group_size, context=16, predictor_rank=4, dense_on_gpu=dense_on_gpu)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("objective,dense_on_gpu", [("time", True), ("time", False), ("impact", True)])
def test_ilp_equals_brute_force_optimum(seed, objective, dense_on_gpu):
    budget = [0, 3, 7, 13, 20, 36][seed]
    problem = problem_for(random_profile(seed), budget, dense_on_gpu=dense_on_gpu)
    placement = solve(problem, objective)
    assert placement.objective == pytest.approx(brute_force(problem, objective), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("seed", range(8))
def test_greedy_ilp_lp_ordering_and_budget(seed):
    shape = ModelShape("mid", n_layers=6, d_model=256, n_ff=512, n_heads=4, n_kv_heads=4, head_dim=64,
                       vocab_size=1000)
    prof = synthetic_profile(6, 512, tokens=5000, seed=seed)
    problem = problem_for(prof, int(np.random.default_rng(seed).integers(100, 3000)), shape, group_size=32)
    ilp_t, ilp_i, gr = solve(problem, "time"), solve(problem, "impact"), greedy(problem)
    # time is minimised: LP bound <= ILP <= greedy's time
    assert ilp_t.lp_bound <= ilp_t.objective * (1 + 1e-9)
    assert ilp_t.predicted_time <= gr.predicted_time * (1 + 1e-3)
    assert ilp_t.objective == pytest.approx(ilp_t.predicted_time, rel=1e-9)
    # impact is maximised: greedy <= ILP <= LP bound
    assert gr.objective <= ilp_i.objective * (1 + 1e-3) and ilp_i.objective <= ilp_i.lp_bound * (1 + 1e-9)
    for p in (ilp_t, ilp_i, gr):
        assert gpu_bytes(problem, p) <= problem.budget
        for l, gpu in enumerate(p.gpu_neurons):
            assert len(set(gpu.tolist())) == len(gpu) and (np.diff(gpu) > 0).all() and gpu.max(initial=0) < 512


def test_bytes_match_real_tensors(tmp_path):
    from tiny_models import build_tiny

    from powerinfer.loader import load

    path = build_tiny("llama", tmp_path)
    model = load(str(path), dtype="fp16", with_tokenizer=False).model
    shape = shape_of_args(model.args)
    layer = model.layers[0]
    neuron = (layer.ffn.w_in.weight.nbytes + layer.ffn.w_out.weight.nbytes) // model.args.ffn_dim
    assert shape.neuron_bytes("fp16") == neuron
    attn = layer.attn.qkv.weight.nbytes + layer.attn.o.weight.nbytes + layer.attn_norm.weight.nbytes
    attn += layer.ffn_norm.weight.nbytes
    assert shape.attention_bytes("fp16") == attn
    assert shape.lm_head_bytes("fp16") == model.lm_head.weight.nbytes
    cache = model.new_cache(100)
    assert shape.kv_bytes(100, "fp32") == cache.nbytes()
    prof = synthetic_profile(shape.n_layers, shape.n_ff, seed=0)
    problem = problem_for(prof, 100, shape, group_size=8)
    p = solve(problem)
    assert gpu_bytes(problem, p) == sum(problem.mandatory.values()) + neuron * sum(len(g) for g in p.gpu_neurons)


def test_layers_stay_in_integer_order():
    shape = replace(TINY, n_layers=12, n_ff=16)
    layers = [LayerStats(np.zeros(16, dtype=np.int64), 100, 0.0) for _ in range(12)]
    layers[10] = LayerStats(np.full(16, 100, dtype=np.int64), 100, 0.0)  # only layer 10 is ever active
    problem = problem_for(Profile(layers, {}), 8, shape, group_size=4)
    placement = solve(problem, "impact")
    doc = placement_document(problem, placement, {}, {}, None, None)
    assert [l["layer"] for l in doc["layers"]] == list(range(12))
    assert [l["n_gpu"] > 0 for l in doc["layers"]] == [i == 10 for i in range(12)]


def test_impossible_budgets_and_mismatches_are_refused():
    prof = synthetic_profile(TINY.n_layers, TINY.n_ff, seed=0)
    for budget, msg in [(0, "positive"), (-5, "positive"), (1000, "smaller than the parts"),
                        (2**40, "exceeds the GPU")]:
        with pytest.raises(BadArgumentError, match=msg):
            build_problem(prof, TINY, HW, budget)
    with pytest.raises(BadArgumentError, match="neurons"):
        build_problem(synthetic_profile(3, 20, seed=0), TINY, HW, 2**29)
    with pytest.raises(BadArgumentError, match="layers"):
        build_problem(synthetic_profile(2, 12, seed=0), TINY, HW, 2**29)
    with pytest.raises(BadArgumentError, match="no GPU"):
        build_problem(prof, TINY, BUILTIN["cpu"], 2**29)



def test_cli_solve_writes_placement_and_refuses_bad_input(tmp_path):
    r = run_cli_here("profile", "--synthetic", "--layers", "32", "--ffn", "11008", "-o", str(tmp_path / "syn"))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "place.json"
    r = run_cli_here("solve", "--profile", str(tmp_path / "syn"), "--shape", "llama-7b", "--hardware", "rtx2080ti",
                "--vram-budget", "6GiB", "--explain", "-o", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["budget"]["total"] == 6 * 2**30 and doc["budget"]["free"] >= 0
    assert len(doc["layers"]) == 32 and "| 31 |" in r.stdout
    assert doc["predicted_tokens_per_s"] >= doc["baselines"]["greedy"]["tokens_per_s"] * 0.999
    # the offload baseline: whole layers after the LM head (llama-7b fp16 head: 262 MB of 6 GiB)
    off = doc["baselines"]["offload"]
    assert off["head_on_gpu"] is True and 0 < off["gpu_layers"] < 32
    for budget, msg in [("-1GiB", "negative"), ("0", "positive"), ("1MiB", "smaller than"), ("64GiB", "exceeds"),
                        ("lots", "cannot read size")]:
        r = run_cli_here("solve", "--profile", str(tmp_path / "syn"), "--shape", "llama-7b", "--hardware", "rtx2080ti",
                    f"--vram-budget={budget}", "-o", str(tmp_path / "x.json"))
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, (budget, r.stderr)
    r = run_cli_here("solve", "--profile", str(tmp_path / "syn"), "--shape", "llama-13b", "-o", str(tmp_path / "y.json"))
    assert r.returncode == 2 and "layers" in r.stderr
    # a native Q4_K_M pack: Q4_K gate/up rows and a Q8_0 down column per neuron, in the budget
    q = tmp_path / "q.json"
    r = run_cli_here("solve", "--profile", str(tmp_path / "syn"), "--shape", "llama-7b", "--hardware", "rtx2080ti",
                     "--vram-budget", "2GiB", "--weights", "q4_k+q8_0", "-o", str(q))
    assert r.returncode == 0, r.stderr
    doc_q = json.loads(q.read_text())
    assert doc_q["budget"]["neuron_bytes"] == 2 * 4096 * 144 // 256 + 4096 * 34 // 32
    assert 0 <= doc_q["budget"]["free"] and doc_q["budget"]["neurons"] == sum(
        len(layer["gpu_neurons"]) for layer in doc_q["layers"]) * doc_q["budget"]["neuron_bytes"]
    r = run_cli_here("solve", "--profile", str(tmp_path / "syn"), "--shape", "llama-7b", "--weights", "q3_k",
                     "-o", str(tmp_path / "w.json"))
    assert r.returncode == 2 and "unknown weight type 'q3_k'" in r.stderr and "Traceback" not in r.stderr
    r = run_cli_here("solve", "--profile", str(tmp_path / "syn"), "--shape", "llama-7b", "-o", str(out))
    assert r.returncode == 2 and "--force" in r.stderr


def test_profile_for_another_model_is_refused(tmp_path):
    r = run_cli_here("profile", "--synthetic", "--layers", "30", "--ffn", "1536", "-o", str(tmp_path / "syn"))
    assert r.returncode == 0
    manifest = json.loads((tmp_path / "syn" / "manifest.json").read_text())
    manifest["model"] = {"hash": "0" * 32}
    (tmp_path / "syn" / "manifest.json").write_text(json.dumps(manifest))
    r = run_cli_here("solve", "--profile", str(tmp_path / "syn"), "-m", __import__("powerinfer.paths").paths.default_model_path(),
                "-o", str(tmp_path / "z.json"))
    assert r.returncode == 2 and "made for model" in r.stderr


def test_hardware_profiles_measure_show_and_edit(tmp_path):
    from powerinfer.hardware import load_hardware

    out = tmp_path / "hw.json"
    r = run_cli_here("hardware", "--measure", "-o", str(out))
    assert r.returncode == 0, r.stderr
    measured = load_hardware(str(out))
    assert measured.cpu_bandwidth > 1e9 and measured.cpu_flops > 1e8
    assert measured.gpu_memory == (0 if not torch.cuda.is_available() else measured.gpu_memory)
    r = run_cli_here("hardware", "--show", "rtx2080ti")
    assert r.returncode == 0 and json.loads(r.stdout)["gpu_memory"] == 11 * 2**30
    toml = tmp_path / "edited.toml"
    fields = BUILTIN["rtx4090"].to_dict() | {"name": "my-pc", "gpu_memory": 8 * 2**30}
    toml.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in fields.items()))
    assert load_hardware(str(toml)).gpu_memory == 8 * 2**30
    toml.write_text('name = "x"\ngpu_memory = 1\n')
    with pytest.raises(BadArgumentError, match="missing hardware fields"):
        load_hardware(str(toml))
    toml.write_text(toml.read_text() + "warp_drive = 1\n")
    with pytest.raises(BadArgumentError, match="unknown hardware fields"):
        load_hardware(str(toml))
    with pytest.raises(BadArgumentError, match="unknown hardware"):
        load_hardware("no-such-gpu")


@pytest.mark.parametrize("dtype,name", [(torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float32, "fp32")])
def test_native_weight_types_of_an_hf_checkpoint_read_from_its_header(tmp_path, dtype, name):
    """`prepare --dtype native` on an HF directory: the solver's weight type is the FFN
    weights' stored dtype, read from the safetensors header."""
    from safetensors.torch import save_file

    from powerinfer.offline.prepare import native_weight_types

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"model.embed_tokens.weight": torch.zeros(8, 4),
               "model.layers.0.mlp.gate_proj.weight": torch.zeros(6, 4, dtype=dtype)},
              str(tmp_path / "model.safetensors"))
    assert native_weight_types(str(tmp_path)) == name
