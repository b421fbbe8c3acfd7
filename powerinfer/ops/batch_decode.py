"""Decode kernels for several sequences at once: each weight row is read once per step and
multiplied by every sequence's vector while it is in cache.

Why hand-written: decode is memory-bound, so B sequences cost about what one does only if
the weights stream past once; torch's GEMM would widen half or quantized weights first and
round differently. Each kernel here repeats, per sequence, exactly the arithmetic of its
one-token twin (`cpu.add_matvec`, `panels.add_matvec_panels`, `quant.add_matvec_q`,
`decode.attention_block`, `decode.dense_ffn`): the same row helpers, row grouping and
accumulation order (GGUF blocks: block_ir's dots, alike for one vector or four). A
sequence's logits are therefore bit for bit those of its solo decode, whatever else is in
the batch (a server returns each greedy request's solo output; tests/test_batch_decode.py
checks equality).

Shapes: V, X, H are (B, features) fp32 row-major; weights as the one-token kernels take them.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .cpu import STREAMS, _act, attend_chunk, attention_chunks, dot4, merge_chunks, row_dot, rms_norm, write_kv
from .decode import _gated_value, gated_values_rows
from .numba_half import widen
from .panels import in_features, out_features, weight_parts
from .block_ir import dot_row, dot_vecs2, dot_vecs4, dot_vecs8, quantize_acts_rows
from .lanes import add_matvec_lanes_batch


@njit(parallel=True, fastmath=True, cache=True)
def add_matvec_rows(w, V, b, X):
    """X[s] += W V[s] (+ b) for every sequence s, W in rows: `cpu.add_matvec` per sequence."""
    n = w.shape[0]
    q = n // STREAMS
    has_b = b.shape[0] > 0
    for i in prange(q):
        for s in range(V.shape[0]):
            a0, a1, a2, a3 = dot4(w, i, i + q, i + 2 * q, i + 3 * q, V[s])
            if has_b:
                a0 += b[i]
                a1 += b[i + q]
                a2 += b[i + 2 * q]
                a3 += b[i + 3 * q]
            X[s, i] += a0
            X[s, i + q] += a1
            X[s, i + 2 * q] += a2
            X[s, i + 3 * q] += a3
    for i in range(STREAMS * q, n):
        for s in range(V.shape[0]):
            acc = row_dot(w, i, V[s])
            if has_b:
                acc += b[i]
            X[s, i] += acc


@njit(parallel=True, fastmath=True, cache=True)
def add_matvec_panels(wp, V, b, X, threads):
    """X[s] += W V[s] (+ b), W in panels: `panels.add_matvec_panels` per sequence."""
    nb, n, p = wp.shape
    for t in prange(threads):
        lo, hi = t * n // threads, (t + 1) * n // threads
        h = (hi - lo) // 2
        for blk in range(nb):
            off = blk * p
            for i in range(lo, lo + h):
                k = i + h
                for s in range(V.shape[0]):
                    a0 = np.float32(0.0)
                    a1 = np.float32(0.0)
                    for c in range(p):
                        vc = V[s, off + c]
                        a0 += widen(wp[blk, i, c]) * vc
                        a1 += widen(wp[blk, k, c]) * vc
                    X[s, i] += a0
                    X[s, k] += a1
            for i in range(lo + 2 * h, hi):
                for s in range(V.shape[0]):
                    acc = np.float32(0.0)
                    for c in range(p):
                        acc += widen(wp[blk, i, c]) * V[s, off + c]
                    X[s, i] += acc
        if b.shape[0] > 0:
            for i in range(lo, hi):
                for s in range(V.shape[0]):
                    X[s, i] += b[i]


@njit(fastmath=True, cache=True)
def add_matvec_q(w, V, b, X, threads):
    """X[s] += W V[s] (+ b), W in GGUF blocks, for a batch (B >= 2; one vector takes
    `quant.add_matvec_q`): the vectors quantized to int8 records once, then eight (four,
    two, one) at a time through one unpacking of each block (`add_matvec_4v`)."""
    B = V.shape[0]
    add_matvec_4v(w, quantize_acts_rows(V, w.shape[2]), X)
    n = w.shape[0]
    if b.shape[0] > 0:
        for k in range(n):
            for s in range(B):
                X[s, k] += b[k]


def matvec_into(w, V, b, X, threads):  # pragma: no cover - only its numba overload runs
    """X += W V^T row by row, any weight layout (the batch twin of panels.matvec_into)."""
    raise NotImplementedError("matvec_into() is for numba kernels")


@overload(matvec_into)
def _matvec_into(w, V, b, X, threads):
    if isinstance(w, types.BaseTuple):  # row parts of mixed formats, as panels.matvec_into
        return lambda w, V, b, X, threads: _add_parts(w, V, b, X, threads)
    if w.ndim == 4:
        return lambda w, V, b, X, threads: add_matvec_lanes_batch(w, V, b, X, threads)
    if w.ndim == 3 and w.dtype == types.uint8:
        return lambda w, V, b, X, threads: add_matvec_q(w, V, b, X, threads)
    if w.ndim == 3:
        return lambda w, V, b, X, threads: add_matvec_panels(w, V, b, X, threads)
    return lambda w, V, b, X, threads: add_matvec_rows(w, V, b, X)


_add_parts = weight_parts(matvec_into)  # the mixed-format parts, a batch at a time


@njit(fastmath=True, cache=True, nogil=True)
def gemv(w, V, bias, residual, out, threads):
    """out[s] = W V[s] (+ bias) (+ residual[s]) for every s: `panels.gemv_any` per sequence.
    Empty `bias`/`residual` mean none."""
    if residual.shape[0] > 0:
        out[:] = residual
    else:
        out[:] = 0.0
    matvec_into(w, V, bias, out, threads)


@njit(parallel=True, fastmath=True, cache=True)
def _gated_hidden_rows(H, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden):
    """`decode._gated_hidden` per sequence: neurons i and i + n_ff/2 per step."""
    q = n_ff // 2
    for i in prange(q):
        k = i + q
        for s in range(H.shape[0]):
            g0, u0, g1, u1 = dot4(w_in, i, n_ff + i, k, n_ff + k, H[s])
            hidden[s, i] = _gated_value(g0, u0, i, n_ff, b_in, act_id, up_act_id, criterion, threshold)
            hidden[s, k] = _gated_value(g1, u1, k, n_ff, b_in, act_id, up_act_id, criterion, threshold)
    for i in range(2 * q, n_ff):
        for s in range(H.shape[0]):
            hidden[s, i] = _gated_value(row_dot(w_in, i, H[s]), row_dot(w_in, n_ff + i, H[s]), i, n_ff, b_in, act_id,
                                        up_act_id, criterion, threshold)


@njit(inline="always")
def _gated_hidden_pre(H, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads):
    """Panels and GGUF blocks: every gate and up dot first, then the neurons' values (as
    `decode._gated_hidden_pre`, the same value kernel over every sequence)."""
    pre = np.zeros((H.shape[0], 2 * n_ff), dtype=np.float32)
    matvec_into(w_in, H, np.zeros(0, dtype=np.float32), pre, threads)
    gated_values_rows(pre, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden)


def gated_hidden(H, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads):  # pragma: no cover
    raise NotImplementedError("gated_hidden() is for numba kernels")


@overload(gated_hidden)
def _gated_hidden_any(H, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads):
    if w_in.ndim >= 3:
        return lambda H, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads: (
            _gated_hidden_pre(H, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads))
    return lambda H, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads: _gated_hidden_rows(
        H, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden)


@njit(fastmath=True, cache=True, nogil=True)
def dense_ffn(H, w_in, b_in, w_out, b_out, gated, act_id, up_act_id, criterion, threshold, X, threads):
    """X[s] += FFN(H[s]) in place for every sequence: `decode.dense_ffn` per sequence."""
    B = H.shape[0]
    n_ff = in_features(w_out)
    hidden = np.empty((B, n_ff), dtype=np.float32)
    if gated:
        gated_hidden(H, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads)
    else:
        hidden[:] = 0.0
        matvec_into(w_in, H, b_in, hidden, threads)
        for s in range(B):
            for i in range(n_ff):
                v = _act(hidden[s, i], act_id)
                hidden[s, i] = np.float32(0.0) if criterion != 0 and abs(v) <= threshold else v
    matvec_into(w_out, hidden, b_out, X, threads)


@njit(fastmath=True, cache=True, nogil=True)
def attention_in(X, norm_w, eps, wqkv, bqkv, QKV, threads):
    """QKV[s] = Wqkv rms_norm(X[s]) (+ b): the first part of `decode.attention_block`."""
    H = np.empty_like(X)
    for s in range(X.shape[0]):
        rms_norm(X[s], norm_w, eps, H[s])
    QKV[:] = 0.0
    matvec_into(wqkv, H, bqkv, QKV, threads)


@njit(fastmath=True, cache=True, nogil=True)
def attention_out(ATT, wo, bo, X, ffn_norm_w, eps, H_out, threads):
    """X[s] += Wo ATT[s] (+ b), then H_out[s] = rms_norm(X[s]) * ffn_norm_w: the end of
    `decode.attention_block`."""
    matvec_into(wo, ATT, bo, X, threads)
    for s in range(X.shape[0]):
        rms_norm(X[s], ffn_norm_w, eps, H_out[s])


def _cache_of(caches, s, layer):  # pragma: no cover - only its numba overload runs
    raise NotImplementedError("_cache_of() is for numba kernels")


@overload(_cache_of, inline="always")
def _cache_of_any(caches, s, layer):
    """Row s's (kv_heads, max_len, head_dim) cache of `layer`: from a typed list of the
    sequences' caches, (layers, ...) blocks or one layer's; or the one layer cache all rows
    share."""
    if isinstance(caches, types.Array):
        return lambda caches, s, layer: caches
    if caches.dtype.ndim == 4:
        return lambda caches, s, layer: caches[s][layer]
    return lambda caches, s, layer: caches[s]


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def attend(QKV, pos, cos, sin, k_caches, v_caches, layer, n_heads, n_kv, head_dim, scale, rope, ATT):
    """Decode attention for B rows in one call: row s's token at position pos[s] (RoPE, its
    keys and values written into its cache of `layer`: from k_caches[s] / v_caches[s], typed
    lists with one element per sequence, its (layers, kv_heads, max_len, head_dim) blocks or
    its (kv_heads, max_len, head_dim) layer caches; or one such layer cache all rows share, a
    short prompt's tokens, causal because every row is written before any is read), then
    softmax(q k^T * scale) v: every row's (KV head, chunk) work items in one parallel loop, as
    `cpu.attend_one` runs them per sequence, without a thread launch each (at 8 sequences
    those launches were a fifth of a step)."""
    B = QKV.shape[0]
    chunks = np.empty(B, dtype=np.int64)
    start = np.zeros(B + 1, dtype=np.int64)  # sequence s's work items: start[s] .. start[s + 1]
    for s in range(B):
        write_kv(QKV[s], pos[s], cos, sin, _cache_of(k_caches, s, layer), _cache_of(v_caches, s, layer), n_heads,
                 n_kv, head_dim, rope)
        chunks[s] = attention_chunks(pos[s], 0)
        start[s + 1] = start[s] + n_kv * chunks[s]
    most = chunks.max()
    top = np.empty((B, n_heads, most), dtype=np.float32)
    total = np.empty((B, n_heads, most), dtype=np.float32)
    o = np.empty((B, n_heads, most, head_dim), dtype=np.float32)
    for item in prange(start[B]):
        s = np.searchsorted(start, item, side="right") - 1
        k = item - start[s]
        attend_chunk(k // chunks[s], k % chunks[s], QKV[s], pos[s], cos, sin, _cache_of(k_caches, s, layer),
                     _cache_of(v_caches, s, layer), n_heads, n_kv, head_dim, scale, rope, 0, np.float32(0.0), top[s],
                     total[s], o[s])
    for s in range(B):
        merge_chunks(chunks[s], top[s], total[s], o[s], ATT[s], head_dim)


@njit(parallel=True, fastmath=True, cache=True)
def add_matvec_4v(w, QA, X):
    """X[s] += W V[s] for W in GGUF blocks (any format), eight vectors per pass over a row (each
    block unpacked once for the eight: register blocking), the rest four, two and one at a time.
    QA[s] holds V[s]'s int8 activation records (`block_ir.quantize_acts_rows`). Each (row,
    vector) dot runs as in the one-vector GEMV (block_ir), so the rows equal solo."""
    n, B = w.shape[0], QA.shape[0]
    eights = B // 8 * 8
    fours = eights + (B - eights) // 4 * 4
    for i in prange(n):
        for s in range(0, eights, 8):
            r = dot_vecs8(w, i, QA, s)
            for c in range(8):
                X[s + c, i] += r[c]
        for s in range(eights, fours, 4):
            a0, a1, a2, a3 = dot_vecs4(w, i, QA, s, s + 1, s + 2, s + 3)
            X[s, i] += a0
            X[s + 1, i] += a1
            X[s + 2, i] += a2
            X[s + 3, i] += a3
        s = fours
        if B - s >= 2:  # the rest: two at a time, then one
            a0, a1 = dot_vecs2(w, i, QA, s, s + 1)
            X[s, i] += a0
            X[s + 1, i] += a1
            s += 2
        if s < B:
            X[s, i] += dot_row(w, i, QA[s])


@njit(fastmath=True, cache=True, nogil=True)
def layer_stack(X, norm_w, eps, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out, gated, act_id, up_act_id,
                pos, cos, sin, k_caches, v_caches, n_heads, n_kv, head_dim, scale, rope, threads):
    """One decode step of B rows through every layer in one call: per layer `attention_in`,
    `attend`, `attention_out` and `dense_ffn`, the kernels the per-layer batch path calls, so
    the rows are that path's to the bit. The per-layer arrays come in typed lists (as
    `decode.layer_stack` takes them); k_caches / v_caches are typed lists of the sequences'
    (layers, kv_heads, max_len, head_dim) blocks. Why: between the four calls of a layer the
    Python path spent ~40-60 us (a fifth of a two-sequence step on SmolLM2)."""
    B, d = X.shape
    q_dim = n_heads * head_dim
    ATT = np.empty((B, q_dim), dtype=np.float32)
    H = np.empty((B, d), dtype=np.float32)
    no_criterion = np.int64(0)  # not the constant 0: a literal argument compiles dense_ffn once more
    for i in range(len(wqkv)):
        QKV = np.empty((B, out_features(wqkv[i])), dtype=np.float32)
        attention_in(X, norm_w[i], eps, wqkv[i], bqkv[i], QKV, threads)
        attend(QKV, pos, cos, sin, k_caches, v_caches, i, n_heads, n_kv, head_dim, scale, rope, ATT)
        attention_out(ATT, wo[i], bo[i], X, ffn_norm_w[i], eps, H, threads)
        dense_ffn(H, w_in[i], b_in[i], w_out[i], b_out[i], gated, act_id, up_act_id, no_criterion, np.float32(0.0), X,
                  threads)
