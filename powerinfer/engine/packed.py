"""Load a packed model (offline/pack.py writes it) onto its two tiers, as a runnable model.

The GPU tier is the CUDA device when there is one; without one it is a second set of CPU
tensors computed by the GPU tier's torch code on its own executor thread, so every code
path runs (and is tested) on a CPU-only machine. The dense parts the placement puts on the
GPU (attention projections, embeddings, LM head) and, with `--kv-on-gpu`, the KV cache go to
that tier too; norms and the residual stream stay on the CPU. How each layer runs is the
load plan's decision (plan.py), made before any tensor is read.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..errors import BadArgumentError
from ..formats.finite import check_finite
from ..formats.packed import SHARDS, PackedManifest, PackedModelError, read_manifest
from ..loader import LoadedModel, parse_dtype, parse_kv_dtype, set_threads
from ..models.base import DenseTier, Model, ModelArgs
from ..ops import quant
from ..ops.ffn_rows import FFNSpec
from ..ops.memory import drop_file_cache, on_huge_pages
from ..paths import content_hash
from .hybrid import FFNStats, Tier, make_ffn
from .plan import PREDICTOR_BYPASS, LoadPlan, Strategy, make_plan
from .predictor import Predictor

__all__ = ["PackedEngine", "PackedModelError", "PREDICTOR_BYPASS", "load_packed", "read_manifest",
           "resolve_gpu_device", "available_ram"]


@dataclass
class PackedEngine:
    """A loaded packed model's engine state: where it came from, how it runs, what it did."""

    path: str
    manifest: PackedManifest
    plan: LoadPlan
    stats: FFNStats
    gpu_device: str

    @property
    def mode(self) -> str:
        return self.plan.mode


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _read_shards(path: str, manifest: PackedManifest) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out = {}
    for name in SHARDS:
        info = manifest.shards[name]
        file = os.path.join(path, info.file)
        if not os.path.isfile(file):
            raise PackedModelError(f"{file}: missing shard")
        if os.path.getsize(file) != info.bytes:
            raise PackedModelError(f"{file}: {os.path.getsize(file)} bytes, the manifest says {info.bytes} "
                                   "(truncated or replaced); pack the model again")
        if info.hash and content_hash(file) != info.hash:
            raise PackedModelError(f"{file}: contents do not match the manifest's hash (corrupt); pack the model again")
        try:
            out[name] = load_file(file)
        except (SafetensorError, OSError, ValueError) as e:
            raise PackedModelError(f"{file}: corrupt shard ({e})") from None
        check_finite(out[name].items(), file)  # the hash above is memoised by mtime: a rewrite may keep it
    return out


def _tier_tensors(shards: dict, layer: int, tier: str, args: ModelArgs, n_expected: int,
                  path: str) -> dict[str, torch.Tensor | None]:
    q = f"layers.{layer}.ffn.{tier}."
    sh = shards[tier]
    # popped: once the tier has its own copies (huge pages, run dtype) the shard's are freed,
    # so loading peaks near the model's size instead of twice it
    got = {k: sh.pop(q + k, None) for k in ("gate", "up", "b_in", "down_t", "neurons")}
    n = None if got["neurons"] is None else got["neurons"].shape[0]
    d = args.d_model

    def shape(t: torch.Tensor) -> tuple[int, ...]:  # quantized blocks: the matrix they hold
        return quant.shape_of(t) if quant.is_quantized(t) else tuple(t.shape)

    ok = (n is not None and got["gate"] is not None and got["down_t"] is not None
          and shape(got["gate"]) == (n, d) and shape(got["down_t"]) == (n, d)
          and (not args.gated_ffn or (got["up"] is not None and shape(got["up"]) == (n, d)))
          and (got["b_in"] is None or tuple(got["b_in"].shape) == (n,)))
    if not ok:
        raise PackedModelError(f"{path}: layer {layer} {tier}-tier tensors are missing or do not match the model's shape")
    if n != n_expected:
        raise PackedModelError(f"{path}: layer {layer}'s {tier} tier holds {n} neurons, the manifest says {n_expected}")
    return got


def resolve_gpu_device(gpu_device: str | None) -> torch.device:
    """The GPU tier's device: CUDA when present (or asked for), else the CPU (a virtual GPU tier)."""
    if gpu_device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(gpu_device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BadArgumentError("--gpu-device cuda asked for, but torch sees no CUDA device")
    return dev


def _check_memory(manifest: PackedManifest, dev: torch.device) -> None:
    total = sum(s.tensor_bytes for s in manifest.shards.values())
    gpu_bytes = manifest.shards["gpu"].tensor_bytes
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0]
        if gpu_bytes > free:
            raise BadArgumentError(f"the GPU tier needs {gpu_bytes / 2**30:.2f} GiB, the GPU has {free / 2**30:.2f} GiB "
                                   "free; prepare with a smaller --vram-budget")
    ram = available_ram()
    if total > ram:
        raise BadArgumentError(f"the packed model needs {total / 2**30:.2f} GiB of memory, "
                               f"{ram / 2**30:.2f} GiB are available")


