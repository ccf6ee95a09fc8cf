"""The one place that sets Numba options.

Kernels are compiled for arrays of any strides (layout ``"A"``) with explicit signatures, so a
C-contiguous, a transposed and a read-only input all run the same machine code: the on-disk
cache holds one entry per dtype and the first call stays fast. Compilation is lazy (on the first
call with a given dtype) so that importing cpuflash costs nothing.
"""

import contextlib
import functools
import hashlib
import itertools
import os
import pathlib
import stat
import sys
import tempfile
import threading
import types as pytypes
import warnings

import numba
import numpy as np
from numba import types
from numba.core import caching, compiler

from . import _codegen, _threads

# `fastmath=True` would add `nnan`/`ninf`, letting LLVM assume no infinity exists: the kernels
# mask scores with -inf, so only the flags that keep IEEE infinities are allowed. `reassoc` is
# left out too: it lets LLVM split a sum into partial sums differently in the 6-row and the
# 1-row micro-kernels, and then a row's bits would depend on the tile it fell in (so on the
# thread count). The SIMD code is explicit, so reassociation buys nothing.
FASTMATH = {"nsz", "arcp", "contract", "afn"}

_PACKAGE_DIR = str(pathlib.Path(__file__).resolve().parent)
_KERNEL_SOURCE = os.path.join(_PACKAGE_DIR, "kernels", "forward.py")


@functools.cache
def cache_dir_for(py_file):
    """(folder, why) where the compiled code of functions in `py_file` is cached, or
    (None, why) when there is no folder fit for it: the first of

    * ``NUMBA_CACHE_DIR`` (the user's choice), when writable;
    * the ``__pycache__`` next to the source (an editable or user-owned install);
    * Numba's per-user cache folder (a read-only install);
    * ``<tmp>/cpuflash-<uid>``, only if it is this user's own and nobody else can write to it.

    A cache entry is machine code and its index a pickle: whoever can write to the folder can
    run code as the user who loads it. The first three are the user's own (or root's); the
    temporary folder is shared by every user, so it is created private and checked.
    """
    subpath = caching._CacheLocator.get_suitable_cache_subpath(py_file)
    candidates = [(os.path.join(os.path.dirname(py_file), "__pycache__"),
                   "next to the source, in the package's __pycache__"),
                  (os.path.join(_user_cache_root(), subpath),
                   "Numba's per-user cache folder (the package's __pycache__ is not writable)")]
    if numba.config.CACHE_DIR:
        candidates.insert(0, (os.path.join(numba.config.CACHE_DIR, subpath), "NUMBA_CACHE_DIR"))
    for path, why in candidates:
        if _writable(path):
            return path, why
    private = _private_temp_root()
    if private is not None and _writable(os.path.join(private, subpath)):
        return (os.path.join(private, subpath),
                "a private temporary folder (no user cache folder is writable)")
    return None, "none fit: kernels compile in memory, in every process"


def _private_temp_root():
    """``<tmp>/cpuflash-<uid>``, created 0700, if it is ours and closed to others; else None."""
    if not hasattr(os, "getuid"):
        return None  # Windows: the per-user folder is under the user's profile
    root = os.path.join(tempfile.gettempdir(), f"cpuflash-{os.getuid()}")
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    return root if is_private_dir(root) else None


def is_private_dir(path):
    """Whether `path` is a real folder (no link), owned by this user, that only it can write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


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


def cache_location():
    """(folder, why) of the kernels' cache; folder is None when they compile in memory."""
    return cache_dir_for(_KERNEL_SOURCE)


CACHING = cache_location()[0] is not None
if not CACHING:
    warnings.warn("cpuflash: no private, writable folder for compiled kernels (the package's "
                  "__pycache__, Numba's per-user cache folder and a private temporary folder "
                  "were tried): kernels are compiled again in every process. Set "
                  "NUMBA_CACHE_DIR to a folder of your own to keep them.", RuntimeWarning)

_codegen.install()  # kernels emitted once, not at every level of their call chain

OPTIONS = dict(cache=CACHING, nogil=True, error_model="numpy", boundscheck=False,
               fastmath=FASTMATH)


