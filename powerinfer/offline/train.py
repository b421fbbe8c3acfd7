"""`powerinfer train`: one activation predictor per layer, sized per layer.

Predictor: logits = W2 relu(W1 x + b1) + b2, W1 (r x d), W2 (n_ff x r); a neuron is
predicted active when its logit exceeds the layer's threshold tau. Trained with a
class-weighted BCE on the profiler's (FFN input, active mask) samples, full-batch-free
(mini-batches of whole tensors, no per-sample Python), Adam, early stopping on validation.

tau is chosen on validation so that recall (share of truly active (token, neuron) pairs
that are predicted) reaches the target R; what a bigger predictor buys is then precision
(fewer neurons computed for nothing), so sizing compares precision at recall R:

* the starting rank comes from the layer's sparsity and skew (sparser, more skewed layers
  start smaller): r0 = clip(d * (1 - sparsity) * (1 - gini / 2), r_min, r_max), to a power of 2;
* shrink: halve r while precision stays within `tolerance` of the best precision seen;
* grow: double r while that raises precision by more than `tolerance`;
* budget: while all predictors together exceed F x the model's parameters, move the layer
  whose next-smaller tried rank loses the least precision per parameter saved to it.

With the samples' true scores (magnitude-weighted training), each candidate also gets its
heaviest misses made always-on until the layer keeps `mass_recall` of the activation mass
(see `force_heavy_misses`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..errors import BadArgumentError, PowerInferError
from ..manifest import read_manifest
from ..paths import Artefact, staged_dir
from .stats import Profile

FORMAT = "powerinfer-predictors"
FORMAT_VERSION = 1
ARTEFACT = Artefact(FORMAT, "set of predictors", frozenset({"manifest.json", "predictors.safetensors", "eval.json"}))


class PredictorError(PowerInferError):
    """Predictor files missing, corrupt, or made for another model or profile."""


@dataclass
class TrainSettings:
    recall: float = 0.95
    recall_margin: float = 0.015  # tau is set for recall + margin on validation: held-out prompts drift
    budget: float = 0.10  # max predictor / model parameter ratio
    tolerance: float = 0.02  # precision difference that counts as "holds" / "buys"
    r_min: int = 8
    r_max: int = 1024
    epochs: int = 20
    batch_size: int = 1024
    lr: float = 1e-2
    val_fraction: float = 0.2
    patience: int = 4
    max_samples: int = 4096  # per layer; more buys little and costs minutes
    magnitude_cap: float = 20.0  # with scores: a positive's loss weight is (score / mean)^power, capped here
    magnitude_power: float = 1.0
    # with scores: neurons the predictor misses most (by activation mass) are made always-on
    # until the layer's mass recall reaches this, at most max_forced of its neurons
    mass_recall: float = 0.99
    max_forced: float = 0.05
    seed: int = 0


@dataclass
class LayerPredictor:
    w1: torch.Tensor  # (r, d)
    b1: torch.Tensor
    w2: torch.Tensor  # (n_ff, r)
    b2: torch.Tensor
    threshold: float
    recall: float
    precision: float
    predicted_sparsity: float
    true_sparsity: float
    tried: dict[int, float]  # rank -> precision at the recall target
    mass_recall: float | None = None  # share of the true activation mass predicted (with scores)
    forced: list[int] = field(default_factory=list)  # always-on neurons (their b2 is ALWAYS_ON)

    @property
    def rank(self) -> int:
        return int(self.w1.shape[0])

    @property
    def n_params(self) -> int:
        return sum(t.numel() for t in (self.w1, self.b1, self.w2, self.b2))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)

    def active(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x) > self.threshold


def load_samples(profile: Profile, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x fp32 (N, d), mask bool (N, n_ff)) of one layer's profiled samples."""
    root = profile.samples_dir()
    if root is None:
        raise BadArgumentError(f"{profile.path}: the profile has no training samples (re-run profile with "
                               "--sample-tokens > 0)")
    n = int(profile.manifest["samples"]["count"])
    try:
        x = np.load(os.path.join(root, f"x.{layer}.npy"), mmap_mode="r")[:n]
        m = np.load(os.path.join(root, f"mask.{layer}.npy"), mmap_mode="r")[:n]
    except (OSError, ValueError) as e:
        raise BadArgumentError(f"{root}: samples of layer {layer} are missing or corrupt ({e})") from None
    n_ff = profile.layers[layer].n_ff
    mask = np.unpackbits(np.asarray(m), axis=1)[:, :n_ff].astype(bool)
    return torch.from_numpy(np.asarray(x, dtype=np.float32)), torch.from_numpy(mask)