def load_packed(path: str, mode: str = "sparse", dtype: str | torch.dtype = "fp32", threads: int | None = None,
                gpu_device: str | None = None, model_hash: str | None = None,
                with_tokenizer: bool = True, kv_on_gpu: bool = False,
                predictor_bypass: float | None = PREDICTOR_BYPASS,
                gpu_dtype: str | torch.dtype | None = None, kv_dtype: str | torch.dtype = "fp32") -> LoadedModel:
    """Load the packed model at `path` for `mode` (sparse, oracle, dense or offload).

    The load plan (engine/plan.py) decides each layer's strategy from the manifest and the
    mode; `predictor_bypass` is the predicted share of neurons from which a sparse layer
    computes every row instead (None: never). Dense parts follow the placement (attention
    projections and LM head on the GPU tier with `dense_on_gpu`; in offload mode the
    offloaded layers' attention, and the head where the baseline's budget holds it);
    `kv_on_gpu` puts the KV cache there too.

    `gpu_dtype`: the GPU tier's weight dtype; by default `dtype`, except that fp32 becomes
    fp16 on a CUDA device (tests ask for fp32 there, to compare tightly). `kv_dtype`: the KV
    cache's in CPU memory, fp32 or fp16 (on CUDA it is fp16, as the placement budgets it).

    Refuses, with one clear message, directories that are not packed models, manifests with
    a missing or mistyped field, shards that are truncated or corrupt, tensors that do not
    match the manifest, a packed model made from another model than `model_hash`, and tiers
    the machine cannot hold.
    """
    set_threads(threads)
    kv = parse_kv_dtype(kv_dtype)
    manifest = read_manifest(path)
    if model_hash is not None and manifest.source.hash != model_hash:
        raise PackedModelError(f"{path}: packed from model {manifest.source.hash}, not this one ({model_hash}); "
                               "run `powerinfer prepare` for it")
    args = ModelArgs.from_dict(manifest.args, lambda m: PackedModelError(f"{path}: {m}"))
    plan = make_plan(manifest, args.n_layers, mode, kv_on_gpu, predictor_bypass)
    torch_dtype = parse_dtype(dtype)
    dev = resolve_gpu_device(gpu_device)
    tier_dtype = parse_dtype(gpu_dtype) if gpu_dtype is not None else (
        torch_dtype if dev.type == "cpu" else _gpu_dtype(torch_dtype))
    _check_memory(manifest, dev)
    shards = _read_shards(path, manifest)
    stats = FFNStats()
    ffns = [_layer_ffn(shards, manifest, plan, i, args, dev, tier_dtype, torch_dtype, stats, path)
            for i in range(args.n_layers)]
    if any(f.gpu.n > 0 for f in ffns):
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-tier")
        for f in ffns:
            f.executor = executor
    dense_state = _with_parts({k: v for name in SHARDS for k, v in shards[name].items() if ".ffn.gpu." not in k
                               and ".ffn.cpu." not in k and ".predictor." not in k and not k.endswith(".ffn.b_out")})
    problem = args.shape_problem(dense_state)
    if problem:
        raise PackedModelError(f"{path}: the manifest's args disagree with the shards ({problem})")
    any_dense_on_tier = any(plan.attention_on_gpu) or plan.head_on_gpu or kv_on_gpu
    tier = DenseTier(device=dev if any_dense_on_tier else None, dtype=tier_dtype,
                     attention=list(plan.attention_on_gpu), head=plan.head_on_gpu, kv=kv_on_gpu)
    model = Model(args, dense_state, torch_dtype, ffns=ffns, tier=tier)
    model.kv_dtype = kv
    del dense_state, shards  # every tensor now has its own copy: the shards' cached pages can go
    drop_file_cache(*(os.path.join(path, s.file) for s in manifest.shards.values()))
    engine = PackedEngine(path, manifest, plan, stats, str(dev))
    tokenizer = _tokenizer(path, args) if with_tokenizer else None
    return LoadedModel(model=model, tokenizer=tokenizer, path=manifest.source.path, packed=engine)


