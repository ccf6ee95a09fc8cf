"""Numba kernels; private. Each module is one kernel family."""
