"""A decode token through every layer in one parallel region (a `team`), for lanes weights.

Why: `decode.layer_stack` runs the token in one call, but every layer still opens five
parallel regions (QKV, attention, output projection, the FFN's gate/up records, the down
projection), and on SmolLM2 each open and close costs more than a small phase's work. Here
the threads open one region for the whole token and take each phase's items from a shared
counter (ops/team.py). The items are those of the phase's own kernel (groups of 16 rows,
attention (KV head, chunk) items, record blocks), each run by the same helper as there, so
the result equals `layer_stack`'s to the bit whichever thread takes which item. Small serial
steps (the norms, the activations' int8 records, the softmax merge) run on every thread into
its own buffer instead of as a phase of their own; a KV head's key and value are written by
the item that attends its last chunk.

Covers the common case: gated FFN, every matrix in lanes (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K re-laid
16 rows at a time); `runs_as_team` says when, and other layers keep `layer_stack`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types

from .block_ir import _quantize_into
from .cpu import (attend_chunk_bytes, attention_chunks, merge_chunks, prefetch_chunk, rms_norm,
                  write_kv_head_bytes)
from .decode import gated_record_block, record_block
from .lane_ir import LANES
from .lanes import add_groups, block_weights, record_bytes
from .team import MAX_RANKS, await_phase, finish, first_share, new_sync, next_share, share, taken

PHASES_PER_LAYER = 5  # QKV rows, attention items, output rows, gate/up record blocks, down rows


def runs_as_team(wqkv, wo, w_in, w_out, gated: bool) -> bool:
    """Whether a layer's arrays (numba types or arrays) fit `layer_stack_team`."""
    def lanes(a):
        t = a if isinstance(a, types.Type) else None
        if t is None:
            return isinstance(a, np.ndarray) and a.ndim == 4 and a.dtype == np.uint8
        return isinstance(t, types.Array) and t.ndim == 4 and t.dtype == types.uint8
    return gated and all(lanes(a) for a in (wqkv, wo, w_in, w_out))


@njit(inline="always")
def _records_len(cols, bb):
    P, rec = record_block(bb)
    return cols // P * rec


@njit(inline="always")
def _rows(w, b, qa, x, lo, hi, zero):
    """x[16g:16g + 16] (zeroed first when `zero`) += W v (+ b) for groups g in [lo, hi): the
    batch helper on one-row views (a row's dots are the GEMV's)."""
    add_groups(w, b, qa.reshape(1, qa.shape[0]), x.reshape(1, x.shape[0]), lo, hi, zero)


@njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
def _rank_layers(rank, size, sync, x, norm_w, eps, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out, act_id,
                 up_act_id, pos, cos, sin, k_all, v_all, kv, n_heads, n_kv, head_dim, scale, rope, h, attn, qa_qkv,
                 qa_o, qa_in, qkv, top, total, o, pre, hidden, recs):
    """One rank's part of every layer: per phase not yet all claimed, wait for the phase
    before, prepare this rank's inputs, then do shares until the phase is done (ops/team.py)."""
    n_chunks = top.shape[1]
    n_ff = hidden.shape[0]
    bb_qkv, bb_o, bb_in, bb_out = record_bytes(wqkv[0]), record_bytes(wo[0]), record_bytes(w_in[0]), \
        record_bytes(w_out[0])
    n_items, n_blocks = n_kv * n_chunks, pre.shape[0]
    for i in range(len(wqkv)):
        ph = PHASES_PER_LAYER * i
        # QKV rows (after the last layer's down projection)
        if not taken(sync, ph, size):
            if i > 0:
                await_phase(sync, ph - 1, size)
            rms_norm(x, norm_w[i], eps, h[rank])
            _quantize_into(h[rank], bb_qkv, qa_qkv[rank])
            r = first_share(sync, ph, rank, size)
            while r >= 0:
                lo, hi = share(wqkv[i].shape[0], r, size)
                _rows(wqkv[i], bqkv[i], qa_qkv[rank], qkv, lo, hi, True)
                finish(sync, ph, size)
                r = next_share(sync, ph, size)
        # attention items (KV head, chunk); the last chunk's item writes the head's key and value
        if not taken(sync, ph + 1, size):
            await_phase(sync, ph, size)
            r = first_share(sync, ph + 1, rank, size)
            while r >= 0:
                lo, hi = share(n_items, r, size)
                for item in range(lo, hi):
                    if item + 1 < hi:  # the next item's rows, while this one is computed
                        prefetch_chunk((item + 1) // n_chunks, (item + 1) % n_chunks, pos, 0, k_all[i], v_all[i])
                    g, c = item // n_chunks, item % n_chunks
                    if c == n_chunks - 1:
                        write_kv_head_bytes(kv, g, qkv, pos, cos, sin, k_all[i], v_all[i], n_heads, n_kv, head_dim,
                                            rope)
                    attend_chunk_bytes(kv, g, c, qkv, pos, cos, sin, k_all[i], v_all[i], n_heads, n_kv, head_dim, scale,
                                       rope, 0, np.float32(0.0), top, total, o)
                finish(sync, ph + 1, size)
                r = next_share(sync, ph + 1, size)
        # output projection rows, added to x
        if not taken(sync, ph + 2, size):
            await_phase(sync, ph + 1, size)
            merge_chunks(n_chunks, top, total, o, attn[rank], head_dim)
            _quantize_into(attn[rank], bb_o, qa_o[rank])
            r = first_share(sync, ph + 2, rank, size)
            while r >= 0:
                lo, hi = share(wo[i].shape[0], r, size)
                _rows(wo[i], bo[i], qa_o[rank], x, lo, hi, False)
                finish(sync, ph + 2, size)
                r = next_share(sync, ph + 2, size)
        # gate/up record blocks
        if not taken(sync, ph + 3, size):
            await_phase(sync, ph + 2, size)
            rms_norm(x, ffn_norm_w[i], eps, h[rank])
            _quantize_into(h[rank], bb_in, qa_in[rank])
            r = first_share(sync, ph + 3, rank, size)
            while r >= 0:
                lo, hi = share(n_blocks, r, size)
                for blk in range(lo, hi):
                    pre[blk] = 0.0
                    gated_record_block(blk, qa_in[rank], w_in[i], b_in[i], n_ff, act_id, up_act_id, 0,
                                       np.float32(0.0), bb_out, pre, hidden, recs)
                finish(sync, ph + 3, size)
                r = next_share(sync, ph + 3, size)
        # down projection rows, added to x
        if not taken(sync, ph + 4, size):
            await_phase(sync, ph + 3, size)
            r = first_share(sync, ph + 4, rank, size)
            while r >= 0:
                lo, hi = share(w_out[i].shape[0], r, size)
                _rows(w_out[i], b_out[i], recs, x, lo, hi, False)
                finish(sync, ph + 4, size)
                r = next_share(sync, ph + 4, size)


@njit(parallel=True, fastmath=True, cache=True, nogil=True, error_model="numpy")
def layer_stack_team(x, norm_w, eps, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out, act_id, up_act_id,
                     pos, cos, sin, k_all, v_all, kv, n_heads, n_kv, head_dim, scale, rope, threads):
    """`decode.layer_stack` (gated FFN, all lanes) with every layer in one team region of
    `threads` threads; the (layers, kv_heads, max_len, head_dim) caches come as bytes (uint8
    views) of element code `kv` (cpu.kv_code), so one compile serves fp32 and fp16 caches."""
    d = x.shape[0]
    T = min(max(threads, 1), MAX_RANKS)
    q_dim = n_heads * head_dim
    n_qkv = wqkv[0].shape[0] * LANES
    n_ff = w_out[0].shape[1] * block_weights(w_out[0].shape[3])
    P, rec = record_block(record_bytes(w_out[0]))
    n_blocks = n_ff // P
    n_chunks = attention_chunks(pos, 0)
    h = np.empty((T, d), dtype=np.float32)  # per thread: a norm's output
    attn = np.empty((T, q_dim), dtype=np.float32)  # per thread: the merged heads
    qa_qkv = np.empty((T, _records_len(d, record_bytes(wqkv[0]))), dtype=np.uint8)
    qa_o = np.empty((T, _records_len(q_dim, record_bytes(wo[0]))), dtype=np.uint8)
    qa_in = np.empty((T, _records_len(d, record_bytes(w_in[0]))), dtype=np.uint8)
    qkv = np.empty(n_qkv, dtype=np.float32)  # shared: each thread writes its own rows
    top = np.empty((n_heads, n_chunks), dtype=np.float32)
    total = np.empty((n_heads, n_chunks), dtype=np.float32)
    o = np.empty((n_heads, n_chunks, head_dim), dtype=np.float32)
    pre = np.empty((n_blocks, 2, P), dtype=np.float32)
    hidden = np.empty(n_ff, dtype=np.float32)
    recs = np.empty(n_blocks * rec, dtype=np.uint8)
    sync = new_sync(PHASES_PER_LAYER * len(wqkv))
    for rank in prange(T):
        # int64: numba types the prange index int64 when it types the loop and uint64 in the
        # parallel body, so an uncast rank compiles `_rank_layers` twice (the second with float64 share bounds)
        _rank_layers(np.int64(rank), T, sync, x, norm_w, eps, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out,
                     act_id, up_act_id, pos, cos, sin, k_all, v_all, kv, n_heads, n_kv, head_dim, scale, rope, h, attn,
                     qa_qkv, qa_o, qa_in, qkv, top, total, o, pre, hidden, recs)
