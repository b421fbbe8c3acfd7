"""Reading the JSON manifests our artefacts carry (profile, predictors, packed model)."""

from __future__ import annotations

import json
from typing import Type

from .errors import PowerInferError


def read_manifest(path: str, fmt: str, kind: str, missing: str, error: Type[PowerInferError]) -> dict:
    """The manifest at `path` as a dict with "format" == `fmt`; else `error`: `missing` when
    there is no file, "corrupt manifest" when it is not JSON, "not a powerinfer {kind}
    manifest" when it is another document."""
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise error(missing) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: corrupt manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise error(f"{path}: not a powerinfer {kind} manifest")
    return manifest
