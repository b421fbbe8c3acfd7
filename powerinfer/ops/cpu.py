"""CPU kernels in numba (parallel, fastmath, cached).

Hand-written because no library gives what we need here: torch's CPU GEMV reads far less
of the memory bus than a numba prange row-dot (docs/BENCHMARKS-history.md), and numba reads
bf16/fp16 weights directly with fp32 accumulation, where torch would first copy them. Kernels take numpy views of torch
tensors (no copies, see numba_half.numpy_weights); weights are row-major (out, in).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from .criterion import GATE_UP
from .numba_half import narrow, widen
from .row_dots import dot4, prefetch_l2, row_dot
from .symbols import c_function, compile_lock
from .vmath import exp32


# Each thread reads its share of the rows as STREAMS interleaved sequential streams, from
# STREAMS distant parts of the share: more memory requests in flight per core than one
# stream (four beat one and eight; docs/BENCHMARKS-history.md, issue 7 session 4).
STREAMS = 4


@njit(parallel=True, fastmath=True, cache=True)
def add_matvec(w, v, b, x):
    """x += W v (+ b), in parallel. Step i reads rows i, i+q, i+2q, i+3q (q = n/4): numba
    gives each thread a contiguous range of steps, so each thread reads STREAMS distant
    streams. A called function, not inlined: the kernels that use it share one compiled copy
    per weight dtype (inlined, it cost attention_block ~2.5 s and the GEMV kernel ~2 s more
    compile), and it runs just as fast."""
    n = w.shape[0]
    q = n // STREAMS
    has_b = b.shape[0] > 0
    for i in prange(q):
        a0, a1, a2, a3 = dot4(w, i, i + q, i + 2 * q, i + 3 * q, v)
        if has_b:
            a0 += b[i]
            a1 += b[i + q]
            a2 += b[i + 2 * q]
            a3 += b[i + 3 * q]
        x[i] += a0
        x[i + q] += a1
        x[i + 2 * q] += a2
        x[i + 3 * q] += a3
    for i in range(STREAMS * q, n):  # the few rows left over
        acc = row_dot(w, i, v)
        if has_b:
            acc += b[i]
        x[i] += acc


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NO_BIAS = np.zeros(0, dtype=np.float32)


def supports(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in SUPPORTED_DTYPES and weight.dim() == 2


def set_threads(n: int) -> None:
    """Threads for the numba kernels called from this thread."""
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


# -- single-token decode kernels ------------------------------------------------------------
# Each replaces a chain of 5-25 tiny torch ops (about 2-5 us each) with one call.

@njit(fastmath=True, cache=True)
def rms_norm(x, weight, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * weight."""
    d = x.shape[0]
    ss = np.float32(0.0)
    for j in range(d):
        ss += x[j] * x[j]
    r = np.float32(1.0) / np.sqrt(ss / np.float32(d) + np.float32(eps))
    for j in range(d):
        out[j] = x[j] * r * weight[j]


@njit(fastmath=True, cache=True)
def rms_norm_rows(X, weight, eps, out):
    """out[s] = rms_norm(X[s]) for every row: each row as the one-token kernel computes it
    (a batch's final norms in one call instead of one call per row)."""
    for s in range(X.shape[0]):
        rms_norm(X[s], weight, eps, out[s])


@njit(fastmath=True, cache=True)
def add_rms_norm(x, delta, weight, eps, out):
    """x += delta (in place), then out = rms_norm(x) * weight."""
    for j in range(x.shape[0]):
        x[j] += delta[j]
    rms_norm(x, weight, eps, out)




@njit(inline="always", fastmath=True)
def _act(v, act_id):
    if act_id == 0:
        return v / (np.float32(1.0) + exp32(-v))
    if act_id == 1:
        return v if v > 0 else np.float32(0.0)
    if act_id == 2:
        return np.float32(0.5) * v * (np.float32(1.0) + math.erf(v * np.float32(0.7071067811865476)))
    inner = np.float32(0.7978845608028654) * (v + np.float32(0.044715) * v * v * v)
    return np.float32(0.5) * v * (np.float32(1.0) + np.tanh(inner))


@njit(inline="always", fastmath=True)
def gated_value(a, u, up_act_id, criterion, threshold):
    """A gated neuron's value a * up_act(u), a being its activated gate; 0 when off by
    GATE_UP (|value| <= threshold). GATE (|a| <= threshold) is the caller's, which
    may then skip reading the up row."""
    if up_act_id >= 0:
        u = _act(u, up_act_id)
    v = a * u
    if criterion == GATE_UP and abs(v) <= threshold:
        return np.float32(0.0)
    return v


