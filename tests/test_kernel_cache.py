"""numba's kernel cache is dropped when any source of the package changes (ops/kernel_cache.py):
numba itself only compares a kernel with its own file, while kernels inline helpers from
sibling files."""

from __future__ import annotations

from pathlib import Path

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


def test_the_package_stamp_matches_its_sources():
    """Importing powerinfer.ops left a stamp of the sources now in the tree, in the folder
    where numba keeps the package's kernels (its own cache files are there too)."""
    import importlib

    import powerinfer.ops as ops

    importlib.import_module("powerinfer.ops.row_dots")  # its C functions are cached kernels

    here = Path(ops.__file__).parent
    cache = kernel_cache.package_cache_dir()
    assert (cache / kernel_cache.STAMP).read_text().strip() == kernel_cache.sources_digest(here)
    assert any(p.suffix == ".nbi" for p in cache.iterdir())


def test_the_tests_own_kernels_are_dropped_with_the_package_s(tmp_path: Path, monkeypatch):
    """The tests' folder's numba cache (where a kernel defined in a test file is kept) is the
    one conftest stamps with ops/'s digest: a kernel cached there before an edit to ops/ is
    dropped, as the package's own are."""
    from numba import config
    from numba.core.caching import UserProvidedCacheLocator

    import test_team

    tests = Path(__file__).resolve().parent
    cache = kernel_cache.cache_dir_for(tests)
    assert cache == tests / "__pycache__" or config.CACHE_DIR
    assert (cache / kernel_cache.STAMP).read_text().strip() == kernel_cache.sources_digest(
        Path(kernel_cache.__file__).resolve().parent)
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    numbas = UserProvidedCacheLocator.from_function(test_team._chain.py_func, test_team.__file__).get_cache_path()
    assert kernel_cache.cache_dir_for(tests) == Path(numbas)


def test_a_user_cache_dir_is_kept_current_too(tmp_path: Path, monkeypatch):
    """With NUMBA_CACHE_DIR set, numba keeps ops/'s kernels in a folder of its own under it:
    that folder gets the stamp, and kernels made from other sources are dropped there."""
    from numba import config
    from numba.core.caching import UserProvidedCacheLocator

    from powerinfer.ops import row_dots

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    cache = kernel_cache.package_cache_dir()
    numbas = UserProvidedCacheLocator.from_function(row_dots._row_dot_c, row_dots.__file__).get_cache_path()
    assert cache == Path(numbas) and cache.parent == tmp_path
    cache.mkdir(exist_ok=True)  # numba's locator made it already
    (cache / "kernel.k-1.py311.nbi").write_bytes(b"index from other sources")
    kernel_cache.drop_stale_package_cache()
    assert _cache_files(cache) == []
    assert (cache / kernel_cache.STAMP).read_text().strip() == kernel_cache.sources_digest(Path(row_dots.__file__).parent)


def _save_many(cache_dir: str, key: str, start, rounds: int) -> None:
    import time

    from numba.core.caching import IndexDataCacheFile

    from powerinfer.ops import kernel_cache

    kernel_cache.lock_cache_files()  # as importing powerinfer.ops does (already, under fork)
    load_index = IndexDataCacheFile._load_index

    def slow_load_index(self):  # widen numba's window between reading and writing the index
        index = load_index(self)
        time.sleep(0.02)
        return index

    IndexDataCacheFile._load_index = slow_load_index
    start.wait()
    for i in range(rounds):
        f = IndexDataCacheFile(cache_dir, "kernel", source_stamp=("stamp", 1))
        f.save((key, i), {"key": key, "i": i})


def test_concurrent_saves_keep_each_signature_in_its_own_file(tmp_path: Path):
    """Two processes saving different signatures of one kernel at once: every signature
    keeps its own data file (without the lock both read the index, both take the first free
    name, and one signature's file then holds the other's code)."""
    import multiprocessing as mp

    from numba.core.caching import IndexDataCacheFile

    ctx = mp.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_save_many, args=(str(tmp_path), key, start, 4)) for key in ("a", "b")]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    f = IndexDataCacheFile(str(tmp_path), "kernel", source_stamp=("stamp", 1))
    index = f._load_index()
    assert len(index) == 8 and len(set(index.values())) == 8
    for key, i in index:
        assert f.load((key, i)) == {"key": key, "i": i}
