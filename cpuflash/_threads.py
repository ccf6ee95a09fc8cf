"""Pick a Numba threading layer that survives threads and fork.

Numba's `workqueue` layer aborts the process when two Python threads launch a parallel kernel at
once, and GNU OpenMP (`omp`) breaks in a child process forked after the parent used it. oneTBB
is safe for both, so cpuflash depends on the `tbb` wheel and asks Numba for it, unless the user
chose a layer with NUMBA_THREADING_LAYER.

The wheel installs `libtbb.so.12` into `<prefix>/lib`, which Numba's TBB extension only finds
when that directory is on its runpath: true of a conda or system interpreter, not of a virtual
environment or a `pip install --user`. So the library is loaded here, by the path the wheel's
file list gives; the dynamic loader then resolves Numba's reference to it by its soname.

Where oneTBB cannot be loaded, the layer is `workqueue` and every parallel launch takes one
process-wide lock (`SERIALIZED`): calls from several Python threads then run one at a time
instead of aborting, and forked children keep working. One warning says so.

This must run before the first parallel kernel of the process launches Numba's thread pool, so
it runs when cpuflash is imported.

Where torch is imported before cpuflash's first kernel, the layer is Numba's GNU OpenMP one
instead (`settle_layer`, at import or at the first call). Numba's OpenMP extension then binds to
the GNU OpenMP runtime torch loaded (the first `GOMP_*` symbols in the process): cpuflash's
kernels run on torch's own worker threads, one pool for both libraries, where oneTBB's workers
would sleep beside torch's spinning ones and be woken at every call (attention calls between
torch matmuls, and transformers models, ran faster so: docs/history.md, "Two thread pools: TBB
or OpenMP").
Numba stops a forked child that launches a parallel kernel after its parent used GNU OpenMP, so
a child forked after a cpuflash call runs each kernel's one-thread build (`FORKED_AFTER_OPENMP`,
`_jit.Kernel`).
"""

import ctypes
import importlib.metadata
import importlib.util
import os
import sys
import threading
import warnings

import numba
from numba.np.ufunc import parallel as _numba_parallel

TBB_SONAME = {"linux": "libtbb.so.12", "win32": "tbb12.dll", "darwin": "libtbb.12.dylib"}
LAUNCH_LOCK = threading.Lock()
SERIALIZED = False  # True when parallel launches must hold LAUNCH_LOCK (workqueue fallback)
FORKED_AFTER_OPENMP = False  # True in a child forked after GNU OpenMP ran a kernel
SETTLED = False  # whether `settle_layer` has run
_chosen_by_user = "NUMBA_THREADING_LAYER" in os.environ


def choose_threading_layer():
    """Load oneTBB and ask Numba for it; else fall back to a serialized `workqueue` layer."""
    global SERIALIZED
    problem = load_tbb()
    if "NUMBA_THREADING_LAYER" in os.environ:
        return  # the user's choice, and the user's guarantees
    if problem is None:
        numba.config.THREADING_LAYER = "tbb"
        if "torch" in sys.modules:
            settle_layer()
        return
    numba.config.THREADING_LAYER = "workqueue"
    SERIALIZED = True
    warnings.warn(
        f"cpuflash: oneTBB could not be loaded ({problem}); using Numba's 'workqueue' threading "
        "layer, so calls from several Python threads run one at a time. "
        "`pip install tbb` restores concurrent calls.", RuntimeWarning, stacklevel=2)


def settle_layer():
    """Numba's GNU OpenMP layer where torch is imported (see the module's notes) and that layer
    loads, unless the user chose a layer or Numba's threads have started; once, at import if
    torch is there, else at the first public call (before `numba.get_num_threads`, which
    starts the threads)."""
    global SETTLED, SERIALIZED
    if SETTLED:
        return
    SETTLED = True
    if _chosen_by_user or "torch" not in sys.modules or _started_layer() is not None:
        return
    if importlib.util.find_spec("numba.np.ufunc.omppool") is None:
        return
    try:
        importlib.import_module("numba.np.ufunc.omppool")  # needs the system's libgomp
    except (ImportError, OSError):
        return
    numba.config.THREADING_LAYER = "omp"
    SERIALIZED = False  # (GNU OpenMP takes launches from several threads at once)


def thread_count():
    """`numba.get_num_threads()`, which takes Numba's two start-up locks on every call (a
    noticeable share of a short decoding call); once the threads are up, Numba's own getter
    behind it gives the same number for a fraction of that (measured: docs/history.md,
    "Per-call cost", decoding on the Xeon)."""
    if getattr(_numba_parallel, "_is_initialized", False):
        getter = getattr(_numba_parallel, "_get_num_threads", None)
        n = getter() if getter is not None else 0
        if n > 0:
            return n
    return numba.get_num_threads()


def _started_layer():
    """The layer Numba's threads run on, or None before they have started."""
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        return None


def _after_fork_in_child():
    global FORKED_AFTER_OPENMP
    if _started_layer() == "omp":
        FORKED_AFTER_OPENMP = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def load_tbb():
    """Load the `tbb` wheel's library into the process; None on success, else why not."""
    if importlib.util.find_spec("numba.np.ufunc.tbbpool") is None:
        return "this Numba build has no TBB layer"
    soname = TBB_SONAME.get(sys.platform)
    try:
        files = importlib.metadata.files("tbb")
    except importlib.metadata.PackageNotFoundError:
        return "the `tbb` package is not installed"
    paths = [f.locate() for f in files or () if f.name == soname]
    if not paths:
        return f"the `tbb` package has no {soname}"
    try:
        ctypes.CDLL(str(paths[0]), mode=ctypes.RTLD_GLOBAL)
    except OSError as error:
        return str(error)
    return None


def threading_layer():
    """The layer Numba uses (or will use at the first parallel call)."""
    return _started_layer() or f"{numba.config.THREADING_LAYER} (not started)"
