"""`bench hybrid` end to end on a small planted model, the GPU tier on CPU tensors: the
solver's placement and the offload baseline share one budget, and both engines decode."""

from __future__ import annotations

import json
import re

from cli_helpers import run_cli_here

from powerinfer.hardware import BUILTIN
from powerinfer.units import parse_size

SMALL = ["--layers", "4", "--d-model", "256", "--ffn-dim", "1024", "--heads", "4"]


def test_bench_hybrid_places_both_engines_under_one_budget(tmp_path):
    # an rtx4090 without fixed costs, so that even this small model's neurons go to the GPU
    hw = BUILTIN["rtx4090"].to_dict() | {"name": "small-gpu", "runtime_buffers": 1 << 20, "sync_overhead": 0,
                                         "pcie_latency": 0, "gpu_layer_overhead": 0}
    (tmp_path / "hw.json").write_text(json.dumps(hw))
    r = run_cli_here("bench", "hybrid", *SMALL, "--vram-fraction", "0.5", "--tokens", "6", "--rounds", "1",
                "--hardware", str(tmp_path / "hw.json"), "--dir", str(tmp_path / "h"), "-t", "2")
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
