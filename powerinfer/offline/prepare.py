"""`prepare`: the whole offline pipeline (profile, train, solve, pack) for one model, cached.

Every artefact lives in the model's cache directory (paths.model_cache_dir) and is reused
when it is still valid for the model (content hash), the profile (stats hash) and the
requested hardware, budget and dtype; a second run with the same request does nothing but
these checks. Without a GPU the placement is all-CPU and the solve step is skipped.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from ..errors import BadArgumentError, PowerInferError
from ..paths import content_hash, model_cache_dir
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
    from ..commands.hardware import measure

    return measure()


def prepare(model_path: str | None, s: PrepareSettings, lm=None) -> str:
    """Run (or reuse) every offline step for the model; returns the packed model directory."""
    from ..loader import resolve_model_path
    from .pack import PACK_REVISION

    path = resolve_model_path(model_path)
    model_hash = content_hash(path)
    cache = model_cache_dir(model_hash)
    hw = resolve_hardware(s.hardware)
    budget = (s.vram_budget if s.vram_budget is not None else hw.gpu_memory) if hw.has_gpu else 0
    if hw.has_gpu and not 0 < budget <= hw.gpu_memory:
        raise BadArgumentError(f"VRAM budget {budget / 2**30:.2f} GiB is not within the {hw.name}'s "
                               f"{hw.gpu_memory / 2**30:.2f} GiB")
    packed_dir = default_packed_dir(model_hash)
    request = {"hardware": hw.name, "budget": budget, "dtype": s.dtype, "predictor_loss": "magnitude-weighted, heavy misses forced",
               "pack_revision": PACK_REVISION}
    if _packed_is_current(packed_dir, model_hash, cache, request):
        _log(f"{packed_dir} is up to date ({hw.name}, budget {budget} bytes, {s.dtype})")
        return packed_dir
    if lm is None:
        from ..loader import load

        _log(f"loading {path}")
        lm = load(path, dtype="fp32")
    profile = _profile(lm, cache, model_hash, s)
    predictors = _predictors(lm, profile, cache, model_hash, s)
    placement = _placement(profile, hw, budget, cache, model_hash, s)
    from .pack import pack_model

    _log(f"packing into {packed_dir}")
    manifest = pack_model(path, packed_dir, profile, predictors, placement, s.dtype, force=True)
    manifest["prepare_request"] = request
    manifest["predictors_hash"] = _predictors_hash(cache)
    manifest["placement"]["hardware"] = hw.name
    manifest["check"] = check_sparse(lm, packed_dir, profile, predictors, s)
    with open(os.path.join(packed_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return packed_dir


QUALITY_SLACK = 0.02  # sparse may cost this much held-out perplexity over dense and still be the default
# ... and must decode at least this much faster: closer than that the two are within this
# machine's run-to-run noise (SmolLM2, where both run the same kernels, measured 44.6 vs 41.8
# tok/s), and a tie should not trade quality for nothing
MIN_SPEEDUP = 1.05


def check_sparse(lm, packed_dir: str, profile: Profile, predictors, s: PrepareSettings) -> dict:
    """Measure what `--mode auto` should pick: the sparse engine only when it decodes at least
    MIN_SPEEDUP times as fast as the dense one here and its held-out perplexity is within
    QUALITY_SLACK of dense."""
    from ..bench.timing import decode_round
    from ..engine.packed import load_packed
    from .evaluate import bypassed_layers, engine_variant, heldout_texts
    from .profile import instrumented, perplexity, tokenize

    _log("checking the sparse engine's speed and quality against dense")
    texts = heldout_texts(profile, 16) if s.heldout else []
    ppl = {}
    sparse = load_packed(packed_dir, mode="sparse", dtype=s.dtype, with_tokenizer=False).model
    if texts:  # what the engine computes: predicted neurons, the true ones where bypassed, all where exact
        tokens = tokenize(lm, texts, s.max_tokens)
        ppl["dense"] = perplexity(lm.model, tokens, "dense ppl")
        predict, thresholds = engine_variant(predictors.layers, profile.thresholds, *bypassed_layers(sparse))
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
    return {"tokens_per_s": tps, "perplexity": ppl, "auto_mode": mode, "quality_slack": QUALITY_SLACK,
            "min_speedup": MIN_SPEEDUP}


def _predictors_hash(cache) -> str | None:
    """The cached predictors' identity: their tensors and their manifest (thresholds live there)."""
    from .train import file_hash

    files = [cache / "predictors" / "predictors.safetensors", cache / "predictors" / "manifest.json"]
    return "-".join(file_hash(str(f)) for f in files) if all(f.is_file() for f in files) else None


def _packed_is_current(packed_dir: str, model_hash: str, cache, request: dict) -> bool:
    """Whether the packed model was made by this request from the cached profile and the
    cached predictors as they are now (`powerinfer train` may have replaced them since)."""
    from .train import file_hash

    try:
        with open(os.path.join(packed_dir, "manifest.json")) as f:
            m = json.load(f)
        stats = cache / "profile" / "stats.safetensors"
        return (m.get("source", {}).get("hash") == model_hash and m.get("prepare_request") == request
                and stats.is_file() and m.get("profile_hash") == file_hash(str(stats))
                and m.get("predictors") is not None and m.get("check") is not None
                and m.get("predictors_hash") is not None and m.get("predictors_hash") == _predictors_hash(cache))
    except (OSError, ValueError):
        return False


def _profile(lm, cache, model_hash: str, s: PrepareSettings) -> Profile:
    from ..commands.profile import make_profile
    from .profile import ProfileSettings

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
    return make_profile(lm, s.dataset, s.prompts, s.heldout, s.max_tokens, settings, out)


def _predictors(lm, profile: Profile, cache, model_hash: str, s: PrepareSettings):
    from .train import Predictors, TrainSettings, file_hash, model_scores, train_predictors

    out = str(cache / "predictors")
    profile_hash = file_hash(os.path.join(profile.path, "stats.safetensors"))
    try:
        preds = Predictors.load(out, model_hash, profile_hash)
        trained = preds.manifest.get("settings", {})
        if (preds.manifest.get("magnitude_weighted") and trained.get("recall") == s.recall
                and trained.get("mass_recall") == TrainSettings.mass_recall):
            _log(f"reusing the predictors in {out}")
            return preds
    except PowerInferError:
        pass
    _log("training predictors (step 2 of 4)")
    preds = train_predictors(profile, lm.model.num_parameters(), TrainSettings(recall=s.recall, budget=s.budget,
                                                                                seed=s.seed),
                             model_scores(lm.model, profile.criterion))
    preds.save(out)
    return preds


def _placement(profile: Profile, hw, budget: int, cache, model_hash: str, s: PrepareSettings) -> dict | None:
    if not hw.has_gpu:
        _log(f"hardware {hw.name} has no GPU: every neuron on the CPU tier (step 3 of 4 skipped)")
        return None
    from ..commands.solve import shape_from_manifest
    from ..hardware import offload_baseline
    from .solve import build_problem, greedy, placement_document, solve_auto

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
    problem, best = solve_auto(lambda dense: build_problem(profile, shape, hw, budget, s.weights, dense_on_gpu=dense))
    doc = placement_document(problem, best, {"greedy": greedy(problem)},
                             offload_baseline(shape, hw, s.weights, budget), model_hash, profile.path)
    out.write_text(json.dumps(doc))
    return doc