class HelperCompiler(compiler.CompilerBase):
    """Numba's nopython pipeline with less to do for the helpers, which are loops over explicit
    indices: no SSA form, and none of the passes for the lifting of ``with`` blocks, the
    inlining of closures and comprehensions, and the rewrites after typing (which fuse array
    expressions and index by string constants).

    Numba runs every pass over every function it compiles, and a kernel's chain holds 60-80
    of them: these took a noticeable share of a cold forward compile (measured:
    docs/history.md, "Compile time", a shorter pipeline for helpers). Without SSA form a
    variable keeps one type in the whole function (as in Numba before 0.50), so each helper
    gives each of its variables one type (`tests/test_helper_compiler.py` checks it), and the
    kernels' outputs came out bit-identical. A helper written with a closure or a
    comprehension fails to compile; an array expression (``a + b`` on arrays) compiles unfused.
    The kernels (`Kernel`) keep Numba's own pipeline, which their parallel loops need.
    """

    # (by name: a Numba release without one of them compiles with the rest)
    _LEFT_OUT = {"WithLifting", "InlineClosureLikes", "NopythonRewrites"}

    def define_pipelines(self):
        self.state.flags.enable_ssa = False  # (this compile's own flags)
        full = compiler.DefaultPassBuilder.define_nopython_pipeline(self.state)
        pipeline = compiler.PassManager(full.pipeline_name)
        for pass_class, description in full.passes:
            if pass_class.__name__ not in self._LEFT_OUT:
                pipeline.add_pass(pass_class, description)
        pipeline.finalize()
        return [pipeline]


# Helpers and overloads are only called from compiled code: no wrappers for Python callers (a
# helper's wrappers cost about as much to compile as a small helper)
_NO_WRAPPERS = dict(no_cpython_wrapper=True, no_cfunc_wrapper=True,
                    pipeline_class=HelperCompiler)
HELPER_OPTIONS = dict(OPTIONS, **_NO_WRAPPERS)
STRICT_OPTIONS = dict(cache=CACHING, **_NO_WRAPPERS)  # no fastmath flags (IEEE conversions)


class _PackageCacheLocator(caching.InTreeCacheLocator):
    """Numba cache entries of cpuflash functions, in `cache_dir_for`'s folder, stamped with all
    of the kernels' sources.

    Numba stamps a cached function with its own file only, but a kernel has the code of the
    helpers it calls (other files) compiled into it: after an edit or an upgrade of
    `_steps.py` alone, `forward.py`'s cached kernel would still run the old micro-kernels.
    Stamping every entry with a hash of all the sources that kernels are compiled from
    (`kernels/`, `_simd.py`, this file) and the Numba version makes any change to them
    invalidate every entry, wherever it is stored.
    """

    def __init__(self, py_func, py_file):
        super().__init__(py_func, py_file)
        # (a source folder without a fit folder of its own shares the kernels' one)
        self._cache_path = cache_dir_for(py_file)[0] or cache_location()[0]
        _LOCKED_FOLDERS.add(self._cache_path)

    def get_source_stamp(self):
        return _package_stamp()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not os.path.abspath(py_file).startswith(_PACKAGE_DIR + os.sep):
            return None  # not ours: Numba's own locators
        return cls(py_func, py_file)


class _LockedCacheFile(caching.IndexDataCacheFile):
    """Numba's index and data files of one function's cache entries, whose entries are saved
    under a file lock in cpuflash's cache folders.

    Numba saves an entry by reading the index, adding the entry and writing the index back,
    unlocked: two processes that compile two signatures of one kernel at once (test workers,
    MPI ranks or data-loader workers on a cold cache) can each drop the other's entry, and
    both can take the same data file, leaving an index entry that names the other signature's
    machine code (numba#10128). Under the lock entries are added one at a time, and the data
    is written before the index names it.
    """

    def save(self, key, data):
        if self._cache_path not in _LOCKED_FOLDERS:
            return super().save(key, data)
        with _folder_lock(self._cache_path):
            overloads = self._load_index()
            name = overloads.get(key)
            if name is None:
                taken = set(overloads.values())
                name = next(n for n in map(self._data_name, itertools.count(1))
                            if n not in taken)
            self._save_data(name, data)
            if overloads.get(key) != name:
                overloads[key] = name
                self._save_index(overloads)


_LOCKED_FOLDERS = set()  # the folders `_PackageCacheLocator` stores entries in


