"""Long-context causal attention in a few hundred MB: N = 32768 without an N x N matrix.

A naive implementation materializes the ``H x N x N`` score matrix (16 GiB in float32 for
H=4, N=32768); cpuflash streams key blocks through the cache and keeps only the output and a
few tiles per thread. The script times one call, prints the peak memory of the process
(``ru_maxrss``) next to the size of that matrix, and checks the first and the last 64 query
rows against the dense reference (exits non-zero on failure). Linux/macOS (uses `resource`).

    python examples/long_context.py           # B=1, H=4, N=32768, D=64, causal (~10 s)
    python examples/long_context.py --small   # N=2048, used by the tests
"""

import argparse
import resource
import sys
import time

import numpy as np

import cpuflash
from cpuflash.reference import attention_reference

CHECK_ROWS = 64


def peak_rss_bytes():
    """Peak resident memory of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def check_rows(name, got, q, k, v):
    """Compare `got` to the float64 reference with the tests' rule: at most 2x the error of a
    plain float32 implementation, plus a tiny floor."""
    ref = attention_reference(q, k, v, causal=True)
    plain = attention_reference(q, k, v, causal=True, dtype=np.float32)
    err = float(np.abs(got - ref).max())
    plain_err = float(np.abs(plain - ref).max())
    ok = err <= 2 * plain_err + 1e-6
    print(f"  {name}: max error {err:.2e} (plain float32: {plain_err:.2e}) "
          f"{'OK' if ok else 'FAILED'}")
    return ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="N=2048 (for CI)")
    args = parser.parse_args(argv)
    batch, heads, n, d = (1, 4, 2048, 64) if args.small else (1, 4, 32768, 64)

    # Load the compiled kernel first, so that the memory and time below are the call's own.
    tiny = np.zeros((1, 1, 8, d), dtype=np.float32)
    cpuflash.attention(tiny, tiny, tiny, causal=True)

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((batch, heads, n, d), dtype=np.float32) for _ in range(3))
    rss_before = peak_rss_bytes()

    start = time.perf_counter()
    out = cpuflash.attention(q, k, v, causal=True)
    seconds = time.perf_counter() - start
    rss_after = peak_rss_bytes()

    flops = 4 * batch * heads * (n * (n + 1) // 2) * d  # causal: visible pairs only
    scores_bytes = batch * heads * n * n * 4  # what a naive float32 implementation allocates
    inputs_bytes = 3 * q.nbytes
    mib = 2.0**20
    print(f"cpuflash.attention  B={batch} H={heads} N={n} D={d} causal float32")
    print(f"  {seconds:.2f} s = {flops / seconds / 1e9:.0f} GFLOP/s")
    print(f"  q, k, v: {inputs_bytes / mib:.0f} MiB, output: {out.nbytes / mib:.0f} MiB")
    print(f"  process peak RSS: {rss_after / mib:.0f} MiB "
          f"(grew by {(rss_after - rss_before) / mib:.0f} MiB during the call)")
    print(f"  a naive N x N float32 score matrix alone: {scores_bytes / mib:.0f} MiB")

    # Bottom-right causal alignment: the last rows of q against all keys are the last rows of
    # the full causal attention, and the first rows only see the first keys.
    ok = check_rows(f"last {CHECK_ROWS} rows", out[..., -CHECK_ROWS:, :],
                    q[..., -CHECK_ROWS:, :], k, v)
    ok &= check_rows(f"first {CHECK_ROWS} rows", out[..., :CHECK_ROWS, :],
                     q[..., :CHECK_ROWS, :], k[..., :CHECK_ROWS, :], v[..., :CHECK_ROWS, :])
    if not ok:
        raise SystemExit("FAILED: error above the accuracy rule")
    print("  OK")


if __name__ == "__main__":
    main()
