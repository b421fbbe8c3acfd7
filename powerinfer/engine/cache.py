"""A preallocated KV cache: one tensor for keys, one for values, written in place."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer, (layers, kv_heads, max_len, head_dim) each.

    Preallocated once per sequence so decoding makes no per-step allocations for it;
    `length` is the number of positions already filled.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        shape = (n_layers, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # numpy views for the CPU decode kernels (same memory)
        self.k_np = self.k.numpy() if self.k.device.type == "cpu" else None
        self.v_np = self.v.numpy() if self.v.device.type == "cpu" else None
        self.max_len = max_len
        self.length = 0

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (T, kv_heads, head_dim) at [start, start+T); return the filled views."""
        end = start + k.shape[0]
        self.k[layer, :, start:end] = k.transpose(0, 1)
        self.v[layer, :, start:end] = v.transpose(0, 1)
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on (the data stays; it is overwritten later)."""
        self.length = min(self.length, length)

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
