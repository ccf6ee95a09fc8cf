"""The one place that sets Numba options.

Kernels are compiled for arrays of any strides (layout ``"A"``) with explicit signatures, so a
C-contiguous, a transposed and a read-only input all run the same machine code: the on-disk
cache holds one entry per dtype and the first call stays fast. Compilation is lazy (on the first
call with a given dtype) so that importing cpuflash costs nothing.
"""

import threading

import numba
from numba import types

# `fastmath=True` would add `nnan`/`ninf`, letting LLVM assume no infinity exists: the kernels
# mask scores with -inf, so only the flags that keep IEEE infinities are allowed.
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

OPTIONS = dict(cache=True, nogil=True, error_model="numpy", boundscheck=False, fastmath=FASTMATH)


def jit(func):
    """`numba.njit` with the project's options, for helpers called from kernels."""
    return numba.njit(**OPTIONS)(func)


def array(dtype, ndim, readonly=False):
    """Numba type of an array of any strides."""
    return types.Array(numba.from_dtype(dtype), ndim, "A", readonly=readonly)


class Kernel:
    """A parallel kernel compiled once per signature key, on first use.

    `signature(key)` returns the Numba signature for a key (a dtype, say); each key gets its own
    dispatcher, compiled for exactly that signature with compilation then disabled, so arrays
    of other layouts are converted to ``"A"`` instead of triggering new specializations.
    """

    def __init__(self, pyfunc, signature, parallel=True):
        self._pyfunc = pyfunc
        self._signature = signature
        self._parallel = parallel
        self._dispatchers = {}
        self._lock = threading.Lock()
        self.__doc__ = pyfunc.__doc__
        self.__name__ = pyfunc.__name__

    def specialize(self, key):
        """The compiled dispatcher for `key` (compiling or loading it from the cache once)."""
        dispatcher = self._dispatchers.get(key)
        if dispatcher is None:
            with self._lock:
                dispatcher = self._dispatchers.get(key)
                if dispatcher is None:
                    sig = self._signature(key)
                    dispatcher = numba.njit(sig, parallel=self._parallel, **OPTIONS)(self._pyfunc)
                    self._dispatchers[key] = dispatcher
        return dispatcher
