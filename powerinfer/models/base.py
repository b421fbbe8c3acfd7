"""The one decoder-only transformer every family runs on, and its arguments.

Family modules (llama.py, opt.py, ...) only translate a checkpoint into `ModelArgs` and a
canonical state dict; the forward pass lives here once. Conventions of the canonical state:

* Q and K rows are in the *interleaved* RoPE layout (pairs (2i, 2i+1) rotate together, as in
  GGUF and Meta's checkpoints). HF checkpoints use the half-split layout; families permute
  them on load. Attention scores are unchanged because q and k get the same permutation, and
  the interleaved layout lets RoPE be one complex multiply.
* Q, K and V are fused into one matrix `wqkv` (rows: all q heads, all k heads, all v heads),
  so attention costs one GEMV for the three projections.
* Every FFN is an `models.ffn.FFN` object, the single place the sparse engine plugs into.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from .cache import KVCache
from .ffn import FFN, DenseFFN
from .stack import LayerStack, layer_stack
from ..ops import api, lanes, quant, quant_torch
from ..ops.linear import Linear

_EMPTY_TABLE = np.zeros((1, 1), dtype=np.float32)


@dataclass
class ModelArgs:
    """Shape and options of a decoder-only model, independent of the checkpoint format."""

    family: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    max_seq_len: int
    norm: str = "rms"  # "rms" | "layer"
    norm_eps: float = 1e-5
    position: str = "rope"  # "rope" | "learned"
    rope_inv_freq: list[float] | None = None  # per rotary pair, scaling already applied
    rope_attention_factor: float = 1.0
    learned_pos_offset: int = 0  # OPT stores positions from 2
    act: str = "silu"
    gated_ffn: bool = True
    up_act: str | None = None  # Bamboo-style ReLU on the up projection as well
    qk_norm: bool = False  # RMSNorm of each head's q and k before RoPE (Qwen3, Gemma 3)
    embed_scale: float = 1.0  # the embeddings are multiplied by it (Gemma: sqrt(d_model))
    post_norms: bool = False  # a norm on the attention's and the FFN's output before each residual add (Gemma 2/3)
    attn_scale: float | None = None  # the q.k scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention scores -> cap * tanh(score / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    sliding_window: int | None = None  # a windowed layer attends to its last `sliding_window` positions
    window_layers: list[bool] | None = None  # which layers are windowed; None: all (when sliding_window is set)
    rope_inv_freq_local: list[float] | None = None  # windowed layers' own RoPE frequencies (Gemma 3)
    parallel_block: bool = False  # attention and FFN read the same input (Falcon)
    pre_norm: bool = True  # False: post-norm (OPT-350m)
    tie_embeddings: bool = False
    embed_dim: int | None = None  # OPT word_embed_proj_dim when it differs from d_model
    final_norm: bool = True
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict, error: type[Exception] = ValueError) -> "ModelArgs":
        """ModelArgs from a dict (a packed manifest's `args`), checked: `error` names the
        first unknown, missing or inconsistent field in one line."""
        if not isinstance(data, dict):
            raise error("field args must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise error(f"field args.{unknown[0]} is not a model argument")
        try:
            args = cls(**data)
        except TypeError as e:
            raise error(f"field args is malformed ({e})") from None
        args.validate(error)
        return args

    def validate(self, error: type[Exception] = ValueError, where: str = "field args.") -> None:
        """Refuse sizes that no model has (they would fail deep inside a kernel); `where`
        prefixes the field's name in the message."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise error(f"{where}{name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise error(f"{where}n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.position == "rope" and (self.head_dim % 2 or not self.rope_inv_freq
                                        or len(self.rope_inv_freq) != self.head_dim // 2):
            raise error(f"{where}rope_inv_freq must hold head_dim / 2 = {self.head_dim // 2} frequencies")
        if not 0 < self.norm_eps < 1:  # NaN too
            raise error(f"{where}norm_eps must be in (0, 1), got {self.norm_eps!r}")
        for name in ("embed_scale", "attn_scale", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0):
                raise error(f"{where}{name} must be a positive number, got {value!r}")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise error(f"{where}sliding_window must be a positive integer, got {window!r}")
        if self.window_layers is not None and (window is None or len(self.window_layers) != self.n_layers):
            raise error(f"{where}window_layers needs sliding_window and one entry per layer ({self.n_layers})")
        if self.rope_inv_freq_local is not None and len(self.rope_inv_freq_local) != self.head_dim // 2:
            raise error(f"{where}rope_inv_freq_local must hold head_dim / 2 = {self.head_dim // 2} frequencies")

    def windowed(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window (and uses the local RoPE)."""
        if self.sliding_window is None:
            return False
        return True if self.window_layers is None else bool(self.window_layers[layer])

    def shape_problem(self, state: dict) -> str | None:
        """The first tensor of a canonical state dict whose shape disagrees with these
        arguments, described in a line; None when all agree."""
        d, e = self.d_model, self.embed_dim or self.d_model
        n_in = (2 if self.gated_ffn else 1) * self.ffn_dim
        expected = {"embed": (self.vocab_size, e), "lm_head": (self.vocab_size, e)}
        for i in range(self.n_layers):
            p = f"layers.{i}."
            expected.update({p + "wqkv": (self.q_dim + 2 * self.kv_dim, d), p + "wo": (d, self.q_dim),
                             p + "ffn.w_in": (n_in, d), p + "ffn.w_out": (d, self.ffn_dim),
                             p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,),
                             p + "post_attn_norm.weight": (d,), p + "post_ffn_norm.weight": (d,),
                             p + "q_norm.weight": (self.head_dim,), p + "k_norm.weight": (self.head_dim,)})
        for name, want in expected.items():
            t = state.get(name)
            if t is None:
                continue
            got = quant.matrix_shape(t)
            if got != want:
                return f"tensor {name} has shape {list(got)}, the model's sizes make it {list(want)}"
        return None

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass
class DenseTier:
    """Which dense parts a packed model's placement puts on the GPU tier (`device`; None:
    everything on the CPU): the attention projections of the layers in `attention` (all when
    True), the LM head (`head`; the embeddings with it when they are tied), the KV cache
    (`kv`, for `--kv-on-gpu`).
    Norms and the residual stream stay on the CPU; `dtype` is the tier's weight dtype."""

    device: torch.device | None = None
    dtype: torch.dtype | None = None
    attention: bool | list[bool] = False
    head: bool = False
    kv: bool = False

    def attention_on_tier(self, layer: int) -> bool:
        if self.device is None:
            return False
        return self.attention if isinstance(self.attention, bool) else self.attention[layer]

    def __post_init__(self) -> None:
        if self.device is None:
            self.head = self.kv = False


@dataclass
class Norm:
    """RMSNorm or LayerNorm with optional weight and bias."""

    kind: str
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return api.rms_norm(x, self.weight, self.eps)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Each row of x normed as that row alone (a batch's rows as one token's)."""
        if self.kind == "layer":
            return torch.cat([self(x[b:b + 1]) for b in range(x.shape[0])])
        return api.rms_norm_rows(x.contiguous(), self.weight, self.eps)


@dataclass
class Attention:
    """Fused-QKV multi-head attention with grouped KV heads."""

    qkv: Linear
    o: Linear
    q_norm: Norm | None = None  # per head, over head_dim (args.qk_norm)
    k_norm: Norm | None = None


@dataclass
class Layer:
    attn_norm: Norm
    attn: Attention
    ffn_norm: Norm | None  # None in a parallel block that shares attn_norm
    ffn: FFN
    post_attn_norm: Norm | None = None  # args.post_norms: on the attention output before the residual add
    post_ffn_norm: Norm | None = None  # and on the FFN output
    fused_decode: bool = False  # decode runs the attention block as one kernel (ops/api.py)
    decode_weights: api.AttentionWeights | None = None  # that kernel's per-layer weights, built once


def rope_inv_freq(head_dim: int, theta: float) -> list[float]:
    """Default RoPE frequencies: theta^(-2i/d) for each rotary pair i."""
    return [1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)]


def half_split_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute q/k rows from HF's half-split RoPE layout to the interleaved one (as llama.cpp)."""
    shape = w.shape
    head_dim = shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *shape[1:]).transpose(1, 2).reshape(shape).contiguous()


