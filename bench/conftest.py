"""Shared set-up of the pytest-benchmark suite.

Run ``python -m pytest bench`` for measurements (see pytest-benchmark's options, such as
``--benchmark-columns`` or ``--benchmark-json``); ``CPUFLASH_BENCH_SMALL=1 python -m pytest bench
--benchmark-disable`` is a quick smoke run on toy shapes, for CI. Each result carries its FLOP
count and GFLOP/s (from the best round) in ``extra_info``.

The FLOP counting, the inputs and the competing implementations come from `runner`
(``bench/runner.py``), so this suite and ``python -m cpuflash bench`` measure the same things the
same way.
"""

import os

import numba
import pytest

import cpuflash

import runner  # bench/runner.py

# Toy shapes instead of the real ones: CI checks that the suite runs, not how fast.
SMALL = os.environ.get("CPUFLASH_BENCH_SMALL") == "1"


def pytest_report_header(config):
    machine = cpuflash.cpu_info()
    mode = "small shapes (CPUFLASH_BENCH_SMALL=1)" if SMALL else "full shapes"
    return (f"cpuflash bench: {machine['model']}, {numba.get_num_threads()} Numba threads, "
            f"{mode}")


@pytest.fixture(scope="session", autouse=True)
def same_threads_for_torch():
    """torch gets as many threads as Numba, so no side has more cores."""
    runner.match_torch_threads()


@pytest.fixture
def timed(benchmark):
    """Warm up, check, then time a call; records FLOPs and GFLOP/s in ``extra_info``.

    Returns ``timed(fn, flop_count, check=None, visible_pairs=None)``: `fn` is called once
    untimed (compiling or loading its kernel from the cache) and `check`, when given, judges
    that first result before any timing. With `visible_pairs`, the best time per visible
    query-key pair (summed over heads) is recorded too, in nanoseconds.
    """
    def run(fn, flop_count, check=None, visible_pairs=None):
        first = fn()
        if check is not None:
            check(first)
        del first
        benchmark.extra_info["flops"] = flop_count
        benchmark(fn)
        if benchmark.stats is not None:  # None under --benchmark-disable
            best = benchmark.stats.stats.min
            benchmark.extra_info["gflops"] = flop_count / best / 1e9
            if visible_pairs:
                benchmark.extra_info["ns_per_visible_pair"] = best / visible_pairs * 1e9

    return run
