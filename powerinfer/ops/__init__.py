"""Named ops the models call; this package decides which backend runs them.

reference.py holds the plain-torch definitions (the oracle), cpu.py the numba kernels.
"""

from .kernel_cache import drop_stale_package_cache, lock_cache_files, serialize_compiles

# before any kernel is loaded from numba's cache (see kernel_cache.py)
drop_stale_package_cache()
lock_cache_files()
serialize_compiles()

import platform as _platform  # noqa: E402

from numba import config as _numba_config  # noqa: E402

# a named x86-64 target (not the host, which has F16C wherever these kernels run well) may
# lack F16C: numba_half.py
if _platform.machine().lower() in ("x86_64", "amd64") and _numba_config.CPU_NAME not in (None, "host"):
    from .numba_half import provide_half_libcalls

    provide_half_libcalls()
