"""Reading HF model directories: config.json plus one or more *.safetensors files."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ModelFileError


@dataclass
class HFCheckpoint:
    """An HF model directory: its parsed config and a name -> file map of its tensors."""

    path: str
    config: dict[str, Any]
    _files: dict[str, str]

    def tensor_names(self) -> list[str]:
        return list(self._files)

    def has(self, name: str) -> bool:
        return name in self._files

    def dtype_of(self, name: str) -> str:
        """Tensor `name`'s stored dtype as safetensors names it ("F16", "BF16", "F32", ...),
        read from the file's header alone."""
        from safetensors import SafetensorError, safe_open

        if name not in self._files:
            raise ModelFileError(f"{self.path}: tensor {name} is missing")
        try:
            with safe_open(self._files[name], framework="pt") as f:
                return f.get_slice(name).get_dtype()
        except SafetensorError as e:
            raise ModelFileError(f"{self._files[name]}: corrupt safetensors file ({e})") from None

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor `name` in `dtype`, or with None in its stored dtype (fp32 for non-float ones)."""
        from safetensors import SafetensorError, safe_open

        if name not in self._files:
            raise ModelFileError(f"{self.path}: tensor {name} is missing")
        try:
            with safe_open(self._files[name], framework="pt") as f:
                t = f.get_tensor(name)
                if dtype is None:
                    return t if t.is_floating_point() else t.float()
                return t.to(dtype)
        except SafetensorError as e:
            raise ModelFileError(f"{self._files[name]}: corrupt safetensors file ({e})") from None


def _check_layout(full: str, size: int) -> None:
    """Name what is cut short in a safetensors file (its own errors say "invalid header
    length" or "file not fully covered" for a file that is simply truncated)."""
    if size < 8:
        raise ModelFileError(f"{full}: truncated safetensors file: the header length is cut short ({size} bytes)")
    with open(full, "rb") as raw:
        header_len = int.from_bytes(raw.read(8), "little")
        if header_len > 100 << 20:
            raise ModelFileError(f"{full}: corrupt safetensors file: its header claims {header_len} bytes")
        if 8 + header_len > size:
            raise ModelFileError(f"{full}: truncated safetensors file: the header is cut short "
                                 f"(needs {8 + header_len} bytes, the file has {size})")
        try:
            header = json.loads(raw.read(header_len))
            ends = {k: v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"}
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise ModelFileError(f"{full}: corrupt safetensors file: its header is not valid JSON") from None
    for name, end in ends.items():
        if not isinstance(end, int) or 8 + header_len + end > size:
            raise ModelFileError(f"{full}: truncated safetensors file: tensor {name} is cut short "
                                 f"(it ends at byte {8 + header_len + end}, the file has {size})")


def _tensor_index(path: str, files: list[str]) -> dict[str, str]:
    from safetensors import SafetensorError, safe_open

    index: dict[str, str] = {}
    for name in files:
        full = os.path.join(path, name)
        _check_layout(full, os.path.getsize(full))
        try:
            with safe_open(full, framework="pt") as f:
                keys = list(f.keys())
        except (SafetensorError, ValueError, OSError) as e:
            raise ModelFileError(f"{full}: corrupt safetensors file ({e})") from None
        for k in keys:
            index[k] = full
    return index


def open_hf_dir(path: str) -> HFCheckpoint:
    """Open an HF directory; refuse it with a clear message when it is not one we can read."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelFileError(f"{path}: not a model directory (no config.json)")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{config_path}: invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{config_path}: expected a JSON object")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        if any(f.endswith(".bin") for f in os.listdir(path)):
            raise ModelFileError(f"{path}: only PyTorch .bin weights found; convert them to safetensors first")
        raise ModelFileError(f"{path}: no *.safetensors weights")
    return HFCheckpoint(path=path, config=config, _files=_tensor_index(path, files))
