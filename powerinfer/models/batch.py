"""One decode step for several sequences, each after its own KV cache (a server's batch),
with the short prompts of sequences just admitted riding along as rows (`batch_step`).

Decode is memory-bound: the step's cost is reading the weights, so B sequences should read
them once. Llama-shaped layers (those that decode through the fused kernels) run the batch
kernels of ops/batch_decode.py: norms and QKV for all sequences, attention for all in one
call, each over its own cache, then the output projection and FFN for all. Other layers on
the CPU (windows, soft-caps, post-norms, q/k norms, parallel or post-norm blocks) take the
per-op path of `Model.block` with the projections and the dense FFN over the batch, norms
and attention per sequence. Layers on the GPU tier run per sequence; the sparse FFNs read
each sequence's own predicted rows (or, where it pays, their union: engine/hybrid.py). A
sequence's result does not depend on its batch: row b of `decode_step` equals
`Model.forward` on that sequence alone, bit for bit for float weights and to float rounding
for GGUF blocks (ops/batch_decode.py says why).
"""

from __future__ import annotations

import numpy as np
import torch
from numba.typed import List

from ..errors import BadArgumentError
from ..ops import api
from ..ops.lists import typed_list
from .base import _EMPTY_TABLE, Layer, Model
from .cache import KVCache
from .ffn import DenseFFN


def decode_step(model: Model, tokens: list[int], caches: list[KVCache]) -> torch.Tensor:
    """Logits (B, vocab) of tokens[b] appended to caches[b], for every b; advances each cache."""
    return batch_step(model, [[t] for t in tokens], caches)


def can_ride(model: Model, tokens: int, cache: KVCache) -> bool:
    """Whether a prompt (rest) of `tokens` tokens can run as rows of a `batch_step` with the
    same result as running it alone: one token always (a decode row), a few only where the
    model's own `forward` would run them as rows too (`prefill_short`)."""
    return tokens == 1 or (model.short_prefill and short_prefill_fits(model, tokens, cache))


@torch.inference_mode()
def batch_step(model: Model, tokens: list[list[int]], caches: list[KVCache]) -> torch.Tensor:
    """Logits (S, vocab) after the last of tokens[s] appended to caches[s], for every sequence
    s; advances each cache. Every token is one row of one batched pass, so each weight is read
    once for the whole step: a decode step is one token per sequence, and the prompts of newly
    admitted sequences ride along as several rows sharing their cache (where `can_ride`), so
    their prefill costs no extra pass over the weights. Row results equal each sequence run
    alone (see the module docstring)."""
    S = len(tokens)
    if S == 0 or len(caches) != S:
        raise BadArgumentError(f"batch_step needs one cache per sequence, got {S} sequences and {len(caches)} caches")
    if len({id(c) for c in caches}) != S:
        raise BadArgumentError("batch_step: each sequence needs its own cache")
    for toks, c in zip(tokens, caches):
        if not toks:
            raise BadArgumentError("batch_step: a sequence without tokens")
        if c.length + len(toks) > c.max_len:
            raise ValueError(f"cache holds {c.max_len} positions, asked for {c.length + len(toks)}")
        if len(toks) > 1 and S > 1 and not can_ride(model, len(toks), c):
            raise BadArgumentError(f"batch_step: {len(toks)} tokens of one sequence cannot run as rows of this model's "
                                   "batch (prefill them alone)")
    if S == 1:
        return model.forward(torch.tensor(tokens[0], dtype=torch.long), caches[0])[None]
    pos = [c.length + j for toks, c in zip(tokens, caches) for j in range(len(toks))]
    row_caches = [c for toks, c in zip(tokens, caches) for _ in toks]
    last = np.cumsum([len(t) for t in tokens]) - 1  # each sequence's last row
    ids = torch.tensor([t for toks in tokens for t in toks], dtype=torch.long)
    x = _embed_rows(model, ids, pos)
    stack = model._layer_stack() if all(c.k_all_np is not None for c in caches) else None
    if stack is not None:  # every layer in one call (the per-layer path's kernels, in numba)
        shape = model._attn_shape
        cos, sin = model.rope_cos_sin(max(pos) + 1) if shape.rope else (_EMPTY_TABLE, _EMPTY_TABLE)
        # the team kernel writes a row's keys while other rows attend: rows sharing a cache (a
        # prompt's) need the per-layer kernels, which write every row's before any row reads
        team = stack.team and len(pos) == S
        api.layer_stack_batch(x.numpy(), stack.lists, model.args.norm_eps, stack.gated, stack.act_id,
                              stack.up_act_id, np.asarray(pos, dtype=np.int64), cos, sin,
                              *_layer_caches(model, row_caches, 0), shape, team=team,
                              kv_bytes=_cache_bytes(model, row_caches) if team else None)
    else:
        for i, layer in enumerate(model.layers):
            if layer.fused_decode and all(c.k_np[i] is not None for c in caches):
                _fused_layer(model, i, layer, x, pos, *_layer_caches(model, row_caches, i), i)
            elif layer.attn.qkv.batch_kernels and layer.attn.o.batch_kernels:
                x = _layer(model, i, layer, x, row_caches, pos)
            else:  # weights on the GPU tier: one row at a time, in order (a prompt's rows are causal)
                for b in range(len(pos)):
                    x[b:b + 1] = model.block(i, layer, x[b:b + 1].clone(), row_caches[b], pos[b])
    for toks, c in zip(tokens, caches):
        c.length += len(toks)
    return _logits(model, x[torch.from_numpy(last)] if len(pos) > S else x)


