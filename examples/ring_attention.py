"""Ring attention: one causal attention over a long sequence, spread across MPI ranks.

    mpiexec -n 2 python -m mpi4py examples/ring_attention.py [--length 16384] [--small]

(`-m mpi4py` makes an error on one rank abort them all, instead of leaving the others waiting.)
Every rank makes the same whole q, k, v (the same seed), keeps its zigzag part (`shard`), and
the ranks run the forward and the backward on the ring: key/value parts travel from rank to
rank while each computes. Up to N = 8192 (``--length 8192``), each rank also computes the whole
attention alone and checks its part of the output and of the gradients against it; beyond that
the check would cost more than the ring itself, and the output says it was skipped. Each rank
prints its timings: compute, and time waiting on the ring. Run with one Numba thread per rank
(NUMBA_NUM_THREADS=1, set here when unset) and no more ranks than cores.

Without mpiexec it runs as a ring of one rank.
"""

import argparse
import os
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import cpuflash  # noqa: E402
from cpuflash import distributed  # noqa: E402 (needs mpi4py: pip install -e ".[mpi]")
from mpi4py import MPI  # noqa: E402

CHECK_UP_TO = 8192  # longest sequence checked against one process


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384, help="sequence length")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--small", action="store_true", help="a quick run (N = 512)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = 512 if args.small else args.length
    n -= n % (2 * size)  # zigzag: the length must be a multiple of 2P

    # -- the same whole sequence on every rank, then each keeps its part
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, args.heads, n, args.dim), dtype=np.float32)
    k, v = (rng.standard_normal((1, args.kv_heads, n, args.dim), dtype=np.float32)
            for _ in range(2))
    dout = rng.standard_normal(q.shape, dtype=np.float32)
    my_q, my_k, my_v, my_dout = (distributed.shard(x) for x in (q, k, v, dout))

    # -- load the compiled kernels first, so that the timings below are the ring's
    tiny = np.ones((1, 1, 8, args.dim), np.float32)
    tiny_out, tiny_lse = cpuflash.attention(tiny, tiny, tiny, causal=True, return_lse=True)
    cpuflash.attention_backward(tiny, tiny, tiny, tiny, tiny_out, tiny_lse, causal=True)

    # -- forward and backward on the ring
    forward, backward = {}, {}
    comm.Barrier()
    start = time.perf_counter()
    out, lse = distributed.ring_attention(my_q, my_k, my_v, causal=True, return_lse=True,
                                          timings=forward)
    middle = time.perf_counter()
    dq, dk, dv = distributed.ring_attention_backward(my_dout, my_q, my_k, my_v, out, lse,
                                                     causal=True, timings=backward)
    end = time.perf_counter()

    # -- against one process, when that is affordable
    checked = (f"; not checked against one process (N > {CHECK_UP_TO}: run with --length "
               f"{CHECK_UP_TO} or less to check)")
    if n <= CHECK_UP_TO:
        whole, whole_lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
        grads = cpuflash.attention_backward(dout, q, k, v, whole, whole_lse, causal=True)
        errors = [np.abs(mine - distributed.shard(ref)).max() / np.abs(ref).max()
                  for mine, ref in zip((out, dq, dk, dv), (whole,) + grads)]
        assert max(errors) < 1e-4, f"rank {rank}: relative errors {errors}"
        checked = "; out, dq, dk, dv match one process (largest relative difference " \
                  f"{max(errors):.1e})"

    lines = comm.gather(
        f"rank {rank}: forward {middle - start:.3f} s (compute {forward['compute_s']:.3f} s, "
        f"waiting {forward['wait_s']:.4f} s, {forward['skipped_steps']} steps skipped), "
        f"backward {end - middle:.3f} s (compute {backward['compute_s']:.3f} s, waiting "
        f"{backward['wait_s']:.4f} s){checked}", root=0)
    if rank == 0:
        print(f"causal attention over N = {n} tokens, {args.heads} query heads, "
              f"{args.kv_heads} key/value heads, D = {args.dim}, on {size} rank(s) "
              f"({n // size} tokens each, zigzag)")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
