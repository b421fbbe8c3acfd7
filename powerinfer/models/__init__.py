"""Model families, one module per family, found by import.

This registry names what each family module serves (HF model_types, GGUF architectures)
without importing it, so that an unsupported model is refused before torch loads. Each
family module defines `args_from_hf`, `state_from_hf` and, where llama.cpp has the
architecture, `args_from_gguf` and `state_from_gguf`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import UnsupportedModelError

# family module -> (HF model_types, GGUF architectures) it serves
FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llama": (("llama", "mistral"), ("llama",)),
    "qwen2": (("qwen2",), ("qwen2",)),
    "qwen3": (("qwen3",), ("qwen3",)),
    "gemma2": (("gemma2",), ("gemma2",)),
    "gemma3": (("gemma3_text",), ("gemma3",)),
    "phi3": (("phi3",), ("phi3",)),
    "opt": (("opt",), ()),
    "falcon": (("falcon", "RefinedWeb", "RefinedWebModel"), ("falcon",)),
}


def family_name(model_type: str, gguf: bool = False) -> str:
    """The family module's name serving an HF model_type (or, with `gguf`, a GGUF
    architecture); a one-line UnsupportedModelError naming the supported ones otherwise."""
    for name, (hf_types, gguf_archs) in FAMILIES.items():
        if model_type in (gguf_archs if gguf else hf_types):
            return name
    if gguf:
        supported = sorted(a for _, archs in FAMILIES.values() for a in archs)
        hf_only = [name for name, (types, _) in FAMILIES.items() if model_type in types]
        hint = " (this family runs from its HF checkpoint)" if hf_only else ""
        raise UnsupportedModelError(f"unsupported GGUF architecture {model_type!r}{hint}; "
                                    f"supported: {', '.join(supported)}")
    supported = sorted(t for types, _ in FAMILIES.values() for t in types)
    raise UnsupportedModelError(f"unsupported model_type {model_type!r}; supported: {', '.join(supported)}")


def family_module(model_type: str, gguf: bool = False) -> ModuleType:
    """The family module serving an HF model_type (or, with `gguf`, a GGUF architecture)."""
    return importlib.import_module(f"{__name__}.{family_name(model_type, gguf)}")