@contextlib.contextmanager
def _folder_lock(folder):
    """An exclusive lock on `folder`'s cache entries between processes (POSIX `flock` on a
    file in it); no lock where there is no `fcntl` or the file cannot be opened."""
    try:
        import fcntl

        handle = open(os.path.join(folder, "cpuflash-cache.lock"), "a")
    except (ImportError, OSError):
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed
        yield


caching.IndexDataCacheFile = _LockedCacheFile  # read by Numba's `Cache` as it is created


# the files whose code is compiled into kernels (what the stamp must cover)
_COMPILED_SOURCES = [pathlib.Path(_PACKAGE_DIR, name)
                     for name in ("_jit.py", "_simd.py", "_amx.py", "_combine.py")]
_COMPILED_SOURCES += pathlib.Path(_PACKAGE_DIR, "kernels").glob("*.py")
_stamp = None


def _package_stamp():
    global _stamp
    if _stamp is None:
        from . import _amx, _simd  # (imports this module: not at the top)

        # the bfloat16 routes are chosen in Python, not by the target Numba keys entries by
        digest = hashlib.sha256(
            f"{numba.__version__} bf16-dot={_simd.BF16_DOT} amx={_amx.TILES}".encode())
        for path in sorted(_COMPILED_SOURCES):
            digest.update(path.relative_to(_PACKAGE_DIR).as_posix().encode())
            digest.update(path.read_bytes())
        _stamp = digest.hexdigest()
    return _stamp


# first in line: used for cpuflash's files, declines every other file
_impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # renamed in Numba 0.6x
if _PackageCacheLocator not in _impl._locator_classes:
    _impl._locator_classes.insert(0, _PackageCacheLocator)


class _PackageCacheImpl(caching.CompileResultCacheImpl):
    """Numba's cache entries of compiled functions, without the typed source of cpuflash's.

    With each entry Numba stores the function's source annotated with every variable's type
    (for `inspect_types()`); rendering it for the 60-80 functions of a kernel's chain took a
    small share of a cold forward compile (measured: docs/history.md, "Compile time"). Nobody
    inspects the kernels' helpers through the cache.
    """

    def reduce(self, cres):
        if isinstance(self.locator, _PackageCacheLocator):
            cres = cres._replace(type_annotation="(not cached by cpuflash)")
        return super().reduce(cres)


caching.FunctionCache._impl_class = _PackageCacheImpl  # read as each function's cache is made


def jit(func):
    """`numba.njit` with the project's options, for helpers called from kernels."""
    return numba.njit(**HELPER_OPTIONS)(func)


def jit_borrowing(func, cache=CACHING):
    """`jit` without reference counting, for a hot helper that only reads and writes arrays its
    caller holds (it allocates none and returns none): the atomic increments and decrements of
    every array passed from call to call otherwise cost as much as a short helper's work."""
    return numba.njit(_nrt=False, **dict(HELPER_OPTIONS, cache=cache))(func)


def jit_borrowing_any_constants(func, cache=CACHING):
    """`jit_borrowing`, one specialization for any constants (`without_literals`): the
    decoding kernel's hot helpers."""
    return without_literals(jit_borrowing(func, cache=cache))


def without_literals(dispatcher):
    """`dispatcher`, compiled for the plain types of constant arguments.

    Called from compiled code with a constant (``f(x, 0)``, ``f(x, 2 * LANES)``), a Numba
    dispatcher compiles for its literal type (``Literal[int](0)``): one specialization per
    constant, each typed, optimized, emitted and cached on its own (six of one decoding helper,
    whose calls differ by a constant offset). LLVM inlines the small helpers and propagates the
    constants all the same. Not for every helper: a literal also lets Numba drop the branches it
    decides, and the forward and backward compiled slower without, where the decoding kernel
    compiled faster (measured, cold: docs/history.md, "Compile time").
    """
    typed = dispatcher.get_call_template

    def get_call_template(args, kws):
        return typed(tuple(types.unliteral(a) for a in args),
                     {name: types.unliteral(a) for name, a in kws.items()})

    dispatcher.get_call_template = get_call_template
    return dispatcher


def array(dtype, ndim, readonly=False):
    """Numba type of an array of any strides."""
    return types.Array(numba.from_dtype(dtype), ndim, "A", readonly=readonly)


