"""Decoding against a KV cache: cpuflash's split-KV kernel, torch SDPA and the memory bandwidth.

Decoding reads every cached key and value once, so it is memory-bound: the yardstick is the read
bandwidth of this machine, measured in the same process as a sum over a 1 GiB array (torch's sum
when torch is installed, numpy's otherwise), and GB/s are those of the K/V cache read.

    python -m pytest bench/test_bench_decode.py           # pytest-benchmark, GB/s in extra_info
    python bench/test_bench_decode.py [--repeats 20]       # side-by-side ratios in one process

Cases: GQA decode B=1, Hq=32, Hk=8, Nk=16384, D=128, one query row, also with float16 and
bfloat16 caches (half the bytes), int8 and float8_e4m3 caches (`cpuflash.quantize_kv`: a
quarter of the bytes, plus a float32 scale per row) and int4 ones (0.16x, a scale per 32); MQA
decode (Hq=8, Hk=1) with automatic splits against ``num_splits=1``.
"""

import os
import time

import numpy as np
import pytest

import cpuflash
from cpuflash.reference import attention_reference

import runner  # bench/runner.py

SMALL = os.environ.get("CPUFLASH_BENCH_SMALL") == "1"
N_KEYS = 1024 if SMALL else 16384
CASES = {"gqa-32/8": (32, 8), "mqa-8/1": (8, 1)}
HEAD_DIM = 128

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


def half_dtypes():
    """name -> dtype of the half-precision caches available (bfloat16 needs ml_dtypes)."""
    dtypes = {"float16": np.dtype(np.float16)}
    try:
        import ml_dtypes
        dtypes["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
    except ImportError:
        pass
    return dtypes


def quantized_formats():
    """The quantized cache formats available (float8_e4m3 needs ml_dtypes; int4 in groups of
    32)."""
    return ["int8"] + (["float8_e4m3"] if "bfloat16" in half_dtypes() else []) + ["int4"]


def cache_bytes(cache):
    """Bytes of a cache array, or of a QuantizedKV's rows and scales."""
    if isinstance(cache, cpuflash.QuantizedKV):
        return cache.data.nbytes + cache.scale.nbytes
    return cache.nbytes


def check(out, q, k_cache, v_cache):
    """flash-attn's rule against the float64 reference of the (possibly rounded) inputs; for a
    quantized cache, of the dequantized one."""
    if isinstance(k_cache, cpuflash.QuantizedKV):
        k_cache, v_cache = cpuflash.dequantize_kv(k_cache), cpuflash.dequantize_kv(v_cache)
    ref = attention_reference(q, k_cache, v_cache, causal=True)
    plain = attention_reference(q, k_cache, v_cache, causal=True, dtype=np.float32)
    if q.dtype != np.float32:  # the output is rounded to the inputs' precision
        plain = plain.astype(q.dtype).astype(np.float64)
    err = np.abs(np.asarray(out).astype(np.float64) - ref).max()
    assert err <= 2 * np.abs(plain - ref).max() + 1e-6


def implementations(q, k_cache, v_cache, halves=False):
    """name -> (call, its inputs), for one case; with `halves`, the same case with float16 and
    bfloat16 inputs and int8, float8_e4m3 and int4 caches; torch when installed."""
    calls = {
        "cpuflash": (lambda: cpuflash.attention_with_kvcache(q, k_cache, v_cache),
                     (q, k_cache, v_cache)),
        "cpuflash-1-split": (lambda: cpuflash.attention_with_kvcache(q, k_cache, v_cache,
                                                                     num_splits=1),
                             (q, k_cache, v_cache)),
    }
    for name, dtype in half_dtypes().items() if halves else ():
        inputs = tuple(x.astype(dtype) for x in (q, k_cache, v_cache))
        calls["cpuflash-" + name] = (
            lambda inputs=inputs: cpuflash.attention_with_kvcache(*inputs), inputs)
    for name in quantized_formats() if halves else ():
        inputs = (q, cpuflash.quantize_kv(k_cache, name), cpuflash.quantize_kv(v_cache, name))
        calls["cpuflash-" + name] = (
            lambda inputs=inputs: cpuflash.attention_with_kvcache(*inputs), inputs)
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k_cache, v_cache))
        calls["torch"] = (lambda: torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, enable_gqa=True), (q, k_cache, v_cache))
    return calls


