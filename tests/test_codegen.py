"""Code generation deferred to the kernel (`cpuflash._codegen`): a cold compile emits machine
code once, for the kernel, and what it caches works in later processes.

Each test runs a tiny parallel kernel with a helper in a fresh interpreter, with its own empty
Numba cache. The kernels' bits under the deferred scheme are the suite's other tests.
"""

import textwrap

import pytest

from cpuflash import _codegen

from helpers import clean_env, explain, last_json_line, run_python

checked = pytest.mark.skipif(not _codegen.SUPPORTED,
                             reason="a Numba release the deferral was not checked against")

TINY = """
    import numba
    import numpy as np
    from numba import prange, types

    from cpuflash import _jit


    @numba.njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True)
    def twice_plus_one(i):
        return 2 * i + 1


    def _body(x, out):
        for i in prange(x.shape[0]):
            out[i] = x[i] * twice_plus_one(i)


    def _signature(dtype):
        array = types.Array(numba.from_dtype(dtype), 1, "A")
        return types.void(array, array)


    KERNEL = _jit.Kernel(_body, _signature, "tiny")
"""

RUN = """
    import json, sys
    import numba
    import numpy as np
    from numba.core import codegen

    sys.path.insert(0, sys.argv[1])
    import tiny

    numba.njit(lambda: 1)()  # Numba's own runtime library emitted before counting
    emitted = []
    finalize = codegen.CPUCodeLibrary._finalize_final_module

    def counting(self):
        emitted.append(self.name)
        finalize(self)

    codegen.CPUCodeLibrary._finalize_final_module = counting
    dtype = np.dtype(sys.argv[2])
    x = np.arange(1000, dtype=dtype)
    out = np.empty_like(x)
    tiny.KERNEL.specialize(dtype)(x, out)
    helpers = tiny.twice_plus_one.overloads.values()  # (Numba types the index two ways)
    print(json.dumps(dict(
        right=bool(np.array_equal(out, x * (2 * np.arange(1000) + 1))),
        emitted=emitted,
        helpers_pending=[helper.library._pending for helper in helpers],
        helpers_loaded=sum(tiny.twice_plus_one.stats.cache_hits.values()),
        kernel_loaded=bool(tiny.KERNEL._dispatchers[dtype].stats.cache_hits))))
"""


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / "tiny.py").write_text(textwrap.dedent(TINY))
    return tmp_path


def _run(folder, dtype, cache):
    result = run_python(RUN, folder, dtype, env=clean_env(NUMBA_CACHE_DIR=str(cache)),
                        timeout=300)
    assert result.returncode == 0, explain(result)
    return last_json_line(result)


@checked
def test_a_cold_compile_emits_only_the_kernel(tiny):
    """The helper, the parallel loop's body and its two wrappers are linked into the kernel as
    IR; Numba alone emits each of the five on its own."""
    cold = _run(tiny, "float32", tiny / "cache")
    assert cold["right"], cold
    assert cold["emitted"] == ["_body"], cold
    assert cold["helpers_pending"] and all(cold["helpers_pending"]), cold


@checked
def test_what_a_cold_compile_caches_is_loaded_and_linked_by_later_processes(tiny):
    """The kernel comes back as machine code; the helper, cached as IR, is linked into a
    kernel of another dtype compiled in a later process."""
    cache = tiny / "cache"
    _run(tiny, "float32", cache)
    warm = _run(tiny, "float32", cache)
    assert warm["right"] and warm["kernel_loaded"], warm
    other = _run(tiny, "float64", cache)
    assert other["right"] and not other["kernel_loaded"], other
    assert other["helpers_loaded"] == len(other["helpers_pending"]) > 0, other
    assert all(other["helpers_pending"]) and other["emitted"] == ["_body"], other


@checked
def test_outside_a_kernel_numba_compiles_as_it_always_has(tmp_path):
    """A user's own Numba functions in the same process are emitted as Numba emits them."""
    result = run_python("""
        import numba
        import cpuflash

        @numba.njit(no_cpython_wrapper=True)
        def helper(x):
            return x + 1

        @numba.njit
        def caller(x):
            return helper(x) * 2

        assert caller(1) == 4
        [overload] = helper.overloads.values()
        print("pending", overload.library._pending)
    """, env=clean_env(NUMBA_CACHE_DIR=str(tmp_path / "cache")))
    assert result.returncode == 0, explain(result)
    assert "pending False" in result.stdout, explain(result)


def test_info_says_how_kernels_compile(monkeypatch):
    from cpuflash.__main__ import info_lines

    [line] = [x for x in info_lines() if x.startswith("compiling:")]
    assert ("emitted once, in the kernel" in line) == _codegen.SUPPORTED
    monkeypatch.setattr(_codegen, "SUPPORTED", False)
    [line] = [x for x in info_lines() if x.startswith("compiling:")]
    assert "Numba's own way" in line and "0.68" in line
