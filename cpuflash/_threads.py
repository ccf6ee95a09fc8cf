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
"""

import ctypes
import importlib.metadata
import importlib.util
import os
import sys
import threading
import warnings

import numba

TBB_SONAME = {"linux": "libtbb.so.12", "win32": "tbb12.dll", "darwin": "libtbb.12.dylib"}
LAUNCH_LOCK = threading.Lock()
SERIALIZED = False  # True when parallel launches must hold LAUNCH_LOCK (workqueue fallback)


def choose_threading_layer():
    """Load oneTBB and ask Numba for it; else fall back to a serialized `workqueue` layer."""
    global SERIALIZED
    problem = load_tbb()
    if "NUMBA_THREADING_LAYER" in os.environ:
        return  # the user's choice, and the user's guarantees
    if problem is None:
        numba.config.THREADING_LAYER = "tbb"
        return
    numba.config.THREADING_LAYER = "workqueue"
    SERIALIZED = True
    warnings.warn(
        f"cpuflash: oneTBB could not be loaded ({problem}); using Numba's 'workqueue' threading "
        "layer, so calls from several Python threads run one at a time. "
        "`pip install tbb` restores concurrent calls.", RuntimeWarning, stacklevel=2)


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
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        return f"{numba.config.THREADING_LAYER} (not started)"