@njit(fastmath=True, cache=True, error_model="numpy")  # vmath: loops of exp32 vectorize
def gated_act(h, n_ff, act_id, up_act_id, out):
    """out[i] = act(h[i]) * up_act(h[n_ff + i]); up_act_id < 0 means no activation on up."""
    for i in range(n_ff):
        up = h[n_ff + i]
        if up_act_id >= 0:
            up = _act(up, up_act_id)
        out[i] = _act(h[i], act_id) * up


@njit(fastmath=True, cache=True, error_model="numpy")  # vmath: loops of exp32 vectorize
def act_inplace(h, act_id):
    for i in range(h.shape[0]):
        h[i] = _act(h[i], act_id)


@njit(fastmath=True, cache=True)
def write_kv_head(g, qkv, pos, cos, sin, k_cache, v_cache, n_heads, n_kv, head_dim, rope):
    """KV head g's part of `write_kv` (decode's team kernel writes each head's as it attends)."""
    half = head_dim // 2
    q_dim = n_heads * head_dim
    kv_dim = n_kv * head_dim
    base = q_dim + g * head_dim
    for i in range(half):
        k0 = qkv[base + 2 * i]
        k1 = qkv[base + 2 * i + 1]
        if rope:
            c, s = cos[pos, i], sin[pos, i]
            k_cache[g, pos, 2 * i] = narrow(k0 * c - k1 * s, k_cache)
            k_cache[g, pos, 2 * i + 1] = narrow(k0 * s + k1 * c, k_cache)
        else:
            k_cache[g, pos, 2 * i] = narrow(k0, k_cache)
            k_cache[g, pos, 2 * i + 1] = narrow(k1, k_cache)
    for j in range(head_dim):
        v_cache[g, pos, j] = narrow(qkv[q_dim + kv_dim + g * head_dim + j], v_cache)


@njit(fastmath=True, cache=True)
def write_kv(qkv, pos, cos, sin, k_cache, v_cache, n_heads, n_kv, head_dim, rope):
    """Rotate the token's keys (interleaved RoPE when `rope`) and store keys and values in
    the (kv_heads, max_len, head_dim) caches at `pos` (fp32, or fp16 bits as int16)."""
    for g in range(n_kv):
        write_kv_head(g, qkv, pos, cos, sin, k_cache, v_cache, n_heads, n_kv, head_dim, rope)


# Positions per work item of decode attention. A KV head's query heads (GQA) share one pass
# over a chunk of its keys and values, so each cached row is read once per token instead of
# once per query head; chunks give the threads balanced work at long contexts. Fixed (not
# per thread count) so that a result never depends on the number of threads.
CHUNK = 256


@njit(inline="always")
def _attended(pos, window):
    """(first, end) of the positions a token at `pos` attends to: all, or the last `window`."""
    length = pos + 1
    return (length - window if 0 < window < length else 0), length


@njit(inline="always")
def attention_chunks(pos, window):
    """The number of CHUNK-position work items per KV head for a token at `pos`."""
    first, length = _attended(pos, window)
    return (length - first + CHUNK - 1) // CHUNK


