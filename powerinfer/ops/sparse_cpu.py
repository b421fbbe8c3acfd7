"""Neuron-aware sparse CPU kernels (numba): compute only the active neurons' rows/columns.

Why hand-written: the torch route (`W.index_select(0, idx) @ x`) copies the selected rows
and runs slower than the dense GEMV at 10% activity; these kernels read each active row in
place, once, and accumulate in fp32 whatever the weight dtype (see numba_half).

Layouts: row kernels take W (n_ff, d) with one neuron per row (gate, up, fc1); the column
AXPY takes the down projection stored transposed, Wt (n_ff, d), so a neuron's column is a
contiguous row. `x` is (T, d) for a batch of T tokens sharing one active set (the union of
theirs). Parallel scheme: row kernels split the active set across threads, each output
independent; accumulating kernels give each thread a static chunk of the active set and a
private (T, d) accumulator, summed at the end, so there are no write conflicts.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from .criterion import GATE
from .cpu import _act, gated_value
from .row_dots import (axpy4_by_code, axpy8_by_code, axpy_by_code, dot4_by_code, dot8_by_code, pair_dots_by_code,
                       row_dot_by_code, weight_ref)


# Rows are processed several at a time: independent streams per thread keep more memory
# requests in flight than one (measured, bf16 at 10% active: 1 row 16 GB/s, 4 rows 26-27,
# 8 rows 29). Row dots and AXPYs both go eight rows at a time.
ROW_BLOCK = 8
AXPY_BLOCK = 8
SHORT_ROW = 1024  # row length (elements) up to which dense-ish sets are read sequentially

# The kernels take each weight matrix as a reference, `row_dots.weight_ref`: (address, rows,
# columns, row stride, dtype code), and read it only through the row dots' C functions, so
# each kernel compiles once for fp32, bf16 and fp16 weights (per dtype they had been ~60 s of
# a cold start's compile). The wrappers at the end take the numpy weight views as before.
ADDR, N_ROWS, N_COLS, STRIDE, CODE = 0, 1, 2, 3, 4


@njit(inline="always")
def _el_bytes(w):
    return 4 if w[CODE] == 0 else 2


@njit(inline="always")
def _x_at(x, t):
    """Address of row t of the C array x (T, d)."""
    return x.ctypes.data + t * x.strides[0]


@njit(inline="always")
def _dot(w, r, x, t):
    """w[r] . x[t] (fp32 accumulation)."""
    return row_dot_by_code(w[CODE], (w[ADDR], w[STRIDE], r, _x_at(x, t), x.shape[1]))[0]


@njit(inline="always")
def _dot4(w, r0, r1, r2, r3, x, t):
    return dot4_by_code(w[CODE], (w[ADDR], w[STRIDE], (r0, r1, r2, r3), _x_at(x, t), x.shape[1]))


@njit(inline="always")
def _dot8(w, rows, x, t, out_addr, pw, ahead, n_ahead):
    """The eight dots w[rows[i]] . x[t] into float32s at out_addr, prefetching the first
    n_ahead rows of `ahead` in matrix pw (the rows read next)."""
    dot8_by_code(w[CODE], (w[ADDR], w[STRIDE], rows.ctypes.data, _x_at(x, t), x.shape[1], out_addr, pw[ADDR],
                           pw[STRIDE] * _el_bytes(pw), _el_bytes(pw), ahead.ctypes.data, n_ahead))


@njit(inline="always")
def _block_rows(idx, k0, k, dense, rows):
    """rows[0:8] = the rows of active-set entries k0..k0+7; False (rows untouched) when the
    set has fewer than eight entries from k0."""
    if k0 + ROW_BLOCK > k:
        return False
    for i in range(ROW_BLOCK):
        rows[i] = _row_of(idx, k0 + i, dense)
    return True


@njit(inline="always")
def _row_of(idx, kk, dense):
    return np.int64(kk) if dense else np.int64(idx[kk])


@njit(inline="always", fastmath=True)
def _finish_row(v, r, bias, act_id):
    """A row dot's output: + bias[r] (when there is a bias), then the activation (act_id >= 0)."""
    if bias.shape[0] > 0:
        v += bias[r]
    if act_id >= 0:
        v = _act(v, act_id)
    return v


