"""The named ops model and engine code call, and the one place that picks their backend.

Sparse ops (torch tensors in, fp32 torch tensors out): CPU tensors run the numba kernels
(sparse_cpu), anything else the torch backend (torch_ops: CUDA, or the CPU-backed GPU
tier). Every sparse op takes x as (d,) or (T, d) (a few tokens sharing the union of their
active sets), indices as int32/int64, weights as fp32, bf16 or fp16, and validates indices
unless `check=False` (for callers that produced them).

Decoder ops (the end of this module): RMSNorm, the one-call decode attention block and
dense FFN, which take typed records (`AttentionWeights`) and unpack them at the numba
boundary, and their twins for several sequences at once (`*_batch`, ops/batch_decode.py). The FFN over a row set of the hybrid engine is `ffn_rows.output`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from ..errors import BadArgumentError
from . import batch_decode, batch_team, cpu, decode, decode_team, panels, sparse_cpu, torch_ops
from .activations import activation_id
from .cpu import NO_BIAS, SUPPORTED_DTYPES
from .criterion import Criterion
from .numba_half import numpy_weights



def _on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def _as_2d(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if x.dim() == 1:
        return x[None], True
    if x.dim() != 2:
        raise BadArgumentError(f"x must be (d,) or (T, d), got shape {tuple(x.shape)}")
    return x, False


def validate(idx: torch.Tensor, n: int) -> None:
    """Refuse index sets that are not 1-D integers, distinct, within [0, n)."""
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise BadArgumentError(f"indices must be a 1-D int32/int64 tensor, got {idx.dtype} {tuple(idx.shape)}")
    code = sparse_cpu.check_indices(idx.cpu().numpy(), n)
    if code > 0:
        raise BadArgumentError(f"index out of range: idx[{code - 1}] = {int(idx[code - 1])}, rows are [0, {n})")
    if code < 0:
        raise BadArgumentError(f"duplicate index {int(idx[-code - 1])} at position {-code - 1}")


def _weights(w: torch.Tensor, name: str) -> np.ndarray:
    if w.dtype not in SUPPORTED_DTYPES or w.dim() != 2:
        raise BadArgumentError(f"{name} must be a 2-D fp32/bf16/fp16 tensor, got {w.dtype} {tuple(w.shape)}")
    return numpy_weights(w.contiguous())


def _idx(idx: torch.Tensor) -> np.ndarray:
    """Indices as int64 for the kernels: widening int32 here costs a copy of k integers (about
    a microsecond) and lets every kernel compile one specialisation per weight dtype instead
    of two, which is most of what a first run (and a clean CI run) spends compiling."""
    return idx.numpy().astype(np.int64, copy=False)


def _f32(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().contiguous().numpy()


def _set_threads(threads: int | None) -> None:
    if threads is not None and threads != numba.get_num_threads():
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def sparse_row_gemv(w: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, bias: torch.Tensor | None = None,
                    act: str | None = None, *, check: bool = True, threads: int | None = None) -> torch.Tensor:
    """y[..., k] = act(W[idx[k]] . x + bias[idx[k]]) for the active rows only."""
    if check:
        validate(idx, w.shape[0])
    x2, squeeze = _as_2d(x)
    if not _on_cpu(w, x2, idx):
        y = torch_ops.sparse_row_gemv(w, x2, idx, bias, act)
        return y[0] if squeeze else y
    _set_threads(threads)
    out = np.empty((x2.shape[0], idx.shape[0]), dtype=np.float32)
    if idx.shape[0]:
        sparse_cpu.row_gemv(_weights(w, "w"), _f32(x2), _idx(idx), NO_BIAS if bias is None else _f32(bias),
                            activation_id(act), out)
    y = torch.from_numpy(out)
    return y[0] if squeeze else y


def sparse_col_axpy(wt: torch.Tensor, a: torch.Tensor, idx: torch.Tensor, *, check: bool = True,
                    threads: int | None = None) -> torch.Tensor:
    """y = sum_k a[..., k] * Wt[idx[k]], with the down projection stored transposed."""
    if check:
        validate(idx, wt.shape[0])
    a2, squeeze = _as_2d(a)
    if a2.shape[1] != idx.shape[0]:
        raise BadArgumentError(f"{a2.shape[1]} coefficients for {idx.shape[0]} indices")
    if not _on_cpu(wt, a2, idx):
        y = torch_ops.sparse_col_axpy(wt, a2, idx)
        return y[0] if squeeze else y
    _set_threads(threads)
    out = np.zeros((a2.shape[0], wt.shape[1]), dtype=np.float32)
    if idx.shape[0]:
        sparse_cpu.col_axpy(_weights(wt, "wt"), _f32(a2), _idx(idx), sparse_cpu.default_chunks(), out, False)
    y = torch.from_numpy(out)
    return y[0] if squeeze else y


def sparse_gated_ffn(w_gate: torch.Tensor, w_up: torch.Tensor, wt_down: torch.Tensor, x: torch.Tensor,
                     idx: torch.Tensor, act: str = "silu", up_act: str | None = None, criterion: str = "none",
                     threshold: float = 0.0, *, check: bool = True,
                     threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated FFN over the active neurons: returns (output (.., d), neuron values (.., k)).

    criterion "gate" zeroes neurons with |act(gate)| <= threshold (their up row is not read),
    "gate_up" those with |act(gate) * up| <= threshold; zeroed neurons skip their down row.
    """
    crit = int(Criterion.parse(criterion))
    n_ff = w_gate.shape[0]
    if w_up.shape != w_gate.shape or wt_down.shape[0] != n_ff:
        raise BadArgumentError("w_gate, w_up must be (n_ff, d) and wt_down (n_ff, d_out)")
    if check:
        validate(idx, n_ff)
    x2, squeeze = _as_2d(x)
    if not _on_cpu(w_gate, w_up, wt_down, x2, idx):
        out, h = torch_ops.sparse_gated_ffn(w_gate, w_up, wt_down, x2, idx, act, up_act, crit, threshold)
    else:
        _set_threads(threads)
        out_np = np.zeros((x2.shape[0], wt_down.shape[1]), dtype=np.float32)
        h_np = np.zeros((x2.shape[0], idx.shape[0]), dtype=np.float32)
        if idx.shape[0]:
            sparse_cpu.gated_ffn(_weights(w_gate, "w_gate"), _weights(w_up, "w_up"), _weights(wt_down, "wt_down"),
                                 _f32(x2), _idx(idx), activation_id(act), activation_id(up_act),
                                 crit, np.float32(threshold), sparse_cpu.default_chunks(), h_np,
                                 out_np, False)
        out, h = torch.from_numpy(out_np), torch.from_numpy(h_np)
    return (out[0], h[0]) if squeeze else (out, h)


