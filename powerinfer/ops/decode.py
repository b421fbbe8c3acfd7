"""Whole-block decode kernels: one numba call per attention block and one per dense FFN.

Why: a decode token of a small model is dominated by per-call overhead, not by bytes. With
one numba call per matmul, norm and attention, SmolLM2-135M spent about 5 ms of a 17 ms
token outside the kernels (Python dispatch, numpy/torch views, small torch ops). These
kernels run a pre-norm attention block (norm, QKV, RoPE, cache write, attention, output
projection, residual, the FFN's norm) or a dense FFN (gate/up, activation, down, residual)
in a single call with a few parallel regions inside, so a layer costs two calls, and
`layer_stack` runs every layer of a token in one call where the layers allow it
(models/stack.py).

The row dots and attention heads are the same helpers the per-op kernels in `cpu.py` use.
Weights are numpy views in `numpy_weights` encoding (fp32, bf16 as uint16, fp16 as int16);
activations and the KV cache are fp32. Empty bias arrays mean no bias.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.extending import overload

from numba import types

from . import lanes, quant
from .block_ir import _quantize_into, quantize_acts
from .criterion import GATE
from .cpu import _act, attend_all, gated_value, rms_norm, write_kv
from .lane_ir import LANES, lane_dots1
from .panels import in_features, matvec_into, out_features
from .row_dots import array_ref, dot4_by_code, row_dot_by_code
from .vmath import exp32


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
    neurons (i, i + n_ff/2) per step: four row streams per thread (see cpu.add_matvec). w_in
    comes as a `row_dots.weight_ref` (h a C array), so one compile serves fp32, bf16 and fp16
    rows (~10 s each). Called, not inlined, like add_matvec (dense_ffn compiled in 7 s
    instead of 12)."""
    addr, d, stride, code = w_in[0], w_in[2], w_in[3], w_in[4]
    x = h.ctypes.data
    q = n_ff // 2
    for step in prange(q):
        i = np.int64(step)  # the prange index is unsigned in the loop body
        k = i + q
        g0, u0, g1, u1 = dot4_by_code(code, (addr, stride, (i, n_ff + i, k, n_ff + k), x, d))
        hidden[i] = _gated_value(g0, u0, i, n_ff, b_in, act_id, up_act_id, criterion, threshold)
        hidden[k] = _gated_value(g1, u1, k, n_ff, b_in, act_id, up_act_id, criterion, threshold)
    for i in range(2 * q, n_ff):
        g = row_dot_by_code(code, (addr, stride, i, x, d))[0]
        u = row_dot_by_code(code, (addr, stride, n_ff + i, x, d))[0]
        hidden[i] = _gated_value(g, u, i, n_ff, b_in, act_id, up_act_id, criterion, threshold)


@njit(inline="always", fastmath=True)
def _silu_times(v, u):
    """silu(v) * u as the vectorizing loops compute it: one formula for `gated_values` and
    `gated_row`, so that the per-layer and team batch paths give the same bits."""
    return v / (np.float32(1.0) + exp32(-v)) * u


@njit(inline="always", fastmath=True)
def gated_values(g, u, out, i0, n_ff, b_in, act_id, up_act_id, criterion, threshold):
    """out[k] = `_gated_value`(g[k], u[k]) for neurons i0 + k: the same values, in a loop
    that vectorizes (with error_model="numpy") for the common FFN: SiLU, no bias, no
    criterion, nothing on up."""
    if b_in.shape[0] == 0 and criterion == 0 and up_act_id < 0 and act_id == 0:
        for k in range(out.shape[0]):
            out[k] = _silu_times(g[k], u[k])
    else:
        for k in range(out.shape[0]):
            out[k] = _gated_value(g[k], u[k], i0 + k, n_ff, b_in, act_id, up_act_id, criterion, threshold)


@njit(fastmath=True, cache=True, error_model="numpy")  # vmath: loops of exp32 vectorize
def gated_row(pre, hidden, s, n_ff, b_in, act_id, up_act_id):
    """hidden[s, k] = `_gated_value`(pre[s, k], pre[s, n_ff + k]) for every neuron k (no
    criterion), the team kernels' activation pass over a row. It indexes the 2-D arrays
    instead of slicing them: each slice takes and drops a reference to the array, an atomic
    on a counter both threads of a team share (in steps of 64 neurons that was ~20x the
    arithmetic: a fifth of a batched step on SmolLM2). Not inlined, so that LLVM vectorizes
    the loop on its own."""
    if b_in.shape[0] == 0 and up_act_id < 0 and act_id == 0:
        for k in range(n_ff):
            hidden[s, k] = _silu_times(pre[s, k], pre[s, n_ff + k])
    else:
        for k in range(n_ff):
            hidden[s, k] = _gated_value(pre[s, k], pre[s, n_ff + k], k, n_ff, b_in, act_id, up_act_id, 0,
                                        np.float32(0.0))


