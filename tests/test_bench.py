"""`bench hybrid` end to end on a small planted model, the GPU tier on CPU tensors: the
solver's placement and the offload baseline share one budget, and both engines decode."""

from __future__ import annotations

import json
import re

from cli_helpers import run_cli_here

from powerinfer.hardware import BUILTIN
from powerinfer.units import parse_size

SMALL = ["--layers", "4", "--d-model", "256", "--ffn-dim", "1024", "--heads", "4"]


def small_gpu(tmp_path) -> str:
    """An rtx4090 without fixed costs, so that even a small model's neurons go to the GPU."""
    hw = BUILTIN["rtx4090"].to_dict() | {"name": "small-gpu", "runtime_buffers": 1 << 20, "sync_overhead": 0,
                                         "pcie_latency": 0, "gpu_layer_overhead": 0}
    (tmp_path / "hw.json").write_text(json.dumps(hw))
    return str(tmp_path / "hw.json")


def test_bench_hybrid_places_both_engines_under_one_budget(tmp_path):
    r = run_cli_here("bench", "hybrid", *SMALL, "--vram-fraction", "0.5", "--tokens", "6", "--rounds", "1",
                "--hardware", small_gpu(tmp_path), "--dir", str(tmp_path / "h"), "-t", "2")
    assert r.returncode == 0, r.stderr
    budget = parse_size(re.search(r"budget ([\d.]+ \w+)", r.stdout).group(1).replace(" ", ""))
    rows = {m[0]: m[1:] for m in re.findall(r"\| (offload|hybrid) \| ([\d.]+) \| ([\d.]+ \w+) \| n/a \| (.*) \|", r.stdout)}
    assert set(rows) == {"offload", "hybrid"}
    for speed, held, _ in rows.values():
        assert float(speed) > 0 and 0 < parse_size(held.replace(" ", "")) <= budget * 1.01
    assert re.search(r"[1-3] whole layers, LM head GPU", rows["offload"][2])
    share = float(re.search(r"GPU share of neuron load ([\d.]+)", rows["hybrid"][2]).group(1))
    assert 0 < share < 1 and int(rows["hybrid"][2].split()[0]) > 0
    doc = json.loads((tmp_path / "h" / "placement.json").read_text())
    assert doc["baselines"]["offload"]["head_on_gpu"] and doc["hardware"]["name"] == "small-gpu"


def test_bench_hybrid_keeps_q4_0_blocks_in_the_gpu_tier(tmp_path):
    """--dtype q4_0: the solver counts Q4_0 rows + a Q8_0 down column per neuron, the GPU tier
    holds exactly those bytes, and the offload baseline puts its LM head (and the whole layers
    that fit) there as blocks too."""
    from powerinfer.engine.packed import load_packed
    from powerinfer.hardware import WEIGHT_BYTES
    from powerinfer.ops import quant

    r = run_cli_here("bench", "hybrid", *SMALL, "--dtype", "q4_0", "--vram-fraction", "0.5", "--tokens", "6",
                     "--rounds", "1", "--hardware", small_gpu(tmp_path), "--dir", str(tmp_path / "h"), "-t", "2")
    assert r.returncode == 0, r.stderr
    speeds = dict(re.findall(r"\| (offload|hybrid) \| ([\d.]+) \|", r.stdout))
    assert set(speeds) == {"offload", "hybrid"} and all(float(v) > 0 for v in speeds.values())
    assert re.search(r"\| offload \| [\d.]+ \| [\d.]+ \w+ \| n/a \| [0-3] whole layers, LM head GPU", r.stdout)
    doc = json.loads((tmp_path / "h" / "placement.json").read_text())
    assert doc["dtype"] == "q4_0+q8_0"
    d = 256
    assert doc["budget"]["neuron_bytes"] == 2 * d * WEIGHT_BYTES["q4_0"] + d * WEIGHT_BYTES["q8_0"]
    lm = load_packed(str(tmp_path / "h" / "packed"), mode="sparse", dtype="native", gpu_device="cpu",
                     with_tokenizer=False)
    tiers = [layer.ffn.gpu for layer in lm.model.layers]
    n_gpu = sum(t.n for t in tiers)
    assert n_gpu > 0 and all(quant.format_of(t.w_gate) == "Q4_0" for t in tiers if t.n)
    held = sum(x.numel() * x.element_size() for t in tiers for x in (t.w_gate, t.w_up, t.wt_down))
    assert held == n_gpu * doc["budget"]["neuron_bytes"]


def test_bench_relu7b_on_quantized_blocks_leaves_nothing_behind(tmp_path, monkeypatch):
    """The planted model written as Q4_0: the dense engine reads the file's blocks, the packed
    sparse one its Q4_0 rows with a Q8_0 down projection; both decode and the table prints.
    Without --dir the planted model (~14 GB at the default shape) goes to a temporary folder
    that is removed at the end, not left in /tmp run after run."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    r = run_cli_here("bench", "relu7b", *SMALL, "--dtype", "q4_0", "--tokens", "4", "--rounds", "1", "-t", "2")
    assert r.returncode == 0, r.stderr
    assert "planted-256d-1024ff-4h-4l.q4_0.gguf" in r.stdout and list(tmp_path.iterdir()) == []
    speeds = dict(re.findall(r"\| (dense|sparse) \| ([\d.]+) \|", r.stdout))
    assert set(speeds) == {"dense", "sparse"} and all(float(v) > 0 for v in speeds.values())
