"""Naive numpy vs FlashAttention-1 vs FlashAttention-2 on this CPU, side by side.

The three implementations run in one process, each checked against the float64 reference
before it is timed (that first call also compiles or loads its kernels), then timed interleaved
with a float32 matmul (sgemm, 2048^3) so that a busy machine slows them all alike; the best of a
few runs is reported as time, GFLOP/s and percent of that sgemm ceiling (left out when an
implementation beat it); the sgemm row gives the matmul's own time, the same size at every N.
FLOPs count the visible (query, key) pairs only: 4 * B * H * pairs * D.

    python examples/fa1_vs_fa2.py             # B=1, H=8, D=64, N = 1024, 2048, 4096
    python examples/fa1_vs_fa2.py --causal --head-dim 128
    python examples/fa1_vs_fa2.py --small     # N = 256, 512, used by the tests
"""

import argparse
import time

import numpy as np

import cpuflash
from cpuflash.reference import attention_fa1, attention_reference, naive_attention

CHECK_ROWS = 128  # rows checked against the dense float64 reference (the last ones: see below)
SGEMM_SIZE = 2048


def seconds(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="N = 256, 512 (for CI)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--head-dim", type=int, default=64, choices=(64, 128))
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    args = parser.parse_args(argv)
    batch, heads, d, causal = 1, 8, args.head_dim, args.causal
    lengths = (256, 512) if args.small else (1024, 2048, 4096)
    implementations = {
        "naive numpy": naive_attention,
        "FA-1": attention_fa1,
        "FA-2 (cpuflash)": cpuflash.attention,
    }
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((SGEMM_SIZE, SGEMM_SIZE), dtype=np.float32) for _ in range(2))
    a @ b  # warm-up: start the BLAS threads

    print(f"B={batch} H={heads} D={d} {'causal' if causal else 'non-causal'} float32, "
          f"best of {args.repeat}, interleaved")
    print(f"{'N':>6} {'implementation':<16} {'time ms':>9} {'GFLOP/s':>8} {'% sgemm':>8}")
    failed = False
    for n in lengths:
        q, k, v = (rng.standard_normal((batch, heads, n, d), dtype=np.float32) for _ in range(3))
        visible_pairs = n * (n + 1) // 2 if causal else n * n
        flops = 4 * batch * heads * visible_pairs * d

        # With bottom-right causal alignment the last query rows against all keys are exactly
        # the last rows of the full result, so a small dense reference suffices.
        rows = np.s_[..., -CHECK_ROWS:, :]
        ref = attention_reference(q[rows], k, v, causal=causal)
        plain = attention_reference(q[rows], k, v, causal=causal, dtype=np.float32)
        allowed = 2 * float(np.abs(plain - ref).max()) + 1e-6
        for name, attend in implementations.items():  # also the warm-up (JIT cache load)
            err = float(np.abs(attend(q, k, v, causal=causal)[rows] - ref).max())
            if not err <= allowed:
                print(f"FAILED: {name} at N={n}: max error {err:.2e} > {allowed:.2e}")
                failed = True

        times = {name: [] for name in implementations}
        sgemm_times = []
        for _ in range(args.repeat):  # interleaved: one run of each, then again
            sgemm_times.append(seconds(lambda: a @ b))
            for name, attend in implementations.items():
                times[name].append(seconds(lambda: attend(q, k, v, causal=causal)))
        ceiling = 2 * SGEMM_SIZE**3 / min(sgemm_times) / 1e9
        gflops = {name: flops / min(runs) / 1e9 for name, runs in times.items()}
        # Attention's FLOPs are matmul FLOPs: beating sgemm means sgemm was measured while the
        # machine was busy (or numpy's BLAS is slow on this CPU), and a share above 100% would
        # not be a measurement.
        reliable = max(gflops.values()) <= ceiling
        # the ceiling's own row: one float32 matmul of SGEMM_SIZE^3, the same at every N
        print(f"{n:>6} {f'sgemm {SGEMM_SIZE}^3':<16} {min(sgemm_times) * 1e3:>9.1f} "
              f"{ceiling:>8.1f} {'100%' if reliable else '-':>8}")
        for name, runs in times.items():
            share = f"{100 * gflops[name] / ceiling:.0f}%" if reliable else "-"
            print(f"{n:>6} {name:<16} {min(runs) * 1e3:>9.1f} {gflops[name]:>8.1f} {share:>8}")
        if not reliable:
            print(f"{'':>6} (faster than sgemm: the machine was busy while sgemm ran, or "
                  "numpy's BLAS is slow on this CPU; no % given)")
    if failed:
        raise SystemExit("FAILED: an implementation is above the accuracy rule")
    print("all implementations agree with the reference")


if __name__ == "__main__":
    main()
