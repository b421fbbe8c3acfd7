"""Reading GGUF files with the `gguf` package: metadata, and tensors as torch.

GGUF stores each tensor row-major with its shape listed innermost-first; `gguf` hands us
numpy arrays whose shape is already (rows, cols) for float types and (rows, bytes) for
quantized ones, which `gguf.quants.dequantize` turns into float32 (rows, cols).

Float tensors (F32, F16, BF16) keep their stored dtype and are not copied: the file is
mapped copy-on-write, so they are page-cache views until something writes to them. A 7B
F16 model therefore reads as 13.5 GB, not the 27 GB an fp32 copy would take, and the
loader's own copies (in the run dtype, on huge pages) are the only resident ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import ModelFileError, UnsupportedModelError
from .gguf_check import map_tensors, read_header

GGUF_MAGIC = b"GGUF"


@dataclass
class GGUFFile:
    """An opened GGUF file: parsed metadata and lazy tensor access."""

    path: str
    metadata: dict[str, Any]
    _tensors: dict[str, Any]
    native: bool = False  # quantized tensors as blocks (ops/quant.py) where a kernel reads them
    _map: Any = None  # the file's copy-on-write memory map (np.memmap), which the tensors view
    dequantized: set[str] = field(default_factory=set)  # what native mode widened to bf16 (for the note)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value of `key`, with `{arch}` replaced by the file's architecture."""
        return self.metadata.get(key.replace("{arch}", self.architecture), default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFileError(f"{self.path}: GGUF metadata lacks {key.replace('{arch}', self.architecture)}")
        return value

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def release(self, *names: str) -> None:
        """Drop the resident pages of tensors whose contents were copied (fused matrices), so
        that loading a model does not hold the file's pages and the copies at once. Safe:
        the file is mapped privately and never written; a later read maps the pages again."""
        for name in names:
            t = self._tensors.get(name)
            if t is not None:
                self._drop_pages(int(t.data_offset), int(t.n_bytes))

    def release_copied(self, t: torch.Tensor) -> None:
        """Drop the resident pages under `t` when it views this file's mapping and has been
        copied elsewhere (same safety as `release`); anything else is left alone."""
        data = self._map
        if data is None or t.device.type != "cpu":
            return
        base, addr, n = data.ctypes.data, t.data_ptr(), t.numel() * t.element_size()
        if base <= addr and addr + n <= base + data.nbytes:
            self._drop_pages(addr - base, n)

    def _drop_pages(self, offset: int, n_bytes: int) -> None:
        """madvise(DONTNEED) on the whole pages inside bytes [offset, offset + n_bytes) of the
        mapping (none where the reader's map cannot be advised)."""
        import mmap

        mm = getattr(self._map, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (offset + n_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor `name`, shape (rows, cols) as in PyTorch's Linear: in `dtype`, or with None
        in its stored dtype for float types (a view of the mapped file) and fp32 for
        quantized ones; in `native` mode quantized matrices of a format the kernels read stay
        blocks (a view, ops/quant.py) and other quantized ones are dequantized to bf16."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        from ..ops import quant

        if name not in self._tensors:
            raise ModelFileError(f"{self.path}: tensor {name} is missing")
        t = self._tensors[name]
        kind = t.tensor_type.name
        if self.native and dtype is None and kind in quant.FORMATS and len(t.shape) == 2:
            cols, rows = int(t.shape[0]), int(t.shape[1])
            return quant.from_gguf(t.data, kind, rows, cols)
        if self.native and dtype is None and kind not in ("F32", "F16", "BF16"):
            self.dequantized.add(kind)
            dtype = torch.bfloat16
        try:
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                array = t.data  # a view of the copy-on-write mapping: no copy
            elif t.tensor_type == GGMLQuantizationType.BF16:
                shape = tuple(int(s) for s in reversed(t.shape))
                bits = torch.from_numpy(np.ascontiguousarray(t.data).view(np.int16).reshape(shape))
                return bits.view(torch.bfloat16) if dtype is None else bits.view(torch.bfloat16).to(dtype)
            else:
                array = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name} uses quant type {t.tensor_type.name}, which gguf cannot dequantize"
            ) from e
        shape = tuple(int(s) for s in reversed(t.shape))
        array = np.ascontiguousarray(array).reshape(shape)
        out = torch.from_numpy(array)
        return out if dtype is None else out.to(dtype)


def open_gguf(path: str, native: bool = False) -> GGUFFile:
    """Open and validate a GGUF file; any structural problem becomes a one-line ModelFileError.
    `native`: read quantized matrices as blocks (see `GGUFFile.tensor`). Only the header is
    read here (formats/gguf_check.py); tensors are views of a copy-on-write map of the file."""
    if not os.path.isfile(path):
        raise ModelFileError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (bad magic {magic!r})")
    header = read_header(path, os.path.getsize(path))
    mapped = map_tensors(path, header)
    return GGUFFile(path=path, metadata=header.metadata, _tensors=header.tensors, native=native, _map=mapped)
