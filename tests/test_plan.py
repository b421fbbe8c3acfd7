"""The load plan (engine/plan.py): each layer's strategy is chosen where expected."""

from __future__ import annotations

from dataclasses import replace

import pytest

from powerinfer.engine.plan import PREDICTOR_BYPASS, Strategy, make_plan
from powerinfer.errors import BadArgumentError
from powerinfer.formats.packed import LayerInfo, LayerPredictor
from powerinfer.ops.criterion import Criterion
from test_manifest import valid_manifest

P, D, A = Strategy.PREDICTED, Strategy.DENSE, Strategy.ALL_ROWS


def manifest(layers, criterion="gate_up", offload=0, head=False, dense_on_gpu=False):
    m = valid_manifest()
    placement = replace(m.placement, offload_gpu_layers=offload, offload_head_on_gpu=head, dense_on_gpu=dense_on_gpu)
    return replace(m, layers=layers, criterion=criterion, placement=placement)


def layer(i, n_gpu, n_cpu, fraction=None):
    pred = None if fraction is None else LayerPredictor(4, 0.0, 0.95, 0.8, fraction)
    return LayerInfo(i, n_gpu, n_cpu, 0.1, pred)


LAYERS = [layer(0, 0, 24, 0.3),   # CPU only, a predictor that pays
          layer(1, 8, 16, 0.3),   # split, a predictor that pays
          layer(2, 0, 24, 0.95),  # CPU only, dense-ish predictor
          layer(3, 8, 16, 0.95),  # split, dense-ish predictor
          layer(4, 0, 24, None),  # CPU only, no predictor (prepare: could not pay)
          layer(5, 8, 16, None)]  # split, no predictor


@pytest.mark.parametrize("mode,expected", [
    ("sparse", [P, P, D, A, D, A]),
    ("oracle", [A] * 6),
    ("dense", [D] * 6),
    ("offload", [D] * 6),
])
def test_strategy_per_layer(mode, expected):
    plan = make_plan(manifest(LAYERS), 6, mode)
    assert [l.strategy for l in plan.layers] == expected
    for l in plan.layers:
        # DENSE never thresholds; the others apply the profile's criterion at decode
        assert l.criterion == (Criterion.NONE if l.strategy is D else Criterion.GATE_UP)
        # prefill: dense for predicted layers, as decode for the others
        assert l.prefill_criterion == (Criterion.NONE if l.strategy is P else l.criterion)
        # the dense kernel's layout exactly where every row is read on the CPU alone
        assert l.dense_layout == (l.n_gpu == 0 and l.strategy is not P)


def test_bypass_threshold_and_none():
    at = [layer(0, 0, 24, PREDICTOR_BYPASS), layer(1, 0, 24, PREDICTOR_BYPASS - 0.01)]
    assert [l.strategy for l in make_plan(manifest(at), 2, "sparse").layers] == [D, P]
    assert [l.strategy for l in make_plan(manifest(at), 2, "sparse", predictor_bypass=None).layers] == [P, P]
    assert [l.strategy for l in make_plan(manifest(at), 2, "sparse", predictor_bypass=0.0).layers] == [D, D]


def test_offload_moves_whole_layers_and_the_head():
    layers = [layer(i, 8, 16, 0.3) for i in range(3)]
    plan = make_plan(manifest(layers, offload=2, head=True), 3, "offload")
    assert [(l.n_gpu, l.n_cpu) for l in plan.layers] == [(24, 0), (24, 0), (0, 24)]
    assert plan.attention_on_gpu == (True, True, False) and plan.head_on_gpu
    assert [l.dense_layout for l in plan.layers] == [False, False, True]
    sparse = make_plan(manifest(layers, offload=2, head=True, dense_on_gpu=True), 3, "sparse", kv_on_gpu=True)
    assert sparse.attention_on_gpu == (True,) * 3 and sparse.head_on_gpu and sparse.kv_on_gpu
    assert [(l.n_gpu, l.n_cpu) for l in sparse.layers] == [(8, 16)] * 3


def test_summary_says_when_sparse_computes_the_dense_model():
    dense_ish = [layer(i, 0, 24, 0.97) for i in range(3)]
    plan = make_plan(manifest(dense_ish), 3, "sparse")
    assert plan.computes_dense_model
    assert "computes the dense model" in plan.summary() and ">= 85%" in plan.summary()
    mixed = make_plan(manifest(LAYERS), 6, "sparse")
    assert not mixed.computes_dense_model and "computes the dense model" not in mixed.summary()
    assert "2 predicted" in mixed.summary()


def test_refusals():
    with pytest.raises(BadArgumentError, match="unknown mode"):
        make_plan(manifest(LAYERS), 6, "fast")
    with pytest.raises(BadArgumentError, match="describes 6 layers"):
        make_plan(manifest(LAYERS), 5, "sparse")
    none = [layer(i, 0, 24, None) for i in range(2)]
    with pytest.raises(BadArgumentError, match="without predictors"):
        make_plan(manifest(none), 2, "sparse", predictor_bypass=None)
    assert make_plan(manifest(none), 2, "sparse").computes_dense_model