def recall_threshold(logits: torch.Tensor, target: torch.Tensor, recall: float) -> float:
    """The largest tau with recall(logits > tau) >= `recall` over all (token, neuron) pairs."""
    pos = logits[target]
    if pos.numel() == 0:
        return float("inf")
    k = int(math.floor((1 - recall) * pos.numel()))  # positives allowed below tau
    if k == 0:
        return float(pos.min()) - 1e-6
    return float(torch.kthvalue(pos.flatten(), k).values)


def evaluate(logits: torch.Tensor, target: torch.Tensor, tau: float) -> dict[str, float]:
    pred = logits > tau
    tp = (pred & target).sum().item()
    return {"recall": tp / max(target.sum().item(), 1), "precision": tp / max(pred.sum().item(), 1),
            "predicted_sparsity": 1 - pred.float().mean().item(), "true_sparsity": 1 - target.float().mean().item()}


ALWAYS_ON = 1e4  # an always-on neuron's output bias: its logit clears any threshold


def mass_recall(logits: torch.Tensor, target: torch.Tensor, score: torch.Tensor, tau: float) -> float:
    """Share of the true activation mass (sum of scores of active pairs) that is predicted."""
    active = score * target
    return float((active * (logits > tau)).sum() / active.sum().clamp_min(1e-12))


def force_heavy_misses(p: LayerPredictor, x_va: torch.Tensor, y_va: torch.Tensor, score_va: torch.Tensor,
                       s: TrainSettings) -> LayerPredictor:
    """Make the neurons whose misses lose the most activation mass always-on, until the mass
    recall on validation reaches `s.mass_recall` or `s.max_forced` of the neurons are forced.

    Why: a count-recall threshold treats every miss alike, but on SiLU models a few neurons
    fire rarely and hugely (SmolLM2 layer 11: count recall 0.97 kept only 0.78 of the mass),
    and those misses are what costs perplexity. Forcing is done through b2, so the engine
    needs nothing new; recall can only go up."""
    with torch.no_grad():
        logits = p.logits(x_va)
        missed = (score_va * (y_va & ~(logits > p.threshold))).sum(0)
        total = float((score_va * y_va).sum().clamp_min(1e-12))
        got = total - float(missed.sum())
        forced: list[int] = []
        for i in torch.argsort(missed, descending=True).tolist()[: int(s.max_forced * p.b2.shape[0])]:
            if got / total >= s.mass_recall or missed[i] <= 0:
                break
            forced.append(i)
            got += float(missed[i])
        b2 = p.b2.clone()
        b2[forced] = ALWAYS_ON
        logits = F.linear(F.relu(F.linear(x_va, p.w1, p.b1)), p.w2, b2)  # as the forced predictor's
        m = evaluate(logits, y_va, p.threshold)
        return LayerPredictor(p.w1, p.b1, p.w2, b2, p.threshold, m["recall"], m["precision"], m["predicted_sparsity"],
                              m["true_sparsity"], p.tried, mass_recall(logits, y_va, score_va, p.threshold),
                              sorted(forced))


def magnitude_weights(score: torch.Tensor, active: torch.Tensor, cap: float, power: float = 1.0) -> torch.Tensor:
    """Per-(token, neuron) loss weights: 1 for inactive pairs, score / mean active score
    (clamped to [1/cap, cap]) for active ones, so missing a strong activation costs more than
    missing a barely-active one; the threshold still targets the count recall."""
    w = torch.ones_like(score)
    pos = score[active]
    if pos.numel():
        rel = (pos / pos.mean().clamp_min(1e-12)) ** power
        w[active] = (rel / rel.mean()).clamp(1 / cap, cap)
    return w