@njit(inline="always", fastmath=True)
def _attend_chunk_arrays(g, c, qkv, pos, cos, sin, k_cache, v_cache, n_heads, n_kv, head_dim, scale, rope, window,
                         softcap, top_out, total_out, o_out):
    """`attend_chunk`'s body, on arrays (compiled into its C functions)."""
    half = head_dim // 2
    rep = n_heads // n_kv
    first, length = _attended(pos, window)
    lo = first + c * CHUNK
    hi = min(lo + CHUNK, length)
    n = hi - lo
    q = np.empty((rep, head_dim), dtype=np.float32)
    for r in range(rep):
        h = g * rep + r
        for i in range(half):
            q0 = qkv[h * head_dim + 2 * i]
            q1 = qkv[h * head_dim + 2 * i + 1]
            if rope:
                cs, sn = cos[pos, i], sin[pos, i]
                q[r, 2 * i] = (q0 * cs - q1 * sn) * scale
                q[r, 2 * i + 1] = (q0 * sn + q1 * cs) * scale
            else:
                q[r, 2 * i] = q0 * scale
                q[r, 2 * i + 1] = q1 * scale
    K, V = k_cache[g], v_cache[g]
    scores = np.empty((rep, n), dtype=np.float32)
    row = K.strides[0]
    k_at, v_at = K.ctypes.data, V.ctypes.data
    t = lo
    while t + 4 <= hi:  # four rows of K, read once for every query head of g
        # the rows of K 16 positions ahead, and these rows of V (read after the scores)
        for b in range(0, 4 * row, 64):
            prefetch_l2(k_at + (t + 16) * row + b)
            prefetch_l2(v_at + t * row + b)
        for r in range(rep):
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for j in range(head_dim):
                qj = q[r, j]
                a0 += qj * widen(K[t, j])
                a1 += qj * widen(K[t + 1, j])
                a2 += qj * widen(K[t + 2, j])
                a3 += qj * widen(K[t + 3, j])
            scores[r, t - lo], scores[r, t - lo + 1], scores[r, t - lo + 2], scores[r, t - lo + 3] = a0, a1, a2, a3
        t += 4
    while t < hi:
        for r in range(rep):
            a0 = np.float32(0.0)
            for j in range(head_dim):
                a0 += q[r, j] * widen(K[t, j])
            scores[r, t - lo] = a0
        t += 1
    for r in range(rep):
        top = np.float32(-np.inf)
        for k in range(n):
            if softcap > 0:
                scores[r, k] = np.float32(softcap * np.tanh(scores[r, k] / softcap))
            top = max(top, scores[r, k])
        total = np.float32(0.0)
        for k in range(n):
            e = exp32(scores[r, k] - top)
            scores[r, k] = e
            total += e
        top_out[g * rep + r, c] = top
        total_out[g * rep + r, c] = total
    o = np.zeros((rep, head_dim), dtype=np.float32)  # contiguous, so the j loops vectorize
    t = lo
    while t + 4 <= hi:  # four rows of V, read once for every query head of g
        for r in range(rep):
            p0, p1, p2, p3 = scores[r, t - lo], scores[r, t - lo + 1], scores[r, t - lo + 2], scores[r, t - lo + 3]
            for j in range(head_dim):
                o[r, j] += (p0 * widen(V[t, j]) + p1 * widen(V[t + 1, j]) + p2 * widen(V[t + 2, j])
                                + p3 * widen(V[t + 3, j]))
        t += 4
    while t < hi:
        for r in range(rep):
            p0 = scores[r, t - lo]
            for j in range(head_dim):
                o[r, j] += p0 * widen(V[t, j])
        t += 1
    for r in range(rep):  # element by element: a slice assignment fails inside a C function
        for j in range(head_dim):
            o_out[g * rep + r, c, j] = o[r, j]


def _attend_chunk_c(g, c, qkv_p, n_qkv, pos, cos_p, sin_p, cs_rows, cs_cols, k_p, v_p, kv_len, n_heads, n_kv,
                    head_dim, scale, rope, window, softcap, top_p, top_cols, total_p, o_p):
    # the arrays' names differ from every local of `_attend_chunk_arrays`: numba's inlining
    # let its local `o` overwrite a caller's array of that name (the outputs stayed zero)
    c_qkv = numba.carray(qkv_p, (n_qkv,))
    c_cos, c_sin = numba.carray(cos_p, (cs_rows, cs_cols)), numba.carray(sin_p, (cs_rows, cs_cols))
    c_k = numba.carray(k_p, (n_kv, kv_len, head_dim))
    c_v = numba.carray(v_p, (n_kv, kv_len, head_dim))
    c_top = numba.carray(top_p, (n_heads, top_cols))
    c_total = numba.carray(total_p, (n_heads, top_cols))
    c_o = numba.carray(o_p, (n_heads, top_cols, head_dim))
    _attend_chunk_arrays(g, c, c_qkv, pos, c_cos, c_sin, c_k, c_v, n_heads, n_kv, head_dim, scale, rope != 0, window,
                         softcap, c_top, c_total, c_o)


# One C function per KV cache dtype (fp32, fp16 bits as int16) and scale type (the callers'
# float32 or float64: each keeps its own rounding), called by symbol (ops/symbols.py).
_ATTEND_CALLS: dict[tuple[str, str], object] = {}


def _build_attend() -> None:
    i64, f32p = types.int64, types.CPointer(types.float32)
    for kv_name, kv in (("float32", types.float32), ("int16", types.int16)):
        for scale_name, scale in (("float32", types.float32), ("float64", types.float64)):
            kvp = types.CPointer(kv)
            sig = types.void(i64, i64, f32p, i64, i64, f32p, f32p, i64, i64, kvp, kvp, i64, i64, i64, i64, scale, i64,
                             i64, types.float32, f32p, i64, f32p, f32p)
            _ATTEND_CALLS[kv_name, scale_name] = c_function(f"powerinfer_attend_chunk_{kv_name}_{scale_name}",
                                                            _attend_chunk_c, sig, fastmath=True, error_model="numpy")


