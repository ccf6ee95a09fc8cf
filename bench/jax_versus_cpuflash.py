"""cpuflash.jax against jax.nn.dot_product_attention, both jitted, on this CPU.

Both take (B, N, H, D) arrays; the forward and the forward + gradient (q, k, v) are timed
side by side in one process, interleaved (one call of each in turn, so that a change in the
machine's state hits both), best of `--repeat`. Outputs and gradients are compared first.

    python bench/jax_versus_cpuflash.py                  # B1 N4096 H8 D128 causal float32
    taskset -c 1 python bench/jax_versus_cpuflash.py --n 1024 --repeat 3

GFLOP/s count 4*B*H*D per visible (query, key) pair for the forward (2 matmuls) and 2.5x that
for the backward (5 matmuls), as flash-attn's benchmarks do.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import cpuflash.jax as cj


def visible_pairs(n, causal):
    return n * (n + 1) // 2 if causal else n * n


def best_times(functions, args, repeat):
    """Best wall time of each function, calls interleaved."""
    for f in functions:  # compile and warm up
        jax.block_until_ready(f(*args))
    best = [float("inf")] * len(functions)
    for _ in range(repeat):
        for i, f in enumerate(functions):
            start = time.perf_counter()
            jax.block_until_ready(f(*args))
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    shape = (args.batch, args.n, args.heads, args.dim)
    dtype = jnp.dtype(args.dtype)
    q, k, v, w = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(4))

    def forward(attention):
        return jax.jit(lambda q, k, v: attention(q, k, v, is_causal=args.causal))

    def with_grad(attention):
        def loss(q, k, v):
            out = attention(q, k, v, is_causal=args.causal)
            return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    implementations = [jax.nn.dot_product_attention, cj.dot_product_attention]
    fwd = [forward(f) for f in implementations]
    fwd_bwd = [with_grad(f) for f in implementations]

    # -- check before timing: cpuflash against jax.nn (every row sees a key here)
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    a, b = (np.asarray(f(q, k, v), np.float32) for f in fwd)
    scale = np.abs(a).max()
    assert np.abs(a - b).max() <= tolerance * scale, "forward outputs differ"
    (_, ga), (_, gb) = (f(q, k, v) for f in fwd_bwd)
    for x, y in zip(ga, gb):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.abs(x - y).max() <= tolerance * np.abs(x).max(), "gradients differ"

    flops = 4.0 * args.batch * args.heads * args.dim * visible_pairs(args.n, args.causal)
    print(f"B{args.batch} N{args.n} H{args.heads} D{args.dim} "
          f"{'causal' if args.causal else 'full'} {args.dtype}, best of {args.repeat}, "
          f"jax {jax.__version__}")
    print(f"{'':16}{'jax.nn ms':>11}{'GFLOP/s':>9}{'cpuflash ms':>13}{'GFLOP/s':>9}"
          f"{'speedup':>9}")
    for label, functions, work in (("forward", fwd, flops),
                                   ("forward+grad", fwd_bwd, 3.5 * flops)):
        times = best_times(functions, (q, k, v), args.repeat)
        rates = [work / t / 1e9 for t in times]
        print(f"{label:16}{1e3 * times[0]:11.1f}{rates[0]:9.1f}{1e3 * times[1]:13.1f}"
              f"{rates[1]:9.1f}{times[0] / times[1]:8.2f}x")


if __name__ == "__main__":
    main()
