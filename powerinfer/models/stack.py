"""Decode a token through every layer in one kernel call (ops/decode.py `layer_stack`).

Why: on a small model the Python around the two kernel calls of a layer (weight records,
argument unboxing, wrappers) cost ~15 us a layer, an eighth of a SmolLM2 token. When every
layer is a fused pre-norm block with a dense FFN whose arrays are alike in type across the
layers, the per-layer arrays are gathered once into numba typed lists and one call runs
them all; otherwise (sparse or instrumented FFNs, mixed formats across layers, caches on
the GPU tier) decode keeps its per-layer path. Both paths call the same kernels, so their
results are equal to the bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numba import typeof
from numba.typed import List

from ..ops import api
from ..ops.decode_team import runs_as_team
from ..ops.lists import typed_list
from .ffn import DenseFFN

if TYPE_CHECKING:
    from .base import Model
    from .cache import KVCache


class LayerStack:
    """The per-layer kernel arrays of a model whose decode can run as one call."""

    def __init__(self, ffns: list[Any], lists: dict[str, List], ffn_kind: tuple[bool, int, int], team: bool):
        self.ffns = ffns  # the FFN objects the lists were gathered from (checked per token)
        self.lists = lists
        self.gated, self.act_id, self.up_act_id = ffn_kind
        self.team = team  # every layer in one parallel region (ops/decode_team.py)

    def current(self, model: Model) -> bool:
        """Whether the model's layers still hold the FFNs gathered here (the profiler swaps
        in instrumented ones)."""
        return all(layer.ffn is f for layer, f in zip(model.layers, self.ffns))

    def run(self, model: Model, x: np.ndarray, cache: KVCache, pos: int) -> None:
        """x (d,) through every layer at position `pos`, in place; keys and values written."""
        s = model._attn_shape
        cos, sin = model.rope_cos_sin(pos + 1) if s.rope else (_EMPTY_TABLE, _EMPTY_TABLE)
        w = self.lists
        if self.team and api.threads() > 1:
            api.layer_stack_team(x, w["norm_w"], model.args.norm_eps, w["wqkv"], w["bqkv"], w["wo"], w["bo"],
                                 w["ffn_norm_w"], w["w_in"], w["b_in"], w["w_out"], w["b_out"], self.act_id,
                                 self.up_act_id, pos, cos, sin, cache.k_all_np, cache.v_all_np, s)
            return
        api.layer_stack(x, w["norm_w"], model.args.norm_eps, w["wqkv"], w["bqkv"], w["wo"], w["bo"], w["ffn_norm_w"],
                        w["w_in"], w["b_in"], w["w_out"], w["b_out"], self.gated, self.act_id, self.up_act_id, pos,
                        cos, sin, cache.k_all_np, cache.v_all_np, s)


_EMPTY_TABLE = np.zeros((0, 0), dtype=np.float32)


def layer_stack(model: Model) -> LayerStack | None:
    """The model's layers gathered for one-call decode, or None where it cannot run (see the
    module docstring)."""
    layers = model.layers
    if not layers or not all(layer.fused_decode for layer in layers):
        return None
    ffns = [layer.ffn for layer in layers]
    if not all(type(f) is DenseFFN for f in ffns):
        return None
    kinds = {(f.gated, f._act_id, f._up_act_id) for f in ffns}
    if len(kinds) != 1:
        return None
    per_layer: dict[str, list[Any]] = {k: [] for k in ("norm_w", "wqkv", "bqkv", "wo", "bo", "ffn_norm_w", "w_in",
                                                       "b_in", "w_out", "b_out")}
    for layer, f in zip(layers, ffns):
        w = model.attention_weights(layer)
        arrays = {"norm_w": w.norm_w, "wqkv": w.wqkv, "bqkv": w.bqkv, "wo": w.wo, "bo": w.bo,
                  "ffn_norm_w": w.ffn_norm_w, "w_in": f.w_in.w_np, "b_in": f.w_in.b_np, "w_out": f.w_out.w_np,
                  "b_out": f.w_out.b_np}
        for k, a in arrays.items():
            if not isinstance(a, np.ndarray):  # a weight the kernels do not read, or row parts (a tuple)
                return None
            per_layer[k].append(a)
    lists = {}
    for k, arrays in per_layer.items():
        if len({typeof(a) for a in arrays}) != 1:  # formats (or read-only flags) differ across layers
            return None
        lists[k] = typed_list(arrays)
    gated, act_id, up_act_id = kinds.pop()
    team = all(runs_as_team(w, o, i, d, gated) for w, o, i, d in zip(per_layer["wqkv"], per_layer["wo"],
                                                                       per_layer["w_in"], per_layer["w_out"]))
    return LayerStack(ffns, lists, (gated, act_id, up_act_id), team)
