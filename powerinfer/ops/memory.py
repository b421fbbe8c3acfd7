"""Weight buffers on transparent huge pages (Linux), for the CPU kernels.

The sparse kernels read rows scattered over matrices of tens to hundreds of MB; with 4 KiB
pages nearly every active row costs a TLB miss, with 2 MiB pages almost none do. The
kernel here only grants huge pages to memory that asks for them (THP mode "madvise" is the
common default), and only at first touch, so the buffer is advised before it is filled.
No library does this for torch tensors; it is one madvise call through ctypes.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MIN_BYTES = 4 * HUGE_PAGE  # smaller tensors gain little and would waste up to 2 MiB each

_libc = None


def _madvise(addr: int, length: int) -> bool:
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` in a buffer advised for huge pages (or `t` itself
    when it is small, not on the CPU, or the system refuses the advice)."""
    n = t.numel() * t.element_size()
    if t.device.type != "cpu" or n < MIN_BYTES:
        return t
    raw = torch.empty(n + HUGE_PAGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % HUGE_PAGE
    if not _madvise(raw.data_ptr() + off, n - n % HUGE_PAGE):
        return t
    out = raw[off : off + n].view(t.dtype).view(t.shape)  # a view keeps `raw` alive
    out.copy_(t)
    return out