def short_prefill_fits(model: Model, tokens: int, cache: KVCache) -> bool:
    """Whether `prefill_short` can run these tokens: a few of them, every layer Llama-shaped
    with a dense FFN the CPU kernels read, and the cache in CPU memory."""
    return (1 < tokens <= SHORT_PREFILL_MAX
            and all(layer.fused_decode and type(layer.ffn) is DenseFFN and layer.ffn.w_in.w_np is not None
                    and layer.ffn.w_out.w_np is not None and cache.k_np[i] is not None
                    for i, layer in enumerate(model.layers)))


# Up to here a prompt is cheaper as decode rows than through the prefill's torch ops, whose fixed
# cost per op dominates a short prompt on a small model; past ~16 a 7B's prefill GEMMs win
# (docs/BENCHMARKS.md, "Short prompts").
SHORT_PREFILL_MAX = 16


@torch.inference_mode()
def prefill_short(model: Model, x: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
    """A short prompt's hidden states: x (T, d) are its embedded tokens at positions start..
    start+T-1 of `cache`, run through every layer by the batched decode kernels as T rows that
    share one cache. Correctly causal: the attention kernel writes every row's key and value
    before any row reads, and row t reads positions <= start + t only."""
    T = x.shape[0]
    pos = list(range(start, start + T))
    for i, layer in enumerate(model.layers):
        _fused_layer(model, i, layer, x, pos, cache.k_np[i], cache.v_np[i], i)
    return x


def _fused_layer(model: Model, i: int, layer: Layer, x: torch.Tensor, pos: list[int], k_caches: List | np.ndarray,
                 v_caches: List | np.ndarray, cache_layer: int) -> None:
    """A Llama-shaped layer for every row, x (B, d) updated in place: what
    `Model._fused_block` does for one token, with each weight read once; row b at position
    pos[b] over caches k_caches[b] / v_caches[b] (typed lists), or over the one layer cache
    all rows share (arrays); `cache_layer` picks the layer where the lists hold (layers, ...)
    blocks."""
    a, shape = model.args, model._attn_shape
    w = model.attention_weights(layer)
    B = x.shape[0]
    xs = x.numpy()
    qkv = np.empty((B, layer.attn.qkv.out_features), dtype=np.float32)
    api.attention_in_batch(w, xs, qkv)
    cos, sin = model.rope_cos_sin(max(pos) + 1) if shape.rope else (_EMPTY_TABLE, _EMPTY_TABLE)
    att = np.empty((B, a.q_dim), dtype=np.float32)
    api.attend_batch(qkv, shape, np.asarray(pos, dtype=np.int64), cos, sin, k_caches, v_caches, cache_layer, att)
    h = np.empty((B, a.d_model), dtype=np.float32)
    api.attention_out_batch(w, att, xs, h)
    if layer.ffn.add_batch(h, xs):
        return
    for b in range(B):
        if not layer.ffn.add_one(h[b], xs[b]):
            x[b:b + 1] = layer.ffn(torch.from_numpy(h[b].copy())[None], residual=x[b:b + 1])


def _layer(model: Model, i: int, layer: Layer, x: torch.Tensor, caches: list[KVCache], pos: list[int]) -> torch.Tensor:
    """Any other layer whose projections the CPU kernels read (windows, soft-caps, post-norms,
    q/k norms, parallel or post-norm blocks): `Model.block`'s steps for one token, with the
    projections and the dense FFN over the batch (each weight read once) and the norms and
    attention per sequence, so each row is computed as one token's."""
    a = model.args
    B = x.shape[0]

    def rows(norm, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([norm(t[b:b + 1]) for b in range(B)])

    def attention(h: torch.Tensor) -> torch.Tensor:
        qkv = layer.attn.qkv.each_row(h)
        if layer.attn.q_norm is not None:
            qkv = torch.cat([model._norm_qk(qkv[b:b + 1], layer.attn) for b in range(B)])
        out = []
        for b in range(B):
            if caches[b].k_np[i] is not None:
                out.append(model._attend_one(i, qkv[b], caches[b], pos[b]).unsqueeze(0))
            else:
                out.append(model._attend_torch(i, qkv[b:b + 1], caches[b], pos[b]))
        return layer.attn.o.each_row(torch.cat(out))

    if not a.pre_norm:  # OPT post-norm
        x = rows(layer.attn_norm, x + attention(x))
        assert layer.ffn_norm is not None
        return rows(layer.ffn_norm, _ffn(layer.ffn, x, residual=x))
    h = rows(layer.attn_norm, x)
    attn_out = attention(h)
    if layer.post_attn_norm is not None:
        attn_out = rows(layer.post_attn_norm, attn_out)
    if a.parallel_block:
        ffn_in = h if layer.ffn_norm is None else rows(layer.ffn_norm, x)
        return _ffn(layer.ffn, ffn_in, residual=x + attn_out)
    x = x + attn_out
    assert layer.ffn_norm is not None
    if layer.post_ffn_norm is not None:
        return x + rows(layer.post_ffn_norm, _ffn(layer.ffn, rows(layer.ffn_norm, x)))
    return _ffn(layer.ffn, rows(layer.ffn_norm, x), residual=x)


def _ffn(ffn, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + FFN(x) per row as one token's: a dense FFN's matmuls over the batch, any
    other FFN (sparse, instrumented, on the GPU tier) one sequence at a time."""
    if isinstance(ffn, DenseFFN) and ffn.w_in.w_np is not None and ffn.w_out.w_np is not None:
        h = ffn.w_in.each_row(x)
        hidden = torch.cat([ffn._hidden_one(h[b]).unsqueeze(0) for b in range(x.shape[0])])
        return ffn.w_out.each_row(hidden, residual)
    return torch.cat([ffn(x[b:b + 1], None if residual is None else residual[b:b + 1]) for b in range(x.shape[0])])


def _layer_caches(model: Model, caches: list[KVCache], layer: int) -> tuple[List, List]:
    """These sequences' caches as numba typed lists for the attention kernel: their
    (layers, ...) blocks where every cache has one (two lists for all layers), else layer
    `layer`'s caches. Built once per batch membership (a typed list costs ~80 us to build
    from Python, so per-layer lists cost ~5 ms per join or leave at 30 layers) and kept on
    the model."""
    memo = getattr(model, "_batch_kv", None)
    # the cache objects themselves are the key (ids could be reused after one is freed)
    if memo is None or len(memo[0]) != len(caches) or any(a is not b for a, b in zip(memo[0], caches)):
        memo = model._batch_kv = (list(caches), {})
    blocks = all(c.k_all_np is not None for c in caches)
    key = -1 if blocks else layer
    lists = memo[1].get(key)
    if lists is None:
        if blocks:
            lists = (typed_list([c.k_all_np for c in caches]), typed_list([c.v_all_np for c in caches]))
        else:
            lists = (typed_list([c.k_np[layer] for c in caches]), typed_list([c.v_np[layer] for c in caches]))
        memo[1][key] = lists
    return lists


def _cache_bytes(model: Model, caches: list[KVCache]) -> tuple[List, List, int]:
    """These sequences' (layers, ...) cache blocks as the team kernel takes them: typed lists
    of their uint8 views and their element code (one kernel for fp32 and fp16 caches);
    memoized with `_layer_caches`' lists."""
    _layer_caches(model, caches, 0)  # (re)keys the memo on these caches
    memo = model._batch_kv[1]
    if "bytes" not in memo:
        codes = {api.kv_code(c.k_all_np) for c in caches}
        if len(codes) != 1:
            raise BadArgumentError("batch_step: the sequences' KV caches differ in dtype; decode them apart")
        memo["bytes"] = (typed_list([c.k_all_np.view(np.uint8) for c in caches]),
                         typed_list([c.v_all_np.view(np.uint8) for c in caches]), codes.pop())
    return memo["bytes"]


def release(model: Model) -> None:
    """Drop the typed lists of the last batch's caches (they keep those caches alive)."""
    model._batch_kv = None


def _embed_rows(model: Model, ids: torch.Tensor, pos: list[int]) -> torch.Tensor:
    """Each row's input as one token's `embed_tokens`: one lookup for every row where nothing
    in it depends on the row's position or mixes values (no learned positions, no input
    projection), else row by row."""
    if model.pos_embed is None and model.project_in is None:
        return model.embed_tokens(ids, 0).contiguous()
    return torch.cat([model.embed_tokens(ids[b:b + 1], pos[b]) for b in range(len(pos))]).contiguous()


def _logits(model: Model, x: torch.Tensor) -> torch.Tensor:
    """The LM head over the batch: its weight read once when the CPU kernels read it; the
    norms before it per row, as one token's."""
    head = model.lm_head
    if head.w_np is None:  # on the GPU tier: per row, as one token's
        return torch.cat([model.hidden_to_logits(x[b:b + 1]) for b in range(x.shape[0])])
    rows = x if model.final_norm is None else model.final_norm.rows(x)
    if model.project_out is not None:  # a projection per row, as one token's
        rows = torch.cat([model.project_out(rows[b:b + 1]) for b in range(rows.shape[0])])
    logits = head.each_row(rows)
    cap = model.args.final_softcap
    return logits if cap is None else torch.tanh(logits / cap) * cap
