"""`powerinfer profile`: per-neuron activation statistics, calibrated thresholds and
predictor-training samples, from running the dense model over a prompt set.

Passes over the profiling split (prefill only, one prompt at a time):
1. calibration (SiLU/GELU models): a fine log-histogram of every layer's neuron scores,
   from which the per-layer threshold for a target sparsity is read off exactly, or the
   largest sparsity whose held-out perplexity stays within the allowed increase is searched;
2. counting: per neuron, how many tokens have score > threshold, plus a reservoir sample of
   (FFN input, active mask) pairs, memory-mapped on disk, for predictor training.
ReLU-family models skip calibration: active means output > 0 (threshold 0).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from ..errors import BadArgumentError
from ..loader import LoadedModel
from ..models.base import Model
from ..models.ffn import DenseFFN, InstrumentedFFN
from .stats import LayerStats, Profile

TOOL_VERSION = "0.1.0"
LOG_MIN, LOG_MAX, BINS = -12.0, 4.0, 8192  # score histogram: log10 range and resolution


@dataclass
class ProfileSettings:
    criterion: str = "gate_up"
    target_sparsity: float | None = 0.5  # ignored for ReLU models unless given explicitly
    max_ppl_increase: float | None = None
    sample_tokens: int = 8192
    sample_bytes: int = 2 << 30
    seed: int = 0
    eval_sparsities: tuple[float, ...] = ()


def is_relu_family(model: Model) -> bool:
    return model.args.act == "relu"


def dense_ffns(model: Model) -> list[DenseFFN]:
    ffns = []
    for layer in model.layers:
        ffn = layer.ffn.ffn if isinstance(layer.ffn, InstrumentedFFN) else layer.ffn
        if not isinstance(ffn, DenseFFN):
            raise BadArgumentError("profiling needs the dense model (got a sparse FFN)")
        ffns.append(ffn)
    return ffns


class instrumented:
    """Context manager: wrap every layer's FFN in an InstrumentedFFN, restore on exit."""

    def __init__(self, model: Model, criterion: str, thresholds: list[float] | None = None,
                 observers: list[Callable[[torch.Tensor, torch.Tensor], None]] | None = None,
                 predictors: list[Callable[[torch.Tensor], torch.Tensor]] | None = None):
        self.model, self.criterion, self.thresholds, self.observers = model, criterion, thresholds, observers
        self.predictors = predictors

    def __enter__(self) -> Model:
        self.saved = [layer.ffn for layer in self.model.layers]
        for i, (layer, ffn) in enumerate(zip(self.model.layers, dense_ffns(self.model))):
            layer.ffn = InstrumentedFFN(ffn, self.criterion, None if self.thresholds is None else self.thresholds[i],
                                        None if self.observers is None else self.observers[i],
                                        None if self.predictors is None else self.predictors[i])
        return self.model

    def __exit__(self, *exc) -> None:
        for layer, ffn in zip(self.model.layers, self.saved):
            layer.ffn = ffn


def tokenize(lm: LoadedModel, texts: list[str], max_tokens: int) -> list[torch.Tensor]:
    """Token ids of each text, truncated to max_tokens; texts under 2 tokens are dropped."""
    if lm.tokenizer is None:
        raise BadArgumentError(f"{lm.path}: the model has no tokenizer; profiling needs text")
    out = []
    for text in texts:
        ids = lm.tokenizer.encode(text)[:max_tokens]
        if len(ids) >= 2:
            out.append(torch.tensor(ids))
    return out


def run_prefill(model: Model, token_lists: list[torch.Tensor], desc: str,
                before_each: Callable[[int], None] | None = None) -> None:
    with tqdm(total=sum(len(t) for t in token_lists), desc=desc, unit="tok", leave=False) as bar:
        for tokens in token_lists:
            if before_each is not None:
                before_each(len(tokens))
            model.forward(tokens, model.new_cache(len(tokens)))
            bar.update(len(tokens))


@torch.inference_mode()
def perplexity(model: Model, token_lists: list[torch.Tensor], desc: str = "perplexity") -> float:
    """exp(mean next-token NLL) over the texts."""
    nll, count = 0.0, 0
    for tokens in tqdm(token_lists, desc=desc, unit="text", leave=False):
        logits = model.forward(tokens, model.new_cache(len(tokens)), all_logits=True)
        nll += float(torch.nn.functional.cross_entropy(logits[:-1], tokens[1:], reduction="sum"))
        count += len(tokens) - 1
    return math.exp(nll / max(count, 1))


