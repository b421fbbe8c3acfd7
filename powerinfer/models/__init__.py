"""Model families, one module per HF `model_type` family, found by import.

Each family module defines MODEL_TYPES, GGUF_ARCHS, `args_from_hf`, `state_from_hf` and,
where llama.cpp has the architecture, `args_from_gguf` and `state_from_gguf`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import UnsupportedModelError

FAMILIES = ("llama", "qwen2", "opt", "falcon")
# HF model_type / GGUF architecture -> family module, for names that differ from the module's.
ALIASES = {"mistral": "llama", "RefinedWeb": "falcon", "RefinedWebModel": "falcon"}


def family_module(model_type: str, gguf: bool = False) -> ModuleType:
    """The family module serving an HF model_type (or, with `gguf`, a GGUF architecture)."""
    name = ALIASES.get(model_type, model_type)
    if name not in FAMILIES:
        kind = "GGUF architecture" if gguf else "model_type"
        raise UnsupportedModelError(f"unsupported {kind} {model_type!r} (supported: {', '.join(FAMILIES)})")
    module = importlib.import_module(f"{__name__}.{name}")
    if gguf and model_type not in module.GGUF_ARCHS:
        raise UnsupportedModelError(f"GGUF architecture {model_type!r} is not supported (use the HF checkpoint)")
    return module
