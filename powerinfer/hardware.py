"""Hardware profiles and the decode cost model shared by the solver and the simulator.

A profile is a plain JSON or TOML file of the fields of `HardwareProfile` (bytes, bytes/s,
FLOP/s, seconds). Built-ins come from public spec sheets, derated where noted; edit a copy
with real measurements (`powerinfer hardware --measure` writes one for this machine).

The cost model prices one decode token. Batch-1 decode is memory-bound, so time is bytes
read / bandwidth plus fixed per-layer overheads:
- attention and the other dense parts run where they are placed (GPU when they fit);
- per layer, the FFN neurons the predictor selects run on the tier that holds them, the two
  tiers concurrently: layer FFN time = max(GPU part, CPU part);
- a layer whose FFN is not entirely on the GPU pays one sync: the PCIe round trip of the
  layer's activations and the merge (this is what PowerInfer's selective sync avoids for
  GPU-only layers);
- an active neuron costs its gate, up and down rows (2 matrices for non-gated FFNs).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, fields

from .errors import BadArgumentError

GB = 1e9


@dataclass
class HardwareProfile:
    """Bandwidths in bytes/s, compute in FLOP/s, latencies in seconds, memory in bytes."""

    name: str
    gpu_memory: int  # 0 = no GPU
    gpu_bandwidth: float
    gpu_flops: float
    cpu_memory: int
    cpu_bandwidth: float
    cpu_flops: float
    pcie_bandwidth: float
    pcie_latency: float
    sync_overhead: float  # fixed cost of one CPU->GPU merge (launch + wait), on top of PCIe
    gpu_layer_overhead: float = 60e-6  # kernel launches of one layer's attention + FFN on the GPU
    cpu_layer_overhead: float = 20e-6  # thread fork/join of one layer's CPU FFN
    sparse_efficiency: float = 0.8  # share of bandwidth that scattered neuron rows reach
    runtime_buffers: int = 64 << 20  # GPU bytes kept free of weights: CUDA context slack, activations, scratch

    @property
    def has_gpu(self) -> bool:
        return self.gpu_memory > 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "profile") -> "HardwareProfile":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise BadArgumentError(f"{source}: unknown hardware fields {', '.join(sorted(unknown))}")
        missing = {f.name for f in fields(cls) if f.default is MISSING} - set(data)
        if missing:
            raise BadArgumentError(f"{source}: missing hardware fields {', '.join(sorted(missing))}")
        try:
            prof = cls(**data)
        except TypeError as e:
            raise BadArgumentError(f"{source}: {e}") from None
        for f in fields(cls):
            v = getattr(prof, f.name)
            if f.name != "name" and (not isinstance(v, (int, float)) or v < 0 or math.isnan(v)):
                raise BadArgumentError(f"{source}: {f.name} must be a non-negative number")
        return prof


BUILTIN: dict[str, HardwareProfile] = {
    # The paper's PC-High: RTX 4090 (24 GB GDDR6X, 1008 GB/s, 82.6 TFLOPS fp16) and an
    # i9-13900K with DDR5 (89.6 GB/s peak; ~60 GB/s reached), PCIe 4.0 x16.
    "rtx4090": HardwareProfile("rtx4090", gpu_memory=24 * 2**30, gpu_bandwidth=1008 * GB * 0.9,
                               gpu_flops=82.6e12, cpu_memory=192 * 2**30, cpu_bandwidth=60 * GB, cpu_flops=1.5e12,
                               pcie_bandwidth=25 * GB, pcie_latency=10e-6, sync_overhead=20e-6),
    # The paper's PC-Low: RTX 2080Ti (11 GB, 616 GB/s, 26.9 TFLOPS fp16) and an i7-12700K;
    # host bandwidth 38.4 GB/s and PCIe 3.0 as given by the sparsity follow-up paper.
    "rtx2080ti": HardwareProfile("rtx2080ti", gpu_memory=11 * 2**30, gpu_bandwidth=616 * GB * 0.9,
                                 gpu_flops=26.9e12, cpu_memory=64 * 2**30, cpu_bandwidth=38.4 * GB,
                                 cpu_flops=1.0e12, pcie_bandwidth=12 * GB, pcie_latency=10e-6,
                                 sync_overhead=25e-6),
    # An H200 server: 141 GB HBM3e at 4.8 TB/s, ~989 TFLOPS bf16 dense; dual-socket host
    # (~300 GB/s), PCIe 5.0 x16.
    "h200": HardwareProfile("h200", gpu_memory=141 * 10**9, gpu_bandwidth=4800 * GB * 0.9, gpu_flops=989e12,
                            cpu_memory=2048 * 2**30, cpu_bandwidth=300 * GB, cpu_flops=5e12, pcie_bandwidth=50 * GB,
                            pcie_latency=8e-6, sync_overhead=15e-6),
    # No GPU: everything on the CPU (the dev machine's order of magnitude).
    "cpu": HardwareProfile("cpu", gpu_memory=0, gpu_bandwidth=0.0, gpu_flops=0.0, cpu_memory=24 * 2**30,
                           cpu_bandwidth=30 * GB, cpu_flops=0.2e12, pcie_bandwidth=0.0, pcie_latency=0.0,
                           sync_overhead=0.0),
}


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name, or a JSON/TOML file of HardwareProfile fields."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    if not os.path.isfile(name_or_path):
        raise BadArgumentError(f"unknown hardware {name_or_path!r}: not a built-in ({', '.join(BUILTIN)}) "
                               "nor a file")
    try:
        if name_or_path.endswith(".toml"):
            import tomllib

            with open(name_or_path, "rb") as f:
                data = tomllib.load(f)
        else:
            with open(name_or_path) as f:
                data = json.load(f)
    except (ValueError, OSError) as e:
        raise BadArgumentError(f"{name_or_path}: unreadable hardware profile ({e})") from None
    if not isinstance(data, dict):
        raise BadArgumentError(f"{name_or_path}: expected a table of hardware fields")
    return HardwareProfile.from_dict(data, name_or_path)


# -- bytes ------------------------------------------------------------------------------------
# Bytes per weight of each storage type (GGML block formats include their scales).
WEIGHT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                "q5_0": 22 / 32, "q5_1": 24 / 32, "q4_k": 144 / 256, "q5_k": 176 / 256, "q6_k": 210 / 256}


def split_types(dtype: str) -> tuple[str, str]:
    """("rows type", "down type") of a weight type: "q4_k+q8_0" names a packed quantized model's
    gate/up rows (the source's blocks) and its transposed down projection (requantized to
    Q8_0); a plain type is both."""
    rows, _, down = dtype.partition("+")
    for t in (rows, down or rows):
        if t not in WEIGHT_BYTES:
            raise BadArgumentError(f"unknown weight type {t!r} (known: {', '.join(WEIGHT_BYTES)}, or ROWS+DOWN)")
    return rows, down or rows


def weight_bytes(dtype: str) -> float:
    """Bytes per weight of `dtype` (the rows type of a ROWS+DOWN pair)."""
    return WEIGHT_BYTES[split_types(dtype)[0]]


@dataclass(frozen=True)
class ModelShape:
    """What the solver and cost model need to know of a model."""

    name: str
    n_layers: int
    d_model: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    gated: bool = True
    ffn_bias: bool = False
    tie_embeddings: bool = False

    def neuron_bytes(self, dtype: str) -> int:
        """Bytes of one FFN neuron: its gate and up rows and its down column (or fc1 row and
        fc2 column), in the weight type (a ROWS+DOWN pair: each in its own), plus its fc1
        bias in fp32 when the FFN has biases."""
        rows, down = split_types(dtype)
        n_rows = 2 if self.gated else 1
        row_bytes = int(math.ceil(n_rows * self.d_model * WEIGHT_BYTES[rows]))
        return row_bytes + int(math.ceil(self.d_model * WEIGHT_BYTES[down])) + (4 if self.ffn_bias else 0)

    def attention_bytes(self, dtype: str) -> int:
        """One layer's q, k, v and o projections plus its norms (fp32)."""
        qkv = self.d_model * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        o = self.n_heads * self.head_dim * self.d_model
        return int(math.ceil((qkv + o) * weight_bytes(dtype))) + 2 * 4 * self.d_model

    def lm_head_bytes(self, dtype: str) -> int:
        return int(math.ceil(self.vocab_size * self.d_model * weight_bytes(dtype)))

    def kv_bytes(self, context: int, kv_dtype: str = "fp16") -> int:
        return int(2 * self.n_layers * self.n_kv_heads * self.head_dim * context * weight_bytes(kv_dtype))

    def predictor_bytes(self, rank: int, dtype: str = "fp16") -> int:
        """One layer's predictor W1 (d x r) and W2 (r x n_ff) plus biases."""
        return int(math.ceil((self.d_model * rank + rank * self.n_ff) * weight_bytes(dtype))) + 4 * (rank + self.n_ff)


