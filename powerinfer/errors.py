"""Errors a user can cause. The CLI prints their message on one line and exits with 2."""


class PowerInferError(Exception):
    """Base class of every error caused by bad input (files, flags, requests)."""


class ModelFileError(PowerInferError):
    """The model path is missing, not a model, truncated or corrupt."""


class UnsupportedModelError(PowerInferError):
    """The model is readable but uses an architecture, option or quant type we do not run."""


class ContextLengthError(PowerInferError):
    """The prompt plus the requested tokens do not fit the model's context."""


class NonFiniteError(PowerInferError):
    """The model's output became NaN or Inf while generating."""


class BadArgumentError(PowerInferError):
    """A flag or parameter has a value we cannot honour."""


def require(ok: bool, message: str) -> None:
    """Raise BadArgumentError(message) unless `ok` (for flag checks written as conditions
    that NaN fails, e.g. `0 < f <= 1`)."""
    if not ok:
        raise BadArgumentError(message)