def train_one(x_tr: torch.Tensor, y_tr: torch.Tensor, x_va: torch.Tensor, y_va: torch.Tensor, rank: int,
              s: TrainSettings, w_tr: torch.Tensor | None = None) -> tuple[LayerPredictor, dict]:
    """Train a rank-`rank` predictor; early-stop on validation precision at the recall target.
    `w_tr`: optional per-element loss weights (see magnitude_weights)."""
    g = torch.Generator().manual_seed(s.seed + rank)
    d, n_ff = x_tr.shape[1], y_tr.shape[1]
    w1 = (torch.randn(rank, d, generator=g) / math.sqrt(d)).requires_grad_()
    b1 = torch.zeros(rank, requires_grad=True)
    w2 = (torch.randn(n_ff, rank, generator=g) / math.sqrt(rank)).requires_grad_()
    rate = y_tr.float().mean(0).clamp(1e-4, 1 - 1e-4)
    b2 = torch.log(rate / (1 - rate)).clone().requires_grad_()  # start at each neuron's base rate
    params = [w1, b1, w2, b2]
    opt = torch.optim.Adam(params, lr=s.lr)
    pos = y_tr.float().mean().clamp(1e-4, 1 - 1e-4)
    pos_weight = ((1 - pos) / pos).clamp(max=50.0)  # class weighting: misses cost more than extras
    best, best_state, stale = -1.0, None, 0
    for _ in range(s.epochs):
        order = torch.randperm(x_tr.shape[0], generator=g)
        for i in range(0, len(order), s.batch_size):
            idx = order[i : i + s.batch_size]
            logits = F.linear(F.relu(F.linear(x_tr[idx], w1, b1)), w2, b2)
            loss = F.binary_cross_entropy_with_logits(logits, y_tr[idx].float(), pos_weight=pos_weight,
                                                      weight=None if w_tr is None else w_tr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        with torch.no_grad():
            logits = F.linear(F.relu(F.linear(x_va, w1, b1)), w2, b2)
            tau = recall_threshold(logits, y_va, min(s.recall + s.recall_margin, 0.999))
            precision = evaluate(logits, y_va, tau)["precision"]
        if precision > best + 1e-4:
            best, best_state, stale = precision, [p.detach().clone() for p in params], 0
        else:
            stale += 1
            if stale >= s.patience:
                break
    w1, b1, w2, b2 = best_state
    with torch.no_grad():
        logits = F.linear(F.relu(F.linear(x_va, w1, b1)), w2, b2)
        tau = recall_threshold(logits, y_va, min(s.recall + s.recall_margin, 0.999))
        metrics = evaluate(logits, y_va, tau)
    return LayerPredictor(w1, b1, w2, b2, tau, metrics["recall"], metrics["precision"],
                          metrics["predicted_sparsity"], metrics["true_sparsity"], {}), metrics


def _pow2_clip(r: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, 2 ** round(math.log2(max(r, 1))))))


def _pow2_floor(r: int) -> int:
    return 2 ** int(math.floor(math.log2(max(r, 1))))


def start_rank(d: int, sparsity: float, gini: float, s: TrainSettings) -> int:
    return _pow2_clip(d * (1 - sparsity) * (1 - gini / 2), s.r_min, min(s.r_max, d))


def size_layer(x: torch.Tensor, y: torch.Tensor, sparsity: float, gini: float, s: TrainSettings,
               bar: tqdm | None = None, r_cap: int | None = None,
               score: torch.Tensor | None = None) -> dict[int, LayerPredictor]:
    """Train the ranks the shrink/grow rule visits (never above r_cap); returns every trained
    candidate. `score` (N, n_ff): the samples' neuron scores, for magnitude-weighted training."""
    if x.shape[0] > s.max_samples:
        keep = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(s.seed))[: s.max_samples]
        x, y = x[keep], y[keep]
        score = None if score is None else score[keep]
    n = x.shape[0]
    n_va = max(1, int(n * s.val_fraction))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(s.seed))
    va, tr = perm[:n_va], perm[n_va:]
    x_tr, y_tr, x_va, y_va = x[tr], y[tr], x[va], y[va]
    w_tr = None if score is None else magnitude_weights(score[tr], y_tr, s.magnitude_cap, s.magnitude_power)
    d = x.shape[1]
    r_hi = min(s.r_max, d, r_cap or s.r_max)
    tried: dict[int, LayerPredictor] = {}

    def fit(r: int) -> float:
        if r not in tried:
            p = train_one(x_tr, y_tr, x_va, y_va, r, s, w_tr)[0]
            tried[r] = p if score is None else force_heavy_misses(p, x_va, y_va, score[va], s)
            if bar is not None:
                bar.set_postfix(rank=r, precision=f"{tried[r].precision:.3f}")
        return tried[r].precision

    r0 = min(start_rank(d, sparsity, gini, s), _pow2_floor(r_hi))
    fit(r0)
    r = r0
    while r * 2 <= r_hi and fit(r * 2) > tried[r].precision + s.tolerance:  # grow while it buys
        r *= 2
    best = max(p.precision for p in tried.values())
    r = r0
    while r // 2 >= s.r_min and fit(r // 2) >= best - s.tolerance:  # shrink while it holds
        r //= 2
    return tried


