"""numba's kernel cache is dropped when any source of the package changes (ops/kernel_cache.py):
numba itself only compares a kernel with its own file, while kernels inline helpers from
sibling files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from powerinfer.ops import kernel_cache


def _cache_files(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.suffix in (".nbi", ".nbc"))


def test_cache_dropped_only_when_a_source_changes(tmp_path: Path):
    src, cache = tmp_path / "ops", tmp_path / "ops" / "__pycache__"
    src.mkdir()
    (src / "helper.py").write_text("def f():\n    return 1\n")
    (src / "kernel.py").write_text("from .helper import f\n")
    cache.mkdir()
    (cache / "kernel.k-1.py311.nbi").write_bytes(b"index")
    (cache / "kernel.k-1.py311.1.nbc").write_bytes(b"code")
    (cache / "kernel.cpython-311.pyc").write_bytes(b"bytecode")

    assert kernel_cache.drop_stale(src, cache)  # no stamp yet: nothing proves the cache current
    assert _cache_files(cache) == [] and (cache / "kernel.cpython-311.pyc").exists()

    (cache / "kernel.k-1.py311.nbi").write_bytes(b"index")  # numba rebuilds it
    assert not kernel_cache.drop_stale(src, cache)  # same sources: kept
    assert _cache_files(cache) == ["kernel.k-1.py311.nbi"]

    (src / "helper.py").write_text("def f():\n    return 2\n")  # the helper, not the kernel's file
    assert kernel_cache.drop_stale(src, cache)
    assert _cache_files(cache) == []
    assert not kernel_cache.drop_stale(src, cache)


@pytest.mark.skipif(bool(os.environ.get("NUMBA_CACHE_DIR")), reason="numba's cache is elsewhere")
def test_the_package_stamp_matches_its_sources():
    """Importing powerinfer.ops left a stamp of the sources now in the tree."""
    import powerinfer.ops as ops

    here = Path(ops.__file__).parent
    stamp = here / "__pycache__" / kernel_cache.STAMP
    assert stamp.read_text().strip() == kernel_cache.sources_digest(here)
