"""The multiply-add rate of `vdpbf16ps` against `fma` on one core, operands in registers.

    python bench/bf16_ports.py [--repeats 5]

Each loop keeps 12 independent accumulators (more than either instruction's latency times its
issue rate), so it measures how many instructions a core retires per second. A `vdpbf16ps`
does 32 multiply-adds (16 float32 lanes, two bfloat16 products each), an `fma` 16: the
bfloat16 kernels only pay where the first rate is well above the second
(`cpuflash._simd._bf16_dot_pays`). Runs on a CPU with AVX512-BF16 only.
"""

import argparse
import os
import sys
import time

os.environ["CPUFLASH_BF16_DOT"] = "1"  # emit vdpbf16ps whatever the rule says of this CPU

import numba  # noqa: E402
import numpy as np  # noqa: E402

from cpuflash import _simd  # noqa: E402
from cpuflash._simd import vadd, vdot_pairs, vfma, vload, vload_pairs, vstore  # noqa: E402


@numba.njit
def _sum12(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11):
    return vadd(vadd(vadd(vadd(c0, c1), vadd(c2, c3)), vadd(vadd(c4, c5), vadd(c6, c7))),
                vadd(vadd(c8, c9), vadd(c10, c11)))


@numba.njit
def fma_loop(x, out, n):
    a, b, c0 = vload(x, 0), vload(x, 16), vload(out, 0)
    c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = c10 = c11 = c0
    for _ in range(n):
        c0, c1, c2, c3 = vfma(a, b, c0), vfma(a, b, c1), vfma(a, b, c2), vfma(a, b, c3)
        c4, c5, c6, c7 = vfma(a, b, c4), vfma(a, b, c5), vfma(a, b, c6), vfma(a, b, c7)
        c8, c9, c10, c11 = vfma(a, b, c8), vfma(a, b, c9), vfma(a, b, c10), vfma(a, b, c11)
    vstore(out, 0, _sum12(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11))


@numba.njit
def dot_loop(bits, out, n):
    a, b, c0 = vload_pairs(bits, 0), vload_pairs(bits, 32), vload(out, 0)
    c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = c10 = c11 = c0
    for _ in range(n):
        c0, c1 = vdot_pairs(c0, a, b), vdot_pairs(c1, a, b)
        c2, c3 = vdot_pairs(c2, a, b), vdot_pairs(c3, a, b)
        c4, c5 = vdot_pairs(c4, a, b), vdot_pairs(c5, a, b)
        c6, c7 = vdot_pairs(c6, a, b), vdot_pairs(c7, a, b)
        c8, c9 = vdot_pairs(c8, a, b), vdot_pairs(c9, a, b)
        c10, c11 = vdot_pairs(c10, a, b), vdot_pairs(c11, a, b)
    vstore(out, 0, _sum12(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=2_000_000)
    args = parser.parse_args(argv)
    if not _simd.BF16_DOT or _simd.LANES_F32 != 16:
        sys.exit("this CPU (as Numba compiles for it) has no AVX512-BF16")
    x = np.full(32, 1e-3, np.float32)
    bits = np.full(64, 0x3A83, np.uint16)  # bfloat16 1e-3
    out = np.zeros(16, np.float32)
    n = args.iterations
    fma_loop(x, out, 1), dot_loop(bits, out, 1)  # compile
    best_fma = best_dot = float("inf")
    for _ in range(args.repeats):  # interleaved, best of N
        start = time.perf_counter()
        fma_loop(x, out, n)
        best_fma = min(best_fma, time.perf_counter() - start)
        start = time.perf_counter()
        dot_loop(bits, out, n)
        best_dot = min(best_dot, time.perf_counter() - start)
    fma_rate, dot_rate = 12 * n * 16 / best_fma / 1e9, 12 * n * 32 / best_dot / 1e9
    print(f"one thread, best of {args.repeats}; multiply-adds per ns (G/s)")
    print(f"fma (16 per instruction):       {fma_rate:6.1f}")
    print(f"vdpbf16ps (32 per instruction): {dot_rate:6.1f}")
    print(f"vdpbf16ps / fma:                {dot_rate / fma_rate:6.2f}x")


if __name__ == "__main__":
    main()
