"""The first call as a new user meets it: threading layer, compile notice, kernel cache folder.

What depends on how the interpreter was installed runs in a fresh interpreter with a clean
environment (no LD_LIBRARY_PATH, no NUMBA_* settings), from a folder outside the repository.
"""

import os
import stat
import subprocess
import sys
import textwrap
import threading
import time

import numba
import numpy as np
import pytest

from cpuflash import _jit, _threads

from helpers import clean_env, explain, run_python

FIRST_CALL = """
    import numba, numpy as np, cpuflash
    x = np.random.default_rng(0).standard_normal((1, 2, 50, 24)).astype(np.float32)
    out = cpuflash.attention(x, x, x, causal=True)
    print("layer", numba.threading_layer(), "finite", bool(np.isfinite(out).all()))
"""
FIRST_BACKWARD = """
    import numpy as np, cpuflash
    from cpuflash.kernels.backward import fa2_backward_plain
    x = np.random.default_rng(0).standard_normal((1, 2, 50, 24)).astype(np.float32)
    out, lse = cpuflash.attention(x, x, x, causal=True, return_lse=True)
    grads = cpuflash.attention_backward(x, x, x, out, out, lse, causal=True)
    [kernel] = fa2_backward_plain._dispatchers.values()
    print("loaded", bool(kernel.stats.cache_hits) and not kernel.stats.cache_misses)
"""

# calls with a modifier other than a causal mask or a window run the general kernels
MODIFIED_CALLS = """
    import numpy as np, cpuflash
    x = np.random.default_rng(0).standard_normal((1, 2, 50, 24)).astype(np.float32)
    out, lse = cpuflash.attention(x, x, x, softcap=20.0, return_lse=True)
    grads = cpuflash.attention_backward(x, x, x, out, out, lse, softcap=20.0)
    step = cpuflash.attention_with_kvcache(x[:, :, :1], x, x, softcap=20.0)
    print("finite", all(bool(np.isfinite(a).all()) for a in (out, grads[0], step)))
"""


def notices(stderr):
    return [line for line in stderr.splitlines() if line.startswith("cpuflash: compiling")]


