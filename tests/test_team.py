"""A team of threads in one parallel region (ops/team.py) and the decode token it runs
(ops/decode_team.py): phases that wait for their inputs, ranks that cannot deadlock when
they run one after another, and logits equal to the per-region stack's to the bit."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from numba import njit, prange

from powerinfer.loader import load
from powerinfer.ops import cpu, decode, decode_team, team

needs_two = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two numba threads")


@njit(parallel=True, cache=True)
def _chain(phases, items, threads):
    """Phase p's item i = (sum of phase p - 1's items) % 1000003 + i, in shares that any rank
    may end up doing: a rank that read phase p - 1 before it was complete would write a wrong
    value. Returns the values and how many shares each rank did."""
    values = np.zeros((phases, items), dtype=np.int64)
    did = np.zeros(threads, dtype=np.int64)
    sync = team.new_sync(phases)
    for rank in prange(threads):
        for p in range(phases):
            if team.taken(sync, p, threads):
                continue
            if p > 0:
                team.await_phase(sync, p - 1, threads)
            base = 0
            if p > 0:
                for k in range(items):
                    base += values[p - 1, k]
            r = team.first_share(sync, p, rank, threads)
            while r >= 0:
                lo, hi = team.share(items, r, threads)
                for i in range(lo, hi):
                    values[p, i] = base % 1000003 + i
                did[rank] += 1
                team.finish(sync, p, threads)
                r = team.next_share(sync, p, threads)
    return values, did


def _expected(phases, items):
    values = np.zeros((phases, items), dtype=np.int64)
    for p in range(phases):
        base = values[p - 1].sum() if p > 0 else 0
        values[p] = base % 1000003 + np.arange(items)
    return values


@needs_two
@pytest.mark.parametrize("items", [1, 3, 37])  # a share may be empty
def test_every_phase_sees_the_whole_phase_before_it(items):
    numba.set_num_threads(2)
    values, did = _chain(3000, items, 2)
    assert np.array_equal(values, _expected(3000, items))
    assert did.sum() == 3000 * 2


def test_ranks_run_one_after_another_on_one_thread_finish_without_deadlock():
    """prange(2) on one numba thread runs rank 0, then rank 1: rank 0 takes over rank 1's
    share of every phase (nothing waits for a rank to arrive), rank 1 finds them all taken."""
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        values, did = _chain(50, 7, 2)
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(values, _expected(50, 7))
    assert list(did) == [50 * 2, 0]


def _decode(model, tokens, team_on: bool, steps: int) -> torch.Tensor:
    cache = model.new_cache(len(tokens) + steps)
    model.forward(tokens, cache)
    out = []
    token = tokens[-1:]
    for _ in range(steps):
        if model._stack is not None:
            model._stack.team = team_on
        logits = model.forward(token, cache)
        out.append(logits)
        token = logits.reshape(-1, logits.shape[-1])[-1].argmax().reshape(1)
    return torch.stack(out)


@needs_two
def test_team_decode_equals_the_stack_to_the_bit_on_the_default_model(smollm2_path):
    """The embedded Q4_1 model (every matrix in lanes): the whole token in one team region
    gives layer_stack's logits to the bit, through a context past one attention chunk."""
    numba.set_num_threads(2)
    model = load(smollm2_path, dtype="native", with_tokenizer=False).model
    tokens = torch.randint(0, 49152, (250,), generator=torch.Generator().manual_seed(3))
    model.forward(tokens[:1], model.new_cache(2))
    stack = model._layer_stack()
    assert stack is not None and stack.team, "the default model should decode as a team"
    teamed = _decode(model, tokens, True, 12)  # positions 250-261: two chunks of 256
    assert torch.equal(teamed, _decode(model, tokens, False, 12))


@pytest.mark.parametrize("numba_threads", [1, 2])
def test_team_kernel_equals_the_stack_whatever_runs_its_ranks(smollm2_path, numba_threads):
    """Two ranks on one thread (one after the other) or on two: the same keys, values and
    hidden state as layer_stack, to the bit."""
    if numba_threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("needs two numba threads")
    model = load(smollm2_path, dtype="native", with_tokenizer=False).model
    tokens = torch.randint(0, 49152, (5,), generator=torch.Generator().manual_seed(4))
    model.forward(tokens[:1], model.new_cache(2))
    stack = model._layer_stack()
    assert stack is not None
    w, s = stack.lists, model._attn_shape
    args = (w["norm_w"], model.args.norm_eps, w["wqkv"], w["bqkv"], w["wo"], w["bo"], w["ffn_norm_w"], w["w_in"],
            w["b_in"], w["w_out"], w["b_out"])
    cos, sin = model.rope_cos_sin(len(tokens) + 1)
    before = numba.get_num_threads()
    states = []
    for run_team in (True, False):
        cache = model.new_cache(8)
        model.forward(tokens, cache)
        x = np.random.default_rng(5).standard_normal(model.args.d_model).astype(np.float32)
        shape = (s.n_heads, s.n_kv_heads, s.head_dim, s.scale, s.rope)
        if run_team:
            numba.set_num_threads(numba_threads)
            try:
                decode_team.layer_stack_team(x, *args, stack.act_id, stack.up_act_id, len(tokens), cos, sin,
                                             cache.k_all_np.view(np.uint8), cache.v_all_np.view(np.uint8),
                                             cpu.kv_code(cache.k_all_np), *shape, 2)
            finally:
                numba.set_num_threads(before)
        else:
            decode.layer_stack(x, *args, True, stack.act_id, stack.up_act_id, len(tokens), cos, sin, cache.k_all_np,
                               cache.v_all_np, *shape, before)
        states.append((x.copy(), cache.k_all_np[:, :, len(tokens)].copy(), cache.v_all_np[:, :, len(tokens)].copy()))
    for a, b in zip(*states):
        assert np.array_equal(a, b)
