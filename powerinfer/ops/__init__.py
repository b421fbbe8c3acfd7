"""Named ops the models call; this package decides which backend runs them.

reference.py holds the plain-torch definitions (the oracle), cpu.py the numba kernels.
"""
