"""Load a packed model (offline/pack.py writes it) onto its two tiers, as a runnable model.

The GPU tier is the CUDA device when there is one; without one it is a second set of CPU
tensors computed by the GPU tier's torch code on its own executor thread, so every code
path runs (and is tested) on a CPU-only machine. The dense parts the placement puts on the
GPU (attention projections, embeddings, LM head) and, with `--kv-on-gpu`, the KV cache go to
that tier too; norms and the residual stream stay on the CPU.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import BadArgumentError, PowerInferError
from ..loader import LoadedModel, parse_dtype, set_threads
from ..manifest import read_manifest as read_json_manifest
from ..models.base import DenseTier, Model, ModelArgs
from ..offline.pack import FORMAT, FORMAT_VERSION, SHARDS
from ..ops.memory import drop_file_cache, on_huge_pages
from ..paths import content_hash
from .hybrid import MODES, FFNStats, HybridFFN, Predictor, Tier


class PackedModelError(PowerInferError):
    """A packed model directory is missing, corrupt, or made for another model."""


def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, "manifest.json")
    if not os.path.isdir(path):
        raise PackedModelError(f"{path}: no such packed model directory; run `powerinfer prepare` or `pack`")
    manifest = read_json_manifest(mpath, FORMAT, "packed-model", f"{path}: not a packed model (no manifest.json)",
                                  PackedModelError)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise PackedModelError(f"{mpath}: packed format version {manifest.get('format_version')} is not "
                               f"{FORMAT_VERSION}; pack the model again")
    return manifest


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _read_shards(path: str, manifest: dict) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out = {}
    for name in SHARDS:
        info = manifest.get("shards", {}).get(name)
        if not info:
            raise PackedModelError(f"{path}: the manifest lists no {name} shard")
        file = os.path.join(path, info["file"])
        if not os.path.isfile(file):
            raise PackedModelError(f"{file}: missing shard")
        if os.path.getsize(file) != info["bytes"]:
            raise PackedModelError(f"{file}: {os.path.getsize(file)} bytes, the manifest says {info['bytes']} "
                                   "(truncated or replaced); pack the model again")
        if info.get("hash") and content_hash(file) != info["hash"]:
            raise PackedModelError(f"{file}: contents do not match the manifest's hash (corrupt); pack the model again")
        try:
            out[name] = load_file(file)
        except (SafetensorError, OSError, ValueError) as e:
            raise PackedModelError(f"{file}: corrupt shard ({e})") from None
    return out


def _tier_tensors(shards: dict, layer: int, tier: str, args: ModelArgs, path: str) -> dict[str, torch.Tensor | None]:
    q = f"layers.{layer}.ffn.{tier}."
    sh = shards[tier]
    # popped: once the tier has its own copies (huge pages, run dtype) the shard's are freed,
    # so loading peaks near the model's size instead of twice it
    got = {k: sh.pop(q + k, None) for k in ("gate", "up", "b_in", "down_t", "neurons")}
    n = None if got["neurons"] is None else got["neurons"].shape[0]
    d_out = args.d_model
    ok = (n is not None and got["gate"] is not None and got["down_t"] is not None
          and tuple(got["gate"].shape) == (n, args.d_model) and tuple(got["down_t"].shape) == (n, d_out)
          and (not args.gated_ffn or (got["up"] is not None and tuple(got["up"].shape) == (n, args.d_model)))
          and (got["b_in"] is None or tuple(got["b_in"].shape) == (n,)))
    if not ok:
        raise PackedModelError(f"{path}: layer {layer} {tier}-tier tensors are missing or do not match the model's shape")
    return got


def resolve_gpu_device(gpu_device: str | None) -> torch.device:
    """The GPU tier's device: CUDA when present (or asked for), else the CPU (a virtual GPU tier)."""
    if gpu_device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(gpu_device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BadArgumentError("--gpu-device cuda asked for, but torch sees no CUDA device")
    return dev


# Predicted share of the neurons from which a layer bypasses its predictor in sparse mode.
# Measured on SmolLM2-135M bf16 (every layer's predictor computes 0.86-0.97 of the neurons):
# bypassing all layers took decode from 75.7 to 87.0 tok/s (median of 8 rounds).
PREDICTOR_BYPASS = 0.85


def load_packed(path: str, mode: str = "sparse", dtype: str | torch.dtype = "fp32", threads: int | None = None,
                gpu_device: str | None = None, model_hash: str | None = None,
                with_tokenizer: bool = True, kv_on_gpu: bool = False,
                predictor_bypass: float | None = PREDICTOR_BYPASS,
                gpu_dtype: str | torch.dtype | None = None) -> LoadedModel:
    """Load the packed model at `path` for `mode` (sparse, oracle, dense or offload).

    Dense parts follow the placement: with `dense_on_gpu` the attention projections and the
    LM head (with the embeddings when tied) go to the GPU tier (in offload mode: the
    attention of the offloaded layers, and the LM head where the offload baseline's budget
    holds it); `kv_on_gpu` puts the KV cache there too. Norms and the residual stream stay
    on the CPU.

    In sparse mode a layer whose predictor computes at least `predictor_bypass` of the
    neurons on the training validation set (the packed manifest's `predicted_fraction`)
    bypasses it: every neuron's gate and up rows are computed and the true activations
    choose the down rows (as the oracle mode). Reading a few percent fewer rows does not pay
    for the predictor and the irregular row set; the true activations are also better than
    the predicted ones. A bypassed layer wholly on the CPU tier runs the dense FFN kernel,
    which reads every down row anyway, so it computes the exact FFN, threshold unapplied
    (`HybridFFN.bypass_exact`). `None` never bypasses.

    `gpu_dtype`: the GPU tier's weight dtype; by default `dtype`, except that fp32 becomes
    fp16 on a CUDA device (tests ask for fp32 there, to compare tightly).

    Refuses, with one clear message, directories that are not packed models, shards that are
    truncated or corrupt, tensors that do not match the manifest's shapes, a packed model made
    from another model than `model_hash`, and tiers the machine cannot hold.
    """
    if mode not in MODES:
        raise BadArgumentError(f"unknown mode {mode!r} (choose {', '.join(MODES)})")
    set_threads(threads)
    manifest = read_manifest(path)
    if model_hash is not None and manifest["source"]["hash"] != model_hash:
        raise PackedModelError(f"{path}: packed from model {manifest['source']['hash']}, not this one ({model_hash}); "
                               "run `powerinfer prepare` for it")
    try:
        args = ModelArgs(**manifest["args"])
    except TypeError as e:
        raise PackedModelError(f"{path}: the manifest's model arguments are malformed ({e})") from None
    torch_dtype = parse_dtype(dtype)
    dev = resolve_gpu_device(gpu_device)
    tier_dtype = parse_dtype(gpu_dtype) if gpu_dtype is not None else (
        torch_dtype if dev.type == "cpu" else _gpu_dtype(torch_dtype))
    total = sum(s["tensor_bytes"] for s in manifest["shards"].values())
    gpu_bytes = manifest["shards"]["gpu"]["tensor_bytes"]
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0]
        if gpu_bytes > free:
            raise BadArgumentError(f"the GPU tier needs {gpu_bytes / 2**30:.2f} GiB, the GPU has {free / 2**30:.2f} GiB "
                                   "free; prepare with a smaller --vram-budget")
    ram = _available_ram()
    if total > ram:
        raise BadArgumentError(f"the packed model needs {total / 2**30:.2f} GiB of memory, "
                               f"{ram / 2**30:.2f} GiB are available")
    shards = _read_shards(path, manifest)
    if mode == "sparse" and manifest.get("predictors") is None:
        raise BadArgumentError(f"{path}: packed without predictors; --mode sparse needs them (use oracle or dense)")
    dense_state = {k: v for name in SHARDS for k, v in shards[name].items() if ".ffn.gpu." not in k
                   and ".ffn.cpu." not in k and ".predictor." not in k}
    stats = FFNStats()
    layers_meta = manifest.get("layers", [])
    if len(layers_meta) != args.n_layers:
        raise PackedModelError(f"{path}: the manifest describes {len(layers_meta)} layers, the model has {args.n_layers}")
    offload_layers = int(manifest["placement"].get("offload_gpu_layers", 0))
    ffns, any_gpu = [], False
    for i in range(args.n_layers):
        g = _tier_tensors(shards, i, "gpu", args, path)
        c = _tier_tensors(shards, i, "cpu", args, path)
        neurons = torch.cat([g["neurons"], c["neurons"]])
        if neurons.shape[0] != args.ffn_dim or not torch.equal(torch.sort(neurons).values, torch.arange(args.ffn_dim)):
            raise PackedModelError(f"{path}: layer {i}'s neuron tables are not a permutation of its {args.ffn_dim} neurons")
        if mode == "offload":  # llama.cpp-style: whole layers on the GPU tier, the rest on the CPU
            g, c = _whole_layer(g, c, on_gpu=i < offload_layers)
        gpu_tier = _make_tier("gpu", g, dev, tier_dtype)
        cpu_tier = _make_tier("cpu", c, torch.device("cpu"), torch_dtype)
        any_gpu = any_gpu or gpu_tier.n > 0
        predictor = None
        if manifest.get("predictors") is not None:
            p = {k: shards["gpu"].get(f"layers.{i}.predictor.{k}") for k in ("w1", "b1", "w2", "b2")}
            if any(v is None for v in p.values()) or p["w2"].shape[0] != args.ffn_dim or p["w1"].shape[1] != args.d_model:
                raise PackedModelError(f"{path}: layer {i}'s predictor is missing or does not match the model")
            if mode == "sparse":  # the other modes compute every neuron: no predictor memory spent
                pred_dev = dev if dev.type == "cuda" else torch.device("cpu")
                predictor = Predictor(*(p[k].to(pred_dev) for k in ("w1", "b1", "w2", "b2")),
                                      threshold=layers_meta[i]["predictor"]["threshold"])
        fraction = (layers_meta[i].get("predictor") or {}).get("predicted_fraction")
        bypass = (mode == "sparse" and predictor_bypass is not None and fraction is not None
                  and fraction >= predictor_bypass)
        if gpu_tier.n == 0 and (mode in ("dense", "oracle", "offload") or bypass):
            # every row is read: the dense kernel's layout (for offload, the CPU layers of the
            # llama.cpp-style baseline then run as a dense engine's would)
            cpu_tier.use_dense_layout(on_huge_pages)
        b_out = dense_state.pop(f"layers.{i}.ffn.b_out", None)
        ffns.append(HybridFFN(gpu_tier, cpu_tier, None if b_out is None else b_out.float(), args.act, args.up_act,
                              args.gated_ffn, manifest["criterion"], layers_meta[i]["threshold"], predictor,
                              mode, None, stats, last_layer=i == args.n_layers - 1, predictor_bypass=bypass))
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-tier") if any_gpu else None
    for f in ffns:
        f.executor = executor
    dense_on_gpu = bool(manifest["placement"].get("dense_on_gpu", False))
    attention = [i < offload_layers for i in range(args.n_layers)] if mode == "offload" else dense_on_gpu
    # offload mode: the LM head where the baseline's budget put it (placed before the layers)
    head = bool(manifest["placement"].get("offload_head_on_gpu", False)) if mode == "offload" else dense_on_gpu
    on_tier = dense_on_gpu or kv_on_gpu or (mode == "offload" and (offload_layers > 0 or head))
    tier = DenseTier(device=dev if on_tier else None, dtype=tier_dtype,
                     attention=attention, head=head, kv=kv_on_gpu)
    model = Model(args, dense_state, torch_dtype, ffns=ffns, tier=tier)
    del dense_state, shards  # every tensor now has its own copy: the shards' cached pages can go
    drop_file_cache(*(os.path.join(path, s["file"]) for s in manifest["shards"].values()))
    model.ffn_stats = stats
    model.packed = {"path": path, "mode": mode, "gpu_device": str(dev), "manifest": manifest}
    tokenizer = None
    tok_dir = os.path.join(path, "tokenizer")
    if with_tokenizer and os.path.isdir(tok_dir):
        from transformers import AutoTokenizer

        from ..tokenizer import Tokenizer, _quiet_transformers

        _quiet_transformers()
        try:
            tokenizer = Tokenizer(AutoTokenizer.from_pretrained(tok_dir), args.eos_token_ids)
        except (OSError, ValueError) as e:
            raise PackedModelError(f"{tok_dir}: cannot load the tokenizer ({e})") from None
    return LoadedModel(model=model, tokenizer=tokenizer, path=manifest["source"]["path"])


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
        return None if x is None else on_huge_pages(x.to(device=device, dtype=dtype).contiguous())

    b_in = None if t["b_in"] is None else t["b_in"].float().to(device).contiguous()
    return Tier(name, mat(t["gate"]), mat(t["up"]), b_in, mat(t["down_t"]), t["neurons"].long(),
                numba_kernels=name == "cpu")
