"""Sweep block_q x block_k on this machine and print GFLOP/s per tile pair, with the chooser's pick.

    python bench/sweep_tiles.py                # D = 64 and 128, B=1, H=8, N=4096, float32
    python bench/sweep_tiles.py --n 2048 --repeats 5

This is how `cpuflash.choose_tiles`' cache model was checked: the pick should land in the flat
region around the best pair. Each pair is timed best-of-N, all pairs in one process.
"""

import argparse
import time

import numpy as np

import cpuflash

from runner import flops  # bench/runner.py

BLOCK_Q = (32, 64, 96, 128, 192, 256, 384)
BLOCK_K = (32, 64, 96, 128, 192, 256)


def best_time(call, repeats):
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    for d in args.head_dims:
        q, k, v = (rng.standard_normal((1, args.heads, args.n, d), dtype=np.float32)
                   for _ in range(3))
        work = flops(1, args.heads, args.n, args.n, d, causal=False)
        pick = cpuflash.choose_tiles(d)
        print(f"\nD={d}, B=1, H={args.heads}, N={args.n}, float32: GFLOP/s "
              f"(choose_tiles picks {pick.block_q} x {pick.block_k})")
        print("block_q \\ block_k " + "".join(f"{bk:>8}" for bk in BLOCK_K))
        for bq in BLOCK_Q:
            row = []
            for bk in BLOCK_K:
                seconds = best_time(lambda: cpuflash.attention(q, k, v, tiles=(bq, bk)),
                                    args.repeats)
                mark = "*" if (bq, bk) == (pick.block_q, pick.block_k) else " "
                row.append(f"{work / seconds / 1e9:7.0f}{mark}")
            print(f"{bq:>17} " + "".join(row))


if __name__ == "__main__":
    main()
