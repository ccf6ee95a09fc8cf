"""Calls from several Python threads at once, from a forked child and from a fork pool give the
serial bits and never hang.

What forks runs in a fresh interpreter, so the pytest process itself never forks with live TBB
threads.
"""

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
    sys.path.insert(0, sys.argv[1])
    from helpers import digest
    from workloads import workload

    def run_all():
        return {name: digest(call()) for name, call in workload().items()}

    parent = run_all()  # the parent's thread pool is up (TBB workers live) before the fork
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


@pytest.mark.slow
def test_kernels_work_in_a_forked_child():
    result = run_python(FORK_SCRIPT, TESTS_DIR, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, explain(result)


POOL_SCRIPT = """
import multiprocessing as mp
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
    print("ok")
"""


@pytest.mark.slow
def test_multiprocessing_fork_pool(tmp_path):
    script = tmp_path / "pool.py"  # a file, so the pool's workers can find `call`
    script.write_text(POOL_SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, explain(result)