def choose_ranks(candidates: list[dict[int, LayerPredictor] | None], s: TrainSettings,
                 model_params: int) -> list[int | None]:
    """Per layer the smallest rank within tolerance of its best; then fit the budget. Layers
    without candidates (not trained) get None."""
    chosen: list[int | None] = []
    for tried in candidates:
        if tried is None:
            chosen.append(None)
            continue
        best = max(p.precision for p in tried.values())
        chosen.append(min(r for r, p in tried.items() if p.precision >= best - s.tolerance))
    limit = s.budget * model_params
    total = lambda: sum(candidates[l][r].n_params for l, r in enumerate(chosen) if r is not None)
    while total() > limit:
        options = []
        for l, r in enumerate(chosen):
            if r is None:
                continue
            smaller = [q for q in candidates[l] if q < r]
            if smaller:
                q = max(smaller)
                saved = candidates[l][r].n_params - candidates[l][q].n_params
                lost = candidates[l][r].precision - candidates[l][q].precision
                options.append((lost / saved, l, q))
        if not options:
            raise BadArgumentError(f"predictors cannot fit {s.budget:.0%} of the model's parameters even at their "
                                   f"smallest trained ranks ({total()} > {limit:.0f}); raise --budget or lower r_min")
        _, l, q = min(options)
        chosen[l] = q
    return chosen


