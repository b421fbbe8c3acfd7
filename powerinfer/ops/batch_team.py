"""A batched decode step (B sequences, each with its own cache) through every layer in one
team region, for lanes weights: `batch_decode.layer_stack` without its nine parallel regions
a layer.

The phases and their items are those of the batch kernels: per layer, the rows' norms and
int8 records, the QKV groups of 16 rows (every row's dots in one pass over the group,
`lanes.group_dots_batch`), the attention (row, KV head, chunk) items (the last chunk's item
writes that row's key and value), the rows' softmax merges and records, the output groups,
the FFN norms and records, the gate/up groups, the rows' neuron values and records, the down
groups. Every item runs the batch kernels' helper, so each row equals the per-layer batch
path to the bit; the threads share the items as in ops/team.py.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .block_ir import _quantize_into
from .cpu import (attend_chunk_bytes, attention_chunks, merge_chunks, prefetch_chunk, rms_norm,
                  write_kv_head_bytes)
from .decode import gated_row
from .decode_team import _records_len
from .lane_ir import LANES
from .lanes import add_groups, block_weights, record_bytes
from .team import MAX_RANKS, await_phase, finish, first_share, new_sync, next_share, share, taken

PHASES_PER_LAYER = 9


@njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
def _rank_layers(rank, size, sync, X, norm_w, eps, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out, act_id,
                 up_act_id, pos, chunks, start, cos, sin, k_caches, v_caches, kv, n_heads, n_kv, head_dim, scale, rope,
                 H, QA_qkv, QKV, top, total, o, ATT, QA_o, QA_in, PRE, HID, QA_d):
    """One rank's part of every layer (see ops/team.py for the protocol)."""
    B = X.shape[0]
    n_ff = HID.shape[1]
    bb_qkv, bb_o, bb_in, bb_d = record_bytes(wqkv[0]), record_bytes(wo[0]), record_bytes(w_in[0]), \
        record_bytes(w_out[0])
    n_items = start[B]
    for i in range(len(wqkv)):
        ph = PHASES_PER_LAYER * i
        # 0: the rows' norms and records for QKV (after the last layer's down groups)
        if not taken(sync, ph, size):
            if i > 0:
                await_phase(sync, ph - 1, size)
            r = first_share(sync, ph, rank, size)
            while r >= 0:
                lo, hi = share(B, r, size)
                for s in range(lo, hi):
                    rms_norm(X[s], norm_w[i], eps, H[s])
                    _quantize_into(H[s], bb_qkv, QA_qkv[s])
                finish(sync, ph, size)
                r = next_share(sync, ph, size)
        # 1: QKV groups
        if not taken(sync, ph + 1, size):
            await_phase(sync, ph, size)
            r = first_share(sync, ph + 1, rank, size)
            while r >= 0:
                lo, hi = share(wqkv[i].shape[0], r, size)
                add_groups(wqkv[i], bqkv[i], QA_qkv, QKV, lo, hi, True)
                finish(sync, ph + 1, size)
                r = next_share(sync, ph + 1, size)
        # 2: attention items (row, KV head, chunk)
        if not taken(sync, ph + 2, size):
            await_phase(sync, ph + 1, size)
            r = first_share(sync, ph + 2, rank, size)
            while r >= 0:
                lo, hi = share(n_items, r, size)
                for item in range(lo, hi):
                    if item + 1 < hi:  # the next item's rows, while this one is computed
                        s = np.searchsorted(start, item + 1, side="right") - 1
                        k = item + 1 - start[s]
                        prefetch_chunk(k // chunks[s], k % chunks[s], pos[s], 0, k_caches[s][i], v_caches[s][i])
                    s = np.searchsorted(start, item, side="right") - 1
                    k = item - start[s]
                    g, c = k // chunks[s], k % chunks[s]
                    kc, vc = k_caches[s][i], v_caches[s][i]
                    if c == chunks[s] - 1:
                        write_kv_head_bytes(kv, g, QKV[s], pos[s], cos, sin, kc, vc, n_heads, n_kv, head_dim, rope)
                    attend_chunk_bytes(kv, g, c, QKV[s], pos[s], cos, sin, kc, vc, n_heads, n_kv, head_dim, scale,
                                       rope, 0, np.float32(0.0), top[s], total[s], o[s])
                finish(sync, ph + 2, size)
                r = next_share(sync, ph + 2, size)
        # 3: the rows' merges and records for the output projection
        if not taken(sync, ph + 3, size):
            await_phase(sync, ph + 2, size)
            r = first_share(sync, ph + 3, rank, size)
            while r >= 0:
                lo, hi = share(B, r, size)
                for s in range(lo, hi):
                    merge_chunks(chunks[s], top[s], total[s], o[s], ATT[s], head_dim)
                    _quantize_into(ATT[s], bb_o, QA_o[s])
                finish(sync, ph + 3, size)
                r = next_share(sync, ph + 3, size)
        # 4: output groups, added to X
        if not taken(sync, ph + 4, size):
            await_phase(sync, ph + 3, size)
            r = first_share(sync, ph + 4, rank, size)
            while r >= 0:
                lo, hi = share(wo[i].shape[0], r, size)
                add_groups(wo[i], bo[i], QA_o, X, lo, hi, False)
                finish(sync, ph + 4, size)
                r = next_share(sync, ph + 4, size)
        # 5: the rows' FFN norms and records
        if not taken(sync, ph + 5, size):
            await_phase(sync, ph + 4, size)
            r = first_share(sync, ph + 5, rank, size)
            while r >= 0:
                lo, hi = share(B, r, size)
                for s in range(lo, hi):
                    rms_norm(X[s], ffn_norm_w[i], eps, H[s])
                    _quantize_into(H[s], bb_in, QA_in[s])
                finish(sync, ph + 5, size)
                r = next_share(sync, ph + 5, size)
        # 6: gate/up groups
        if not taken(sync, ph + 6, size):
            await_phase(sync, ph + 5, size)
            r = first_share(sync, ph + 6, rank, size)
            while r >= 0:
                lo, hi = share(w_in[i].shape[0], r, size)
                add_groups(w_in[i], b_in[i][:0], QA_in, PRE, lo, hi, True)  # biases: in the values
                finish(sync, ph + 6, size)
                r = next_share(sync, ph + 6, size)
        # 7: the rows' neuron values and records for the down projection
        if not taken(sync, ph + 7, size):
            await_phase(sync, ph + 6, size)
            r = first_share(sync, ph + 7, rank, size)
            while r >= 0:
                lo, hi = share(B, r, size)
                b_in_i = b_in[i]
                for s in range(lo, hi):
                    gated_row(PRE, HID, s, n_ff, b_in_i, act_id, up_act_id)
                    _quantize_into(HID[s], bb_d, QA_d[s])
                finish(sync, ph + 7, size)
                r = next_share(sync, ph + 7, size)
        # 8: down groups, added to X
        if not taken(sync, ph + 8, size):
            await_phase(sync, ph + 7, size)
            r = first_share(sync, ph + 8, rank, size)
            while r >= 0:
                lo, hi = share(w_out[i].shape[0], r, size)
                add_groups(w_out[i], b_out[i], QA_d, X, lo, hi, False)
                finish(sync, ph + 8, size)
                r = next_share(sync, ph + 8, size)


@njit(parallel=True, fastmath=True, cache=True, nogil=True, error_model="numpy")
def layer_stack_team(X, norm_w, eps, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out, act_id, up_act_id,
                     pos, cos, sin, k_caches, v_caches, kv, n_heads, n_kv, head_dim, scale, rope, threads):
    """`batch_decode.layer_stack` (gated FFN, every matrix in lanes; k_caches / v_caches typed
    lists of the sequences' (layers, ...) blocks as bytes, uint8 views of element code `kv`:
    cpu.kv_code) as one team region of `threads` threads."""
    B, d = X.shape
    T = min(max(threads, 1), MAX_RANKS)
    q_dim = n_heads * head_dim
    n_ff = w_out[0].shape[1] * block_weights(w_out[0].shape[3])
    chunks = np.empty(B, dtype=np.int64)
    start = np.zeros(B + 1, dtype=np.int64)  # row s's attention items: start[s] .. start[s + 1]
    for s in range(B):
        chunks[s] = attention_chunks(pos[s], 0)
        start[s + 1] = start[s] + n_kv * chunks[s]
    most = chunks.max()
    H = np.empty((B, d), dtype=np.float32)
    QA_qkv = np.empty((B, _records_len(d, record_bytes(wqkv[0]))), dtype=np.uint8)
    QKV = np.empty((B, wqkv[0].shape[0] * LANES), dtype=np.float32)
    top = np.empty((B, n_heads, most), dtype=np.float32)
    total = np.empty((B, n_heads, most), dtype=np.float32)
    o = np.empty((B, n_heads, most, head_dim), dtype=np.float32)
    ATT = np.empty((B, q_dim), dtype=np.float32)
    QA_o = np.empty((B, _records_len(q_dim, record_bytes(wo[0]))), dtype=np.uint8)
    QA_in = np.empty((B, _records_len(d, record_bytes(w_in[0]))), dtype=np.uint8)
    PRE = np.empty((B, 2 * n_ff), dtype=np.float32)
    HID = np.empty((B, n_ff), dtype=np.float32)
    QA_d = np.empty((B, _records_len(n_ff, record_bytes(w_out[0]))), dtype=np.uint8)
    sync = new_sync(PHASES_PER_LAYER * len(wqkv))
    for rank in prange(T):
        # int64: numba types the prange index int64 when it types the loop and uint64 in the
        # parallel body, so an uncast rank compiles `_rank_layers` twice (the second with float64 share bounds)
        _rank_layers(np.int64(rank), T, sync, X, norm_w, eps, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out,
                     act_id, up_act_id, pos, chunks, start, cos, sin, k_caches, v_caches, kv, n_heads, n_kv, head_dim,
                     scale, rope, H, QA_qkv, QKV, top, total, o, ATT, QA_o, QA_in, PRE, HID, QA_d)
