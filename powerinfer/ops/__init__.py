"""Named ops the models call; this package decides which backend runs them.

reference.py holds the plain-torch definitions (the oracle), cpu.py the numba kernels.
"""

from .kernel_cache import drop_stale_package_cache, lock_cache_files, serialize_compiles

# before any kernel is loaded from numba's cache (see kernel_cache.py)
drop_stale_package_cache()
lock_cache_files()
serialize_compiles()
