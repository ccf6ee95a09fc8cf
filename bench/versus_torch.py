"""cpuflash against torch SDPA for one dtype, side by side in one process (interleaved, best of N).

    python bench/versus_torch.py --dtype float64                        # float64 target case
    NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=-avx512f ATEN_CPU_CAPABILITY=avx2 \\
        python bench/versus_torch.py                                    # both on AVX2 code

`python -m cpuflash bench` is the full float32 comparison; this script covers what it does not:
other dtypes, and the AVX2 code paths of both libraries selected by the environment above.
"""

import argparse
import time

import numpy as np
import torch

import cpuflash
from cpuflash._simd import LANES_F32

import runner  # bench/runner.py

CASES = [(1, 8, 2048, 64, False), (1, 8, 4096, 128, False), (1, 8, 4096, 128, True)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    dtype = np.dtype(args.dtype)
    runner.match_torch_threads()
    print(f"{args.dtype}; cpuflash vectors: {LANES_F32} float32 lanes; torch CPU capability: "
          f"{torch.backends.cpu.get_cpu_capability()}")
    for batch, heads, n, d, causal in CASES:
        case = runner._case(batch, heads, heads, n, n, d, causal)
        q, k, v = runner.random_inputs(case, dtype=dtype)
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        calls = {
            "cpuflash": lambda: cpuflash.attention(q, k, v, causal=causal),
            "torch": lambda: torch.nn.functional.scaled_dot_product_attention(
                tq, tk, tv, is_causal=causal).numpy(),
        }
        for name, call in calls.items():  # check before timing
            ok, error, limit = runner.check_against_reference(
                call().astype(np.float32), q, k, v, causal=causal, heads=[(0, 0)])
            if not ok:
                raise SystemExit(f"{name} is wrong on {case}: error {error:.2g} > {limit:.2g}")
        best = {name: float("inf") for name in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():
                runner.settle(call)  # other library's threads stop spinning; this one's wake
                start = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - start)
        work = runner.case_flops(case)
        rates = {name: work / seconds / 1e9 for name, seconds in best.items()}
        print(f"  {runner.case_label(case):28} cpuflash {rates['cpuflash']:6.1f} GFLOP/s, "
              f"torch {rates['torch']:6.1f}: {rates['cpuflash'] / rates['torch']:.2f}x")


if __name__ == "__main__":
    main()
