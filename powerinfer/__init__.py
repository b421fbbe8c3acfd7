"""powerinfer: PowerInfer-style LLM inference in Python.

Public API::

    import powerinfer
    lm = powerinfer.load()                       # embedded SmolLM2-135M-Instruct, or a path
    print(powerinfer.generate(lm, "The capital of France is", max_tokens=16, temperature=0))
    for r in powerinfer.stream_generate(lm, "Hello", max_tokens=32):
        print(r.text, end="", flush=True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from .errors import BadArgumentError, PowerInferError

if TYPE_CHECKING:
    from .engine.generate import GenerationResponse
    from .engine.sample import SamplingParams
    from .loader import LoadedModel

__version__ = "0.1.0"
__all__ = ["load", "generate", "stream_generate", "LoadedModel", "SamplingParams", "GenerationResponse",
           "PowerInferError"]
# imported on first use: `import powerinfer` (and so the CLI) must not load torch before it
# knows it has a model it can run (an unsupported one is refused in well under 2 s)
_LAZY = {"load": "loader", "LoadedModel": "loader", "SamplingParams": "engine.sample",
         "GenerationResponse": "engine.generate"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def stream_generate(lm: LoadedModel, prompt: str | list[int], max_tokens: int = 256, *,
                    temperature: float = 0.8, top_k: int = 0, top_p: float = 0.95, min_p: float = 0.0,
                    repetition_penalty: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
                    chat: bool = False) -> Iterator[GenerationResponse]:
    """Stream a completion of `prompt`. With `chat`, the prompt is one user message put
    through the model's chat template."""
    if lm.tokenizer is None:
        raise BadArgumentError(f"{lm.path}: the model has no tokenizer; pass token ids")
    if chat:
        if not isinstance(prompt, str):
            raise BadArgumentError("chat=True needs a text prompt")
        prompt = lm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    from .engine.generate import stream_generate as _stream_generate
    from .engine.sample import SamplingParams

    sampling = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty, seed)
    return _stream_generate(lm.model, lm.tokenizer, prompt, max_tokens, sampling, stop)


def generate(lm: LoadedModel, prompt: str | list[int], max_tokens: int = 256, **kwargs) -> str:
    """The full completion of `prompt` as a string; keyword arguments as `stream_generate`."""
    return "".join(r.text for r in stream_generate(lm, prompt, max_tokens, **kwargs))
