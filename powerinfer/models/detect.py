"""What architecture a model path holds, read without torch: the GGUF header's
general.architecture or config.json's model_type. The CLI asks this first, so that a model
no family serves is refused in a fraction of a second, before weights, torch or the
tokenizer are loaded."""

from __future__ import annotations

import json
import os

from . import family_name


def check_supported(path: str) -> None:
    """Raise UnsupportedModelError when `path` (a GGUF file or HF directory) holds an
    architecture no family serves; anything else (missing, corrupt, ...) is left to the
    loader, which reports it in full."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return
        from ..errors import ModelFileError
        from ..formats.gguf_check import read_header

        try:
            arch = read_header(path, os.path.getsize(path)).metadata.get("general.architecture")
        except ModelFileError:
            return
        if isinstance(arch, str):
            family_name(arch, gguf=True)
    elif os.path.isfile(os.path.join(path, "config.json")):
        try:
            with open(os.path.join(path, "config.json")) as f:
                model_type = json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError):
            return
        if isinstance(model_type, str) and model_type:
            family_name(model_type)