@njit(parallel=True, fastmath=True, cache=True)
def _row_gemv(w, x, idx, bias, act_id, out):
    """`row_gemv` with w a weight reference."""
    T = x.shape[0]
    dense = idx.shape[0] == 0
    k = w[N_ROWS] if dense else idx.shape[0]
    if 2 * k >= w[N_ROWS] and w[N_COLS] <= SHORT_ROW:
        # Dense-ish sets of short rows: step kk reads rows kk, kk + q, kk + 2q, kk + 3q of the
        # set (q = k/4), so each thread reads four distant sequential streams (cpu.add_matvec;
        # at d = 4096 the eight-row blocks below win).
        q = k // 4
        for kk in prange(q):
            r0, r1 = _row_of(idx, kk, dense), _row_of(idx, kk + q, dense)
            r2, r3 = _row_of(idx, kk + 2 * q, dense), _row_of(idx, kk + 3 * q, dense)
            for t in range(T):
                v0, v1, v2, v3 = _dot4(w, r0, r1, r2, r3, x, t)
                out[t, kk] = _finish_row(v0, r0, bias, act_id)
                out[t, kk + q] = _finish_row(v1, r1, bias, act_id)
                out[t, kk + 2 * q] = _finish_row(v2, r2, bias, act_id)
                out[t, kk + 3 * q] = _finish_row(v3, r3, bias, act_id)
        for kk in range(4 * q, k):
            r = _row_of(idx, kk, dense)
            for t in range(T):
                out[t, kk] = _finish_row(_dot(w, r, x, t), r, bias, act_id)
        return
    for b in prange((k + ROW_BLOCK - 1) // ROW_BLOCK):
        k0 = b * ROW_BLOCK
        rows = np.empty(ROW_BLOCK, dtype=np.int64)
        if _block_rows(idx, k0, k, dense, rows):
            ahead = np.empty(ROW_BLOCK, dtype=np.int64)
            more = _block_rows(idx, k0 + ROW_BLOCK, k, dense, ahead)
            for t in range(T):  # the next block's rows are prefetched once, with the first token
                _dot8(w, rows, x, t, out.ctypes.data + t * out.strides[0] + 4 * k0, w, ahead,
                      ROW_BLOCK if more and t == 0 else 0)
        else:
            for kk in range(k0, k):
                r = _row_of(idx, kk, dense)
                for t in range(T):
                    out[t, kk] = _dot(w, r, x, t)
        for kk in range(k0, min(k0 + ROW_BLOCK, k)):
            r = _row_of(idx, kk, dense)
            for t in range(T):
                out[t, kk] = _finish_row(out[t, kk], r, bias, act_id)


@njit(fastmath=True, cache=True)
def _reduce_chunks(acc, out, accumulate):
    n_chunks, T, d = acc.shape
    for t in range(T):
        for j in range(d):
            s = np.float32(0.0)
            for c in range(n_chunks):
                s += acc[c, t, j]
            out[t, j] = out[t, j] + s if accumulate else s


@njit(inline="always")
def _axpy_rows_sequential(wt, idx, coefs, lo, hi, acc_row):
    """acc_row += sum_k coefs[k] * wt[idx[k]] over k in [lo, hi) into a local accumulator,
    reading four distant parts of [lo, hi) as four interleaved sequential streams (more
    memory requests in flight than one; see cpu.STREAMS). For dense-ish sets of short rows
    this beats the eight-row blocks of adjacent rows (d = 576, bf16: one stream 73 vs 87 us
    at 93% of rows; at 60% the blocks win). Zero coefficients are multiplied, not skipped:
    skipping a third of the rows at random saved no time at d = 576."""
    d = acc_row.shape[0]
    local = np.zeros(d, dtype=np.float32)
    q = (hi - lo) // 4
    for kk in range(lo, lo + q):
        rows = (np.int64(idx[kk]), np.int64(idx[kk + q]), np.int64(idx[kk + 2 * q]), np.int64(idx[kk + 3 * q]))
        axpy4_by_code(wt[CODE], (wt[ADDR], wt[STRIDE], rows, coefs[kk], coefs[kk + q], coefs[kk + 2 * q],
                                 coefs[kk + 3 * q], d, local.ctypes.data))
    row, coef = np.empty(1, dtype=np.int64), np.empty(1, dtype=np.float32)
    for kk in range(lo + 4 * q, hi):
        row[0], coef[0] = np.int64(idx[kk]), coefs[kk]
        axpy_by_code(wt[CODE], (wt[ADDR], wt[STRIDE], row.ctypes.data, coef.ctypes.data, 1, d, local.ctypes.data))
    for j in range(d):
        acc_row[j] += local[j]


@njit(inline="always")
def _sequential_axpy(wt, k):
    """Whether an AXPY over k of wt's rows takes the streamed sequential route (>= 50% of
    short rows; d = 576, bf16, 30 matrices cycled: 66% of rows 85 vs 104 us for the blocks)."""
    return 2 * k >= wt[N_ROWS] and wt[N_COLS] <= SHORT_ROW


@njit(inline="always")
def _next_nonzero(idx, coefs, kk, hi, rows, blk):
    """Queue the next (up to AXPY_BLOCK) entries from kk on whose coefficient is not zero
    into rows/blk; returns (how many, where the scan stopped)."""
    n = 0
    while kk < hi and n < AXPY_BLOCK:
        s = coefs[kk]
        if s != 0.0:
            rows[n] = np.int64(idx[kk])
            blk[n] = s
            n += 1
        kk += 1
    return n, kk


@njit(fastmath=True, cache=True)
def _down_chunk(wt, idx, coefs, lo, hi, acc_row, sequential):
    """acc_row += sum over k in [lo, hi) of coefs[k] * wt[idx[k]], zero coefficients skipped:
    sequentially for dense-ish short rows, else in eight-row blocks, each block's rows
    prefetched while the one before is added (the skipped rows are never fetched). A called
    function, not inlined: col_axpy and both gated_ffn routes share one compiled copy
    (compile time)."""
    if sequential:
        _axpy_rows_sequential(wt, idx, coefs, lo, hi, acc_row)
        return
    d = acc_row.shape[0]
    rows, nxt = np.empty(AXPY_BLOCK, dtype=np.int64), np.empty(AXPY_BLOCK, dtype=np.int64)
    blk, nxt_blk = np.empty(AXPY_BLOCK, dtype=np.float32), np.empty(AXPY_BLOCK, dtype=np.float32)
    n, kk = _next_nonzero(idx, coefs, lo, hi, rows, blk)
    while n == AXPY_BLOCK:
        n_next, kk = _next_nonzero(idx, coefs, kk, hi, nxt, nxt_blk)
        axpy8_by_code(wt[CODE], (wt[ADDR], wt[STRIDE], rows.ctypes.data, blk.ctypes.data, d, acc_row.ctypes.data,
                                 wt[ADDR], wt[STRIDE] * _el_bytes(wt), _el_bytes(wt), nxt.ctypes.data, n_next))
        rows, nxt = nxt, rows
        blk, nxt_blk = nxt_blk, blk
        n = n_next
    axpy_by_code(wt[CODE], (wt[ADDR], wt[STRIDE], rows.ctypes.data, blk.ctypes.data, n, d, acc_row.ctypes.data))


@njit(parallel=True, fastmath=True, cache=True)
def _col_axpy(wt, a, idx, n_chunks, out, accumulate):
    """`col_axpy` with wt a weight reference."""
    T, k = a.shape
    d = wt[N_COLS]
    acc = np.zeros((n_chunks, T, d), dtype=np.float32)
    sequential = _sequential_axpy(wt, k)
    for c in prange(n_chunks):
        lo, hi = c * k // n_chunks, (c + 1) * k // n_chunks
        for t in range(T):
            _down_chunk(wt, idx, a[t], lo, hi, acc[c, t], sequential)
    _reduce_chunks(acc, out, accumulate)


@njit(inline="always", fastmath=True)
def _neuron_value(w_gate, w_up, r, x, t, act_id, up_act_id, criterion, threshold):
    """One gated neuron's value act(g) * up_act(u) for token x[t], 0 when off by the
    criterion (GATE: |act(g)| <= threshold, its up row then not read; GATE_UP: |act(g) * u| <= threshold)."""
    a = _act(_dot(w_gate, r, x, t), act_id)
    if criterion == GATE and abs(a) <= threshold:
        return np.float32(0.0)
    return gated_value(a, _dot(w_up, r, x, t), up_act_id, criterion, threshold)


@njit(fastmath=True, cache=True)
def _neuron_pair(w_gate, w_up, r0, r1, x, t, act_id, up_act_id, criterion, threshold):
    """Two neurons' values (as `_neuron_value`) in one pass over x[t]: four row streams. Called,
    not inlined (compile time)."""
    if criterion == GATE or w_gate[CODE] != w_up[CODE] or w_gate[STRIDE] != w_up[STRIDE]:
        # under GATE up rows are read only for neurons the gate keeps
        return (_neuron_value(w_gate, w_up, r0, x, t, act_id, up_act_id, criterion, threshold),
                _neuron_value(w_gate, w_up, r1, x, t, act_id, up_act_id, criterion, threshold))
    g0, u0, g1, u1 = pair_dots_by_code(w_gate[CODE], (w_gate[ADDR], w_up[ADDR], w_gate[STRIDE], (r0, r1), _x_at(x, t),
                                                       x.shape[1]))
    return (gated_value(_act(g0, act_id), u0, up_act_id, criterion, threshold),
            gated_value(_act(g1, act_id), u1, up_act_id, criterion, threshold))


@njit(fastmath=True, cache=True)
def _gate_then_up(w_gate, w_up, x, idx, lo, hi, act_id, up_act_id, threshold, h):
    """h[k] for k in [lo, hi), one token x (1, d), under GATE (|act(gate)| <= threshold
    -> off): gate rows eight at a time; the neurons the gate keeps are queued and their up rows
    read eight at a time too. A ReLU gate at threshold 0 is exact (off means h = 0), so for
    ReLU models a predicted neuron that does not fire costs one row, not three, and the up
    rows still stream in blocks (one row at a time left the bus idle: 1,100 neurons of 4096
    fp16, half of them off, read one up row at a time took as long as all three rows).
    Called, not inlined (compile time)."""
    rows = np.empty(ROW_BLOCK, dtype=np.int64)
    gates = np.empty(ROW_BLOCK, dtype=np.float32)
    q_rows = np.empty(ROW_BLOCK, dtype=np.int64)
    q_k = np.empty(ROW_BLOCK, dtype=np.int64)
    q_a = np.empty(ROW_BLOCK, dtype=np.float32)
    ups = np.empty(ROW_BLOCK, dtype=np.float32)
    n = 0
    ahead = np.empty(ROW_BLOCK, dtype=np.int64)
    for k0 in range(lo, hi, ROW_BLOCK):
        k1 = min(k0 + ROW_BLOCK, hi)
        if _block_rows(idx, k0, hi, False, rows):
            more = _block_rows(idx, k0 + ROW_BLOCK, hi, False, ahead)
            _dot8(w_gate, rows, x, 0, gates.ctypes.data, w_gate, ahead, ROW_BLOCK if more else 0)
        else:
            for kk in range(k0, k1):
                gates[kk - k0] = _dot(w_gate, np.int64(idx[kk]), x, 0)
        for kk in range(k0, k1):
            a = _act(gates[kk - k0], act_id)
            if abs(a) <= threshold:
                h[kk] = 0.0
                continue
            q_rows[n], q_k[n], q_a[n] = np.int64(idx[kk]), kk, a
            n += 1
            if n == ROW_BLOCK:
                _dot8(w_up, q_rows, x, 0, ups.ctypes.data, w_up, q_rows, 0)
                for i in range(ROW_BLOCK):
                    h[q_k[i]] = gated_value(q_a[i], ups[i], up_act_id, 1, threshold)
                n = 0
    for i in range(n):
        h[q_k[i]] = gated_value(q_a[i], _dot(w_up, q_rows[i], x, 0), up_act_id, 1, threshold)


@njit(parallel=True, fastmath=True, cache=True)
def _gated_ffn(w_gate, w_up, wt_down, x, idx, act_id, up_act_id, criterion, threshold, n_chunks, h, out,
               accumulate):
    """`gated_ffn` with the weights as references."""
    T = x.shape[0]
    k = idx.shape[0]
    d_out = wt_down[N_COLS]
    # Dense-ish sets have mostly adjacent rows: reading them one after another is one long
    # sequential stream, which beats eight interleaved short ones (measured at SmolLM2's
    # shape: all rows 218 vs 302 us, 66% about equal, 30% 153 vs 129 us in favour of eight).
    sequential = 2 * k >= w_gate[N_ROWS] and w_gate[N_COLS] <= SHORT_ROW
    sequential_down = _sequential_axpy(wt_down, k)
    acc = np.zeros((n_chunks, T, d_out), dtype=np.float32)
    if sequential:
        # Two phases, as the dense FFN: every neuron's gate and up rows in one fine-grained
        # parallel loop, then the down rows per chunk (d = 576, bf16: 252-257 vs 277-280 us
        # per layer for the single blocked pass below; the dense FFN takes 216).
        # Two neurons (kk, kk + k/2) per step: four row streams per thread (cpu.add_matvec).
        q = k // 2
        for kk in prange(q):
            r0, r1 = np.int64(idx[kk]), np.int64(idx[kk + q])
            for t in range(T):
                h[t, kk], h[t, kk + q] = _neuron_pair(w_gate, w_up, r0, r1, x, t, act_id, up_act_id, criterion,
                                                      threshold)
        for kk in range(2 * q, k):
            for t in range(T):
                h[t, kk] = _neuron_value(w_gate, w_up, np.int64(idx[kk]), x, t, act_id, up_act_id, criterion,
                                         threshold)
        for c in prange(n_chunks):
            lo, hi = c * k // n_chunks, (c + 1) * k // n_chunks
            for t in range(T):
                _down_chunk(wt_down, idx, h[t], lo, hi, acc[c, t], sequential_down)
        _reduce_chunks(acc, out, accumulate)
        return
    for c in prange(n_chunks):
        rows = np.empty(ROW_BLOCK, dtype=np.int64)
        ups = np.empty(ROW_BLOCK, dtype=np.float32)
        lo, hi = c * k // n_chunks, (c + 1) * k // n_chunks
        if T == 1 and criterion == GATE:  # decode under the gate criterion: up rows of kept neurons only
            _gate_then_up(w_gate, w_up, x, idx, lo, hi, act_id, up_act_id, threshold, h[0])
            _down_chunk(wt_down, idx, h[0], lo, hi, acc[c, 0], sequential_down)
            continue
        ahead = np.empty(ROW_BLOCK, dtype=np.int64)
        for k0 in range(lo, hi, ROW_BLOCK):
            k1 = min(k0 + ROW_BLOCK, hi)
            full = _block_rows(idx, k0, hi, False, rows)
            more = full and _block_rows(idx, k0 + ROW_BLOCK, hi, False, ahead)
            for t in range(T):
                if full:
                    # prefetch, with the first token: the up rows of this block while the gate
                    # rows are read, then the next block's gate rows while the up rows are
                    n_next = ROW_BLOCK if more and t == 0 else 0
                    h_at = h.ctypes.data + t * h.strides[0] + 4 * k0
                    if criterion != GATE:  # every up row is read anyway: eight at a time
                        _dot8(w_gate, rows, x, t, h_at, w_up, rows, ROW_BLOCK if t == 0 else 0)
                        _dot8(w_up, rows, x, t, ups.ctypes.data, w_gate, ahead, n_next)
                    else:
                        _dot8(w_gate, rows, x, t, h_at, w_gate, ahead, n_next)
                else:
                    for kk in range(k0, k1):
                        h[t, kk] = _dot(w_gate, np.int64(idx[kk]), x, t)
                for kk in range(k0, k1):
                    a = _act(h[t, kk], act_id)
                    if criterion == GATE and abs(a) <= threshold:
                        h[t, kk] = 0.0
                        continue
                    u = ups[kk - k0] if full and criterion != GATE else _dot(w_up, np.int64(idx[kk]), x, t)
                    h[t, kk] = gated_value(a, u, up_act_id, criterion, threshold)
        for t in range(T):
            _down_chunk(wt_down, idx, h[t], lo, hi, acc[c, t], sequential_down)
    _reduce_chunks(acc, out, accumulate)


def row_gemv(w: np.ndarray, x: np.ndarray, idx: np.ndarray, bias: np.ndarray, act_id: int, out: np.ndarray) -> None:
    """out[t, k] = act(W[idx[k]] . x[t] + bias[idx[k]]); empty idx = all rows, act_id < 0 = none.
    W in `numpy_weights` encoding, x (T, d) and out (T, k) fp32 C arrays."""
    _row_gemv(weight_ref(w), x, idx, bias, act_id, out)


def col_axpy(wt: np.ndarray, a: np.ndarray, idx: np.ndarray, n_chunks: int, out: np.ndarray,
             accumulate: bool) -> None:
    """out[t] (+)= sum_k a[t, k] * Wt[idx[k]]; zero coefficients skip their row."""
    _col_axpy(weight_ref(wt), a, idx, n_chunks, out, accumulate)


def gated_ffn(w_gate: np.ndarray, w_up: np.ndarray, wt_down: np.ndarray, x: np.ndarray, idx: np.ndarray, act_id: int,
              up_act_id: int, criterion: int, threshold: np.float32, n_chunks: int, h: np.ndarray, out: np.ndarray,
              accumulate: bool) -> None:
    """The fused gated FFN over an active set, in one call:
    g = W_gate[i].x, a = act(g), u = W_up[i].x (up_act optional), h = a*u, out += h * Wt_down[i].

    criterion (ops/criterion.py) NONE: no threshold; GATE: |a| <= threshold -> neuron off, its up row is not read
    (CATS; exact for a ReLU gate at threshold 0; at decode the kept neurons' up rows are read
    eight at a time, `_gate_then_up`); GATE_UP: |a*u| <= threshold -> off. Off neurons skip their
    down row. `h` (T, k) gets the neuron values (0 when off). Each thread walks its chunk of the
    active set in blocks of eight neurons: gate rows, then up rows, then down rows.
    """
    _gated_ffn(weight_ref(w_gate), weight_ref(w_up), weight_ref(wt_down), x, idx, act_id, up_act_id, criterion,
               threshold, n_chunks, h, out, accumulate)


@njit(cache=True)
def threshold_to_index(logits, threshold, out_dtype_probe):
    """Sorted indices i where logits[t, i] > threshold[i] for any t (the union over tokens)."""
    T, n = logits.shape
    per_neuron = threshold.shape[0] > 1
    mask = np.zeros(n, dtype=np.bool_)
    count = 0
    for i in range(n):
        thr = threshold[i] if per_neuron else threshold[0]
        for t in range(T):
            if logits[t, i] > thr:
                mask[i] = True
                count += 1
                break
    out = np.empty(count, dtype=out_dtype_probe.dtype)
    p = 0
    for i in range(n):
        if mask[i]:
            out[p] = i
            p += 1
    return out


@njit(cache=True)
def check_indices(idx, n):
    """0 if idx holds distinct values in [0, n); else 1 + position of the first bad entry
    (negative when it is a duplicate)."""
    seen = np.zeros(n, dtype=np.bool_)
    for p in range(idx.shape[0]):
        i = idx[p]
        if i < 0 or i >= n:
            return p + 1
        if seen[i]:
            return -(p + 1)
        seen[i] = True
    return 0


def default_chunks() -> int:
    return numba.get_num_threads()


PREDICT_CHUNK = 1024  # neurons per work item of `predict_active`


@njit(inline="always", fastmath=True)
def _predict_hidden(w1, b1, x, hidden, i):
    acc = b1[i]
    for j in range(w1.shape[1]):
        acc += w1[i, j] * x[j]
    hidden[i] = acc if acc > 0 else np.float32(0.0)


RANK_STEP = 16  # predictor ranks are padded (zero rows) to a multiple of this (`pad_rank`)


def pad_rank(w1: np.ndarray, b1: np.ndarray, w2t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w1 (r, d), b1 (r,), w2t (r, n) with zero rows up to a multiple of RANK_STEP, as the
    predictor kernels take them: a zero row adds relu(0) * 0 = 0 to every logit."""
    r = w1.shape[0]
    pad = -r % RANK_STEP
    if pad == 0:
        return w1, b1, w2t
    z = lambda a: np.concatenate([a, np.zeros((pad,) + a.shape[1:], dtype=a.dtype)])
    return z(w1), z(b1), z(w2t)


@njit(inline="always", fastmath=True)
def _predict_chunk(w2t, b2, hidden, threshold, logits, slots, lo, hi):
    """logits[lo:hi] = b2[lo:hi] + hidden . w2t[:, lo:hi] (W2 transposed, (rank, n), the rank
    a multiple of RANK_STEP), and the neurons above `threshold` written from slots[lo] on;
    returns their count. Each logit sums RANK_STEP terms in a register per pass, the
    constant inner loop unrolled so that the loop over neurons vectorises (a loop over the
    whole rank did not: 55 -> 11 us for 11008 neurons at rank 16), and the set is compacted
    without a branch (a mispredicted branch per neuron cost more than the arithmetic).
    Unsigned indices: numba's wraparound of negative ones, for an index it cannot prove
    >= 0, kept the loop from vectorising (75 -> 11 us)."""
    lo, hi = np.uint64(lo), np.uint64(hi)
    for j0 in range(0, hidden.shape[0], RANK_STEP):
        for i in range(lo, hi):
            acc = b2[i] if j0 == 0 else logits[i]
            for j in range(RANK_STEP):
                acc += hidden[j0 + j] * w2t[j0 + j, i]
            logits[i] = acc
    m = lo
    for i in range(lo, hi):
        slots[m] = i
        m += np.uint64(logits[i] > threshold)
    return np.int64(m - lo)


@njit(parallel=True, fastmath=True, cache=True)
def predict_active(w1, b1, w2t, b2, x, threshold, hidden, logits, out_dtype_probe):
    """`predict_active_small` in two parallel passes: the hidden rows, then chunks of
    neurons, each compacted into its own slots, joined in one serial copy at the end (7B
    shape, rank 16: 88 us per layer as two GEMVs and a threshold pass before)."""
    for i in prange(w1.shape[0]):
        _predict_hidden(w1, b1, x, hidden, i)
    n = b2.shape[0]
    n_chunks = (n + PREDICT_CHUNK - 1) // PREDICT_CHUNK
    counts = np.empty(n_chunks, dtype=np.int64)
    slots = np.empty(n, dtype=out_dtype_probe.dtype)
    for c in prange(n_chunks):
        lo = c * PREDICT_CHUNK
        counts[c] = _predict_chunk(w2t, b2, hidden, threshold, logits, slots, lo, min(lo + PREDICT_CHUNK, n))
    out = np.empty(counts.sum(), dtype=out_dtype_probe.dtype)
    p = 0
    for c in range(n_chunks):
        lo = c * PREDICT_CHUNK
        out[p:p + counts[c]] = slots[lo:lo + counts[c]]
        p += counts[c]
    return out


@njit(fastmath=True, cache=True)
def predict_active_small(w1, b1, w2t, b2, x, threshold, hidden, logits, out_dtype_probe):
    """Sorted indices with W2 relu(W1 x + b1) + b2 > threshold, for one token, in one serial
    call: for small predictors the parallel launches and allocations of the general path
    cost more than the arithmetic (SmolLM2: ~17k multiply-adds per layer). `w2t` is W2
    transposed, (rank, n), so that the logits vectorise across neurons, where n dot
    products of length rank (8) do not; the rank padded by `pad_rank`."""
    for i in range(w1.shape[0]):
        _predict_hidden(w1, b1, x, hidden, i)
    slots = np.empty(w2t.shape[1], dtype=out_dtype_probe.dtype)
    return slots[:_predict_chunk(w2t, b2, hidden, threshold, logits, slots, 0, w2t.shape[1])].copy()
