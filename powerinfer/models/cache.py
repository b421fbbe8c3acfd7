"""A preallocated KV cache: per layer one tensor for keys and one for values, written in place."""

from __future__ import annotations

import torch

from ..errors import BadArgumentError
from ..ops.numba_half import numpy_weights


class KVCache:
    """Keys and values of every layer, (kv_heads, max_len, head_dim) each per layer.

    Preallocated once per sequence so decoding makes no per-step allocations for it;
    `length` is the number of positions already filled. Each layer's cache lives on the
    device given for it (CPU memory by default; the GPU tier's with `--kv-on-gpu`, in
    `tier_dtype` there). `dtype` is fp32 or fp16 (`--kv-dtype`; fp16 halves the cache and
    the attention's reads, as llama.cpp's default, for the rounding of keys and values to
    fp16). `k_np`/`v_np` are numpy views for the CPU decode kernels (fp16 as int16 bits, the
    kernels' half encoding), None for a layer whose cache is on the GPU tier (it is then
    served by torch code on that tier's device); `k_all_np`/`v_all_np` the (layers, ...)
    blocks they are views of when every layer's cache is in CPU memory, else None.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", tier_device: torch.device | None = None,
                 on_tier: list[bool] | None = None, tier_dtype: torch.dtype | None = None):
        if dtype not in (torch.float32, torch.float16):
            raise BadArgumentError(f"a KV cache is fp32 or fp16, not {dtype}")
        shape = (n_kv_heads, max_len, head_dim)
        on_tier = on_tier or [False] * n_layers
        devices = [tier_device if t and tier_device is not None else torch.device(device) for t in on_tier]
        dtypes = [tier_dtype if t and tier_dtype is not None else dtype for t in on_tier]
        on_gpu = sum(d.type == "cuda" for d in devices) if tier_device is not None and tier_device.type == "cuda" else 0
        if on_gpu:
            need = 2 * on_gpu * n_kv_heads * max_len * head_dim * (tier_dtype or dtype).itemsize
            free = torch.cuda.mem_get_info(tier_device)[0]
            if need > free:
                raise BadArgumentError(f"the KV cache for {max_len} positions needs {need / 2**30:.2f} GiB on the GPU, "
                                       f"{free / 2**30:.2f} GiB are free; ask for fewer tokens or drop --kv-on-gpu")
        # all layers in CPU memory: one block per kind, each layer's cache a view of it, so
        # that decode can pass every layer's cache to one kernel call (models/stack.py)
        one_block = n_layers > 0 and not any(on_tier) and all(d.type == "cpu" for d in devices)
        if one_block:
            k_all, v_all = (torch.zeros((n_layers,) + shape, dtype=dtype) for _ in range(2))
            self.k, self.v = list(k_all.unbind(0)), list(v_all.unbind(0))
        else:
            self.k = [torch.zeros(shape, dtype=t, device=d) for t, d in zip(dtypes, devices)]
            self.v = [torch.zeros(shape, dtype=t, device=d) for t, d in zip(dtypes, devices)]
        self.k_all_np = numpy_weights(k_all) if one_block else None
        self.v_all_np = numpy_weights(v_all) if one_block else None
        self.k_np = [None if t or k.device.type != "cpu" else numpy_weights(k) for t, k in zip(on_tier, self.k)]
        self.v_np = [None if t or v.device.type != "cpu" else numpy_weights(v) for t, v in zip(on_tier, self.v)]
        self.max_len = max_len
        self.length = 0

    def device(self, layer: int) -> torch.device:
        return self.k[layer].device

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (T, kv_heads, head_dim) at [start, start+T); return the filled views
        (in the cache's dtype: an fp16 cache gives the rounded keys and values that decode
        reads too)."""
        end = start + k.shape[0]
        dev = self.k[layer].device
        self.k[layer][:, start:end] = k.transpose(0, 1).to(dev)
        self.v[layer][:, start:end] = v.transpose(0, 1).to(dev)
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on (the data stays; it is overwritten later)."""
        self.length = min(self.length, length)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)