def _timed(call):
    """Seconds of one call in steady state, best of three, after `runner.settle`
    (a pause for other libraries' spinning threads, then untimed calls while the cores clock
    up and this library's threads wake)."""
    runner.settle(call)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", ["cpuflash", "cpuflash-1-split", "cpuflash-float16",
                                  "cpuflash-bfloat16", "cpuflash-int8",
                                  "cpuflash-float8_e4m3", "cpuflash-int4", "torch"])
def test_decode(benchmark, case, name):
    q, k_cache, v_cache = make_case(*CASES[case])
    calls = implementations(q, k_cache, v_cache, halves=True)
    if name not in calls:
        pytest.skip(f"{name}: torch or ml_dtypes is not installed")
    call, inputs = calls[name]
    check(call(), *inputs)
    benchmark(call)
    if benchmark.stats is not None:
        benchmark.extra_info["cache_gb_per_s"] = (
            (cache_bytes(inputs[1]) + cache_bytes(inputs[2])) / benchmark.stats.stats.min / 1e9)


def main(repeats=20):
    if torch is not None:
        torch.set_num_threads(cpuflash.cpu_info()["threads"])
    data = np.ones(2 ** 28, dtype=np.float32)  # the yardstick: a sum over 1 GiB
    source = torch.from_numpy(data) if torch is not None else data
    for case, (heads, kv_heads) in CASES.items():
        q, k_cache, v_cache = make_case(heads, kv_heads)
        calls = implementations(q, k_cache, v_cache, halves=kv_heads > 1)
        for call, inputs in calls.values():  # warm up and check each before timing
            check(call(), *inputs)
        calls["read 1 GiB"] = (source.sum, ())
        best = {name: float("inf") for name in calls}
        for _ in range(repeats):  # interleaved rounds (the yardstick too), best of N
            for name, (call, _) in calls.items():
                best[name] = min(best[name], _timed(call))
        bandwidth = data.nbytes / best.pop("read 1 GiB") / 1e9
        print(f"\n{case}: B=1 Hq={heads} Hk={kv_heads} Nk={N_KEYS} D={HEAD_DIM} float32, "
              f"one query row, best of {repeats}; read bandwidth {bandwidth:.1f} GB/s")
        for name, seconds in best.items():
            inputs = calls[name][1]
            rate = (cache_bytes(inputs[1]) + cache_bytes(inputs[2])) / seconds / 1e9
            print(f"  {name:18} {seconds * 1e3:7.2f} ms  {rate:5.1f} GB/s "
                  f"({rate / bandwidth:4.0%} of the read bandwidth)")
        if "torch" in best:
            print(f"  cpuflash / torch: {best['torch'] / best['cpuflash']:.2f}x")
        print(f"  auto splits / 1 split: {best['cpuflash-1-split'] / best['cpuflash']:.2f}x")
        for name in half_dtypes():
            if "cpuflash-" + name in best:
                print(f"  {name} / float32 cache time: "
                      f"{best['cpuflash-' + name] / best['cpuflash']:.2f}")
        for name in quantized_formats():
            if "cpuflash-" + name in best:
                against = {"float32": best["cpuflash"]}
                if "cpuflash-bfloat16" in best:
                    against["bfloat16"] = best["cpuflash-bfloat16"]
                print(f"  {name} cache speed: " + ", ".join(
                    f"{seconds / best['cpuflash-' + name]:.2f}x {other}'s"
                    for other, seconds in against.items()))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Decode benchmark, side by side.")
    parser.add_argument("--repeats", type=int, default=20)
    main(parser.parse_args().repeats)
