"""How fast one core streams the decode case's KV cache, by the shape of the loop that reads it.

The decoding target (85% of the read bandwidth) is met only at times, and this script shows
where the cap lies. It reads the float32 cache of `bench/test_bench_decode.py`'s GQA case (Hk=8,
Nk=16384, D=128: 128 MiB of keys and values) in the decode kernel's order (per KV head, a block
of 256 key rows, then the same block's value rows, no software prefetch) with the same
arithmetic per row (64 FMAs on the 16 vectors of a key and a value row, as four query rows
need), in four loop shapes, after a loop that only reads:

* ``reads only``: each row read once, front to back, an add per vector: the kernel's order of
  reads alone;
* ``1 load per cache vector``: each row read once, front to back, its FMAs taking their other
  operand from registers;
* ``2 passes, the second from L2``: the same, but each block read twice (two query rows a pass,
  two FMAs per vector each time), as two query rows at a time must when four rows' query
  vectors or accumulators do not fit in the 32 registers;
* ``5 loads per cache vector``: one pass, the other operands loaded from L1 (four query rows);
* ``four-row shapes, 2 loads per``: Q K^T four keys x four query rows at a time (the loads hop
  between four rows, a query vector loaded for every four key vectors) and P V four query rows x
  four vectors (two passes over the block, half a row each, a broadcast of P for every four value
  vectors): the decode kernel's shapes for other head dims and for half-precision caches.

It times them next to `cpuflash.attention_with_kvcache` on the same cache and the sum over 1 GiB
that `bench/test_bench_decode.py` uses as the yardstick, interleaved, best of N. On the 2-core
EPYC (Zen 5), on one thread (2026-11-30): 84% for the first shape, 70% for two passes, 61% and
51% for the others, and 74% for the kernel, whose Q K^T reads each key row once (prefetching
ahead) and whose P V still takes two passes. A second pass over a block costs the stream more
than its arithmetic. The kernel read 61-63% with two passes in Q K^T too. The reads alone, in
the kernel's order, streamed at 92% on one thread and 95-112% on two (three runs, a later session
of 2026-11-30), where the kernel read 76% and 75-90%: the order of the reads is not what holds
the kernel back, but how much of the stream a core keeps in flight while it computes.

    python bench/stream_shapes.py --threads 1      # one core: the cleanest comparison
    python bench/stream_shapes.py                  # every thread
"""

import argparse
import time

import numba
import numpy as np
from numba import prange

import cpuflash
from cpuflash import benchmark as runner
from cpuflash._simd import LANES_F32, vadd, vbroadcast, vfma, vhsum, vload, vzeros

KV_HEADS, N_KEYS, HEAD_DIM, BLOCK = 8, 16384, 128, 256
N = LANES_F32  # float32 lanes of the vectors below; the loops step by it


@numba.njit(inline="always")
def _fold(total, accumulators):
    """`total` plus every vector of `accumulators`: a shape's result, so that none of its
    loads is dead code."""
    for vector in accumulators:
        total = vadd(total, vector)
    return total


@numba.njit(inline="always")
def _read_only(data, start, weights, total):
    """BLOCK rows from flat `start`, each front to back, one add per loaded vector: the
    kernel's order of reads with no arithmetic to speak of."""
    a0 = a1 = a2 = a3 = vzeros(data)
    for c in range(BLOCK):
        for x in range(0, HEAD_DIM, 4 * N):
            o = start + c * HEAD_DIM + x
            a0, a1 = vadd(a0, vload(data, o)), vadd(a1, vload(data, o + N))
            a2, a3 = vadd(a2, vload(data, o + 2 * N)), vadd(a3, vload(data, o + 3 * N))
    return _fold(total, (a0, a1, a2, a3))