with compile_lock("attend_chunk"):
    _build_attend()


def attend_chunk(g, c, qkv, pos, cos, sin, k_cache, v_cache, n_heads, n_kv, head_dim, scale, rope, window, softcap,
                 top_out, total_out, o_out):  # pragma: no cover - only its numba overload runs
    """KV head g's query heads over chunk c of the attended positions: per head h, the chunk's
    largest score top_out[h, c], its sum of exp(score - top) total_out[h, c] and the
    unnormalized output o_out[h, c] (merged by `merge_chunks`). Four positions per pass in
    both products (four independent sums over q . k; one load and store of the output per
    four rows of v) and the scale folded into q: 1.6-2x one-position loops at 64-1024
    positions (docs/BENCHMARKS.md, "Batched decode"). `window` > 0: only the last `window`
    positions (sliding-window layers); `softcap` > 0: scores s become softcap * tanh(s /
    softcap) (Gemma 2)."""
    raise NotImplementedError("attend_chunk() is for numba kernels")


@overload(attend_chunk, inline="always")
def _ol_attend_chunk(g, c, qkv, pos, cos, sin, k_cache, v_cache, n_heads, n_kv, head_dim, scale, rope, window,
                     softcap, top_out, total_out, o_out):
    """Arrays C-contiguous (not checked: a raise would serialize the callers' prange loops)."""
    call = _ATTEND_CALLS.get((str(getattr(k_cache, "dtype", "")), "float32" if scale == types.float32 else "float64"))
    if call is None:
        return None

    def impl(g, c, qkv, pos, cos, sin, k_cache, v_cache, n_heads, n_kv, head_dim, scale, rope, window, softcap,
             top_out, total_out, o_out):
        call((g, c, qkv.ctypes.data, qkv.shape[0], pos, cos.ctypes.data, sin.ctypes.data, cos.shape[0], cos.shape[1],
              k_cache.ctypes.data, v_cache.ctypes.data, k_cache.shape[1], n_heads, n_kv, head_dim, scale, rope, window,
              np.float32(softcap), top_out.ctypes.data, top_out.shape[1], total_out.ctypes.data, o_out.ctypes.data))

    return impl


# A KV cache passed as its bytes (a uint8 view) and a code for its element type, so that a
# kernel compiles once for both cache types: the team kernels' compile is ~40 s a type.
KV_FP32, KV_FP16 = 0, 1


def kv_code(cache: np.ndarray) -> int:
    """The element code of a numpy KV cache (fp32, or fp16 bits as int16) for the `*_bytes` kernels."""
    if cache.dtype == np.float32:
        return KV_FP32
    if cache.dtype == np.int16:
        return KV_FP16
    raise TypeError(f"a KV cache of {cache.dtype}: the kernels read fp32 or fp16 (as int16)")


@njit(inline="always")
def write_kv_head_bytes(kv, g, qkv, pos, cos, sin, k_bytes, v_bytes, n_heads, n_kv, head_dim, rope):
    """`write_kv_head` into caches given as bytes (uint8 views) of element code `kv`."""
    if kv == KV_FP16:
        write_kv_head(g, qkv, pos, cos, sin, k_bytes.view(np.int16), v_bytes.view(np.int16), n_heads, n_kv,
                      head_dim, rope)
    else:
        write_kv_head(g, qkv, pos, cos, sin, k_bytes.view(np.float32), v_bytes.view(np.float32), n_heads, n_kv,
                      head_dim, rope)


@njit(inline="always")
def prefetch_chunk(g, c, pos, window, k_cache, v_cache):
    """Ask for the cached keys and values that the attention item (g, c) of a token at `pos`
    reads (`attend_chunk` with `window`; caches of any element type, or their bytes) into
    L2: issued before the item ahead of it is computed, its rows arrive meanwhile (after the
    weights streamed through, an item's rows come from memory; docs/BENCHMARKS.md, "Batched
    decode")."""
    first, length = _attended(pos, window)
    lo = first + c * CHUNK
    row = k_cache.strides[1]
    off = g * k_cache.strides[0] + lo * row
    k_at, v_at = k_cache.ctypes.data + off, v_cache.ctypes.data + off
    for b in range(0, (min(lo + CHUNK, length) - lo) * row, 64):
        prefetch_l2(k_at + b)
        prefetch_l2(v_at + b)