# Shapes of the models the paper evaluates (and ours), for benchmarks and the simulator.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "llama-7b": ModelShape("llama-7b", 32, 4096, 11008, 32, 32, 128, 32000),
    "llama-13b": ModelShape("llama-13b", 40, 5120, 13824, 40, 40, 128, 32000),
    "llama-70b": ModelShape("llama-70b", 80, 8192, 28672, 64, 8, 128, 32000),
    "falcon-40b": ModelShape("falcon-40b", 60, 8192, 32768, 128, 8, 64, 65024, gated=False),
    "opt-30b": ModelShape("opt-30b", 48, 7168, 28672, 56, 56, 128, 50272, gated=False, ffn_bias=True,
                          tie_embeddings=True),
    "opt-66b": ModelShape("opt-66b", 64, 9216, 36864, 72, 72, 128, 50272, gated=False, ffn_bias=True,
                          tie_embeddings=True),
    "opt-175b": ModelShape("opt-175b", 96, 12288, 49152, 96, 96, 128, 50272, gated=False, ffn_bias=True,
                           tie_embeddings=True),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 1536, 9, 3, 64, 49152, tie_embeddings=True),
}


def shape_of_args(args, name: str = "model") -> ModelShape:
    """A ModelShape from our ModelArgs."""
    return ModelShape(name, args.n_layers, args.d_model, args.ffn_dim, args.n_heads, args.n_kv_heads, args.head_dim,
                      args.vocab_size, gated=args.gated_ffn, ffn_bias=not args.gated_ffn and args.family == "opt",
                      tie_embeddings=args.tie_embeddings)


