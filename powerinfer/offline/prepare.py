"""`prepare`: the whole offline pipeline (profile, train, solve, pack) for one model, cached.

Every artefact lives in the model's cache directory (paths.model_cache_dir) and is reused
when it is still valid for the model (content hash), the profile (stats hash) and the
requested hardware, budget and dtype; a second run with the same request does nothing but
these checks. Without a GPU the placement is all-CPU and the solve step is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass

from ..errors import BadArgumentError, PowerInferError
from ..paths import content_hash, model_cache_dir, write_json
from .stats import Profile


@dataclass
class PrepareSettings:
    hardware: str = "auto"  # built-in name, a file, or auto (cpu without CUDA, else measured)
    vram_budget: int | None = None  # bytes; None = the whole GPU
    dtype: str = "fp32"  # packed weight dtype
    weights: str = "fp16"  # weight type the solver's cost model assumes on the GPU
    dataset: str = "sharegpt"
    prompts: int = 256
    heldout: int = 32
    max_tokens: int = 256
    target_sparsity: float | None = None
    max_ppl_increase: float | None = 0.01
    recall: float = 0.95
    predictors: str = "auto"  # which layers get a predictor: auto (where one can pay), all, none
    budget: float = 0.10
    seed: int = 0


def default_packed_dir(model_hash: str) -> str:
    return str(model_cache_dir(model_hash) / "packed")


def _log(msg: str) -> None:
    print(f"prepare: {msg}", file=sys.stderr, flush=True)


def resolve_hardware(name: str):
    from ..hardware import load_hardware

    if name != "auto":
        return load_hardware(name)
    import torch

    if not torch.cuda.is_available():
        return load_hardware("cpu")
    from .measure import measure_hardware

    return measure_hardware()


def prepare(model_path: str | None, s: PrepareSettings, lm=None) -> str:
    """Run (or reuse) every offline step for the model; returns the packed model directory."""
    from ..formats.packed import PACK_REVISION
    from ..loader import resolve_model_path

    path = resolve_model_path(model_path)
    model_hash = content_hash(path)
    cache = model_cache_dir(model_hash)
    hw = resolve_hardware(s.hardware)
    if s.vram_budget is not None and not hw.has_gpu:  # as `solve` refuses a budget the GPU cannot hold
        raise BadArgumentError(f"--vram-budget: hardware {hw.name} has no GPU (choose one with --hardware)")
    budget = (s.vram_budget if s.vram_budget is not None else hw.gpu_memory) if hw.has_gpu else 0
    if hw.has_gpu and not 0 < budget <= hw.gpu_memory:
        raise BadArgumentError(f"VRAM budget {budget / 2**30:.2f} GiB is not within the {hw.name}'s "
                               f"{hw.gpu_memory / 2**30:.2f} GiB")
    packed_dir = default_packed_dir(model_hash)
    request = {"hardware": hw.name, "budget": budget, "dtype": s.dtype, "predictor_loss": "magnitude-weighted, heavy misses forced",
               "pack_revision": PACK_REVISION, "predictors": s.predictors}
    if _packed_is_current(packed_dir, model_hash, cache, request):
        _log(f"{packed_dir} is up to date ({hw.name}, budget {budget} bytes, {s.dtype})")
        return packed_dir
    if lm is None:
        from ..loader import load

        _log(f"loading {path}")
        lm = load(path, dtype="fp32")
    from ..formats.packed import write_check
    from .pack import pack_model

    profile = _profile(lm, cache, model_hash, s)
    predictors = _predictors(lm, profile, cache, model_hash, s, hw)
    placement = _placement(profile, hw, budget, cache, model_hash, s, path)
    _log(f"packing into {packed_dir}")
    pack_model(path, packed_dir, profile, predictors, placement, s.dtype, force=True, prepare_request=request,
               predictors_hash=_predictors_hash(cache))
    write_check(packed_dir, check_sparse(lm, packed_dir, profile, predictors, s))
    return packed_dir


QUALITY_SLACK = 0.02  # sparse may cost this much held-out perplexity over dense and still be the default
# ... and must decode at least this much faster: closer than that is run-to-run noise on a
# 2-core machine, and a tie should not trade quality for nothing
MIN_SPEEDUP = 1.05


def check_sparse(lm, packed_dir: str, profile: Profile, predictors, s: PrepareSettings):
    """Measure what `--mode auto` should pick: the sparse engine only when it decodes at least
    MIN_SPEEDUP times as fast as the dense one here and its held-out perplexity is within
    QUALITY_SLACK of dense. When the load plan computes the dense model in every layer there
    is nothing to measure: auto picks dense and says why."""
    from ..engine.packed import load_packed
    from ..formats.packed import SparseCheck
    from ..timing import decode_round
    from .evaluate import bypassed_layers, engine_variant, heldout_texts
    from .profile import instrumented, perplexity, tokenize

    loaded = load_packed(packed_dir, mode="sparse", dtype=s.dtype, with_tokenizer=False)
    plan = loaded.packed.plan
    if plan.computes_dense_model:
        note = plan.summary()
        _log(note + "; --mode auto will use dense")
        return SparseCheck({}, {}, "dense", QUALITY_SLACK, MIN_SPEEDUP, note=note)
    _log("checking the sparse engine's speed and quality against dense")
    sparse = loaded.model
    texts = heldout_texts(profile, 16) if s.heldout else []
    ppl = {}
    if texts:  # what the engine computes: predicted neurons, the true ones where bypassed, all where exact
        tokens = tokenize(lm, texts, s.max_tokens)
        ppl["dense"] = perplexity(lm.model, tokens, "dense ppl")
        layers = predictors.layers if predictors is not None else [None] * len(profile.layers)
        predict, thresholds = engine_variant(layers, profile.thresholds, *bypassed_layers(plan))
        with instrumented(lm.model, profile.criterion, thresholds, predictors=predict):
            ppl["sparse"] = perplexity(lm.model, tokens, "sparse ppl")

    def speed(model, n: int = 32) -> float:
        return decode_round(model, [1, 2, 3, 4], n)[1]

    speed(lm.model, 4), speed(sparse, 4)  # compile and warm up
    runs: dict[str, list[float]] = {"dense": [], "sparse": []}
    for _ in range(3):  # alternating, so that a drift of the machine weighs on both
        runs["dense"].append(speed(lm.model))
        runs["sparse"].append(speed(sparse))
    tps = {name: max(v) for name, v in runs.items()}
    good = not ppl or ppl["sparse"] <= ppl["dense"] * (1 + QUALITY_SLACK)
    mode = "sparse" if good and tps["sparse"] >= MIN_SPEEDUP * tps["dense"] else "dense"
    _log(f"decode {tps['sparse']:.1f} tok/s sparse vs {tps['dense']:.1f} dense ({s.dtype})"
         + (f"; held-out perplexity {ppl['sparse']:.3f} sparse vs {ppl['dense']:.3f} dense" if ppl else "")
         + f"; --mode auto will use {mode}")
    return SparseCheck(tps, ppl, mode, QUALITY_SLACK, MIN_SPEEDUP)


def _predictors_hash(cache) -> str | None:
    """The cached predictors' identity: their tensors and their manifest (thresholds live there)."""
    from .train import file_hash

    files = [cache / "predictors" / "predictors.safetensors", cache / "predictors" / "manifest.json"]
    return "-".join(file_hash(str(f)) for f in files) if all(f.is_file() for f in files) else None


