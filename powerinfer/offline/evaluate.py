"""`powerinfer train --eval`: predictors on held-out prompts, per layer and end to end.

Three variants of the model on the profile's held-out prompts: dense; oracle (neurons with
score <= threshold zeroed: the sparse model's definition); predicted (additionally zeroed
where the predictor says inactive: what the sparse engine computes). Reported: per layer
recall/precision of the predictor against the oracle mask, held-out perplexity, and greedy
agreement: over a dense greedy continuation of `gen_tokens` tokens, the share of positions
where the variant, fed the same prefix, picks the same next token (teacher-forced, so one
early difference does not count as all later ones).
"""

from __future__ import annotations

import json
import os

import torch
from tqdm import tqdm

from ..data import load_prompts
from ..errors import BadArgumentError
from ..engine.sample import greedy
from ..loader import LoadedModel
from .profile import instrumented, perplexity, tokenize
from .stats import Profile
from .train import Predictors


def heldout_texts(profile: Profile, limit: int) -> list[str]:
    split_path = os.path.join(profile.path, "split.json")
    if not os.path.isfile(split_path):
        raise BadArgumentError(f"{profile.path}: no split.json; cannot find the held-out prompts")
    with open(split_path) as f:
        ids = json.load(f)["heldout"][:limit]
    if not ids:
        raise BadArgumentError(f"{profile.path}: the profile kept no held-out prompts (--heldout 0)")
    by_id = {p.id: p.text for p in load_prompts(profile.manifest["dataset"]["name"])}
    return [by_id[i] for i in ids if i in by_id]


@torch.inference_mode()
def greedy_agreement(lm: LoadedModel, prompts: list[torch.Tensor], gen_tokens: int, variant) -> float:
    """Share of next-token choices equal to dense greedy's along dense's own continuation."""
    model = lm.model
    agree = total = 0
    for ids in tqdm(prompts, desc="greedy agreement", unit="prompt", leave=False):
        cache = model.new_cache(len(ids) + gen_tokens)
        logits = model.forward(ids, cache)
        dense = []
        for _ in range(gen_tokens):
            tok = greedy(logits)
            dense.append(tok)
            logits = model.forward(torch.tensor([tok]), cache)
        seq = torch.cat([ids, torch.tensor(dense)])
        with variant():
            out = model.forward(seq, model.new_cache(len(seq)), all_logits=True)
        choices = out[len(ids) - 1 : len(seq) - 1].argmax(-1)
        agree += int((choices == torch.tensor(dense)).sum())
        total += gen_tokens
    return agree / max(total, 1)


def bypassed_layers(plan) -> tuple[list[bool], list[bool]]:
    """Per layer of a sparse engine's load plan (engine/plan.py): whether it bypasses its
    predictor, and whether it is also exact (threshold unapplied)."""
    from ..engine.plan import Strategy

    return ([l.strategy is not Strategy.PREDICTED for l in plan.layers], [l.strategy is Strategy.DENSE for l in plan.layers])


def engine_variant(predictors: list, thresholds: list[float], bypass: list[bool] | None = None,
                   exact: list[bool] | None = None) -> tuple[list, list[float | None]]:
    """(per-layer predictor callables, per-layer thresholds) for `instrumented` that compute
    what the sparse engine does: predicted neurons above the threshold; every neuron where
    the layer bypasses its predictor; no threshold either where it is exact."""
    predict = [None if p is None or (bypass is not None and bypass[i]) else p.active for i, p in enumerate(predictors)]
    return predict, [None if exact is not None and exact[i] else t for i, t in enumerate(thresholds)]


def evaluate_predictors(lm: LoadedModel, profile: Profile, preds: Predictors, n_prompts: int = 16,
                        max_tokens: int = 256, gen_tokens: int = 128, agreement_prompts: int = 8,
                        bypass: list[bool] | None = None, exact: list[bool] | None = None) -> dict:
    """Per-layer recall/precision and end-to-end perplexity and greedy agreement of the dense,
    oracle and predicted variants. `bypass[i]`: layer i runs without its predictor in the
    predicted variant (as the sparse engine runs a dense-ish layer, see load_packed);
    `exact[i]`: and without its threshold (a bypassed layer on the dense FFN kernel)."""
    model = lm.model
    texts = heldout_texts(profile, n_prompts)
    tokens = tokenize(lm, texts, max_tokens)
    thresholds, criterion = profile.thresholds, profile.criterion
    L = len(preds.layers)
    counts = torch.zeros(L, 3, dtype=torch.float64)  # tp, predicted, actual

    def observer(i):
        def observe(x, score):
            actual = score > thresholds[i]
            if preds.layers[i] is None:
                return
            pred = preds.layers[i].active(x)
            counts[i] += torch.tensor([(pred & actual).sum().item(), pred.sum().item(), actual.sum().item()],
                                      dtype=torch.float64)
        return observe

    with instrumented(model, criterion, thresholds, observers=[observer(i) for i in range(L)]):
        oracle_ppl = perplexity(model, tokens, "oracle ppl")
    dense_ppl = perplexity(model, tokens, "dense ppl")
    predict, predicted_thresholds = engine_variant(preds.layers, thresholds, bypass, exact)
    with instrumented(model, criterion, predicted_thresholds, predictors=predict):
        predicted_ppl = perplexity(model, tokens, "predicted ppl")
    prompts = [t[:64] for t in tokens[:agreement_prompts]]
    oracle_agree = greedy_agreement(lm, prompts, gen_tokens, lambda: instrumented(model, criterion, thresholds))
    predicted_agree = greedy_agreement(lm, prompts, gen_tokens,
                                       lambda: instrumented(model, criterion, predicted_thresholds, predictors=predict))
    layers = [{"layer": i, "rank": None if p is None else p.rank, "recall": float(counts[i, 0] / max(counts[i, 2], 1)),
               "precision": float(counts[i, 0] / max(counts[i, 1], 1)),
               "predicted_active": float(counts[i, 1] / max(counts[i, 2], 1))} for i, p in enumerate(preds.layers)]
    return {"prompts": len(tokens), "tokens": int(sum(len(t) for t in tokens)), "gen_tokens": gen_tokens,
            "agreement_prompts": len(prompts),
            "perplexity": {"dense": dense_ppl, "oracle": oracle_ppl, "predicted": predicted_ppl},
            "greedy_agreement": {"dense": 1.0, "oracle": oracle_agree, "predicted": predicted_agree},
            "layers": layers}