# -- time -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerCosts:
    """Per-token seconds of one layer, as linear coefficients the ILP can use."""

    gpu_per_neuron: float  # seconds per expected active neuron on the GPU
    cpu_per_neuron: float
    attention: float  # attention + predictor, on the GPU when the dense parts are there
    sync: float  # one CPU->GPU merge for a layer not entirely on the GPU
    gpu_overhead: float
    cpu_overhead: float
    dense_on_gpu: bool = True  # where attention runs; decides which layers pay the sync


def layer_costs(shape: ModelShape, hw: HardwareProfile, dtype: str, context: int = 512,
                dense_on_gpu: bool = True, predictor_rank: int = 0) -> LayerCosts:
    nb = shape.neuron_bytes(dtype)
    attn_bytes = shape.attention_bytes(dtype) + shape.kv_bytes(context, "fp16") // shape.n_layers
    attn_bytes += shape.predictor_bytes(predictor_rank) if predictor_rank else 0
    gpu = hw.has_gpu
    gpu_bw = hw.gpu_bandwidth * hw.sparse_efficiency if gpu else float("inf")
    cpu_bw = hw.cpu_bandwidth * hw.sparse_efficiency
    if gpu and dense_on_gpu:
        attention = attn_bytes / hw.gpu_bandwidth
    else:
        attention = attn_bytes / hw.cpu_bandwidth
    sync = 0.0
    if gpu:
        sync = hw.sync_overhead + 2 * (hw.pcie_latency + shape.d_model * 4 / hw.pcie_bandwidth)
    return LayerCosts(gpu_per_neuron=nb / gpu_bw if gpu else float("inf"), cpu_per_neuron=nb / cpu_bw,
                      attention=attention, sync=sync, gpu_overhead=hw.gpu_layer_overhead if gpu else 0.0,
                      cpu_overhead=hw.cpu_layer_overhead, dense_on_gpu=gpu and dense_on_gpu)