VALUES_PER_STEP = 64  # neurons per parallel step of the activation pass (whole vectors)


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def gated_values_rows(pre, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden):
    """hidden[s, i] = the value of neuron i from its gate and up dots pre[s, i] and
    pre[s, n_ff + i], every row s, in parallel steps of VALUES_PER_STEP neurons. Its own
    kernel, taking no weights: one compile serves every weight layout, one token or a batch
    (it was compiled into each layout's FFN kernel, ~9 s each)."""
    for step in prange((n_ff + VALUES_PER_STEP - 1) // VALUES_PER_STEP):
        i0 = step * VALUES_PER_STEP
        i1 = min(i0 + VALUES_PER_STEP, n_ff)
        for s in range(pre.shape[0]):
            gated_values(pre[s, i0:i1], pre[s, n_ff + i0:n_ff + i1], hidden[s, i0:i1], i0, n_ff, b_in, act_id,
                         up_act_id, criterion, threshold)


@njit(inline="always")
def _gated_hidden_pre(h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads):
    """_gated_hidden for w_in in panels, GGUF blocks or lanes: the GEMV of all gate and up
    rows first (`panels.matvec_into` picks the kernel; a panel GEMV finishes a neuron's two
    dots only at the last panel), then the neurons' values (`gated_values_rows`)."""
    pre = np.zeros(2 * n_ff, dtype=np.float32)
    matvec_into(w_in, h, np.zeros(0, dtype=np.float32), pre, threads)  # biases: in _gated_value
    gated_values_rows(pre.reshape((1, 2 * n_ff)), b_in, n_ff, act_id, up_act_id, criterion, threshold,
                      hidden.reshape((1, n_ff)))


def gated_hidden(h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads):  # pragma: no cover
    raise NotImplementedError("gated_hidden() is for numba kernels")


@overload(gated_hidden)
def _gated_hidden_any(h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads):
    if w_in.ndim >= 3:  # panels, GGUF blocks, lanes
        return lambda h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads: (
            _gated_hidden_pre(h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads))
    return lambda h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads: _gated_hidden(
        h, array_ref(w_in), b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden)


@njit(inline="always")
def record_block(bb_out):
    """(P, record bytes) of the down projection's activation records: P neurons per record."""
    P = 256 if bb_out == 144 or bb_out == 176 or bb_out == 210 else 32
    return P, 72 * (P // 32)  # block_ir.record_bytes(bb_out)


@njit(inline="always", fastmath=True, error_model="numpy")
def gated_record_block(blk, qa, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, bb_out, pre, hidden,
                       out):
    """Record block `blk` of `_gated_records`: its P neurons' gate and up lane dots with the
    records qa into pre[blk] (zeroed), their values into hidden, their records into out."""
    bb, nb = w_in.shape[3], w_in.shape[1]
    P, rec = record_block(bb_out)
    per = P // LANES  # gate groups (and up groups) per record block
    up0 = n_ff // LANES  # the first group of up rows
    gs = w_in.strides[0]
    a0 = qa.ctypes.data
    for j in range(per):
        g = blk * per + j
        dst = pre.ctypes.data + 4 * (2 * P * blk + LANES * j)
        lane_dots1(bb, w_in.ctypes.data + g * gs, nb, (a0,), (dst,))
        lane_dots1(bb, w_in.ctypes.data + (up0 + g) * gs, nb, (a0,), (dst + 4 * P,))
    gated_values(pre[blk, 0], pre[blk, 1], hidden[blk * P:(blk + 1) * P], blk * P, n_ff, b_in, act_id,
                 up_act_id, criterion, threshold)
    _quantize_into(hidden[blk * P:(blk + 1) * P], bb_out, out[blk * rec:(blk + 1) * rec])


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _gated_records(h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, bb_out):
    """The gated FFN's neurons for W_in in lanes, as the int8 records of a down projection
    of `bb_out`-byte blocks, in one parallel pass: per record block of P neurons, the gate
    and up lane dots of its rows, their values (`_gated_value`), then their records. The same
    dots, values and records as `_gated_hidden_pre` followed by `quantize_acts`, without the
    second parallel loop and the serial quantizer (about a sixth of SmolLM2's FFN)."""
    qa = quantize_acts(h, lanes.record_bytes(w_in))
    P, rec = record_block(bb_out)
    n_blocks = n_ff // P
    pre = np.zeros((n_blocks, 2, P), dtype=np.float32)
    hidden = np.empty(n_ff, dtype=np.float32)
    out = np.empty(n_blocks * rec, dtype=np.uint8)
    for blk in prange(n_blocks):
        # qa passed in the loop, not its address before it: numba frees an array after its
        # last use by name, and the kernels read qa through a raw address
        gated_record_block(blk, qa, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, bb_out, pre, hidden,
                           out)
    return out


def _records_into(w, qa, x):  # pragma: no cover - only its numba overload runs
    raise NotImplementedError("_records_into() is for numba kernels")


@overload(_records_into)
def _records_into_any(w, qa, x):
    if w.ndim == 4:
        return lambda w, qa, x: lanes.add_records_lanes(w, qa, x)
    return lambda w, qa, x: quant.add_records_q(w, qa, x)


def gated_ffn_add(h, w_in, b_in, w_out, b_out, n_ff, act_id, up_act_id, criterion, threshold, x,
                  threads):  # pragma: no cover - only its numba overload runs
    raise NotImplementedError("gated_ffn_add() is for numba kernels")


def _records_pair(w_in, w_out) -> bool:
    """Typing time: gate/up in lanes and a down projection in lanes or GGUF row blocks, whose
    activation records `_gated_records` can write directly."""
    blocks_out = isinstance(w_out, types.Array) and w_out.dtype == types.uint8 and w_out.ndim in (3, 4)
    return isinstance(w_in, types.Array) and w_in.ndim == 4 and blocks_out


@overload(gated_ffn_add)
def _gated_ffn_add_any(h, w_in, b_in, w_out, b_out, n_ff, act_id, up_act_id, criterion, threshold, x, threads):
    if _records_pair(w_in, w_out):
        def fused(h, w_in, b_in, w_out, b_out, n_ff, act_id, up_act_id, criterion, threshold, x, threads):
            bb_out = lanes.record_bytes(w_out) if w_out.ndim == 4 else w_out.shape[2]
            recs = _gated_records(h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, bb_out)
            _records_into(w_out, recs, x)
            if b_out.shape[0] > 0:
                x += b_out
        return fused

    def two_passes(h, w_in, b_in, w_out, b_out, n_ff, act_id, up_act_id, criterion, threshold, x, threads):
        hidden = np.empty(n_ff, dtype=np.float32)
        gated_hidden(h, w_in, b_in, n_ff, act_id, up_act_id, criterion, threshold, hidden, threads)
        matvec_into(w_out, hidden, b_out, x, threads)
    return two_passes


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
    if gated:
        gated_ffn_add(h, w_in, b_in, w_out, b_out, n_ff, act_id, up_act_id, criterion, threshold, x, threads)
        return
    hidden = np.zeros(n_ff, dtype=np.float32)
    matvec_into(w_in, h, b_in, hidden, threads)
    for i in range(n_ff):
        v = _act(hidden[i], act_id)
        hidden[i] = np.float32(0.0) if criterion != 0 and abs(v) <= threshold else v
    matvec_into(w_out, hidden, b_out, x, threads)


@njit(fastmath=True, cache=True, nogil=True)
def layer_stack(x, norm_w, eps, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out, gated, act_id, up_act_id,
                pos, cos, sin, k_all, v_all, n_heads, n_kv, head_dim, scale, rope, threads):
    """One decode token through every layer in one call: per layer `attention_block` then
    `dense_ffn` (no criterion), the same kernels the per-layer path calls, so the result is
    that path's to the bit. The per-layer arrays come in numba typed lists (one element per
    layer, alike in type); `k_all`/`v_all` are the (layers, kv_heads, max_len, head_dim)
    caches. Why: on a small model the Python between two kernel calls was ~15 us a layer,
    an eighth of a SmolLM2 token."""
    h = np.empty(x.shape[0], dtype=np.float32)
    no_criterion = np.int64(0)  # not the constant 0: a literal argument compiles dense_ffn once more
    for i in range(len(wqkv)):
        attention_block(x, norm_w[i], eps, wqkv[i], bqkv[i], wo[i], bo[i], ffn_norm_w[i], pos, cos, sin, k_all[i],
                        v_all[i], n_heads, n_kv, head_dim, scale, rope, h, threads)
        dense_ffn(h, w_in[i], b_in[i], w_out[i], b_out[i], gated, act_id, up_act_id, no_criterion, np.float32(0.0), x,
                  threads)