class ScoreHistogram:
    """Per-layer histogram of log10(score); reads off the score at any quantile."""

    def __init__(self, n_layers: int):
        self.hist = torch.zeros(n_layers, BINS + 2, dtype=torch.float64)  # [<= LOG_MIN, bins..., > LOG_MAX]

    def observer(self, layer: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
        def observe(x: torch.Tensor, score: torch.Tensor) -> None:
            logs = torch.log10(score.float().flatten().clamp_min(1e-30))
            pos = ((logs - LOG_MIN) / (LOG_MAX - LOG_MIN) * BINS).floor().clamp(-1, BINS).long() + 1
            self.hist[layer] += torch.bincount(pos, minlength=BINS + 2).double()

        return observe

    def threshold(self, layer: int, sparsity: float) -> float:
        """The score below which a `sparsity` share of this layer's scores lie."""
        if sparsity <= 0:
            return 0.0 if self.hist[layer, 0] == 0 else 10**LOG_MIN
        cdf = torch.cumsum(self.hist[layer], 0) / self.hist[layer].sum()
        b = int(torch.searchsorted(cdf, torch.tensor(min(sparsity, 1.0), dtype=torch.float64)))
        b = min(b, BINS + 1)
        lo = float(cdf[b - 1]) if b > 0 else 0.0
        frac = (sparsity - lo) / max(float(cdf[b]) - lo, 1e-300)
        edge = LOG_MIN + (b - 1 + min(max(frac, 0.0), 1.0)) * (LOG_MAX - LOG_MIN) / BINS
        return float(10 ** min(max(edge, LOG_MIN), LOG_MAX))

    def thresholds(self, sparsity: float) -> list[float]:
        return [self.threshold(i, sparsity) for i in range(self.hist.shape[0])]


class Counter:
    """Per-neuron activation counts (score > threshold) and the reservoir of training samples."""

    def __init__(self, n_layers: int, n_ff: int, thresholds: list[float], reservoir: "Reservoir | None"):
        self.counts = torch.zeros(n_layers, n_ff, dtype=torch.int64)
        self.tokens = 0
        self.thresholds = thresholds
        self.reservoir = reservoir

    def observer(self, layer: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
        def observe(x: torch.Tensor, score: torch.Tensor) -> None:
            active = score > self.thresholds[layer]
            self.counts[layer] += active.sum(0)
            if self.reservoir is not None:
                self.reservoir.write(layer, x, active)

        return observe

    def before_prompt(self, n_tokens: int) -> None:
        self.tokens += n_tokens
        if self.reservoir is not None:
            self.reservoir.plan(n_tokens)


class Reservoir:
    """Uniform sample (reservoir sampling, seeded) of token positions; for each layer the FFN
    input x (fp16) and the packed active mask at those positions, in .npy memmaps."""

    def __init__(self, out_dir: str, capacity: int, n_layers: int, d_model: int, n_ff: int, seed: int):
        os.makedirs(out_dir, exist_ok=True)
        self.capacity, self.n_ff, self.seen = capacity, n_ff, 0
        self.rng = np.random.default_rng(seed)
        self.x = [np.lib.format.open_memmap(os.path.join(out_dir, f"x.{i}.npy"), mode="w+", dtype=np.float16,
                                            shape=(capacity, d_model)) for i in range(n_layers)]
        self.mask = [np.lib.format.open_memmap(os.path.join(out_dir, f"mask.{i}.npy"), mode="w+", dtype=np.uint8,
                                               shape=(capacity, (n_ff + 7) // 8)) for i in range(n_layers)]
        self.positions = np.zeros(0, dtype=np.int64)
        self.slots = np.zeros(0, dtype=np.int64)

    @staticmethod
    def bytes_needed(capacity: int, n_layers: int, d_model: int, n_ff: int) -> int:
        return capacity * n_layers * (2 * d_model + (n_ff + 7) // 8)

    def plan(self, n_tokens: int) -> None:
        """Choose which of the next n_tokens positions enter the sample, and where."""
        n = self.seen + np.arange(n_tokens)
        slot = np.where(n < self.capacity, n, self.rng.integers(0, n + 1))
        keep = slot < self.capacity
        positions, slots = np.nonzero(keep)[0], slot[keep]
        _, last = np.unique(slots[::-1], return_index=True)  # a slot hit twice keeps the later token
        chosen = np.sort(len(slots) - 1 - last)
        self.positions, self.slots = positions[chosen], slots[chosen]
        self.seen += n_tokens

    def write(self, layer: int, x: torch.Tensor, active: torch.Tensor) -> None:
        if len(self.positions):
            self.x[layer][self.slots] = x[self.positions].to(torch.float16).numpy()
            self.mask[layer][self.slots] = np.packbits(active[self.positions].numpy(), axis=1)

    @property
    def count(self) -> int:
        return min(self.seen, self.capacity)

    def flush(self) -> None:
        for arr in self.x + self.mask:
            arr.flush()


def search_sparsity(model: Model, hist: ScoreHistogram, heldout: list[torch.Tensor], criterion: str,
                    dense_ppl: float, max_increase: float, steps: int = 7) -> tuple[float, float]:
    """Largest sparsity (bisection over [0, 0.95]) whose held-out perplexity is within
    (1 + max_increase) x dense; returns (sparsity, its perplexity)."""
    lo, hi, best = 0.0, 0.95, (0.0, dense_ppl)
    for _ in range(steps):
        mid = (lo + hi) / 2
        with instrumented(model, criterion, hist.thresholds(mid)):
            ppl = perplexity(model, heldout, desc=f"ppl @ {mid:.2f}")
        if ppl <= dense_ppl * (1 + max_increase):
            lo, best = mid, (mid, ppl)
        else:
            hi = mid
    return best


def profile_model(lm: LoadedModel, profile_texts: list[str], heldout_texts: list[str], max_tokens: int,
                  settings: ProfileSettings, out_dir: str, manifest: dict) -> Profile:
    """Run the profiling passes and write the profile to out_dir."""
    model = lm.model
    a = model.args
    relu = is_relu_family(model)
    criterion = "gate" if relu else settings.criterion
    tokens = tokenize(lm, profile_texts, max_tokens)
    heldout = tokenize(lm, heldout_texts, max_tokens)
    if not tokens:
        raise BadArgumentError("no profiling prompt has 2 or more tokens")
    quality: dict[str, float] = {}
    hist = None
    calibrate = not relu or settings.target_sparsity is not None or settings.max_ppl_increase is not None
    if settings.max_ppl_increase is not None and not heldout:
        raise BadArgumentError("--max-ppl-increase needs held-out prompts (--heldout > 0)")
    if heldout and (settings.max_ppl_increase is not None or settings.eval_sparsities or calibrate):
        quality["dense_ppl"] = perplexity(model, heldout, "dense ppl")
    target = settings.target_sparsity
    if relu and settings.target_sparsity is None and settings.max_ppl_increase is None:
        thresholds = [0.0] * a.n_layers
    else:
        hist = ScoreHistogram(a.n_layers)
        with instrumented(model, criterion, observers=[hist.observer(i) for i in range(a.n_layers)]):
            run_prefill(model, tokens, "calibrate")
        if settings.max_ppl_increase is not None:
            target, quality["sparse_ppl"] = search_sparsity(model, hist, heldout, criterion, quality["dense_ppl"],
                                                            settings.max_ppl_increase)
        thresholds = hist.thresholds(target if target is not None else 0.0)
        if relu:  # a ReLU neuron at 0 is off whatever the calibration says
            thresholds = [max(t, 0.0) for t in thresholds]
    n_total = sum(len(t) for t in tokens)
    capacity = min(settings.sample_tokens, n_total)
    per_token = Reservoir.bytes_needed(1, a.n_layers, a.d_model, a.ffn_dim)
    capacity = min(capacity, settings.sample_bytes // per_token)
    reservoir = None
    if capacity > 0:
        samples_dir = os.path.join(out_dir, "samples")
        need = Reservoir.bytes_needed(capacity, a.n_layers, a.d_model, a.ffn_dim)
        os.makedirs(out_dir, exist_ok=True)
        if shutil.disk_usage(out_dir).free < need * 1.1:
            raise BadArgumentError(f"{out_dir}: not enough disk for {need / 2**20:.0f} MiB of samples "
                                   "(lower --sample-tokens or --sample-bytes)")
        reservoir = Reservoir(samples_dir, capacity, a.n_layers, a.d_model, a.ffn_dim, settings.seed)
    counter = Counter(a.n_layers, a.ffn_dim, thresholds, reservoir)
    t0 = time.perf_counter()
    with instrumented(model, criterion, observers=[counter.observer(i) for i in range(a.n_layers)]):
        run_prefill(model, tokens, "count", before_each=counter.before_prompt)
    count_seconds = time.perf_counter() - t0
    if reservoir is not None:
        reservoir.flush()
    if heldout and "sparse_ppl" not in quality and "dense_ppl" in quality and (target or 0) > 0:
        with instrumented(model, criterion, thresholds):
            quality["sparse_ppl"] = perplexity(model, heldout, "sparse ppl")
    if heldout and settings.eval_sparsities:
        if hist is None:
            raise BadArgumentError("--eval-sparsities needs calibration (give --target-sparsity)")
        for s in settings.eval_sparsities:
            with instrumented(model, criterion, hist.thresholds(s)):
                quality[f"ppl@{s:g}"] = perplexity(model, heldout, f"ppl @ {s:g}")
    layers = [LayerStats(counter.counts[i].numpy().copy(), counter.tokens, thresholds[i]) for i in range(a.n_layers)]
    manifest = {**manifest, "tool_version": TOOL_VERSION, "criterion": criterion, "target_sparsity": target,
                "max_ppl_increase": settings.max_ppl_increase, "tokens": counter.tokens, "quality": quality,
                "counting_tokens_per_s": counter.tokens / max(count_seconds, 1e-9),
                "samples": {"count": reservoir.count if reservoir else 0, "d_model": a.d_model,
                            "x_dtype": "float16", "mask": "packbits"}}
    prof = Profile(layers=layers, manifest=manifest)
    prof.save(out_dir)
    return prof


def model_shape_dict(args, path: str) -> dict:
    from dataclasses import asdict

    from ..hardware import shape_of_args

    return asdict(shape_of_args(args, os.path.basename(path.rstrip("/"))))


def make_profile(lm, dataset: str, n_prompts: int, n_heldout: int, max_tokens: int, settings, out_dir: str,
                 weights: str = "fp32", in_cache: bool = False):
    """Split the dataset, write split.json and profile `lm` into out_dir (shared with `prepare`),
    through a staged folder (paths.staged_dir): the caller has checked out_dir, or it is in
    our cache (`in_cache`)."""
    from ..paths import staged_dir
    from .stats import ARTEFACT

    with staged_dir(out_dir, ARTEFACT, in_cache) as tmp:
        prof = _make_profile(lm, dataset, n_prompts, n_heldout, max_tokens, settings, tmp, weights)
    prof.path = out_dir
    return prof


def _make_profile(lm, dataset: str, n_prompts: int, n_heldout: int, max_tokens: int, settings, out_dir: str,
                  weights: str):
    from ..data import load_prompts, split_prompts
    from ..paths import content_hash

    prompts = load_prompts(dataset)
    profile_set, heldout_set = split_prompts(prompts, n_prompts, n_heldout, settings.seed)
    a = lm.args
    manifest = {
        "model": {"hash": content_hash(lm.path), "path": os.path.abspath(lm.path), "family": a.family,
                  "name": os.path.basename(lm.path.rstrip("/")), "n_layers": a.n_layers, "d_model": a.d_model,
                  "n_ff": a.ffn_dim, "act": a.act, "dtype": weights, "shape": model_shape_dict(a, lm.path)},
        "dataset": {"name": dataset, "seed": settings.seed, "n_profile": len(profile_set),
                    "n_heldout": len(heldout_set), "max_tokens": max_tokens, "split_file": "split.json"},
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "split.json"), "w") as f:
        json.dump({"profile": [p.id for p in profile_set], "heldout": [p.id for p in heldout_set]}, f)
    return profile_model(lm, [p.text for p in profile_set], [p.text for p in heldout_set], max_tokens, settings,
                         out_dir, manifest)