def _packed_is_current(packed_dir: str, model_hash: str, cache, request: dict) -> bool:
    """Whether the packed model was made by this request from the cached profile and the
    cached predictors as they are now (`powerinfer train` may have replaced them since)."""
    from ..formats.packed import read_check, read_manifest
    from .train import file_hash

    try:
        m = read_manifest(packed_dir)
    except PowerInferError:
        return False
    stats = cache / "profile" / "stats.safetensors"
    return (m.source.hash == model_hash and m.prepare_request == request
            and stats.is_file() and m.profile_hash == file_hash(str(stats))
            and read_check(packed_dir) is not None and m.predictors_hash == _predictors_hash(cache))


def _profile(lm, cache, model_hash: str, s: PrepareSettings) -> Profile:
    from .profile import ProfileSettings, make_profile

    out = str(cache / "profile")
    try:
        prof = Profile.load(out, model_hash=model_hash)
        m = prof.manifest
        same = (m.get("dataset", {}).get("name") == s.dataset and m["dataset"].get("n_profile") == s.prompts
                and m["dataset"].get("n_heldout") == s.heldout and m["dataset"].get("max_tokens") == s.max_tokens
                and (m.get("max_ppl_increase") is None and m.get("target_sparsity") == s.target_sparsity
                     if s.target_sparsity is not None else m.get("max_ppl_increase") == s.max_ppl_increase))
        if prof.samples_dir() and same:
            _log(f"reusing the profile in {out}")
            return prof
    except PowerInferError:
        pass
    _log("profiling activations (step 1 of 4)")
    settings = ProfileSettings(target_sparsity=s.target_sparsity,
                               max_ppl_increase=None if s.target_sparsity is not None else s.max_ppl_increase,
                               seed=s.seed)
    return make_profile(lm, s.dataset, s.prompts, s.heldout, s.max_tokens, settings, out, in_cache=True)


