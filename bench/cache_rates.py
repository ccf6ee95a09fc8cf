"""Decoding rates of each KV-cache format, in GB/s of cache bytes read: does one core decode a
format faster than its share of a server's memory bandwidth (docs/quantized_kv.md, "The server
model")?

    python bench/cache_rates.py                         # 1 thread, then 2
    python bench/cache_rates.py --threads 1 --repeats 9 --n-keys 65536

Case: B1 Hq32 Hk8 D128, one query row, the whole cache of N keys attended (the cache larger than
the last-level cache at N = 65536). Formats: float32, bfloat16, int8, float8_e4m3 and int4 (group
32), each unrotated, and the quantized ones rotated too; int8 and int4 also with the opt-in
integer Q K^T (`-integer`: `integer_dot=True`). Bytes are those of the rows and their scales
(keys and values). Every output is checked against the float64 reference on the dequantized
cache (flash-attn's rule; for `-integer`, with q as the route quantizes it) before timing; the
formats are timed interleaved in one process, best of N.
"""

import argparse
import time

import numba
import numpy as np

import cpuflash
from cpuflash.reference import attention_reference

QUANTIZED = ("int8", "float8_e4m3", "int4")


def cache_bytes(cache):
    if isinstance(cache, cpuflash.QuantizedKV):
        return cache.data.nbytes + cache.scale.nbytes
    return cache.nbytes


def caches(k, v, name, rotate):
    """(k_cache, v_cache) of format `name`."""
    if name == "float32":
        return k, v
    if name == "bfloat16":
        import ml_dtypes
        return k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)
    return (cpuflash.quantize_kv(k, name, rotate=rotate),
            cpuflash.quantize_kv(v, name, rotate=rotate))


def float_caches(k_cache, v_cache):
    if isinstance(k_cache, cpuflash.QuantizedKV):
        return cpuflash.dequantize_kv(k_cache), cpuflash.dequantize_kv(v_cache)
    return k_cache, v_cache


def quantized_rows(q):
    """q as the integer Q K^T reads it: each row as int8 numbers times amax / 127."""
    scale = np.abs(q).max(axis=-1, keepdims=True) / np.float32(127)
    safe = np.where(scale > 0, scale, np.float32(1))
    return (np.rint(q / safe) * scale).astype(np.float32)


def check(out, q, k_cache, v_cache):
    k, v = float_caches(k_cache, v_cache)
    ref = attention_reference(q, k, v)
    plain = attention_reference(q, k, v, dtype=np.float32)
    plain = plain.astype(out.dtype).astype(np.float64)  # rounded as the output is
    err = np.abs(out.astype(np.float64) - ref).max()
    assert err <= 2 * np.abs(plain - ref).max() + 1e-6, err


def timed(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--n-keys", type=int, default=65536)
    parser.add_argument("--formats", default="float32,bfloat16," + ",".join(QUANTIZED)
                        + "," + ",".join(f"{name}-rotated" for name in QUANTIZED)
                        + ",int8-integer,int4-integer")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((1, 8, args.n_keys, 128), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((1, 32, 1, 128), dtype=np.float32)
    cases = {}
    for label in args.formats.split(","):
        integer = label.endswith("-integer")
        name = label.removesuffix("-integer").removesuffix("-rotated")
        k_cache, v_cache = caches(k, v, name, "-rotated" in label)
        q_case = q.astype(k_cache.dtype) if name == "bfloat16" else q
        options = dict(integer_dot=True) if integer else {}
        cases[label] = (q_case, k_cache, v_cache, options)
        check(cpuflash.attention_with_kvcache(q_case, k_cache, v_cache, **options),
              quantized_rows(q_case) if integer else q_case, k_cache, v_cache)
    print(f"B1 Hq32 Hk8 D128 N{args.n_keys}, one query row; GB/s of cache bytes, best of "
          f"{args.repeats}; {cpuflash.cpu_info()['model']}")
    for threads in args.threads:
        numba.set_num_threads(threads)
        best = dict.fromkeys(cases, float("inf"))
        for _ in range(args.repeats):
            for label, (q_case, k_cache, v_cache, options) in cases.items():
                best[label] = min(best[label], timed(
                    lambda: cpuflash.attention_with_kvcache(q_case, k_cache, v_cache,
                                                            **options)))
        print(f"{threads} thread{'s' if threads > 1 else ''}:")
        for label, seconds in best.items():
            _, k_cache, v_cache, _ = cases[label]
            size = cache_bytes(k_cache) + cache_bytes(v_cache)
            print(f"  {label:20} {seconds * 1e3:8.2f} ms  {size / seconds / 1e9:6.2f} GB/s  "
                  f"{size / 2**20:7.1f} MiB")
        for a, b in (("int4", "int8"), ("int8", "bfloat16"), ("int8", "float32"),
                     ("int8-integer", "int8"), ("int4-integer", "int4"),
                     ("int4-integer", "int8-integer"), ("int8-integer", "bfloat16")):
            if a in best and b in best:
                print(f"  {a} / {b} speed: {best[b] / best[a]:.2f}x")


if __name__ == "__main__":
    main()