@pytest.mark.slow
def test_first_parallel_call_in_this_interpreter_with_a_clean_environment(tmp_path):
    """oneTBB loads wherever pip put it (a venv's `lib`), with no LD_LIBRARY_PATH; a cold
    cache prints one notice on stderr, a warm one none. .ci/run runs the suite from a fresh
    venv, where Numba alone does not find the library."""
    env = clean_env(NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    cold = run_python(FIRST_CALL, env=env, cwd=str(tmp_path), timeout=600)
    assert cold.returncode == 0, explain(cold)
    assert "layer tbb finite True" in cold.stdout, explain(cold)
    assert "Warning" not in cold.stderr, explain(cold)
    lines = notices(cold.stderr)
    assert len(lines) == 1 and str(tmp_path / "cache") in lines[0], explain(cold)
    assert "float32" in lines[0] and "CPUFLASH_QUIET" in lines[0]

    warm = run_python(FIRST_CALL, env=env, cwd=str(tmp_path), timeout=600)
    assert warm.returncode == 0 and "layer tbb" in warm.stdout, explain(warm)
    assert warm.stderr == "", explain(warm)


@pytest.mark.slow
def test_warmup_fills_the_cache_that_a_later_process_uses(tmp_path):
    env = clean_env(NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    warmup = subprocess.run([sys.executable, "-m", "cpuflash", "warmup"], env=env,
                            cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert warmup.returncode == 0, explain(warmup)
    assert "float32   attention" in warmup.stdout and "KV-cache decoding" in warmup.stdout
    assert "float32   attention backward" in warmup.stdout, explain(warmup)
    assert "float32   attention modified" in warmup.stdout, explain(warmup)
    assert "float32   backward modified" in warmup.stdout, explain(warmup)
    assert str(tmp_path / "cache") in warmup.stdout, explain(warmup)
    assert notices(warmup.stderr) == [], "warmup says what it compiles itself"
    assert "float32   split merge" in warmup.stdout, explain(warmup)
    assert "float64" not in warmup.stdout, "only what the dtypes asked for (float32) is compiled"
    later = run_python(FIRST_CALL, env=env, cwd=str(tmp_path), timeout=600)
    assert later.returncode == 0 and later.stderr == "", explain(later)
    backward = run_python(FIRST_BACKWARD, env=env, cwd=str(tmp_path), timeout=600)
    assert backward.returncode == 0 and "loaded True" in backward.stdout, explain(backward)
    assert backward.stderr == "", explain(backward)
    modified = run_python(MODIFIED_CALLS, env=env, cwd=str(tmp_path), timeout=600)
    assert modified.returncode == 0 and "finite True" in modified.stdout, explain(modified)
    assert modified.stderr == "", explain(modified)
    split = run_python(SPLIT_DECODE, env=env, cwd=str(tmp_path), timeout=600)
    assert split.returncode == 0 and "merged True" in split.stdout, explain(split)
    assert split.stderr == "", explain(split)


# a decoding call whose keys are cut into splits: the decode kernel, then the split merge, which
# must come from the cache (a compile of it can take less than the notice's second)
SPLIT_DECODE = """
    import numpy as np, cpuflash
    from cpuflash import _combine
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 600, 8)).astype(np.float32)
    cpuflash.attention_with_kvcache(q, k, k, num_splits=3)
    merge = _combine._merge_kernel._dispatchers[np.dtype(np.float32)]
    print("merged", bool(merge.stats.cache_hits) and not merge.stats.cache_misses)
"""


@pytest.mark.slow
def test_warmup_names_the_dtypes_it_knows(tmp_path):
    done = subprocess.run([sys.executable, "-m", "cpuflash", "warmup", "--dtype", "int16"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "expected one of float32" in done.stderr, explain(done)
    assert "int8, float8_e4m3, int4 or all" in done.stderr, explain(done)


@pytest.mark.slow
def test_warmup_compiles_the_8_bit_cache_decoding_that_a_later_process_loads(tmp_path):
    env = clean_env(NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    warmup = subprocess.run([sys.executable, "-m", "cpuflash", "warmup", "--dtype", "int8"],
                            env=env, cwd=str(tmp_path), capture_output=True, text=True,
                            timeout=600)
    assert warmup.returncode == 0, explain(warmup)
    assert "int8      KV-cache decoding" in warmup.stdout, explain(warmup)
    assert "int8      decoding modified" in warmup.stdout, explain(warmup)
    assert notices(warmup.stderr) == [], explain(warmup)
    later = run_python(INT8_DECODE, env=env, cwd=str(tmp_path), timeout=600)
    assert later.returncode == 0 and "finite True" in later.stdout, explain(later)
    assert later.stderr == "", explain(later)


# float16 queries on an int8 cache with new keys: the kernel warmup compiled (one per format)
INT8_DECODE = """
    import numpy as np, cpuflash
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 1, 16)).astype(np.float16)
    cache = [cpuflash.quantize_kv(rng.standard_normal((2, 2, 50, 16)), "int8") for _ in "kv"]
    new = rng.standard_normal((2, 2, 1, 16)).astype(np.float16)
    out = cpuflash.attention_with_kvcache(q, *cache, k=new, v=new, cache_seqlens=[10, 40])
    print("finite", bool(np.isfinite(out).all()))
"""


WITHOUT_TBB = """
    import importlib.metadata, os, threading, warnings
    files = importlib.metadata.files
    def no_tbb(name):
        if name == "tbb":
            raise importlib.metadata.PackageNotFoundError(name)
        return files(name)
    importlib.metadata.files = no_tbb

    import numba, numpy as np, cpuflash
    x = np.random.default_rng(0).standard_normal((2, 3, 70, 16)).astype(np.float32)
    expected = cpuflash.attention(x, x, x).tobytes()
    got, barrier = [], threading.Barrier(4)
    def call():
        barrier.wait()
        for _ in range(20):
            got.append(cpuflash.attention(x, x, x).tobytes())
    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    pid = os.fork()
    if pid == 0:
        os._exit(0 if cpuflash.attention(x, x, x).tobytes() == expected else 3)
    child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print("layer", numba.threading_layer(), "same", got == [expected] * 80, "child", child)
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_without_tbb_threads_and_fork_still_work_with_one_warning(tmp_path):
    result = run_python(WITHOUT_TBB, env=clean_env(CPUFLASH_QUIET="1"), cwd=str(tmp_path),
                        timeout=600)
    assert result.returncode == 0, explain(result)
    assert "layer workqueue same True child 0" in result.stdout, explain(result)
    warned = [line for line in result.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 1 and "oneTBB could not be loaded" in warned[0], explain(result)
    assert "one at a time" in warned[0]


@pytest.mark.slow
def test_a_threading_layer_the_user_chose_is_kept(tmp_path):
    result = run_python("import numba, cpuflash; print(numba.config.THREADING_LAYER)",
                        env=clean_env(NUMBA_THREADING_LAYER="omp"), cwd=str(tmp_path))
    assert result.returncode == 0 and result.stdout.strip() == "omp", explain(result)


# -- the compile notice ---------------------------------------------------------------------------

def _tiny(x, out):
    out[0] = x[0] + 1.0


def _tiny_signature(dtype):
    return numba.void(_jit.array(dtype, 1), _jit.array(dtype, 1))


@pytest.fixture
def tiny_kernel(monkeypatch, tmp_path):
    """A kernel with a cold cache of its own, watched closely, and a fresh notice state."""
    monkeypatch.setattr(_jit, "NOTICE_POLL", 0.001)
    monkeypatch.setattr(_jit, "_noticed", threading.Event())
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))  # Numba's locator for tests/
    return _jit.Kernel(_tiny, _tiny_signature, "test", parallel=False)


def test_the_compile_notice_is_one_line_once_per_process(tiny_kernel, capsys, monkeypatch):
    monkeypatch.delenv("CPUFLASH_QUIET", raising=False)
    for dtype in (np.float32, np.float64):
        out = np.zeros(1, dtype)
        tiny_kernel.specialize(np.dtype(dtype))(np.ones(1, dtype), out)
        assert out[0] == 2.0
    lines = notices(capsys.readouterr().err)
    assert len(lines) == 1 and "float32 test kernel" in lines[0], lines


def test_a_slow_load_from_the_cache_gives_no_notice(tiny_kernel, capsys, monkeypatch):
    """The notice is for a compile: a load slower than the old one-second threshold (a busy
    machine, a slow disk) once printed it too."""
    from numba.core import caching

    monkeypatch.delenv("CPUFLASH_QUIET", raising=False)
    tiny_kernel.specialize(np.dtype(np.float32))  # compiles and saves
    capsys.readouterr()
    monkeypatch.setattr(_jit, "_noticed", threading.Event())
    load = caching.Cache.load_overload

    def slow_load(self, *args, **kwargs):
        time.sleep(1.2)  # past the one second after which a notice used to be printed
        return load(self, *args, **kwargs)

    monkeypatch.setattr(caching.Cache, "load_overload", slow_load)
    again = _jit.Kernel(_tiny, _tiny_signature, "test", parallel=False)
    again.specialize(np.dtype(np.float32))
    dispatcher = again._dispatchers[np.dtype(np.float32)]
    assert dispatcher.stats.cache_hits and not dispatcher.stats.cache_misses
    assert notices(capsys.readouterr().err) == []


@pytest.mark.parametrize("value", ["1", "yes"])
def test_cpuflash_quiet_hides_the_compile_notice(tiny_kernel, capsys, monkeypatch, value):
    monkeypatch.setenv("CPUFLASH_QUIET", value)
    tiny_kernel.specialize(np.dtype(np.float32))
    assert notices(capsys.readouterr().err) == []


# -- the kernel cache folder ----------------------------------------------------------------------

needs_posix = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """The temporary folder the cache falls back to, and the path of cpuflash's folder in it."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    return tmp_path / f"cpuflash-{os.getuid()}"


@needs_posix
def test_the_temporary_cache_folder_is_created_private(temp_root):
    assert _jit._private_temp_root() == str(temp_root)
    assert stat.S_IMODE(temp_root.stat().st_mode) == 0o700


@needs_posix
def test_a_world_writable_temporary_cache_folder_is_refused(temp_root):
    temp_root.mkdir()
    temp_root.chmod(0o777)
    assert _jit._private_temp_root() is None


@needs_posix
def test_a_group_writable_temporary_cache_folder_is_refused(temp_root):
    temp_root.mkdir()
    temp_root.chmod(0o770)
    assert _jit._private_temp_root() is None


@needs_posix
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="planting a folder owned by another user needs root")
def test_a_temporary_cache_folder_owned_by_another_user_is_refused(temp_root):
    temp_root.mkdir(mode=0o700)
    os.chown(temp_root, 4321, 4321)
    assert _jit._private_temp_root() is None


@needs_posix
def test_a_link_in_place_of_the_temporary_cache_folder_is_refused(temp_root, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    temp_root.symlink_to(target)
    assert _jit._private_temp_root() is None


@needs_posix
def test_with_no_fit_folder_kernels_are_not_cached(temp_root, monkeypatch):
    """Every user folder unwritable and a planted temporary folder: no folder at all."""
    temp_root.mkdir()
    temp_root.chmod(0o777)
    # the planted folder would be taken if only writability were asked
    monkeypatch.setattr(_jit, "_writable", lambda path: path.startswith(str(temp_root)))
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    folder, why = _jit.cache_dir_for.__wrapped__(_jit._KERNEL_SOURCE)
    assert folder is None and "in memory" in why


@needs_posix
def test_the_private_temporary_folder_is_the_last_resort(temp_root, monkeypatch):
    monkeypatch.setattr(_jit, "_writable", lambda path: path.startswith(str(temp_root)))
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    folder, why = _jit.cache_dir_for.__wrapped__(_jit._KERNEL_SOURCE)
    assert folder.startswith(str(temp_root) + os.sep) and "private" in why


def test_the_threading_layer_module_says_why_tbb_is_missing(monkeypatch):
    monkeypatch.setitem(_threads.TBB_SONAME, sys.platform, "no-such-library.so")
    assert "has no no-such-library.so" in _threads.load_tbb()


SAVE_ENTRIES = """
    import sys, time
    from numba.core import caching
    from cpuflash import _jit
    folder, writer, start = sys.argv[1], sys.argv[2], sys.argv[3]
    _jit._LOCKED_FOLDERS.add(folder)  # as `_PackageCacheLocator` adds the kernels' folder
    entries = caching.IndexDataCacheFile(folder, "kernel", "stamp")
    time.sleep(max(0.0, float(start) - time.time()))  # both begin together
    for i in range(60):
        entries.save((writer, i), ("machine code of", writer, i))
"""


def _save_at_once(folder):
    """Two processes saving 60 entries each into one function's cache at the same time; the
    entries that a later process then finds, as (writer, i) -> what it loads."""
    start = str(time.time() + 3.0)  # after both have imported cpuflash
    jobs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(SAVE_ENTRIES), str(folder),
                              writer, start],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for writer in "ab"]
    for job in jobs:
        _, err = job.communicate(timeout=120)
        assert job.returncode == 0, err
    entries = _jit._LockedCacheFile(str(folder), "kernel", "stamp")
    return {(w, i): entries.load((w, i)) for w in "ab" for i in range(60)}


def test_every_file_compiled_into_a_cached_kernel_is_in_the_cache_stamp():
    """A cached entry is valid while the stamp is: a file whose functions are compiled and
    cached but whose text the stamp leaves out would keep serving its old machine code."""
    import importlib
    import pkgutil

    import cpuflash

    stamped = {str(path) for path in _jit._COMPILED_SOURCES}
    compiled = set()
    for info in pkgutil.walk_packages(cpuflash.__path__, "cpuflash."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra's adapter (torch, jax, mpi4py)
            continue
        for value in vars(module).values():
            if isinstance(value, _jit.Kernel):
                compiled.add(value._pyfunc.__code__.co_filename)
            elif (isinstance(value, numba.core.registry.CPUDispatcher)
                  and value.targetoptions.get("cache")):
                compiled.add(value.py_func.__code__.co_filename)
    package = os.path.dirname(cpuflash.__file__)
    compiled = {name for name in compiled if name.startswith(package + os.sep)}
    assert any(name.endswith("_combine.py") for name in compiled), sorted(compiled)
    assert compiled <= stamped, f"not in the stamp: {sorted(compiled - stamped)}"


def test_cache_entries_saved_by_two_processes_at_once_are_all_kept(tmp_path):
    """Numba saves an entry by rewriting the function's index unlocked (numba#10128): two
    processes compiling two signatures of one kernel at once lose entries, or leave one naming
    the other's machine code. cpuflash's cache folders save under a lock."""
    found = _save_at_once(tmp_path)
    assert all(found[(w, i)] == ("machine code of", w, i) for w, i in found), found