# Kernels called through their dispatchers, which check each argument's type against the
# signature (see `_entry_point`): for tests
CHECK_ARGUMENTS = os.environ.get("CPUFLASH_CHECK_KERNEL_ARGUMENTS", "") not in ("", "0")

# How often the notice's watcher asks the dispatcher whether it missed the cache
NOTICE_POLL = 0.05
_noticed = threading.Event()


def variant(func, suffix, **names):
    """A copy of the Python function `func` named ``func.__name__ + suffix`` (Numba keys its
    cache entries by name) that sees `names` in place of its module's globals of those names.

    Numba reads a global as a constant when it compiles, and never compiles a branch on one
    that its value rules out: a variant with a flag set is a function with less to compile.
    Its globals are a copy of the module's as they are when it is made.
    """
    copy = pytypes.FunctionType(func.__code__, dict(func.__globals__, **names),
                                func.__name__ + suffix, func.__defaults__, func.__closure__)
    copy.__qualname__ = func.__qualname__ + suffix
    copy.__module__, copy.__doc__ = func.__module__, func.__doc__
    return copy


class Kernel:
    """A parallel kernel compiled once per signature key, on first use.

    `signature(key)` returns the Numba signature for a key (a dtype, say); each key gets its own
    dispatcher, compiled for exactly that signature with compilation then disabled, so arrays
    of other layouts are converted to ``"A"`` instead of triggering new specializations.
    `name` says what the kernel is, in the one line that tells the user a compile is under way
    (once per process); None for a kernel that compiles in under a second, which says nothing
    (it must not take the line from a kernel compiled after it).
    `fastmath`: the flags of `OPTIONS`, or False for IEEE arithmetic throughout (under the
    flags a division may become a multiply by the reciprocal, even one of a helper compiled
    without them once it is inlined).
    """

    def __init__(self, pyfunc, signature, name, parallel=True, fastmath=FASTMATH):
        self._pyfunc = pyfunc
        self._signature = signature
        self._parallel = parallel
        self._fastmath = fastmath
        self._dispatchers = {}  # key -> its dispatcher
        self._calls = {}  # key -> what `specialize` returns
        self._by_identity = {}  # ids of a key's objects -> (key, what `specialize` returns)
        self._lock = threading.Lock()
        self._serial = None  # `_one_thread`'s kernel
        self.name = name
        self.__doc__ = pyfunc.__doc__
        self.__name__ = pyfunc.__name__

    def specialize(self, key):
        """The compiled kernel for `key` (compiling or loading it from the cache once), as a
        function of the signature's arguments."""
        if _threads.FORKED_AFTER_OPENMP and self._parallel:
            return self._one_thread().specialize(key)
        # Hashing a key that holds a Numba type (the user's functions' type) costs a noticeable
        # share of a short decoding call (docs/history.md, "Per-call cost", Numba's
        # dispatcher); the objects of a key are mostly the very same from call to call
        # (dtypes and Numba types are interned), so they are looked up by identity first. An
        # entry keeps its key's objects alive: their ids stay theirs.
        identity = tuple(map(id, key)) if type(key) is tuple else id(key)
        known = self._by_identity.get(identity)
        if known is not None:
            return known[1]
        call = self._calls.get(key)
        if call is None:
            with self._lock:
                call = self._calls.get(key)
                if call is None:
                    dispatcher = self._compile(key)
                    self._dispatchers[key] = dispatcher
                    call = (_type_checked(dispatcher) if CHECK_ARGUMENTS
                            else _entry_point(dispatcher))
                    if _threads.SERIALIZED and self._parallel:
                        call = _serialized(call)
                    self._calls[key] = call
        self._by_identity[identity] = (key, call)
        return call

    def _one_thread(self):
        """This kernel compiled without `parallel` (each `prange` a plain loop; the same bits),
        for a child forked after GNU OpenMP ran a kernel (`_threads`). Its function is a copy
        under another name: Numba's cache keys do not hold the `parallel` flag, and the name
        gives the copy cache entries of its own."""
        with self._lock:
            if self._serial is None:
                self._serial = Kernel(variant(self._pyfunc, "_on_one_thread"), self._signature,
                                      self.name, parallel=False, fastmath=self._fastmath)
            return self._serial

    def _compile(self, key):
        """What ``numba.njit(sig)`` does, with a watcher that tells the user once the
        dispatcher has missed the cache: a compile, never a load, however slow the load."""
        # (no cfunc wrapper: only the Python entry is called)
        dispatcher = numba.njit(parallel=self._parallel, no_cfunc_wrapper=True,
                                **dict(OPTIONS, fastmath=self._fastmath))(self._pyfunc)  # lazy
        done = threading.Event()
        if self.name is not None:
            threading.Thread(target=_notice_on_compile, args=(dispatcher, done, self.name, key),
                             daemon=True).start()
        try:
            with _codegen.deferred():
                dispatcher.compile(self._signature(key))
        finally:
            done.set()
        dispatcher.disable_compile()
        return dispatcher


