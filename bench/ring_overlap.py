"""How long ring attention's ranks wait on the ring against how long they compute.

    mpiexec -n 2 python bench/ring_overlap.py [--lengths 4096 8192 16384] [--causal]
                                              [--backward] [--repeats 3]

Run with one Numba thread per rank (NUMBA_NUM_THREADS=1, set here when unset) and no more ranks
than cores. For each sequence length, every rank reports, from the best of `--repeats` calls:
its compute time (single-node attention and merging), its wait time (blocked on the ring), its
compute rate, and the time the same key/value parts take to go round the ring alone
(blocking send/receive, nothing computed). With the next part in flight while the current
one is computed, the wait stays near zero as long as a step's compute exceeds its transfer;
without overlap a rank would wait about the transfer time.
"""

import argparse
import os
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from cpuflash import distributed  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def ring_pass_alone(k, v, repeats):
    """Seconds to pass this rank's k and v round the ring (P - 1 hops), nothing computed."""
    best = np.inf
    for _ in range(repeats):
        parts = [np.ascontiguousarray(x) for x in (k, v)]
        COMM.Barrier()
        start = time.perf_counter()
        for _ in range(SIZE - 1):
            for x in parts:
                COMM.Sendrecv_replace(x, dest=(RANK + 1) % SIZE, source=(RANK - 1) % SIZE)
        best = min(best, time.perf_counter() - start)
    return best


def flops(n, heads, d, causal, backward):
    """This rank's share of the attention's multiply-adds x 2: ``4 N^2 H D`` forward (half with
    causal), 2.5x that for the backward (its five tile products to the forward's two)."""
    total = 4.0 * n * n * heads * d * (0.5 if causal else 1.0)
    return total * (2.5 if backward else 1.0) / SIZE


def measure(n, args, rng):
    shape = (1, args.heads, n, args.dim)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    parts = [distributed.shard(x) for x in (q, k, v)]
    del q, k, v
    keywords = dict(causal=args.causal)
    out, lse = distributed.ring_attention(*parts, return_lse=True, **keywords)  # warm-up
    dout = np.ones_like(out)
    best = None
    for _ in range(args.repeats):
        timings = {}
        COMM.Barrier()
        start = time.perf_counter()
        if args.backward:
            distributed.ring_attention_backward(dout, *parts, out, lse, timings=timings,
                                                **keywords)
        else:
            distributed.ring_attention(*parts, timings=timings, **keywords)
        timings["total_s"] = time.perf_counter() - start
        if best is None or timings["total_s"] < best["total_s"]:
            best = timings
    best["alone_s"] = ring_pass_alone(parts[1], parts[2], args.repeats)
    best["gflops"] = flops(n, args.heads, args.dim, args.causal, args.backward) / 1e9 / max(
        best["compute_s"], 1e-12)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    if RANK == 0:
        what = "backward" if args.backward else "forward"
        print(f"ring attention {what}, {SIZE} ranks x {os.environ['NUMBA_NUM_THREADS']} "
              f"thread(s), H={args.heads}, D={args.dim}, float32, causal={args.causal}, "
              f"zigzag; best of {args.repeats}")
        print(f"{'N':>7} {'rank':>4} {'total s':>8} {'compute s':>9} {'wait s':>8} "
              f"{'wait/compute':>12} {'GFLOP/s':>8} {'MB sent':>8} {'ring alone s':>12}")
    for n in args.lengths:
        rows = COMM.gather(measure(n, args, rng), root=0)
        if RANK == 0:
            for rank, t in enumerate(rows):
                print(f"{n:>7} {rank:>4} {t['total_s']:>8.3f} {t['compute_s']:>9.3f} "
                      f"{t['wait_s']:>8.4f} {t['wait_s'] / t['compute_s']:>12.4f} "
                      f"{t['gflops']:>8.1f} {t['bytes_sent'] / 1e6:>8.1f} "
                      f"{t['alone_s']:>12.4f}", flush=True)


if __name__ == "__main__":
    main()
