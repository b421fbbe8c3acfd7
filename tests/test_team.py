"""A team of threads in one parallel region (ops/team.py) and the decode token it runs
(ops/decode_team.py): barriers that hold, a team that falls back to one thread instead of
deadlocking, and logits equal to the per-region stack's to the bit."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from numba import njit, prange

from powerinfer.loader import load
from powerinfer.ops import decode_team, team

TWO_THREADS = numba.config.NUMBA_NUM_THREADS >= 2
needs_two = pytest.mark.skipif(not TWO_THREADS, reason="needs two numba threads")


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_share_splits_items_into_contiguous_near_equal_ranges(size):
    for n in range(0, 23):
        bounds = [team.share(n, r, size) for r in range(size)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(bounds[r][1] == bounds[r + 1][0] for r in range(size - 1))
        lengths = [hi - lo for lo, hi in bounds]
        assert max(lengths) - min(lengths) <= 1


@njit(parallel=True, cache=True)
def _ping_pong(phases, threads):
    """Each rank writes the phase number into its slot, passes a barrier and checks the
    others' slots, then passes another; returns (errors, team sizes)."""
    slots = np.zeros(8 * threads, dtype=np.int64)  # one cache line per rank
    sync = np.zeros(2 * team.WORDS, dtype=np.int64)
    errors = np.zeros(threads, dtype=np.int64)
    sizes = np.zeros(threads, dtype=np.int64)
    for rank in prange(threads):
        size = team.join(sync, rank, threads)
        sizes[rank] = size
        passed = 0
        if size > 0:
            for p in range(1, phases + 1):
                if size == 1:  # a team of one: rank 0 does every rank's part
                    for r in range(threads):
                        slots[8 * r] = p
                else:
                    slots[8 * rank] = p
                passed = team.barrier(sync, passed, size)
                for r in range(threads):
                    if slots[8 * r] != p:
                        errors[rank] += 1
                passed = team.barrier(sync, passed, size)
    return errors, sizes


@needs_two
def test_barrier_holds_every_rank_until_all_arrive():
    numba.set_num_threads(2)
    errors, sizes = _ping_pong(2000, 2)
    assert list(sizes) == [2, 2]
    assert errors.sum() == 0


def test_a_team_run_on_one_thread_falls_back_to_one_rank_instead_of_deadlocking():
    """prange(2) on one numba thread runs rank 0, then rank 1: rank 0 gives up waiting for
    the other, abandons the team and does all the work; rank 1 then does nothing."""
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        errors, sizes = _ping_pong(50, 2)
    finally:
        numba.set_num_threads(before)
    assert list(sizes) == [1, 0]
    assert errors.sum() == 0


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
    model.forward(tokens[:1], model.new_cache(2))  # builds the layer stack
    model.forward(tokens[:1], model.new_cache(2))
    stack = model._layer_stack()
    assert stack is not None and stack.team, "the default model should decode as a team"
    teamed = _decode(model, tokens, True, 12)  # positions 250-261: two chunks of 256
    assert stack.team and stack.team_misses == 0
    assert torch.equal(teamed, _decode(model, tokens, False, 12))


def test_team_kernel_run_alone_equals_the_stack(smollm2_path):
    """The fallback: the team kernel asked for two ranks on one thread (rank 0 ends up alone)
    writes the same keys, values and hidden state as layer_stack."""
    model = load(smollm2_path, dtype="native", with_tokenizer=False).model
    tokens = torch.randint(0, 49152, (5,), generator=torch.Generator().manual_seed(4))
    model.forward(tokens[:1], model.new_cache(2))
    stack = model._layer_stack()
    assert stack is not None
    states = []
    before = numba.get_num_threads()
    for run_team in (True, False):
        cache = model.new_cache(8)
        model.forward(tokens, cache)
        x = np.random.default_rng(5).standard_normal(model.args.d_model).astype(np.float32)
        w, s = stack.lists, model._attn_shape
        cos, sin = model.rope_cos_sin(len(tokens) + 1)
        args = (w["norm_w"], model.args.norm_eps, w["wqkv"], w["bqkv"], w["wo"], w["bo"], w["ffn_norm_w"],
                w["w_in"], w["b_in"], w["w_out"], w["b_out"])
        if run_team:
            numba.set_num_threads(1)
            try:
                size = decode_team.layer_stack_team(x, *args, stack.act_id, stack.up_act_id, len(tokens), cos, sin,
                                                    cache.k_all_np, cache.v_all_np, s.n_heads, s.n_kv_heads,
                                                    s.head_dim, s.scale, s.rope, 2)
            finally:
                numba.set_num_threads(before)
            assert size == 1
        else:
            from powerinfer.ops import decode

            decode.layer_stack(x, *args, True, stack.act_id, stack.up_act_id, len(tokens), cos, sin,
                               cache.k_all_np, cache.v_all_np, s.n_heads, s.n_kv_heads, s.head_dim, s.scale, s.rope,
                               before)
        states.append((x.copy(), cache.k_all_np[:, :, len(tokens)].copy(), cache.v_all_np[:, :, len(tokens)].copy()))
    for a, b in zip(*states):
        assert np.array_equal(a, b)
