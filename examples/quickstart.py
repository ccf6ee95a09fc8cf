"""cpuflash in one minute: attention on random inputs, checked against the reference, timed.

    python examples/quickstart.py           # B=1, H=8, N=2048, D=128
    python examples/quickstart.py --small   # a few seconds, used by the tests
"""

import argparse
import time

import numpy as np

import cpuflash
from cpuflash.reference import attention_reference


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes (for CI)")
    args = parser.parse_args(argv)
    batch, heads, n, d = (1, 2, 256, 64) if args.small else (1, 8, 2048, 128)

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((batch, heads, n, d), dtype=np.float32) for _ in range(3))

    start = time.perf_counter()
    out = cpuflash.attention(q, k, v, causal=True)  # first call: JIT compile or cache load
    first = time.perf_counter() - start

    times = []
    for _ in range(3):
        start = time.perf_counter()
        cpuflash.attention(q, k, v, causal=True)
        times.append(time.perf_counter() - start)
    best = min(times)

    ref = attention_reference(q, k, v, causal=True)  # float64, dense
    err = float(np.abs(out - ref).max())
    plain = float(np.abs(attention_reference(q, k, v, causal=True, dtype=np.float32) - ref).max())
    flops = 4 * batch * heads * (n * (n + 1) // 2) * d  # causal: visible pairs only
    print(f"cpuflash.attention  B={batch} H={heads} N={n} D={d} causal float32")
    print(f"  first call {first:.2f} s, then {best * 1e3:.1f} ms "
          f"= {flops / best / 1e9:.0f} GFLOP/s")
    print(f"  max error vs float64 reference {err:.2e} (plain float32 numpy: {plain:.2e})")
    if not err <= 2 * plain + 1e-6:
        raise SystemExit("FAILED: error above the accuracy rule")
    print("  OK")


if __name__ == "__main__":
    main()
