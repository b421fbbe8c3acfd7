"""A decode token through every layer in one parallel region (a `team`), for lanes weights.

Why: `decode.layer_stack` runs the token in one call, but every layer still opens five
parallel regions (QKV, attention, output projection, the FFN's gate/up records, the down
projection), and on SmolLM2 each open and close costs more than a small phase's work. Here
the threads open one region for the whole token and meet at spin barriers between phases
(ops/team.py). Each phase splits the same work items as its own kernel (groups of 16 rows,
attention (KV head, chunk) items, record blocks) among the threads, and every item runs the
same helper as there, so the result equals `layer_stack`'s to the bit. Small serial steps
(the norms, the activations' int8 records, the key/value write, the softmax merge) run on
every thread into its own buffer instead of behind an extra barrier.

Covers the common case: gated FFN, every matrix in lanes (Q4_0, Q4_1, Q8_0, Q4_K re-laid 16
rows at a time); `runs_as_team` says when, and other layers keep `layer_stack`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types

from .block_ir import _quantize_into
from .cpu import attend_chunk, attention_chunks, merge_chunks, rms_norm, write_kv
from .decode import gated_record_block, record_block
from .lane_ir import LANES, lane_dots1
from .lanes import record_bytes
from .team import WORDS, barrier, join, share


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
def _add_rows(w, qa, x, rank, size):
    """This rank's share of x += W v (lanes; v as records qa): whole groups of 16 rows."""
    g0, g1 = share(w.shape[0], rank, size)
    a0 = qa.ctypes.data
    for g in range(g0, g1):
        lane_dots1(w.shape[3], w.ctypes.data + g * w.strides[0], w.shape[1], (a0,), (x.ctypes.data + 4 * LANES * g,))


@njit(inline="always")
def _add_bias_rows(x, b, rows, rank, size):
    """This rank's share of x += b (by the same groups as `_add_rows`)."""
    if b.shape[0] > 0:
        g0, g1 = share(rows // LANES, rank, size)
        for k in range(g0 * LANES, g1 * LANES):
            x[k] += b[k]


@njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
def _rank_layers(rank, size, sync, x, norm_w, eps, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out, act_id,
                 up_act_id, pos, cos, sin, k_all, v_all, n_heads, n_kv, head_dim, scale, rope, h, attn, qa_qkv, qa_o,
                 qa_in, qkv, top, total, o, pre, hidden, recs):
    """One rank's share of every layer, between the team's barriers (`layer_stack_team`)."""
    d = x.shape[0]
    n_qkv = qkv.shape[0]
    n_chunks = top.shape[1]
    n_items = n_kv * n_chunks
    n_ff = hidden.shape[0]
    n_blocks = pre.shape[0]
    bb_qkv, bb_o, bb_in, bb_out = record_bytes(wqkv[0]), record_bytes(wo[0]), record_bytes(w_in[0]), \
        record_bytes(w_out[0])
    passed = 0
    for i in range(len(wqkv)):
        # attention block: norm, QKV rows, key/value write, attention items
        rms_norm(x, norm_w[i], eps, h[rank])
        _quantize_into(h[rank], bb_qkv, qa_qkv[rank])
        g0, g1 = share(wqkv[i].shape[0], rank, size)
        qkv[g0 * LANES:g1 * LANES] = 0.0
        _add_rows(wqkv[i], qa_qkv[rank], qkv, rank, size)
        _add_bias_rows(qkv, bqkv[i], n_qkv, rank, size)
        passed = barrier(sync, passed, size)
        # every thread writes the same keys and values (and reads only what it wrote)
        write_kv(qkv, pos, cos, sin, k_all[i], v_all[i], n_heads, n_kv, head_dim, rope)
        t0, t1 = share(n_items, rank, size)
        for item in range(t0, t1):
            attend_chunk(item // n_chunks, item % n_chunks, qkv, pos, cos, sin, k_all[i], v_all[i], n_heads,
                         n_kv, head_dim, scale, rope, 0, np.float32(0.0), top, total, o)
        passed = barrier(sync, passed, size)
        merge_chunks(n_chunks, top, total, o, attn[rank], head_dim)
        _quantize_into(attn[rank], bb_o, qa_o[rank])
        _add_rows(wo[i], qa_o[rank], x, rank, size)
        _add_bias_rows(x, bo[i], d, rank, size)
        passed = barrier(sync, passed, size)
        # FFN: norm, gate/up records per block, then the down projection
        rms_norm(x, ffn_norm_w[i], eps, h[rank])
        _quantize_into(h[rank], bb_in, qa_in[rank])
        b0, b1 = share(n_blocks, rank, size)
        for blk in range(b0, b1):
            pre[blk] = 0.0
            gated_record_block(blk, qa_in[rank], w_in[i], b_in[i], n_ff, act_id, up_act_id, 0,
                               np.float32(0.0), bb_out, pre, hidden, recs)
        passed = barrier(sync, passed, size)
        _add_rows(w_out[i], recs, x, rank, size)
        if b_out[i].shape[0] > 0:
            _add_bias_rows(x, b_out[i], d, rank, size)
        passed = barrier(sync, passed, size)


@njit(parallel=True, fastmath=True, cache=True, nogil=True, error_model="numpy")
def layer_stack_team(x, norm_w, eps, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out, act_id, up_act_id,
                     pos, cos, sin, k_all, v_all, n_heads, n_kv, head_dim, scale, rope, threads):
    """`decode.layer_stack` (gated FFN, all lanes) with every layer in one team region of
    `threads` threads; returns the team's size (1: it was abandoned and one thread did all)."""
    d = x.shape[0]
    T = max(threads, 1)
    q_dim = n_heads * head_dim
    n_qkv = wqkv[0].shape[0] * LANES
    n_ff = w_out[0].shape[1] * (256 if w_out[0].shape[3] == 148 else 32)
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
    sync = np.zeros(2 * WORDS, dtype=np.int64)
    sizes = np.zeros(T, dtype=np.int64)
    for rank in prange(T):
        size = join(sync, rank, T)
        sizes[rank] = size
        if size > 0:
            _rank_layers(rank, size, sync, x, norm_w, eps, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out,
                         act_id, up_act_id, pos, cos, sin, k_all, v_all, n_heads, n_kv, head_dim, scale, rope, h, attn,
                         qa_qkv, qa_o, qa_in, qkv, top, total, o, pre, hidden, recs)
    return sizes[0]
