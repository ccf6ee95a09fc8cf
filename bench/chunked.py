"""Chunked local attention (`chunk_size`, Llama 4) against plain causal attention, side by side
in one process, interleaved, best of N.

    python bench/chunked.py                      # 32768 keys in chunks of 8192, D 128
    python bench/chunked.py --n 16384 --chunk 4096 --repeats 5 --backward

A causal prefill in chunks of C does about C / N of the causal work (every chunk its own
triangle); the tiles of other chunks are never visited, so the time should follow the work.
Prints the times, their ratio and the ratio of the visible pairs. Both outputs are checked
against the dense reference on a few query rows before timing.
"""

import argparse
import time

import numpy as np

import cpuflash
from cpuflash.reference import attention_reference


def visible_pairs(n, chunk=None):
    """Query-key pairs a causal (chunked) call computes over `n` rows."""
    if chunk is None:
        return n * (n + 1) // 2
    whole, rest = divmod(n, chunk)
    return whole * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backward", action="store_true", help="time the backward too")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    shape = (1, args.heads, args.n, args.dim)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    rows = slice(args.n - 3, args.n)  # the last rows: the whole last chunk's keys
    for options in (dict(), dict(chunk_size=args.chunk)):
        out = cpuflash.attention(q, k, v, causal=True, **options)
        # (a chunk's start keeps the sliced keys' chunks the whole sequence's)
        start = (args.n - 3) // args.chunk * args.chunk if options else 0
        expected = attention_reference(q[:, :, rows], k[:, :, start:], v[:, :, start:],
                                       causal=True, **options)
        assert np.abs(out[:, :, rows] - expected).max() < 1e-4, options
    calls = {"causal": lambda: cpuflash.attention(q, k, v, causal=True, return_lse=True),
             f"chunk_size={args.chunk}": lambda: cpuflash.attention(
                 q, k, v, causal=True, chunk_size=args.chunk, return_lse=True)}
    if args.backward:
        dout = rng.standard_normal(shape, dtype=np.float32)
        for name, options in (("causal", {}), (f"chunk_size={args.chunk}",
                                                dict(chunk_size=args.chunk))):
            out, lse = calls[name]()
            calls[name + " backward"] = (lambda out=out, lse=lse, options=options:
                                         cpuflash.attention_backward(dout, q, k, v, out, lse,
                                                                     causal=True, **options))
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(args.repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    work = visible_pairs(args.n, args.chunk) / visible_pairs(args.n)
    names = list(calls)
    print(f"N {args.n}, H {args.heads}, D {args.dim}, float32; visible pairs chunked / causal "
          f"{work:.3f}")
    for plain, chunked in zip(names[0::2], names[1::2]):
        print(f"{plain}: {best[plain]:.3f} s; {chunked}: {best[chunked]:.3f} s; "
              f"ratio {best[chunked] / best[plain]:.3f}")


if __name__ == "__main__":
    main()