def _predictors(lm, profile: Profile, cache, model_hash: str, s: PrepareSettings, hw):
    """The cached predictors, or new ones for the layers where one can pay (offline/worth.py);
    None when no layer can: the sparse engine then computes every row."""
    from ..engine.plan import PREDICTOR_BYPASS
    from .train import Predictors, TrainSettings, file_hash, model_scores, train_predictors
    from .worth import layers_worth_training

    out = str(cache / "predictors")
    settings = TrainSettings(recall=s.recall, budget=s.budget, seed=s.seed)
    a = lm.args
    worth = layers_worth_training(profile, a.d_model, a.gated_ffn, hw, settings, PREDICTOR_BYPASS)
    paying = {w.layer for w in worth if w.pays or s.predictors == "all"} if s.predictors != "none" else set()
    if not paying:
        shutil.rmtree(out, ignore_errors=True)  # our own artefact: stale predictors must not be packed later
        if s.predictors == "none":
            _log("--predictors none: step 2 of 4 skipped")
            return None
        _log(f"no layer's predictor can pay here (estimated predicted share {min(w.estimated for w in worth):.2f}-"
             f"{max(w.estimated for w in worth):.2f} of the neurons, predictor {min(w.predictor_cost for w in worth):.0%}+"
             " of the FFN's bytes): step 2 of 4 skipped, the sparse engine will compute the dense model")
        return None
    profile_hash = file_hash(os.path.join(profile.path, "stats.safetensors"))
    try:
        preds = Predictors.load(out, model_hash, profile_hash)
        trained = preds.manifest.get("settings", {})
        if (preds.manifest.get("magnitude_weighted") and trained.get("recall") == s.recall
                and trained.get("mass_recall") == TrainSettings.mass_recall
                and {i for i, p in enumerate(preds.layers) if p is not None} == paying):
            _log(f"reusing the predictors in {out}")
            return preds
    except PowerInferError:
        pass
    _log(f"training predictors for the {len(paying)} of {len(worth)} layers where one can pay (step 2 of 4)")
    preds = train_predictors(profile, lm.model.num_parameters(), settings, model_scores(lm.model, profile.criterion),
                             only=paying)
    preds.save(out, in_cache=True)
    return preds


# GGUF float tensor types -> the cost model's names (hardware.WEIGHT_BYTES); the block formats
# the engine keeps (ops/quant.FORMATS) are their lower-case names, other types widen to bf16
_GGUF_FLOAT_TYPES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}


def native_weight_types(path: str) -> str:
    """The weight type a native pack of the model at `path` puts on the GPU tier, as the
    solver's ROWS+DOWN pair: the gate/up (fc1) rows in the file's format (the widest over the
    layers), the down projection requantized to Q8_0 when it was quantized (offline/pack.py).
    An HF checkpoint keeps its float dtype."""
    from ..hardware import WEIGHT_BYTES
    from ..ops import quant

    if os.path.isdir(path):
        from ..formats.hf import open_hf_dir

        ckpt = open_hf_dir(path)
        ffn = [n for n in ckpt.tensor_names() if n.endswith(".weight") and any(
            k in n for k in ("mlp.", "dense_h_to_4h", ".fc1."))]
        dtype = ckpt.dtype_of(ffn[0]) if ffn else None  # from the header: no tensor read
        return {"F16": "fp16", "BF16": "bf16"}.get(dtype, "fp32")
    from ..formats.gguf_check import read_header

    tensors = read_header(path, os.path.getsize(path)).tensors
    rows, down = set(), set()
    for name, t in tensors.items():
        ggml = t.tensor_type.name
        kind = ggml.lower() if ggml in quant.FORMATS else _GGUF_FLOAT_TYPES.get(ggml, "bf16")
        if name.endswith((".ffn_gate.weight", ".ffn_up.weight")):
            rows.add(kind)
        elif name.endswith(".ffn_down.weight"):
            down.add("q8_0" if kind.startswith("q") else kind)
    if not rows:
        raise BadArgumentError(f"{path}: no FFN weights (ffn_gate/ffn_up) in the file")
    widest = lambda kinds: max(kinds, key=lambda k: WEIGHT_BYTES[k])  # noqa: E731
    r = widest(rows)
    d = widest(down) if down else r
    return r if d == r else f"{r}+{d}"


def _placement(profile: Profile, hw, budget: int, cache, model_hash: str, s: PrepareSettings,
               path: str) -> dict | None:
    if not hw.has_gpu:
        _log(f"hardware {hw.name} has no GPU: every neuron on the CPU tier (step 3 of 4 skipped)")
        return None
    from ..hardware import offload_baseline
    from .solve import build_problem, greedy, placement_document, shape_from_manifest, solve_auto

    out = cache / f"placement-{hw.name}-{budget}.json"
    if out.is_file():
        try:
            doc = json.loads(out.read_text())
            if doc.get("model_hash") == model_hash and doc.get("profile") == profile.path:
                _log(f"reusing the placement {out}")
                return doc
        except (OSError, ValueError):
            pass
    _log(f"solving the placement for {hw.name} (step 3 of 4)")
    shape = shape_from_manifest(profile.manifest)
    weights, dense_ok = s.weights, True
    if s.dtype == "native":  # the GPU tier holds the file's blocks: their real bytes per neuron
        # dense layers of blocks stay on the CPU: their bytes per tensor format are not counted yet
        weights, dense_ok = native_weight_types(path), False
        _log(f"the solver counts {weights} bytes per neuron (gate/up rows + down column, as packed)")
    problem, best = solve_auto(lambda dense: build_problem(profile, shape, hw, budget, weights,
                                                           dense_on_gpu=dense and dense_ok))
    doc = placement_document(problem, best, {"greedy": greedy(problem)},
                             offload_baseline(shape, hw, weights, budget), model_hash, profile.path)
    write_json(str(out), doc, indent=None)
    return doc
