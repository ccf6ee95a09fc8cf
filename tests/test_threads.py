"""Calls from several Python threads at once, from a forked child and from a fork pool give the
serial bits and never hang, under oneTBB and, where torch is imported first, under GNU OpenMP
(a child forked after OpenMP ran a kernel runs the kernels' one-thread builds).

What forks runs in a fresh interpreter, so the pytest process itself never forks with live TBB
threads.
"""

import importlib.util
import subprocess
import sys
import threading

import pytest

from helpers import TESTS_DIR, assert_same_bits, explain, run_python
from workloads import workload


def test_calls_from_many_python_threads_at_once_give_the_serial_bits():
    calls = workload()
    expected = {name: call() for name, call in calls.items()}
    names = list(calls)
    n_threads, repeats = 8, 3
    barrier = threading.Barrier(n_threads)
    results, errors = {}, []

    def worker(t):
        try:
            barrier.wait(timeout=60)
            for r in range(repeats):
                for i in range(len(names)):
                    name = names[(t + i) % len(names)]  # threads start on different calls
                    results[t, r, name] = calls[name]()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((t, repr(exc)))

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not any(thread.is_alive() for thread in threads), "a thread hangs"
    assert not errors, errors
    assert len(results) == n_threads * repeats * len(names)
    for (t, r, name), got in results.items():
        assert_same_bits(got, expected[name], f"thread {t} repeat {r} {name}")


FORK_SCRIPT = """
    import os, sys, time
    if sys.argv[2] == "torch":
        import torch  # before cpuflash's first call: Numba's GNU OpenMP layer
    import numba
    sys.path.insert(0, sys.argv[1])
    from helpers import digest
    from workloads import workload

    def run_all():
        return {name: digest(call()) for name, call in workload().items()}

    run_all()  # the parent's thread pool is up (its workers live) before the fork, and
    parent = run_all()  # repeated calls have stored their plans, launches included
    print("layer", numba.threading_layer())
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.close(read_end)
            child = run_all()
            os.write(write_end, repr(sorted(child.items())).encode())
            code = 0 if child == parent else 4
        finally:
            os._exit(code)
    os.close(write_end)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hangs")
            sys.exit(5)
        time.sleep(0.05)
    reported = os.read(read_end, 1 << 20).decode()
    code = os.waitstatus_to_exitcode(status)
    print("child exit", code)
    if code != 0:
        print("parent", sorted(parent.items()))
        print("child ", reported)
        sys.exit(6)
    print("ok")
"""


LAYERS = [("numpy", "tbb"),
          pytest.param("torch", "omp", marks=pytest.mark.skipif(
              importlib.util.find_spec("torch") is None, reason="torch is not installed"))]


@pytest.mark.slow
@pytest.mark.parametrize("first, layer", LAYERS)
def test_kernels_work_in_a_forked_child(first, layer):
    result = run_python(FORK_SCRIPT, TESTS_DIR, first, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, explain(result)
    assert f"layer {layer}" in result.stdout, explain(result)


POOL_SCRIPT = """
import multiprocessing as mp
import sys
if sys.argv[1] == "torch":
    import torch  # Numba's GNU OpenMP layer
import numba
import numpy as np
import cpuflash

def call(seed):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, 3, 97, 32)).astype(np.float32) for _ in range(3))
    return cpuflash.attention(q, k, v, causal=True).tobytes()

if __name__ == "__main__":
    expected = [call(seed) for seed in range(4)]  # parent's threads live before the fork
    with mp.get_context("fork").Pool(2) as pool:
        got = pool.map_async(call, range(4)).get(timeout=120)
    assert got == expected, "pool results differ from the parent's"
    print("layer", numba.threading_layer(), "ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("first, layer", LAYERS)
def test_multiprocessing_fork_pool(tmp_path, first, layer):
    script = tmp_path / "pool.py"  # a file, so the pool's workers can find `call`
    script.write_text(POOL_SCRIPT)
    result = subprocess.run([sys.executable, str(script), first], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and f"layer {layer} ok" in result.stdout, explain(result)


THREADS_SCRIPT = """
    import sys, threading
    import torch  # Numba's GNU OpenMP layer
    import numba
    sys.path.insert(0, sys.argv[1])
    from helpers import digest
    from workloads import workload

    calls = workload()
    expected = {name: digest(call()) for name, call in calls.items()}
    barrier, got = threading.Barrier(4), []

    def worker(t):
        barrier.wait(timeout=60)
        for name in list(calls)[t:] + list(calls)[:t]:
            got.append((name, digest(calls[name]())))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert len(got) == 4 * len(calls) and all(d == expected[n] for n, d in got), got
    print("layer", numba.threading_layer(), "ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_many_python_threads_under_openmp():
    result = run_python(THREADS_SCRIPT, TESTS_DIR, timeout=300)
    assert result.returncode == 0 and "layer omp ok" in result.stdout, explain(result)