def _with_parts(state: dict) -> dict:
    """`state` with each matrix stored as KEY.part0, KEY.part1, ... (row blocks of different
    GGUF formats: Q4_K_M's fused QKV) put back together as one `QuantParts` under KEY."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for k, v in state.items():
        key, dot, tail = k.rpartition(".part")
        if dot and tail.isdigit():
            parts.setdefault(key, {})[int(tail)] = v
        else:
            out[k] = v
    for key, got in parts.items():
        out[key] = quant.QuantParts([got[j] for j in range(len(got))])
    return out


def _layer_ffn(shards: dict, manifest: PackedManifest, plan: LoadPlan, i: int, args: ModelArgs, dev: torch.device,
               tier_dtype: torch.dtype, torch_dtype: torch.dtype, stats: FFNStats, path: str):
    lp, info = plan.layers[i], manifest.layers[i]
    g = _tier_tensors(shards, i, "gpu", args, info.n_gpu, path)
    c = _tier_tensors(shards, i, "cpu", args, info.n_cpu, path)
    neurons = torch.cat([g["neurons"], c["neurons"]])
    if neurons.shape[0] != args.ffn_dim or not torch.equal(torch.sort(neurons).values, torch.arange(args.ffn_dim)):
        raise PackedModelError(f"{path}: layer {i}'s neuron tables are not a permutation of its {args.ffn_dim} neurons")
    if (lp.n_gpu, lp.n_cpu) != (info.n_gpu, info.n_cpu):  # offload: whole layers on one tier
        g, c = _whole_layer(g, c, on_gpu=lp.n_gpu > 0)
    gpu_tier = _make_tier("gpu", g, dev, tier_dtype)
    cpu_tier = _make_tier("cpu", c, torch.device("cpu"), torch_dtype)
    if lp.dense_layout:  # every row is read: the dense kernel's layout
        cpu_tier.use_dense_layout(on_huge_pages)
    p = {k: shards["gpu"].pop(f"layers.{i}.predictor.{k}", None) for k in ("w1", "b1", "w2", "b2")}
    predictor = None
    if lp.strategy is Strategy.PREDICTED:  # the other strategies spend no memory on a predictor
        if any(v is None for v in p.values()) or p["w2"].shape[0] != args.ffn_dim or p["w1"].shape[1] != args.d_model:
            raise PackedModelError(f"{path}: layer {i}'s predictor is missing or does not match the model")
        pred_dev = dev if dev.type == "cuda" else torch.device("cpu")
        predictor = Predictor(*(p[k].to(pred_dev) for k in ("w1", "b1", "w2", "b2")),
                              threshold=info.predictor.threshold)
    b_out = shards["cpu"].get(f"layers.{i}.ffn.b_out", shards["gpu"].get(f"layers.{i}.ffn.b_out"))
    spec = FFNSpec(args.act, args.up_act, args.gated_ffn, info.threshold)
    return make_ffn(lp, gpu_tier, cpu_tier, spec, None if b_out is None else b_out.float(), stats, predictor,
                    last_layer=i == args.n_layers - 1)


def _tokenizer(path: str, args: ModelArgs):
    tok_dir = os.path.join(path, "tokenizer")
    if not os.path.isdir(tok_dir):
        return None
    from transformers import AutoTokenizer

    from ..tokenizer import Tokenizer, _quiet_transformers

    _quiet_transformers()
    try:
        return Tokenizer(AutoTokenizer.from_pretrained(tok_dir), args.eos_token_ids)
    except (OSError, ValueError) as e:
        raise PackedModelError(f"{tok_dir}: cannot load the tokenizer ({e})") from None


def _gpu_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 on a real GPU wastes its memory and bandwidth; half is what its tensor cores take
    return torch.float16 if dtype == torch.float32 else dtype


def _whole_layer(g: dict, c: dict, on_gpu: bool) -> tuple[dict, dict]:
    merged = {}
    for k in ("gate", "up", "b_in", "down_t", "neurons"):
        merged[k] = None if g[k] is None and c[k] is None else torch.cat([g[k], c[k]])
    empty = {k: None if v is None else v[:0] for k, v in merged.items()}
    return (merged, empty) if on_gpu else (empty, merged)


def _make_tier(name: str, t: dict, device: torch.device, dtype: torch.dtype) -> Tier:
    def mat(x):
        if x is None:
            return None
        kept = quant.is_quantized(x) or dtype is None  # blocks stay blocks, whatever the run dtype
        return on_huge_pages(x.to(device=device, dtype=None if kept else dtype).contiguous())

    b_in = None if t["b_in"] is None else t["b_in"].float().to(device).contiguous()
    return Tier(name, mat(t["gate"]), mat(t["up"]), b_in, mat(t["down_t"]), t["neurons"].long(),
                numba_kernels=name == "cpu")
