"""Whole-block decode kernels: one numba call per attention block and one per dense FFN.

Why: a decode token of a small model is dominated by per-call overhead, not by bytes. With
one numba call per matmul, norm and attention, SmolLM2-135M spent about 5 ms of a 17 ms
token outside the kernels (Python dispatch, numpy/torch views, small torch ops). These
kernels run a pre-norm attention block (norm, QKV, RoPE, cache write, attention, output
projection, residual, the FFN's norm) or a dense FFN (gate/up, activation, down, residual)
in a single call with a few parallel regions inside, so a layer costs two calls.

The row dots and attention heads are the same helpers the per-op kernels in `cpu.py` use.
Weights are numpy views in `numpy_weights` encoding (fp32, bf16 as uint16, fp16 as int16);
activations and the KV cache are fp32. Empty bias arrays mean no bias.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.extending import overload

from .criterion import GATE
from .cpu import _act, attend_all, dot4, gated_value, rms_norm, row_dot, write_kv
from .panels import in_features, matvec_into, out_features


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def attention_block(x, norm_w, eps, wqkv, bqkv, wo, bo, ffn_norm_w, pos, cos, sin, k_cache, v_cache,
                    n_heads, n_kv, head_dim, scale, rope, h_out, threads):
    """x += attention(rms_norm(x)) in place, then h_out = rms_norm(x) * ffn_norm_w.

    `k_cache`/`v_cache` are this layer's (kv_heads, max_len, head_dim) caches; the token's
    key and value are written at `pos`. `threads`: numba's thread count (panels.threads()).
    """
    d = x.shape[0]
    n_qkv = out_features(wqkv)
    q_dim = n_heads * head_dim
    h = np.empty(d, dtype=np.float32)
    rms_norm(x, norm_w, eps, h)
    qkv = np.zeros(n_qkv, dtype=np.float32)
    matvec_into(wqkv, h, bqkv, qkv, threads)
    write_kv(qkv, pos, cos, sin, k_cache, v_cache, n_heads, n_kv, head_dim, rope)
    attn = np.empty(q_dim, dtype=np.float32)
    attend_all(qkv, pos, cos, sin, k_cache, v_cache, n_heads, n_kv, head_dim, scale, rope, attn, 0, np.float32(0.0))
    matvec_into(wo, attn, bo, x, threads)
    rms_norm(x, ffn_norm_w, eps, h_out)


@njit(inline="always", fastmath=True)
def _gated_value(g, u, i, n_ff, b_in, act_id, up_act_id, criterion, threshold):
    """act(g) * up_act(u) (biases added), 0 when off by the criterion (GATE: |act(g)| <= threshold,
    GATE_UP: |act(g) * up_act(u)| <= threshold; NONE: never)."""
    if b_in.shape[0] > 0:
        g += b_in[i]
        u += b_in[n_ff + i]
    a = _act(g, act_id)
    if criterion == GATE and abs(a) <= threshold:
        return np.float32(0.0)
    return gated_value(a, u, up_act_id, criterion, threshold)


@njit(parallel=True, fastmath=True, cache=True)
def _gated_hidden(h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden):
    """hidden[i] = act(gate_i . h) * up_act(up_i . h) for every neuron, in parallel, two
    neurons (i, i + n_ff/2) per step: four row streams per thread (see cpu.add_matvec). Called,
    not inlined, like add_matvec (dense_ffn compiled in 7 s instead of 12)."""
    q = n_ff // 2
    for i in prange(q):
        k = i + q
        g0, u0, g1, u1 = dot4(w_in, i, n_ff + i, k, n_ff + k, h)
        hidden[i] = _gated_value(g0, u0, i, n_ff, b_in, act_id, up_act_id, criterion, threshold)
        hidden[k] = _gated_value(g1, u1, k, n_ff, b_in, act_id, up_act_id, criterion, threshold)
    for i in range(2 * q, n_ff):
        hidden[i] = _gated_value(row_dot(w_in, i, h), row_dot(w_in, n_ff + i, h), i, n_ff, b_in, act_id, up_act_id,
                                 criterion, threshold)


@njit(parallel=True, fastmath=True, cache=True)
def _gated_hidden_pre(h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads):
    """_gated_hidden for w_in in panels, GGUF blocks or lanes: the GEMV of all gate and up
    rows first (`panels.matvec_into` picks the kernel; a panel GEMV finishes a neuron's two
    dots only at the last panel), then the neurons' values."""
    pre = np.zeros(2 * n_ff, dtype=np.float32)
    matvec_into(w_in, h, np.zeros(0, dtype=np.float32), pre, threads)  # biases: in _gated_value
    for i in prange(n_ff):
        hidden[i] = _gated_value(pre[i], pre[n_ff + i], i, n_ff, b_in, act_id, up_act_id, criterion, threshold)


def gated_hidden(h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads):  # pragma: no cover
    raise NotImplementedError("gated_hidden() is for numba kernels")


@overload(gated_hidden)
def _gated_hidden_any(h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads):
    if w_in.ndim >= 3:  # panels, GGUF blocks, lanes
        return lambda h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads: (
            _gated_hidden_pre(h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads))
    return lambda h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads: _gated_hidden(
        h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden)


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def dense_ffn(h, w_in, b_in, w_out, b_out, gated, act_id, up_act_id, criterion, threshold, x, threads):
    """x += FFN(h) in place, every neuron's rows read.

    Gated: w_in is (2 n_ff, d), gate rows first; neuron i = act(gate_i . h) * up_act(up_i . h)
    (up_act_id < 0: no activation on up). Plain: neuron i = act(w_in_i . h + b_in_i).
    w_out is (d, n_ff). Either may be in column panels (ops/panels.py). `criterion`/`threshold`
    zero neurons as the sparse kernels do (0: none; 1: |act(gate)| <= threshold, or |act| for
    a plain FFN; 2: |neuron| <= threshold), which makes this the oracle FFN when every row is
    read anyway. `threads`: numba's thread count (panels.threads()).
    """
    n_ff = in_features(w_out)
    hidden = np.empty(n_ff, dtype=np.float32)
    if gated:
        gated_hidden(h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads)
    else:
        hidden[:] = 0.0
        matvec_into(w_in, h, b_in, hidden, threads)
        for i in range(n_ff):
            v = _act(hidden[i], act_id)
            hidden[i] = np.float32(0.0) if criterion != 0 and abs(v) <= threshold else v
    matvec_into(w_out, hidden, b_out, x, threads)
