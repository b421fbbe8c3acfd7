"""Byte sizes with units on the command line: 6GiB, 512MiB, 1.5GB, 4096."""

from __future__ import annotations

import re

from .errors import BadArgumentError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes in `text`; refuse malformed or negative sizes with a clear message."""
    m = re.fullmatch(r"\s*([-+]?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise BadArgumentError(f"cannot read size {text!r} (examples: 6GiB, 512MiB, 1.5GB, 4096)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 0:
        raise BadArgumentError(f"size {text!r} is negative")
    return int(value)


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
