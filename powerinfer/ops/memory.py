"""Weight buffers on transparent huge pages (Linux), for the CPU kernels.

The sparse kernels read rows scattered over matrices of tens to hundreds of MB; with 4 KiB
pages nearly every active row costs a TLB miss, with 2 MiB pages almost none do. The
kernel here only grants huge pages to memory that asks for them (THP mode "madvise" is the
common default), and only at first touch, so the buffer is advised before it is filled.
No library does this for torch tensors; it is one madvise call through ctypes.
"""

from __future__ import annotations

import ctypes
import math
import os
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


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised contiguous CPU tensor in a buffer advised for huge pages, or None
    when it is small or the system refuses the advice. Fill it before other allocations:
    the pages are granted at first touch."""
    n = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if n < MIN_BYTES:
        return None
    raw = torch.empty(n + HUGE_PAGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % HUGE_PAGE
    if not _madvise(raw.data_ptr() + off, n - n % HUGE_PAGE):
        return None
    return raw[off : off + n].view(dtype).view(shape)  # a view keeps `raw` alive


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` in a buffer advised for huge pages (or `t` itself
    when it is small, not on the CPU, or the system refuses the advice)."""
    if t.device.type != "cpu":
        return t
    out = huge_empty(tuple(t.shape), t.dtype)
    if out is None:
        return t
    out.copy_(t)
    return out


def drop_file_cache(*paths: str) -> None:
    """Tell the kernel the files' cached pages are not needed any more (fadvise DONTNEED).

    Loading reads a model file once into our own buffers; left in the page cache, a 7 GB
    file holds memory that huge-page allocations then have to reclaim and compact. On the
    24 GB dev machine the second 7 GB model loaded got 3.4 GB of its weights on 4 KiB pages,
    which slowed its scattered-row reads. Pages still mapped somewhere are left alone."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def huge_page_share(tensors: list[torch.Tensor]) -> float | None:
    """Share of the bytes of the large CPU tensors among `tensors` that lie on huge pages
    (from /proc/self/smaps; None where it cannot be read)."""
    spans = sorted({(t.data_ptr(), t.numel() * t.element_size()) for t in tensors
                    if t.device.type == "cpu" and t.numel() * t.element_size() >= MIN_BYTES})
    if not spans:
        return None
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return None
    vmas = []  # (start, end, huge bytes)
    start = end = 0
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = head.split("-")
            start, end = int(lo, 16), int(hi, 16)
        elif head == "AnonHugePages:":
            vmas.append((start, end, int(line.split()[1]) * 1024))
    total = huge = 0
    for ptr, n in spans:
        total += n
        for lo, hi, h in vmas:
            if lo <= ptr < hi:
                huge += min(n, h)
                break
    return huge / total