def attend_chunk_bytes(kv, g, c, qkv, pos, cos, sin, k_bytes, v_bytes, n_heads, n_kv, head_dim, scale, rope, window,
                       softcap, top_out, total_out, o_out):  # pragma: no cover - only its numba overload runs
    """`attend_chunk` over caches given as bytes (uint8 views) of element code `kv`."""
    raise NotImplementedError("attend_chunk_bytes() is for numba kernels")


@overload(attend_chunk_bytes, inline="always")
def _ol_attend_chunk_bytes(kv, g, c, qkv, pos, cos, sin, k_bytes, v_bytes, n_heads, n_kv, head_dim, scale, rope,
                           window, softcap, top_out, total_out, o_out):
    scale_name = "float32" if scale == types.float32 else "float64"
    call_fp32, call_fp16 = _ATTEND_CALLS["float32", scale_name], _ATTEND_CALLS["int16", scale_name]

    def impl(kv, g, c, qkv, pos, cos, sin, k_bytes, v_bytes, n_heads, n_kv, head_dim, scale, rope, window, softcap,
             top_out, total_out, o_out):
        args = (g, c, qkv.ctypes.data, qkv.shape[0], pos, cos.ctypes.data, sin.ctypes.data, cos.shape[0],
                cos.shape[1], k_bytes.ctypes.data, v_bytes.ctypes.data, k_bytes.shape[1], n_heads, n_kv, head_dim,
                scale, rope, window, np.float32(softcap), top_out.ctypes.data, top_out.shape[1],
                total_out.ctypes.data, o_out.ctypes.data)
        if kv == KV_FP16:
            call_fp16(args)
        else:
            call_fp32(args)

    return impl


@njit(fastmath=True, cache=True, error_model="numpy")  # vmath: loops of exp32 vectorize
def merge_chunks(n_chunks, top, total, o, out, head_dim):
    """Every head's output from its chunks' partial softmaxes (`attend_chunk`): the chunks'
    sums and outputs rescaled to the largest score, then one division (a single chunk is
    scaled by exactly 1)."""
    for h in range(top.shape[0]):
        m = top[h, 0]
        for c in range(1, n_chunks):
            m = max(m, top[h, c])
        acc = np.zeros(head_dim, dtype=np.float32)
        s = np.float32(0.0)
        for c in range(n_chunks):
            w = exp32(top[h, c] - m)
            s += w * total[h, c]
            for j in range(head_dim):
                acc[j] += w * o[h, c, j]
        inv = np.float32(1.0) / s
        for j in range(head_dim):
            out[h * head_dim + j] = acc[j] * inv


@njit(parallel=True, fastmath=True, cache=True)
def attend_all(qkv, pos, cos, sin, k_cache, v_cache, n_heads, n_kv, head_dim, scale, rope, out, window, softcap):
    """softmax(q k^T * scale) v for every query head of a token at `pos` whose key and value
    are already in the caches: (KV head, chunk) work items in parallel, then their merge."""
    n_chunks = attention_chunks(pos, window)
    top = np.empty((n_heads, n_chunks), dtype=np.float32)
    total = np.empty((n_heads, n_chunks), dtype=np.float32)
    o = np.empty((n_heads, n_chunks, head_dim), dtype=np.float32)
    n_items = n_kv * n_chunks
    for item in prange(n_items):
        if item + 1 < n_items:  # the next item's rows (mostly this thread's next), while this one is computed
            prefetch_chunk((item + 1) // n_chunks, (item + 1) % n_chunks, pos, window, k_cache, v_cache)
        attend_chunk(item // n_chunks, item % n_chunks, qkv, pos, cos, sin, k_cache, v_cache, n_heads, n_kv,
                     head_dim, scale, rope, window, softcap, top, total, o)
    merge_chunks(n_chunks, top, total, o, out, head_dim)


@njit(fastmath=True, cache=True)
def attend_one(qkv, pos, cos, sin, k_cache, v_cache, n_heads, n_kv, head_dim, scale, rope, out, window, softcap):
    """Decode attention for one token at position `pos`, all in one call.

    qkv: the fused projection output [q heads | k heads | v heads]; rotates q and k with
    interleaved RoPE (when `rope`), writes k and v into the caches (kv_heads, max_len,
    head_dim) at `pos`, and writes softmax(q k^T * scale) v for every query head to `out`
    (`window`, `softcap`: as `attend_chunk`; 0 for none).
    """
    write_kv(qkv, pos, cos, sin, k_cache, v_cache, n_heads, n_kv, head_dim, rope)
    attend_all(qkv, pos, cos, sin, k_cache, v_cache, n_heads, n_kv, head_dim, scale, rope, out, window, softcap)
