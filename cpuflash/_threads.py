"""Pick a Numba threading layer that survives threads and fork.

Numba's `workqueue` layer aborts the process when two Python threads launch a parallel kernel at
once, and GNU OpenMP (`omp`) breaks in a child process forked after the parent used it. oneTBB
is safe for both, so cpuflash depends on the `tbb` package and asks Numba for it, unless the user
chose a layer with NUMBA_THREADING_LAYER. This must run before the first parallel kernel of the
process launches Numba's thread pool, so it runs when cpuflash is imported.
"""

import importlib.metadata
import os

import numba


def choose_threading_layer():
    """Ask Numba for the `tbb` layer when it is installed and nobody chose another one."""
    if "NUMBA_THREADING_LAYER" in os.environ:
        return
    try:
        importlib.metadata.version("tbb")
    except importlib.metadata.PackageNotFoundError:
        return  # no oneTBB wheel for this platform: Numba's default, see README's FAQ
    numba.config.THREADING_LAYER = "tbb"


def threading_layer():
    """The layer Numba uses (or will use at the first parallel call)."""
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        return f"{numba.config.THREADING_LAYER} (not started)"
