"""Decoding against a KV cache: cpuflash's split-KV kernel, torch SDPA and the memory bandwidth.

Decoding reads every cached key and value once, so it is memory-bound: the yardstick is the read
bandwidth of this machine, measured in the same process as a sum over a 1 GiB array (torch's sum
when torch is installed, numpy's otherwise), and GB/s are those of the K/V cache read.

    python -m pytest bench/test_bench_decode.py           # pytest-benchmark, GB/s in extra_info
    python bench/test_bench_decode.py [--repeats 20]       # side-by-side ratios in one process

Cases: GQA decode B=1, Hq=32, Hk=8, Nk=16384, D=128, one query row; MQA decode (Hq=8, Hk=1) with
automatic splits against ``num_splits=1``.
"""

import os
import time

import numpy as np
import pytest

import cpuflash
from cpuflash.reference import attention_reference

SMALL = os.environ.get("CPUFLASH_BENCH_SMALL") == "1"
N_KEYS = 1024 if SMALL else 16384
CASES = {"gqa-32/8": (32, 8), "mqa-8/1": (8, 1)}
HEAD_DIM = 128
SETTLE_SECONDS = 0.15  # let another library's spinning threads go to sleep before a sample

try:
    import torch
except ImportError:
    torch = None


def make_case(heads, kv_heads, n_keys=N_KEYS, seed=0):
    rng = np.random.default_rng(seed)
    k_cache, v_cache = (rng.standard_normal((1, kv_heads, n_keys, HEAD_DIM), dtype=np.float32)
                        for _ in range(2))
    q = rng.standard_normal((1, heads, 1, HEAD_DIM), dtype=np.float32)
    return q, k_cache, v_cache


def check(out, q, k_cache, v_cache):
    ref = attention_reference(q, k_cache, v_cache, causal=True)
    plain = attention_reference(q, k_cache, v_cache, causal=True, dtype=np.float32)
    assert np.abs(out - ref).max() <= 2 * np.abs(plain - ref).max() + 1e-6


def implementations(q, k_cache, v_cache):
    """name -> call, for one case; torch when installed."""
    calls = {
        "cpuflash": lambda: cpuflash.attention_with_kvcache(q, k_cache, v_cache),
        "cpuflash-1-split": lambda: cpuflash.attention_with_kvcache(q, k_cache, v_cache,
                                                                    num_splits=1),
    }
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k_cache, v_cache))
        calls["torch"] = lambda: torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, enable_gqa=True)
    return calls


def _timed(call):
    """Seconds of one call in steady state: after a pause (so another library's spinning
    threads have gone to sleep) and one untimed call (so this library's threads are awake)."""
    time.sleep(SETTLE_SECONDS)
    call()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", ["cpuflash", "cpuflash-1-split", "torch"])
def test_decode(benchmark, case, name):
    q, k_cache, v_cache = make_case(*CASES[case])
    calls = implementations(q, k_cache, v_cache)
    if name not in calls:
        pytest.skip("torch is not installed")
    out = np.asarray(calls[name]())
    check(out, q, k_cache, v_cache)
    benchmark(calls[name])
    if benchmark.stats is not None:
        benchmark.extra_info["cache_gb_per_s"] = (
            (k_cache.nbytes + v_cache.nbytes) / benchmark.stats.stats.min / 1e9)


def main(repeats=20):
    if torch is not None:
        torch.set_num_threads(cpuflash.cpu_info()["threads"])
    data = np.ones(2 ** 28, dtype=np.float32)  # the yardstick: a sum over 1 GiB
    source = torch.from_numpy(data) if torch is not None else data
    for case, (heads, kv_heads) in CASES.items():
        q, k_cache, v_cache = make_case(heads, kv_heads)
        calls = implementations(q, k_cache, v_cache)
        for call in calls.values():  # warm up and check each before timing
            check(np.asarray(call()), q, k_cache, v_cache)
        calls["read 1 GiB"] = source.sum
        best = {name: float("inf") for name in calls}
        for _ in range(repeats):  # interleaved rounds (the yardstick too), best of N
            for name, call in calls.items():
                best[name] = min(best[name], _timed(call))
        bandwidth = data.nbytes / best.pop("read 1 GiB") / 1e9
        cache_bytes = k_cache.nbytes + v_cache.nbytes
        print(f"\n{case}: B=1 Hq={heads} Hk={kv_heads} Nk={N_KEYS} D={HEAD_DIM} float32, "
              f"one query row, best of {repeats}; read bandwidth {bandwidth:.1f} GB/s")
        for name, seconds in best.items():
            rate = cache_bytes / seconds / 1e9
            print(f"  {name:18} {seconds * 1e3:7.2f} ms  {rate:5.1f} GB/s "
                  f"({rate / bandwidth:4.0%} of the read bandwidth)")
        if "torch" in best:
            print(f"  cpuflash / torch: {best['torch'] / best['cpuflash']:.2f}x")
        print(f"  auto splits / 1 split: {best['cpuflash-1-split'] / best['cpuflash']:.2f}x")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Decode benchmark, side by side.")
    parser.add_argument("--repeats", type=int, default=20)
    main(parser.parse_args().repeats)