def file_hash(path: str) -> str:
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Predictors:
    layers: list[LayerPredictor]
    manifest: dict

    def save(self, out_dir: str, in_cache: bool = False) -> None:
        """Write to `out_dir` through a staged folder (paths.staged_dir): a new folder, an
        empty one or our own predictors (the caller has checked), or with `in_cache` ours."""
        with staged_dir(out_dir, ARTEFACT, in_cache) as tmp:
            self._write(tmp)

    def _write(self, out_dir: str) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for i, p in enumerate(self.layers):
            for name in ("w1", "b1", "w2", "b2") if p is not None else ():
                tensors[f"layers.{i}.{name}"] = getattr(p, name).contiguous()
        save_file(tensors, os.path.join(out_dir, "predictors.safetensors"))
        layers = [{"layer": i, "rank": p.rank, "threshold": p.threshold, "recall": p.recall, "precision": p.precision,
                   "predicted_sparsity": p.predicted_sparsity, "true_sparsity": p.true_sparsity,
                   "params": p.n_params, "tried": {str(k): v for k, v in p.tried.items()},
                   "mass_recall": p.mass_recall, "forced": p.forced} if p is not None else {"layer": i, "skipped": True}
                  for i, p in enumerate(self.layers)]
        self.manifest = {**self.manifest, "format": FORMAT, "format_version": FORMAT_VERSION, "layers": layers}
        with open(os.path.join(out_dir, "manifest.json"), "w") as f:
            json.dump(self.manifest, f, indent=1)

    @classmethod
    def load(cls, path: str, model_hash: str | None = None, profile_hash: str | None = None) -> "Predictors":
        """Read predictors; refuse them clearly when corrupt or made for another model/profile."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        manifest = read_manifest(os.path.join(path, "manifest.json"), FORMAT, "predictors",
                                 f"{path}: no predictors here (no manifest.json); run `powerinfer train`", PredictorError)
        if model_hash is not None and manifest.get("model_hash") != model_hash:
            raise PredictorError(f"{path}: predictors were trained for model {manifest.get('model_hash')}, "
                                 f"not this one ({model_hash})")
        if profile_hash is not None and manifest.get("profile_hash") != profile_hash:
            raise PredictorError(f"{path}: predictors were trained on another profile "
                                 f"({manifest.get('profile_hash')} != {profile_hash}); retrain")
        try:
            tensors = load_file(os.path.join(path, "predictors.safetensors"))
        except (SafetensorError, OSError, ValueError) as e:
            raise PredictorError(f"{path}/predictors.safetensors: missing or corrupt ({e})") from None
        layers = []
        for i, info in enumerate(manifest.get("layers", [])):
            if info.get("skipped"):
                layers.append(None)
                continue
            try:
                w1, b1, w2, b2 = (tensors[f"layers.{i}.{n}"] for n in ("w1", "b1", "w2", "b2"))
            except KeyError:
                raise PredictorError(f"{path}: layer {i} tensors are missing") from None
            if w1.shape[0] != info["rank"] or w2.shape[1] != info["rank"]:
                raise PredictorError(f"{path}: layer {i} tensors do not match rank {info['rank']}")
            layers.append(LayerPredictor(w1, b1, w2, b2, info["threshold"], info["recall"], info["precision"],
                                         info["predicted_sparsity"], info["true_sparsity"],
                                         {int(k): v for k, v in info.get("tried", {}).items()},
                                         info.get("mass_recall"), list(info.get("forced", []))))
        return cls(layers, manifest)


def model_scores(model, criterion: str) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """`scores` for train_predictors from the dense model's own FFNs (what the profile scored)."""
    from ..ops.criterion import scores as neuron_scores
    from .profile import dense_ffns

    ffns = dense_ffns(model)

    @torch.inference_mode()
    def scores(layer: int, x: torch.Tensor) -> torch.Tensor:
        out = []
        for i in range(0, x.shape[0], 1024):
            a, u = ffns[layer].parts(x[i : i + 1024])
            out.append(neuron_scores(a, u, criterion))
        return torch.cat(out)

    return scores


def train_predictors(profile: Profile, model_params: int, s: TrainSettings,
                     scores: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
                     only: set[int] | None = None) -> Predictors:
    """Size, train and budget one predictor per layer from the profile's samples.

    `scores(layer, x) -> (N, n_ff)`: the true neuron scores of the samples (from the model,
    see `model_scores`); given, training weights each miss by how strongly the neuron fired.
    `only`: train just these layers (the others get None: no predictor)."""
    torch.manual_seed(s.seed)
    candidates: list[dict[int, LayerPredictor] | None] = []
    todo = [i for i in range(len(profile.layers)) if only is None or i in only]
    with tqdm(todo, desc="train predictors", unit="layer") as bar:
        for i in range(len(profile.layers)):
            if i not in todo:
                candidates.append(None)
                continue
            bar.update(1)
            x, y = load_samples(profile, i)
            if x.shape[0] < 10:
                raise BadArgumentError(f"{profile.path}: only {x.shape[0]} samples; profile more tokens")
            st = profile.layers[i]
            # no layer trains ranks beyond twice its fair share of the budget
            fair = s.budget * model_params / len(profile.layers) / (x.shape[1] + st.n_ff + 1)
            score = None if scores is None else scores(i, x)
            candidates.append(size_layer(x, y, st.sparsity, st.gini, s, bar, r_cap=max(s.r_min, _pow2_floor(int(2 * fair))),
                                         score=score))
    ranks = choose_ranks(candidates, s, model_params)
    layers: list[LayerPredictor | None] = []
    for tried, r in zip(candidates, ranks):
        if tried is None:
            layers.append(None)
            continue
        p = tried[r]
        p.tried = {q: c.precision for q, c in sorted(tried.items())}
        layers.append(p)
    total = sum(p.n_params for p in layers if p is not None)
    manifest = {"model_hash": profile.model_hash, "profile_hash": file_hash(os.path.join(profile.path, "stats.safetensors")),
                "profile": profile.path, "settings": asdict(s), "predictor_params": total, "model_params": model_params,
                "param_ratio": total / model_params, "magnitude_weighted": scores is not None}
    return Predictors(layers, manifest)