@numba.njit(inline="always")
def _one_load(data, start, weights, total):
    """BLOCK rows from flat `start`, each front to back, eight vectors at a time: four FMAs per
    loaded vector with weights held in registers (a different one for each FMA of a vector)."""
    w0, w1, w2, w3 = vload(weights, 0), vload(weights, N), vload(weights, 2 * N), \
        vload(weights, 3 * N)
    w4, w5, w6, w7 = vload(weights, 4 * N), vload(weights, 5 * N), vload(weights, 6 * N), \
        vload(weights, 7 * N)
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzeros(data)
    for c in range(BLOCK):
        for x in range(0, HEAD_DIM, 8 * N):
            o = start + c * HEAD_DIM + x
            y = vload(data, o)
            a0, a1, a2, a3 = vfma(y, w0, a0), vfma(y, w1, a1), vfma(y, w2, a2), vfma(y, w3, a3)
            y = vload(data, o + N)
            a4, a5, a6, a7 = vfma(y, w4, a4), vfma(y, w5, a5), vfma(y, w6, a6), vfma(y, w7, a7)
            y = vload(data, o + 2 * N)
            a0, a1, a2, a3 = vfma(y, w1, a0), vfma(y, w2, a1), vfma(y, w3, a2), vfma(y, w4, a3)
            y = vload(data, o + 3 * N)
            a4, a5, a6, a7 = vfma(y, w5, a4), vfma(y, w6, a5), vfma(y, w7, a6), vfma(y, w0, a7)
            y = vload(data, o + 4 * N)
            a0, a1, a2, a3 = vfma(y, w2, a0), vfma(y, w3, a1), vfma(y, w4, a2), vfma(y, w5, a3)
            y = vload(data, o + 5 * N)
            a4, a5, a6, a7 = vfma(y, w6, a4), vfma(y, w7, a5), vfma(y, w0, a6), vfma(y, w1, a7)
            y = vload(data, o + 6 * N)
            a0, a1, a2, a3 = vfma(y, w3, a0), vfma(y, w4, a1), vfma(y, w5, a2), vfma(y, w6, a3)
            y = vload(data, o + 7 * N)
            a4, a5, a6, a7 = vfma(y, w7, a4), vfma(y, w0, a5), vfma(y, w1, a6), vfma(y, w2, a7)
    return _fold(total, (a0, a1, a2, a3, a4, a5, a6, a7))


@numba.njit(inline="always")
def _two_passes(data, start, weights, total):
    """BLOCK rows from flat `start`, each front to back, twice (the second time from L2): two
    FMAs per loaded vector each time, with weights held in registers, as two query rows at a
    time would take them."""
    w0, w1, w2, w3 = vload(weights, 0), vload(weights, N), vload(weights, 2 * N), \
        vload(weights, 3 * N)
    a0 = a1 = a2 = a3 = vzeros(data)
    for p in range(2):
        for c in range(BLOCK):
            for x in range(0, HEAD_DIM, 2 * N):
                o = start + c * HEAD_DIM + x
                y = vload(data, o)
                a0, a1 = vfma(y, w0, a0), vfma(y, w1, a1)
                y = vload(data, o + N)
                a2, a3 = vfma(y, w2, a2), vfma(y, w3, a3)
    return _fold(total, (a0, a1, a2, a3))


@numba.njit(inline="always")
def _five_loads(data, start, weights, total):
    """BLOCK rows from flat `start`, each front to back: four FMAs per loaded vector, their
    other operands loaded from the four query rows in `weights` (L1)."""
    a0 = a1 = a2 = a3 = vzeros(data)
    for c in range(BLOCK):
        for x in range(0, HEAD_DIM, N):
            y = vload(data, start + c * HEAD_DIM + x)
            a0, a1 = vfma(y, vload(weights, x), a0), vfma(y, vload(weights, HEAD_DIM + x), a1)
            a2 = vfma(y, vload(weights, 2 * HEAD_DIM + x), a2)
            a3 = vfma(y, vload(weights, 3 * HEAD_DIM + x), a3)
    return _fold(total, (a0, a1, a2, a3))


@numba.njit(inline="always")
def _qk_shape(data, start, weights, total):
    """The four-row Q K^T: four keys x four query rows, 16 accumulators."""
    for c in range(0, BLOCK, 4):
        o = start + c * HEAD_DIM
        s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = vzeros(data)
        s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = s00
        for x in range(0, HEAD_DIM, N):
            y0, y1 = vload(data, o + x), vload(data, o + HEAD_DIM + x)
            y2, y3 = vload(data, o + 2 * HEAD_DIM + x), vload(data, o + 3 * HEAD_DIM + x)
            q = vload(weights, x)
            s00, s01, s02, s03 = vfma(q, y0, s00), vfma(q, y1, s01), vfma(q, y2, s02), \
                vfma(q, y3, s03)
            q = vload(weights, HEAD_DIM + x)
            s10, s11, s12, s13 = vfma(q, y0, s10), vfma(q, y1, s11), vfma(q, y2, s12), \
                vfma(q, y3, s13)
            q = vload(weights, 2 * HEAD_DIM + x)
            s20, s21, s22, s23 = vfma(q, y0, s20), vfma(q, y1, s21), vfma(q, y2, s22), \
                vfma(q, y3, s23)
            q = vload(weights, 3 * HEAD_DIM + x)
            s30, s31, s32, s33 = vfma(q, y0, s30), vfma(q, y1, s31), vfma(q, y2, s32), \
                vfma(q, y3, s33)
        total = _fold(total, (s00, s01, s02, s03, s10, s11, s12, s13,
                              s20, s21, s22, s23, s30, s31, s32, s33))
    return total


