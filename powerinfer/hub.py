"""`-m org/name`: a model on the Hugging Face Hub, found through huggingface_hub's local cache
(HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE as huggingface_hub reads them), downloaded only
when it is not cached and a network is allowed."""

from __future__ import annotations

import os
import re

from .errors import ModelFileError

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