class Model:
    """A loaded model: weights and the forward pass.

    Matrices are stored in `dtype` (fp32, bf16 or fp16; None: as the checkpoint stores them,
    GGUF quantized blocks included); norms, biases, activations and the KV cache stay fp32,
    so half or quantized weights cost memory bandwidth only, not activation accuracy.

    `forward(tokens, cache)` appends `tokens` at position `cache.length` and returns logits,
    for the last token only unless `all_logits` (tests and perplexity need all).
    """

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 ffns: list[FFN] | None = None, tier: DenseTier | None = None,
                 release: Callable[[torch.Tensor], None] | None = None):
        """`state` is consumed (its tensors are taken out as they are placed, so that loading
        never holds a source and its copy for long). `ffns`: one FFN per layer to use instead
        of building `DenseFFN`s from the state (the packed hybrid engine brings its own).
        `release(source)` is called for each state tensor that was copied (the loader drops
        the mapped file's pages under it, so that loading does not hold file and copy at once). `tier`: which dense parts (attention
        projections, embeddings and LM head, KV cache) live on the GPU tier."""
        self.args = args
        self.dtype = dtype
        self.tier = tier or DenseTier()
        t = self.tier

        def owned(w: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
            # a tensor still sharing the state's memory (a view of a mapped model file) is
            # copied, so that the file can be unmapped and its cached pages dropped
            return w.clone() if w.untyped_storage().data_ptr() == source.untyped_storage().data_ptr() else w

        def get(name: str, on_tier: bool = False, lookup: bool = False) -> torch.Tensor | quant.QuantParts | None:
            w = state.pop(name, None)  # consumed: the source is freed as soon as it is copied
            if w is None:
                return None
            if isinstance(w, quant.QuantParts):  # blocks of mixed formats: each part placed as one
                # matrix would be (on the tier as blocks, widened per matmul; else as lanes where it can)
                return quant.QuantParts([moved(p, on_tier, False) for p in w.parts], w.shape, w.formats)
            return moved(w, on_tier, lookup)

        def moved(w: torch.Tensor, on_tier: bool, lookup: bool) -> torch.Tensor:
            """`place(w)`, releasing w's file pages when it was copied."""
            out = place(w, on_tier, lookup)
            # a copy's source pages go; so do a looked-up table's (read at load by the finite
            # check): its rows fault back in from the file as tokens read them
            if release is not None and (lookup or out.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()):
                release(w)
            return out

        def place(w: torch.Tensor, on_tier: bool, lookup: bool = False) -> torch.Tensor:
            if on_tier:  # blocks move as they are (widened per matmul on the tier), floats in its dtype
                to = {} if quant.is_quantized(w) else {"dtype": t.dtype or dtype}
                return owned(w.to(device=t.device, **to).contiguous(), w)
            if quant.is_quantized(w):  # blocks stay blocks: re-laid once for the dense kernels (the
                # file's pages are then released), else a view of the mapped file, as llama.cpp
                # keeps them (its pages are the weights' only copy)
                return lanes.interleave(w) if not lookup and lanes.fits(w) else w.contiguous()
            if dtype is None:  # native: as the file stores it
                # a table only looked up stays a view of the mapped file, as llama.cpp keeps
                # it: only the rows read become resident (a 7B's F16 table is 0.25-0.4 GB)
                return w.contiguous() if lookup else owned(w.contiguous(), w)
            return owned(w.to(dtype).contiguous(), w)

        def get32(name: str, on_tier: bool = False) -> torch.Tensor | None:
            w = state.pop(name, None)
            return None if w is None else owned(w.float().to(t.device if on_tier else "cpu").contiguous(), w)

        def linear(name: str, bias: str | None = None, on_tier: bool = False) -> Linear | None:
            w = get(name, on_tier)
            # on the GPU tier the torch code runs, also when that tier is CPU tensors (tests)
            return None if w is None else Linear(w, get32(bias, on_tier) if bias else None, kernels=not on_tier)

        def norm(prefix: str) -> Norm | None:
            w, b = get32(prefix + ".weight"), get32(prefix + ".bias")
            if w is None and b is None:
                return None
            return Norm(args.norm, w, b, args.norm_eps)

        # the embedding table is only looked up: on the tier only when it is also the LM head
        self.embed = get("embed", t.head and args.tie_embeddings, lookup=True)
        self.pos_embed = get32("pos_embed")
        self.project_in = linear("project_in")
        self.project_out = linear("project_out")
        self.final_norm = norm("final_norm") if args.final_norm else None
        self.lm_head = Linear(self.embed, kernels=not t.head) if args.tie_embeddings else linear("lm_head", on_tier=t.head)
        self.layers: list[Layer] = []
        for i in range(args.n_layers):
            p = f"layers.{i}."
            attn_norm = norm(p + "attn_norm")
            assert attn_norm is not None, f"missing {p}attn_norm"
            ffn = ffns[i] if ffns is not None else DenseFFN(
                w_in=linear(p + "ffn.w_in", p + "ffn.b_in"),
                w_out=linear(p + "ffn.w_out", p + "ffn.b_out"),
                act=args.act,
                gated=args.gated_ffn,
                up_act=args.up_act,
            )
            on_tier = t.attention_on_tier(i)
            attn = Attention(linear(p + "wqkv", p + "bqkv", on_tier), linear(p + "wo", p + "bo", on_tier),
                             norm(p + "q_norm"), norm(p + "k_norm"))
            layer = Layer(attn_norm, attn, norm(p + "ffn_norm"), ffn, norm(p + "post_attn_norm"),
                          norm(p + "post_ffn_norm"))
            layer.fused_decode = self._can_fuse(layer)
            self.layers.append(layer)
        # per RoPE frequency set (global; local: the windowed layers' own, where a family has one)
        self._rope: dict[bool, torch.Tensor] = {}
        self._rope_cs: dict[bool, tuple[np.ndarray, np.ndarray]] = {}
        self._decode_bufs = threading.local()  # per thread: the FFN input at fused decode
        self.stack_decode = True  # one kernel call per decode token where the layers allow it
        self.short_prefill = True  # a short prompt through the batched decode kernels (models/batch.py)
        self.kv_dtype = torch.float32  # of KV caches in CPU memory: fp32 or fp16 (`--kv-dtype`)
        self._stack: LayerStack | None = None
        self._stack_ffns: list[Any] | None = None
        scale = args.attn_scale if args.attn_scale is not None else args.head_dim**-0.5
        self._attn_shape = api.AttentionShape(args.n_heads, args.n_kv_heads, args.head_dim, scale,
                                              args.position == "rope", args.attn_softcap or 0.0)
        self._windowed = [args.windowed(i) for i in range(args.n_layers)]
        self._local_rope = [w and args.rope_inv_freq_local is not None for w in self._windowed]
        # the one-token attention kernel's window per layer (0: the whole context)
        self._window = [args.sliding_window if w else 0 for w in self._windowed]

    def _can_fuse(self, layer: Layer) -> bool:
        """Whether decode can run this layer's attention block in one kernel: a pre-norm,
        sequential RMSNorm block (the Llama shape) with CPU weights the kernels read."""
        a = self.args
        plain = not (a.post_norms or a.attn_softcap is not None or a.sliding_window is not None)
        return (plain and a.pre_norm and not a.parallel_block and not a.qk_norm and a.norm == "rms"
                and a.position in ("rope", "learned")
                and layer.attn_norm.weight is not None and layer.ffn_norm is not None
                and layer.ffn_norm.weight is not None and layer.attn.qkv.fused_np is not None
                and layer.attn.o.w_np is not None)

    # -- positions -----------------------------------------------------------------------
    def rope_table(self, length: int, local: bool = False) -> torch.Tensor:
        """Complex rotations e^{i p w} for positions [0, length), grown on demand; `local`: with
        the windowed layers' own frequencies."""
        table = self._rope.get(local)
        if table is None or table.shape[0] < length:
            length = max(length, 2 * (0 if table is None else table.shape[0]))
            # fp32 angles, as transformers computes them, so logits match the oracle closely.
            freqs = self.args.rope_inv_freq_local if local else self.args.rope_inv_freq
            inv_freq = torch.tensor(freqs, dtype=torch.float32)
            angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
            factor = 1.0 if local else self.args.rope_attention_factor
            table = self._rope[local] = torch.polar(torch.full_like(angles, factor), angles)
        return table

    def new_cache(self, max_len: int) -> KVCache:
        """A KV cache for up to `max_len` positions: in CPU memory, or on the GPU tier for
        `--kv-on-gpu`."""
        a = self.args
        return KVCache(a.n_layers, a.n_kv_heads, a.head_dim, max_len, self.kv_dtype, tier_device=self.tier.device,
                       on_tier=[self.tier.kv] * a.n_layers, tier_dtype=self._tier_kv_dtype())

    def _tier_kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype on the GPU tier: fp16 on CUDA (what the placement solver
        budgets, offline/solve.py) or for a half tier; else the CPU caches' dtype."""
        t = self.tier
        if t.device is not None and (t.device.type == "cuda" or t.dtype in (torch.float16, torch.bfloat16)):
            return torch.float16
        return self.kv_dtype

    # -- forward -------------------------------------------------------------------------
    def embed_tokens(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        if quant.is_quantized(self.embed):
            x = (quant.embedding(self.embed, tokens) if self.embed.device.type == "cpu"
                 else quant_torch.rows(self.embed, tokens.to(self.embed.device)).cpu())
        else:  # the residual stream is on the CPU
            x = F.embedding(tokens.to(self.embed.device), self.embed).float().cpu()
        if self.args.embed_scale != 1.0:
            x = x * self.args.embed_scale
        if self.project_in is not None:
            x = self.project_in(x)
        if self.pos_embed is not None:
            pos = torch.arange(start, start + tokens.shape[0]) + self.args.learned_pos_offset
            x = x + F.embedding(pos, self.pos_embed)
        return x

    def attention(self, layer_idx: int, attn: Attention, x: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """The attention block's output for x (T, d) on x's device. Projections run where their
        weights are, the attention itself where the layer's KV cache is (both may be the GPU
        tier's device)."""
        w_dev, kv_dev = attn.qkv.weight.device, cache.device(layer_idx)
        qkv = attn.qkv(x.to(w_dev)).to(kv_dev)
        if attn.q_norm is not None:
            qkv = self._norm_qk(qkv, attn)
        if x.shape[0] == 1 and cache.k_np[layer_idx] is not None:
            out = self._attend_one(layer_idx, qkv[0], cache, start).unsqueeze(0)
        else:
            out = self._attend_torch(layer_idx, qkv, cache, start)
        return attn.o(out.to(w_dev)).to(x.device)

    def _norm_qk(self, qkv: torch.Tensor, attn: Attention) -> torch.Tensor:
        """qkv with each head of q and k RMS-normed over head_dim (before RoPE, as Qwen3)."""
        a = self.args
        T = qkv.shape[0]
        q = attn.q_norm(qkv[:, :a.q_dim].reshape(T * a.n_heads, a.head_dim).contiguous()).reshape(T, a.q_dim)
        k = attn.k_norm(qkv[:, a.q_dim:a.q_dim + a.kv_dim].reshape(T * a.n_kv_heads, a.head_dim).contiguous())
        return torch.cat([q, k.reshape(T, a.kv_dim), qkv[:, a.q_dim + a.kv_dim:]], dim=1)

    def _attend_torch(self, layer_idx: int, qkv: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """softmax(q k^T) v for T tokens with torch ops on the cache's device (prefill, GPU tier)."""
        a = self.args
        T, dev = qkv.shape[0], qkv.device
        q = qkv[:, : a.q_dim].view(T, a.n_heads, a.head_dim)
        k = qkv[:, a.q_dim : a.q_dim + a.kv_dim].view(T, a.n_kv_heads, a.head_dim)
        v = qkv[:, a.q_dim + a.kv_dim :].view(T, a.n_kv_heads, a.head_dim)
        if a.position == "rope":
            rot = self.rope_table(start + T, self._local_rope[layer_idx])[start : start + T, None, :].to(dev)
            q = _rotate(q, rot)
            k = _rotate(k, rot)
        keys, values = cache.update(layer_idx, start, k, v)
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # an fp16 cache: its rounded values
        S = start + T
        window = a.sliding_window if self._windowed[layer_idx] else None
        if a.attn_softcap is not None:
            out = _softcapped_attention(q.transpose(0, 1), keys, values, start, window, self._attn_shape.scale,
                                        a.attn_softcap)
            return out.transpose(0, 1).reshape(T, a.q_dim)
        mask = None
        if (T > 1 and start > 0) or (window is not None and S > window):
            mask = _causal_mask(T, S, start, window, dev)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None and T > 1,
            scale=self._attn_shape.scale,
            enable_gqa=a.n_heads != a.n_kv_heads,
        )
        return out[0].transpose(0, 1).reshape(T, a.q_dim)

    def _attend_one(self, layer_idx: int, qkv: torch.Tensor, cache: KVCache, pos: int) -> torch.Tensor:
        """Decode attention in one numba call: RoPE, cache write, softmax(qk)v for all heads."""
        a = self.args
        rope = self._attn_shape.rope
        cos, sin = self.rope_cos_sin(pos + 1, self._local_rope[layer_idx]) if rope else (_EMPTY_TABLE, _EMPTY_TABLE)
        out = torch.empty(a.q_dim, dtype=torch.float32)
        api.attend_one(qkv.numpy(), self._attn_shape, pos, cos, sin, cache.k_np[layer_idx], cache.v_np[layer_idx],
                       out.numpy(), self._window[layer_idx])
        return out

    def rope_cos_sin(self, length: int, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The rope table as separate fp32 cos and sin arrays (positions, head_dim/2)."""
        table = self.rope_table(length, local)
        cs = self._rope_cs.get(local)
        if cs is None or cs[0].shape[0] != table.shape[0]:
            cs = self._rope_cs[local] = (table.real.contiguous().numpy(), table.imag.contiguous().numpy())
        return cs

    def _fused_block(self, i: int, layer: Layer, x: torch.Tensor, cache: KVCache, pos: int) -> torch.Tensor:
        """One decode token through a layer with two kernel calls; x (1, d) is updated in place.
        Per-call Python is kept to a minimum: on a small model it is a large share of a token."""
        a = self.args
        cos, sin = self.rope_cos_sin(pos + 1) if self._attn_shape.rope else (_EMPTY_TABLE, _EMPTY_TABLE)
        w = self.attention_weights(layer)
        h = getattr(self._decode_bufs, "h", None)
        if h is None:
            h = self._decode_bufs.h = np.empty(a.d_model, dtype=np.float32)
        xv = x[0].numpy()
        api.attention_block(w, self._attn_shape, xv, pos, cos, sin, cache.k_np[i], cache.v_np[i], h)
        if layer.ffn.add_one(h, xv):
            return x
        return layer.ffn(torch.from_numpy(h.copy())[None], residual=x)

    def _layer_stack(self) -> LayerStack | None:
        """The layers gathered for one-call decode (models/stack.py), gathered again when a
        layer's FFN was swapped (the profiler's); None where decode keeps its per-layer path
        or `stack_decode` is off."""
        if not self.stack_decode:
            return None
        ffns = [layer.ffn for layer in self.layers]
        if ffns != self._stack_ffns:
            self._stack_ffns, self._stack = ffns, layer_stack(self)
        return self._stack

    def attention_weights(self, layer: Layer) -> api.AttentionWeights:
        """The fused decode kernels' record of a layer's attention block (built once)."""
        w = layer.decode_weights
        if w is None:
            qkv, o = layer.attn.qkv, layer.attn.o
            assert layer.ffn_norm is not None and layer.ffn_norm.weight is not None
            w = layer.decode_weights = api.AttentionWeights(
                layer.attn_norm.weight.numpy(), self.args.norm_eps, qkv.fused_np, qkv.b_np, o.w_np, o.b_np,
                layer.ffn_norm.weight.numpy())
        return w

    def block(self, i: int, layer: Layer, x: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        if layer.fused_decode and x.shape[0] == 1 and cache.k_np[i] is not None:
            return self._fused_block(i, layer, x, cache, start)
        if not self.args.pre_norm:  # OPT post-norm: norm after each residual add
            x = layer.attn_norm(x + self.attention(i, layer.attn, x, cache, start))
            assert layer.ffn_norm is not None
            return layer.ffn_norm(layer.ffn(x, residual=x))
        h = layer.attn_norm(x)
        attn_out = self.attention(i, layer.attn, h, cache, start)
        if layer.post_attn_norm is not None:
            attn_out = layer.post_attn_norm(attn_out)
        if self.args.parallel_block:
            ffn_in = h if layer.ffn_norm is None else layer.ffn_norm(x)
            return layer.ffn(ffn_in, residual=x + attn_out)
        x = x + attn_out
        assert layer.ffn_norm is not None
        if layer.post_ffn_norm is not None:
            return x + layer.post_ffn_norm(layer.ffn(layer.ffn_norm(x)))
        return layer.ffn(layer.ffn_norm(x), residual=x)

    def hidden_to_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        logits = self.lm_head(x.to(self.lm_head.weight.device)).cpu()
        cap = self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Run `tokens` (1-D LongTensor) after the cache's contents; return fp32 logits.

        Shape: (T, vocab) with `all_logits`, else (vocab,) for the last token.
        """
        start = cache.length
        T = tokens.shape[0]
        if start + T > cache.max_len:
            raise ValueError(f"cache holds {cache.max_len} positions, asked for {start + T}")
        x = self.embed_tokens(tokens, start).contiguous()  # fresh: fused decode updates it in place
        stack = self._layer_stack() if T == 1 and cache.k_all_np is not None else None
        if stack is not None:
            stack.run(self, x[0].numpy(), cache, start)
        elif self.short_prefill and _batch().short_prefill_fits(self, T, cache):
            x = _batch().prefill_short(self, x, cache, start)
        else:
            for i, layer in enumerate(self.layers):
                x = self.block(i, layer, x, cache, start)
        cache.length = start + T
        if not all_logits:
            return self.hidden_to_logits(x[-1:])[0]
        return self.hidden_to_logits(x)

    def decode(self, tokens: list[int], caches: list[KVCache]) -> torch.Tensor:
        """One decode step for several sequences, token b after caches[b]'s contents: (B,
        vocab) fp32 logits. Row b equals `forward(tokens[b:b+1], caches[b])` (exactly for float
        weights, to rounding for GGUF blocks), while each weight is read once for the whole
        batch where the layer allows it (models/batch.py)."""
        from .batch import decode_step

        return decode_step(self, tokens, caches)

    def num_parameters(self) -> int:
        # a tied LM head re-laid as lanes is a copy of the embedding, not more parameters
        tied_copy = self.args.tie_embeddings and self.lm_head is not None
        seen = {id(t) for t in self.lm_head.tensors() if t is not self.embed} if tied_copy else set()
        total = 0
        for t in self.tensors():
            if id(t) not in seen:
                seen.add(id(t))
                if lanes.is_lanes(t):
                    rows, cols = lanes.shape_of(t)
                else:
                    rows, cols = quant.shape_of(t) if quant.is_quantized(t) else (t.numel(), 1)
                total += rows * cols
        return total

    def tensors(self) -> list[torch.Tensor]:
        out: list[Any] = [self.embed, self.pos_embed]
        for lin in (self.project_in, self.project_out, self.lm_head):
            out += lin.tensors() if lin is not None else []
        if self.final_norm is not None:
            out += [self.final_norm.weight, self.final_norm.bias]
        for layer in self.layers:
            out += [layer.attn_norm.weight, layer.attn_norm.bias]
            out += layer.attn.qkv.tensors() + layer.attn.o.tensors()
            for norm in (layer.ffn_norm, layer.post_attn_norm, layer.post_ffn_norm, layer.attn.q_norm, layer.attn.k_norm):
                if norm is not None:
                    out += [norm.weight, norm.bias]
            out += layer.ffn.tensors()
        return [t for t in out if t is not None]


def _batch():
    """models/batch.py, which imports this module (so not imported at the top)."""
    from . import batch

    return batch


def _rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to x (T, H, D) in the interleaved layout; rot is (T, 1, D/2) complex."""
    T, H, D = x.shape
    xc = torch.view_as_complex(x.float().reshape(T, H, D // 2, 2))
    return torch.view_as_real(xc * rot).reshape(T, H, D).to(x.dtype)


def _causal_mask(T: int, S: int, start: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(T, S) bool: query start+t may see key s (causal; within the last `window` positions)."""
    q_pos = start + torch.arange(T, device=device)[:, None]
    k_pos = torch.arange(S, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def _softcapped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                          window: int | None, scale: float, cap: float) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap)) v, spelt out: SDPA has no soft-capping.
    q (H, T, D), keys and values (H_kv, S, D); returns (H, T, D)."""
    H, T, _ = q.shape
    group = H // keys.shape[0]
    k = keys.repeat_interleave(group, 0) if group > 1 else keys
    v = values.repeat_interleave(group, 0) if group > 1 else values
    scores = torch.tanh((q @ k.transpose(1, 2)) * (scale / cap)) * cap
    scores = scores.masked_fill(~_causal_mask(T, k.shape[1], start, window, q.device), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