@numba.njit(inline="always")
def _pv_shape(data, start, weights, total):
    """The four-row P V: four query rows x four vectors, a pass per half row."""
    for x in range(0, HEAD_DIM, 4 * N):
        a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = vzeros(data)
        a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = a00
        for c in range(BLOCK):
            o = start + c * HEAD_DIM + x
            v0, v1 = vload(data, o), vload(data, o + N)
            v2, v3 = vload(data, o + 2 * N), vload(data, o + 3 * N)
            p = vbroadcast(weights, c)
            a00, a01, a02, a03 = vfma(p, v0, a00), vfma(p, v1, a01), vfma(p, v2, a02), \
                vfma(p, v3, a03)
            p = vbroadcast(weights, BLOCK + c)
            a10, a11, a12, a13 = vfma(p, v0, a10), vfma(p, v1, a11), vfma(p, v2, a12), \
                vfma(p, v3, a13)
            p = vbroadcast(weights, 2 * BLOCK + c)
            a20, a21, a22, a23 = vfma(p, v0, a20), vfma(p, v1, a21), vfma(p, v2, a22), \
                vfma(p, v3, a23)
            p = vbroadcast(weights, 3 * BLOCK + c)
            a30, a31, a32, a33 = vfma(p, v0, a30), vfma(p, v1, a31), vfma(p, v2, a32), \
                vfma(p, v3, a33)
        total = _fold(total, (a00, a01, a02, a03, a10, a11, a12, a13,
                              a20, a21, a22, a23, a30, a31, a32, a33))
    return total


def _streamer(key_shape, value_shape):
    """A parallel read of both caches, head by head, a key block then its value block."""
    @numba.njit(parallel=True)
    def stream(k_cache, v_cache, weights):
        keys, values = k_cache.reshape(-1), v_cache.reshape(-1)
        out = np.zeros(KV_HEADS, dtype=np.float32)
        for h in prange(KV_HEADS):
            total = vzeros(keys)
            for kb in range(0, N_KEYS, BLOCK):
                start = (h * N_KEYS + kb) * HEAD_DIM
                total = key_shape(keys, start, weights, total)
                total = value_shape(values, start, weights, total)
            out[h] = vhsum(total)
        return out
    return stream


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=cpuflash.cpu_info()["threads"])
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    k_cache, v_cache = (rng.standard_normal((1, KV_HEADS, N_KEYS, HEAD_DIM), dtype=np.float32)
                        for _ in range(2))
    q = rng.standard_normal((1, 4 * KV_HEADS, 1, HEAD_DIM), dtype=np.float32)
    weights = rng.standard_normal(4 * BLOCK, dtype=np.float32)  # query rows, or P of a block
    data = np.ones(2 ** 28, dtype=np.float32)
    try:
        import torch
        torch.set_num_threads(args.threads)
        total = torch.from_numpy(data).sum
    except ImportError:
        total = data.sum
    read_only = _streamer(_read_only, _read_only)
    one_load, five_loads = _streamer(_one_load, _one_load), _streamer(_five_loads, _five_loads)
    two_passes = _streamer(_two_passes, _two_passes)
    four_rows = _streamer(_qk_shape, _pv_shape)
    calls = {
        "read 1 GiB (the yardstick)": total,
        "reads only, no arithmetic": lambda: read_only(k_cache, v_cache, weights),
        "1 load per cache vector": lambda: one_load(k_cache, v_cache, weights),
        "2 passes, the second from L2": lambda: two_passes(k_cache, v_cache, weights),
        "5 loads per cache vector": lambda: five_loads(k_cache, v_cache, weights),
        "four-row shapes, 2 loads per": lambda: four_rows(k_cache, v_cache, weights),
        "attention_with_kvcache": lambda: cpuflash.attention_with_kvcache(q, k_cache, v_cache),
    }
    for call in calls.values():
        call()  # compile
    best = {name: float("inf") for name in calls}
    for _ in range(args.repeats):  # interleaved rounds, best of N
        for name, call in calls.items():
            runner.settle(call)
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    bandwidth = data.nbytes / best.pop("read 1 GiB (the yardstick)") / 1e9
    print(f"{args.threads} thread(s), best of {args.repeats}: read bandwidth {bandwidth:.1f} GB/s")
    for name, seconds in best.items():
        rate = (k_cache.nbytes + v_cache.nbytes) / seconds / 1e9
        print(f"  {name:29} {seconds * 1e3:6.2f} ms {rate:5.1f} GB/s ({rate / bandwidth:4.0%})")


if __name__ == "__main__":
    main()
