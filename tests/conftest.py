"""Shared fixtures: an isolated cache dir, tiny random HF models built with transformers'
own classes (the oracle), and the real embedded SmolLM2 GGUF."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory):
    """Keep the tests' cache (tokenizers, hashes) out of the user's ~/.cache."""
    path = tmp_path_factory.mktemp("powerinfer-cache")
    old = os.environ.get("POWERINFER_CACHE")
    os.environ["POWERINFER_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("POWERINFER_CACHE", None)
    else:
        os.environ["POWERINFER_CACHE"] = old


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from powerinfer.paths import default_model_path

    return default_model_path()


@pytest.fixture(autouse=True)
def deterministic_torch():
    torch.manual_seed(0)
    yield