def _entry_point(dispatcher):
    """The machine code's own Python entry of a dispatcher compiled for one signature.

    Calling the dispatcher types every argument first, and an argument that is a tuple (the
    kernels' `mods`) is typed element by element in Python, which cost more than a small
    call's whole work. The entry point converts the arguments by its one signature, for a
    small fraction of that (measured: docs/history.md, "Per-call cost", Numba's
    dispatcher). It refuses an array of another dtype or a tuple of another length,
    but not an array of another number of dimensions: every caller passes arrays the
    validation built, and the test suite runs with `CHECK_ARGUMENTS` too.
    """
    [compiled] = dispatcher.overloads.values()
    return compiled.entry_point


def _type_checked(dispatcher):
    """The entry point of `dispatcher` (compiled for one signature), called only after each
    argument's whole type is found to convert to the signature's: what calling the dispatcher
    checks, for named tuples too (Numba converts only anonymous ones)."""
    [signature] = dispatcher.signatures
    typing = dispatcher.typingctx
    entry = _entry_point(dispatcher)

    def fits(got, want):
        if isinstance(want, types.BaseNamedTuple):
            return (isinstance(got, types.BaseNamedTuple)
                    and got.instance_class is want.instance_class and len(got) == len(want)
                    and all(map(fits, got, want)))
        return got == want or typing.can_convert(got, want) is not None

    def call(*args):
        for i, (arg, want) in enumerate(zip(args, signature, strict=True)):
            got = numba.typeof(arg)
            if not fits(got, want):
                raise TypeError(f"argument {i} of {dispatcher.py_func.__name__}: {got} where "
                                f"the signature has {want}")
        return entry(*args)
    call.checks_types = True
    return call


def _notice_on_compile(dispatcher, done, name, key):
    """Tell the user (`_tell_compiling`) if `dispatcher` compiles before `done` is set.

    Numba counts a cache miss just before it starts compiling (a load that fails counts one
    too, and is followed by a compile); a load from the cache counts none.
    """
    while not done.wait(NOTICE_POLL):
        if dispatcher.stats.cache_misses:
            _tell_compiling(name, key)
            return


# what a kernel's first compile takes on 2 cores, over the CPUs measured (docs/performance.md,
# "Compile time"): the compile notice, the README and docs/flex.md quote this one figure
COMPILE_TIME = "5-20 s"


# what a kernel's first dtype stands for where it is not the user's: half-precision inputs
# are read as their bits (one kernel serves both formats)
_KERNEL_DTYPES = {"uint16": "float16/bfloat16"}


def _tell_compiling(name, key):
    """One line on stderr, once per process, unless CPUFLASH_QUIET is set."""
    if _noticed.is_set() or os.environ.get("CPUFLASH_QUIET", "") not in ("", "0"):
        return
    _noticed.set()
    dtype = np.dtype(key[0] if isinstance(key, tuple) else key).name
    dtype = _KERNEL_DTYPES.get(dtype, dtype)
    where = cache_location()[0]
    kept = f"cached in {where}" if where else "not cached: no fit folder, see the README's FAQ"
    print(f"cpuflash: compiling the {dtype} {name} kernel ({COMPILE_TIME} a kernel on 2 cores, "
          f"by CPU), once per cache folder ({kept}; CPUFLASH_QUIET=1 hides this line)",
          file=sys.stderr, flush=True)


def _serialized(dispatcher):
    """`dispatcher`, launched under the process-wide lock (the `workqueue` layer's fallback)."""
    @functools.wraps(dispatcher)
    def launch(*args):
        with _threads.LAUNCH_LOCK:
            return dispatcher(*args)
    return launch
