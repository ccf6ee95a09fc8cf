"""The one place that sets Numba options.

Kernels are compiled for arrays of any strides (layout ``"A"``) with explicit signatures, so a
C-contiguous, a transposed and a read-only input all run the same machine code: the on-disk
cache holds one entry per dtype and the first call stays fast. Compilation is lazy (on the first
call with a given dtype) so that importing cpuflash costs nothing.
"""

import hashlib
import os
import pathlib
import tempfile
import threading

import numba
from numba import types
from numba.core import caching

# `fastmath=True` would add `nnan`/`ninf`, letting LLVM assume no infinity exists: the kernels
# mask scores with -inf, so only the flags that keep IEEE infinities are allowed. `reassoc` is
# left out too: it lets LLVM split a sum into partial sums differently in the 6-row and the
# 1-row micro-kernels, and then a row's bits depended on the tile it fell in (so on the thread
# count). The SIMD code is explicit, so reassociation bought nothing.
FASTMATH = {"nsz", "arcp", "contract", "afn"}

OPTIONS = dict(cache=True, nogil=True, error_model="numpy", boundscheck=False, fastmath=FASTMATH)


class _PackageCacheLocator(caching.InTreeCacheLocator):
    """Numba cache entries of cpuflash functions, stamped with all of the kernels' sources.

    Numba stamps a cached function with its own file only, but a kernel has the code of the
    helpers it calls (other files) compiled into it: after an edit or an upgrade of
    `_steps.py` alone, `forward.py`'s cached kernel would still run the old micro-kernels.
    Stamping every entry with a hash of all the sources that kernels are compiled from
    (`kernels/`, `_simd.py`, this file) and the Numba version makes any change to them
    invalidate every entry, wherever it is stored: `NUMBA_CACHE_DIR` if set,
    else the package's `__pycache__`, else (a read-only install) Numba's user-wide cache
    directory, else the temporary directory.
    """

    def __init__(self, py_func, py_file):
        super().__init__(py_func, py_file)
        subpath = self.get_suitable_cache_subpath(py_file)
        candidates = [self._cache_path, os.path.join(_user_cache_root(), subpath),
                      os.path.join(tempfile.gettempdir(), f"cpuflash-{os.getuid()}", subpath)]
        if numba.config.CACHE_DIR:
            candidates.insert(0, os.path.join(numba.config.CACHE_DIR, subpath))
        self._cache_path = next((c for c in candidates if _writable(c)), candidates[-1])

    def get_source_stamp(self):
        return _package_stamp()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not os.path.abspath(py_file).startswith(_PACKAGE_DIR + os.sep):
            return None  # not ours: Numba's own locators
        return cls(py_func, py_file)


_PACKAGE_DIR = str(pathlib.Path(__file__).resolve().parent)
# the files whose code is compiled into kernels (what the stamp must cover)
_COMPILED_SOURCES = [pathlib.Path(_PACKAGE_DIR, name) for name in ("_jit.py", "_simd.py")]
_COMPILED_SOURCES += pathlib.Path(_PACKAGE_DIR, "kernels").glob("*.py")
_stamp = None


def _package_stamp():
    global _stamp
    if _stamp is None:
        digest = hashlib.sha256(numba.__version__.encode())
        for path in sorted(_COMPILED_SOURCES):
            digest.update(path.relative_to(_PACKAGE_DIR).as_posix().encode())
            digest.update(path.read_bytes())
        _stamp = digest.hexdigest()
    return _stamp


def _writable(path):
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def _user_cache_root():
    from numba.misc.appdirs import AppDirs

    return AppDirs(appname="numba", appauthor=False).user_cache_dir


# first in line: used for cpuflash's files, declines every other file
_impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # renamed in Numba 0.6x
if _PackageCacheLocator not in _impl._locator_classes:
    _impl._locator_classes.insert(0, _PackageCacheLocator)


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