def predictor_logits(w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
                     x: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
    """Activation-predictor logits W2 relu(W1 x + b1) + b2, (.., n_ff)."""
    x2, squeeze = _as_2d(x)
    if not _on_cpu(w1, w2, x2):
        y = torch_ops.predictor_logits(w1, b1, w2, b2, x2)
        return y[0] if squeeze else y
    _set_threads(threads)
    no_idx = np.zeros(0, dtype=np.int64)
    hidden = np.empty((x2.shape[0], w1.shape[0]), dtype=np.float32)
    sparse_cpu.row_gemv(_weights(w1, "w1"), _f32(x2), no_idx, NO_BIAS if b1 is None else _f32(b1), activation_id("relu"),
                        hidden)
    out = np.empty((x2.shape[0], w2.shape[0]), dtype=np.float32)
    sparse_cpu.row_gemv(_weights(w2, "w2"), hidden, no_idx, NO_BIAS if b2 is None else _f32(b2), -1, out)
    y = torch.from_numpy(out)
    return y[0] if squeeze else y


def threshold_to_index(logits: torch.Tensor, threshold: float | torch.Tensor,
                       index_dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Sorted indices of neurons whose logit exceeds the threshold (scalar or per neuron)
    for any of the tokens: the active set to hand to the sparse ops."""
    l2, _ = _as_2d(logits)
    thr = torch.as_tensor(threshold, dtype=torch.float32).flatten()
    if thr.numel() not in (1, l2.shape[1]):
        raise BadArgumentError(f"threshold must be a scalar or one value per neuron ({l2.shape[1]})")
    if not _on_cpu(l2):
        thr = thr.to(l2.device)
        return torch_ops.threshold_to_index(l2, thr if thr.numel() > 1 else thr[0]).to(index_dtype)
    probe = np.zeros(0, dtype=np.int32 if index_dtype == torch.int32 else np.int64)
    return torch.from_numpy(sparse_cpu.threshold_to_index(_f32(l2), thr.numpy(), probe))


# -- the decoder's named ops: numba for one CPU token, torch otherwise -------------------------
@dataclass(frozen=True)
class AttentionWeights:
    """What the one-call decode attention block reads of a layer (built once per layer):
    the attention norm, the fused QKV and output projections (kernel arrays, any weight
    format the kernels read), their biases (empty: none) and the FFN norm that follows."""

    norm_w: np.ndarray
    eps: float
    wqkv: np.ndarray | tuple[np.ndarray, ...]  # a tuple: row parts of mixed formats
    bqkv: np.ndarray
    wo: np.ndarray
    bo: np.ndarray
    ffn_norm_w: np.ndarray


@dataclass(frozen=True)
class AttentionShape:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    rope: bool
    softcap: float = 0.0  # attention logit soft-cap (Gemma 2); 0: none


def attention_block(w: AttentionWeights, s: AttentionShape, x: np.ndarray, pos: int, cos: np.ndarray,
                    sin: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, h_out: np.ndarray) -> None:
    """Decode, one token: x += attention(rms_norm(x)) in place (RoPE, KV cache write at
    `pos`), then h_out = rms_norm(x) * ffn_norm_w; one numba call (ops/decode.py)."""
    decode.attention_block(x, w.norm_w, w.eps, w.wqkv, w.bqkv, w.wo, w.bo, w.ffn_norm_w, pos, cos, sin, k_cache,
                           v_cache, s.n_heads, s.n_kv_heads, s.head_dim, s.scale, s.rope, h_out, panels.threads())


def layer_stack(x: np.ndarray, norm_w, eps: float, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out,
                gated: bool, act_id: int, up_act_id: int, pos: int, cos: np.ndarray, sin: np.ndarray,
                k_all: np.ndarray, v_all: np.ndarray, s: AttentionShape) -> None:
    """Decode, one token through every layer (`attention_block` then the dense FFN, per
    layer) in one numba call; the per-layer arrays are numba typed lists (models/stack.py)."""
    decode.layer_stack(x, norm_w, eps, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out, gated, act_id,
                       up_act_id, pos, cos, sin, k_all, v_all, s.n_heads, s.n_kv_heads, s.head_dim, s.scale, s.rope,
                       panels.threads())


def layer_stack_team(x: np.ndarray, norm_w, eps: float, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out,
                     act_id: int, up_act_id: int, pos: int, cos: np.ndarray, sin: np.ndarray, k_all: np.ndarray,
                     v_all: np.ndarray, s: AttentionShape) -> None:
    """`layer_stack` for gated FFNs with every matrix in lanes, the whole token in one parallel
    region (ops/decode_team.py)."""
    decode_team.layer_stack_team(x, norm_w, eps, wqkv, bqkv, wo, bo, ffn_norm_w, w_in, b_in, w_out, b_out, act_id,
                                 up_act_id, pos, cos, sin, k_all.view(np.uint8), v_all.view(np.uint8),
                                 cpu.kv_code(k_all), s.n_heads, s.n_kv_heads, s.head_dim, s.scale, s.rope,
                                 panels.threads())


def kv_code(cache: np.ndarray) -> int:
    """The element code the team kernels take with a KV cache's bytes (fp32, or fp16 as int16)."""
    return cpu.kv_code(cache)


def threads() -> int:
    """The kernels' thread count (numba's)."""
    return panels.threads()


def attend_one(qkv: np.ndarray, s: AttentionShape, pos: int, cos: np.ndarray, sin: np.ndarray, k_cache: np.ndarray,
               v_cache: np.ndarray, out: np.ndarray, window: int = 0) -> None:
    """Decode attention for one token from its fused QKV projection (numba); `window` > 0:
    the layer sees only its last `window` positions; scores soft-capped by `s.softcap`."""
    cpu.attend_one(qkv, pos, cos, sin, k_cache, v_cache, s.n_heads, s.n_kv_heads, s.head_dim, s.scale, s.rope, out,
                   window, np.float32(s.softcap))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm as HF Llama computes it (normalise in fp32, cast back, then scale): numba for
    one CPU token, torch otherwise."""
    if x.shape[0] == 1 and x.device.type == "cpu" and weight is not None and x.dtype == torch.float32:
        out = torch.empty_like(x)
        cpu.rms_norm(x[0].numpy(), weight.numpy(), eps, out[0].numpy())
        return out
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y * weight if weight is not None else y


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`rms_norm` of each row of x as of that row alone (the one-token kernel per row for CPU
    fp32 rows with a weight, in one call; else row by row)."""
    if x.device.type == "cpu" and weight is not None and x.dtype == torch.float32 and x.is_contiguous():
        out = torch.empty_like(x)
        cpu.rms_norm_rows(x.numpy(), weight.numpy(), eps, out.numpy())
        return out
    return torch.cat([rms_norm(x[b:b + 1], weight, eps) for b in range(x.shape[0])])


def dense_ffn_add(h: np.ndarray, w_in: np.ndarray, b_in: np.ndarray, w_out: np.ndarray, b_out: np.ndarray,
                  gated: bool, act_id: int, up_act_id: int, criterion: int, threshold: float, x: np.ndarray) -> None:
    """Decode, one token: x += FFN(h) in place, every neuron's rows read (ops/decode.py)."""
    decode.dense_ffn(h, w_in, b_in, w_out, b_out, gated, act_id, up_act_id, criterion, np.float32(threshold), x,
                     panels.threads())


# -- several sequences, one decode step each (ops/batch_decode.py) -----------------------------
def attention_in_batch(w: AttentionWeights, X: np.ndarray, qkv: np.ndarray) -> None:
    """qkv[s] = Wqkv rms_norm(X[s]) (+ b) for every sequence, each weight row read once."""
    batch_decode.attention_in(X, w.norm_w, w.eps, w.wqkv, w.bqkv, qkv, panels.threads())


def attend_batch(qkv: np.ndarray, s: AttentionShape, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                 k_caches, v_caches, layer: int, out: np.ndarray) -> None:
    """Decode attention for several rows in one call, each over its own sequence's cache of
    `layer` (`k_caches`/`v_caches`: numba typed lists of the sequences' caches) or all over
    one (arrays: a short prompt's tokens); batch_decode.attend says which shapes."""
    batch_decode.attend(qkv, pos, cos, sin, k_caches, v_caches, layer, s.n_heads, s.n_kv_heads, s.head_dim, s.scale,
                        s.rope, out)


def attention_out_batch(w: AttentionWeights, att: np.ndarray, X: np.ndarray, h_out: np.ndarray) -> None:
    """X[s] += Wo att[s] (+ b) in place, then h_out[s] = rms_norm(X[s]) * ffn_norm_w."""
    batch_decode.attention_out(att, w.wo, w.bo, X, w.ffn_norm_w, w.eps, h_out, panels.threads())


def layer_stack_batch(X: np.ndarray, lists: dict, eps: float, gated: bool, act_id: int, up_act_id: int,
                      pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, k_caches, v_caches, s: AttentionShape,
                      team: bool = False, kv_bytes: tuple | None = None) -> None:
    """A batched decode step through every layer in one numba call (batch_decode.layer_stack);
    `lists` are a `models.stack.LayerStack`'s typed lists, the caches typed lists of the
    sequences' (layers, ...) blocks. `team` (gated FFN, every matrix in lanes): the whole step
    in one parallel region (ops/batch_team.py), the same rows to the bit; it takes the caches
    as `kv_bytes` (the lists of their uint8 views and their element code, cpu.kv_code)."""
    w = lists
    if team and panels.threads() > 1:
        if kv_bytes is None:
            raise ValueError("layer_stack_batch: the team kernel reads the caches as bytes (kv_bytes)")
        k_bytes, v_bytes, kv = kv_bytes
        batch_team.layer_stack_team(X, w["norm_w"], eps, w["wqkv"], w["bqkv"], w["wo"], w["bo"], w["ffn_norm_w"],
                                    w["w_in"], w["b_in"], w["w_out"], w["b_out"], act_id, up_act_id, pos, cos, sin,
                                    k_bytes, v_bytes, kv, s.n_heads, s.n_kv_heads, s.head_dim, s.scale, s.rope,
                                    panels.threads())
        return
    batch_decode.layer_stack(X, w["norm_w"], eps, w["wqkv"], w["bqkv"], w["wo"], w["bo"], w["ffn_norm_w"], w["w_in"],
                             w["b_in"], w["w_out"], w["b_out"], gated, act_id, up_act_id, pos, cos, sin, k_caches,
                             v_caches, s.n_heads, s.n_kv_heads, s.head_dim, s.scale, s.rope, panels.threads())


def dense_ffn_add_batch(H: np.ndarray, w_in: np.ndarray, b_in: np.ndarray, w_out: np.ndarray, b_out: np.ndarray,
                        gated: bool, act_id: int, up_act_id: int, X: np.ndarray) -> None:
    """X[s] += FFN(H[s]) in place for every sequence, every neuron's rows read once."""
    batch_decode.dense_ffn(H, w_in, b_in, w_out, b_out, gated, act_id, up_act_id, 0, np.float32(0.0), X,
                           panels.threads())