def layer_time(costs: LayerCosts, gpu_load: float, cpu_load: float, has_gpu_part: bool, all_on_gpu: bool) -> float:
    """Seconds of one layer for expected active-neuron loads on each tier."""
    gpu = costs.gpu_per_neuron * gpu_load + (costs.gpu_overhead if has_gpu_part else 0.0)
    cpu = costs.cpu_per_neuron * cpu_load + (costs.cpu_overhead if not all_on_gpu else 0.0)
    # attention on the GPU: a layer pays the sync unless its FFN is all there; attention on
    # the CPU: a layer pays it as soon as it has a GPU part
    synced = not all_on_gpu if costs.dense_on_gpu else has_gpu_part
    return costs.attention + max(gpu, cpu) + (costs.sync if synced else 0.0)


def head_time(shape: ModelShape, hw: HardwareProfile, dtype: str, on_gpu: bool) -> float:
    bw = hw.gpu_bandwidth if on_gpu and hw.has_gpu else hw.cpu_bandwidth
    return shape.lm_head_bytes(dtype) / bw


def offload_head_on_gpu(shape: ModelShape, hw: HardwareProfile, dtype: str, budget: int) -> bool:
    """Whether the offload baseline's budget holds the LM head (it is placed first)."""
    return hw.has_gpu and budget >= shape.lm_head_bytes(dtype)


def offload_baseline(shape: ModelShape, hw: HardwareProfile, dtype: str, budget: int, context: int = 512) -> dict:
    """The offload baseline as a placement document records it (and the engine's offload
    mode reads it): predicted tok/s, whole GPU layers, and whether the LM head is on the GPU."""
    t, layers = dense_offload_time(shape, hw, dtype, budget, context)
    return {"tokens_per_s": 1 / t, "gpu_layers": layers, "head_on_gpu": offload_head_on_gpu(shape, hw, dtype, budget)}


def dense_offload_time(shape: ModelShape, hw: HardwareProfile, dtype: str, budget: int, context: int = 512) -> tuple[float, int]:
    """llama.cpp's -ngl baseline: whole layers (attention + dense FFN) on the GPU while they
    fit the budget, the rest computed densely on the CPU. Returns (seconds/token, GPU layers)."""
    per_layer = shape.attention_bytes(dtype) + shape.n_ff * shape.neuron_bytes(dtype)
    kv = shape.kv_bytes(context, "fp16") // shape.n_layers
    head = shape.lm_head_bytes(dtype)
    room = budget - head if hw.has_gpu else 0
    gpu_layers = max(0, min(shape.n_layers, int(room // (per_layer + kv)) if room > 0 else 0))
    head_on_gpu = offload_head_on_gpu(shape, hw, dtype, budget)
    t = 0.0
    for i in range(shape.n_layers):
        bw = hw.gpu_bandwidth if i < gpu_layers else hw.cpu_bandwidth
        t += (per_layer + kv) / bw + (hw.gpu_layer_overhead if i < gpu_layers else hw.cpu_layer_overhead)
    if 0 < gpu_layers < shape.n_layers:
        t += 2 * (hw.pcie_latency + shape.d_model * 4 / hw.pcie_bandwidth)
    return t + head_time(shape, hw, dtype, head_on_gpu), gpu_layers
