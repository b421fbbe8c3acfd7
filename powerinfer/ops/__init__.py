"""Named ops the models call; this package decides which backend runs them.

reference.py holds the plain-torch definitions (the oracle), cpu.py the numba kernels.
"""

from .kernel_cache import drop_stale_package_cache, lock_cache_files, serialize_compiles

# before any kernel is loaded from numba's cache (see kernel_cache.py)
drop_stale_package_cache()
lock_cache_files()
serialize_compiles()

from numba import config as _numba_config  # noqa: E402

if _numba_config.CPU_NAME not in (None, "host"):  # a named target may lack F16C: numba_half.py
    from .numba_half import provide_half_libcalls, target_may_lack_f16c

    if target_may_lack_f16c():
        provide_half_libcalls()
