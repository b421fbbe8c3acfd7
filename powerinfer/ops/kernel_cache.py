"""Keeping numba's on-disk kernel cache consistent with this package's sources.

numba checks a cached kernel against its own source file only, but the kernels here inline
helpers from sibling files (block_ir's dots into quant_sparse, decode's blocks into the
layer stack): after an edit to one file, another file's cache would still hold machine code
built from the old helper, and run it. So the whole package's cache is dropped when any of
its sources changes, judged by a digest of their contents kept next to the cache files.
An installed package is unaffected (an upgrade rewrites every file, which numba's own check
catches); this guards a working tree being edited.

Second, `serialize_compiles`: processes that start together cold (the test suite's two
workers, a server beside a CLI run) would each compile the same kernel for the same types,
minutes of duplicated work; with a lock per (kernel, signature) the second waits and loads
the first one's result from the cache.

Third, numba's cache index is a load-modify-write of one file per kernel: two processes
saving different signatures of one kernel at once can both pick the same data file, and a
later process then runs one signature's machine code for the other (a segfault, met with
the test suite's two workers once the KV cache came in two dtypes). `lock_cache_files`
serializes saves per index with a lock file, and loads wait for a save in progress.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from pathlib import Path

STAMP = "powerinfer-sources.sha256"


def sources_digest(src_dir: Path) -> str:
    """SHA-256 over the names and contents of the .py files in `src_dir`."""
    h = hashlib.sha256()
    for path in sorted(src_dir.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def drop_stale(src_dir: Path, cache_dir: Path) -> bool:
    """Delete numba's cache files (*.nbi, *.nbc) in `cache_dir` unless they were made from the
    sources now in `src_dir`; record the current digest. Returns whether files were dropped.
    Never raises: a cache that cannot be cleaned is numba's to rebuild or to trust, as before."""
    try:
        digest = sources_digest(src_dir)
        stamp = cache_dir / STAMP
        if stamp.exists() and stamp.read_text().strip() == digest:
            return False
        dropped = False
        if cache_dir.is_dir():
            for f in list(cache_dir.glob("*.nbi")) + list(cache_dir.glob("*.nbc")):
                f.unlink(missing_ok=True)
                dropped = True
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_dir / f"{STAMP}.{os.getpid()}"
        tmp.write_text(digest + "\n")
        tmp.replace(stamp)  # atomic: a concurrent importer sees the old stamp or the new one
        return dropped
    except OSError:
        return False


def cache_dir_for(src_dir: Path) -> Path | None:
    """Where numba keeps the kernels of the .py files in `src_dir`: its __pycache__, or
    numba's folder for it under NUMBA_CACHE_DIR when that is set (None where numba's locator
    has changed shape)."""
    from numba import config

    if not config.CACHE_DIR:
        return src_dir / "__pycache__"
    try:
        from numba.core.caching import _CacheLocator

        return Path(config.CACHE_DIR) / _CacheLocator.get_suitable_cache_subpath(str(src_dir / "any.py"))
    except (ImportError, AttributeError):
        return None


def package_cache_dir() -> Path | None:
    """Where numba keeps this package's (ops/) kernels (`cache_dir_for`)."""
    return cache_dir_for(Path(__file__).resolve().parent)


def drop_stale_package_cache() -> None:
    """`drop_stale` for this package's kernels, wherever numba keeps them."""
    cache_dir = package_cache_dir()
    if cache_dir is not None:
        drop_stale(Path(__file__).resolve().parent, cache_dir)


def lock_cache_files() -> None:
    """Wrap numba's cache-file save and load (numba.core.caching.IndexDataCacheFile) in a
    POSIX file lock next to each index: exclusive for a save, shared for a load. Without
    fcntl (Windows) or where numba's class has changed shape, nothing is wrapped."""
    try:
        import fcntl

        from numba.core import caching
    except ImportError:
        return
    cls = getattr(caching, "IndexDataCacheFile", None)
    if cls is None or getattr(cls, "_powerinfer_locked", False) or not (hasattr(cls, "save") and hasattr(cls, "load")):
        return
    save, load = cls.save, cls.load

    @contextlib.contextmanager
    def locked(index_file, kind):
        path = getattr(index_file, "_index_path", None)
        try:
            f = open(f"{path}.lock", "ab") if path else None
        except OSError:
            f = None
        if f is None:  # no lock to be had: numba's own behaviour
            yield
            return
        with f:
            fcntl.flock(f, kind)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def locked_save(self, key, data):
        with locked(self, fcntl.LOCK_EX):
            return save(self, key, data)

    def locked_load(self, key):
        with locked(self, fcntl.LOCK_SH):
            return load(self, key)

    cls.save, cls.load = locked_save, locked_load
    cls._powerinfer_locked = True


COMPILE_WAIT_S = 1800  # longest wait for another process's compile before compiling anyway


def serialize_compiles() -> None:
    """Wrap numba's `Dispatcher.compile` for cached kernels in a POSIX file lock per (kernel,
    signature) in the kernel's cache folder, so one process compiles it and a process asking
    meanwhile waits, then loads it from the cache (numba looks there first). No deadlock: a
    compile waits only for the kernels it calls, and calls do not form cycles; a wait is
    still bounded by COMPILE_WAIT_S. Without fcntl, or where numba's class has changed
    shape, nothing is wrapped."""
    try:
        import fcntl

        from numba.core.dispatcher import Dispatcher
    except ImportError:
        return
    if getattr(Dispatcher, "_powerinfer_serialized", False) or not hasattr(Dispatcher, "compile"):
        return
    compile_ = Dispatcher.compile

    def lock_path(dispatcher, sig) -> str | None:
        cache = getattr(dispatcher, "_cache", None)
        folder = getattr(cache, "cache_path", None)
        if not folder:
            return None
        fn = dispatcher.py_func
        key = f"{fn.__module__}.{fn.__qualname__}:{sig}".encode()
        return os.path.join(folder, f"compile-{hashlib.sha1(key).hexdigest()[:16]}.lock")

    def locked_compile(self, sig):
        try:
            path = lock_path(self, sig)
            f = open(path, "ab") if path else None
        except (OSError, TypeError, ValueError):
            f = None
        if f is None:
            return compile_(self, sig)
        with f:
            deadline = time.monotonic() + COMPILE_WAIT_S
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        return compile_(self, sig)
                    time.sleep(0.1)
            try:
                return compile_(self, sig)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    Dispatcher.compile = locked_compile
    Dispatcher._powerinfer_serialized = True
