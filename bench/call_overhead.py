"""The fixed cost of one decoding call, cpuflash against torch SDPA, side by side.

    python bench/call_overhead.py                         # threads 2 and 1, all cases
    python bench/call_overhead.py --threads 2 --dtypes float32 --repeats 15
    python bench/call_overhead.py --baseline HEAD~3       # also an older revision's cpuflash

A decoding step calls attention once per layer (30 times per token for a 30-layer model) with
one query row per head, so at short caches the per-call cost, not the kernel, sets the speed.
Shapes: q (B, 9, 1, 64) on 3 KV heads (GQA), n cached keys. Each case is timed for

* ``kvcache``: ``attention_with_kvcache(q, k_cache, v_cache)``, the whole cache as a
  transformers model hands it (``cache_seqlens=None``);
* ``kvcache-lens``: a preallocated cache of n + 64 rows with ``cache_seqlens`` = n (flash-attn's
  way);
* ``kvcache-tensors``: ``kvcache`` with torch tensors in (read in place; float32/float16);
* ``attention``: ``attention(q, k, v, causal=True)`` with Nq = 1;
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)``;

with the same thread count for both libraries (numba.set_num_threads and torch.set_num_threads),
interleaved round by round, best of N rounds of a loop of calls. Prints microseconds per call and
torch's time over each cpuflash call's (above 1: cpuflash is faster). Every output is checked
against torch's before timing.
"""

import argparse
import sys
import time

import numba
import numpy as np
import torch

import cpuflash

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
LOOP_SECONDS = 0.004  # one timed loop: long enough for the clock, short enough to interleave


def _inputs(rng, batch, n_keys, dtype):
    """numpy and torch versions of q, k, v (and a padded cache with its lengths)."""
    import ml_dtypes

    shapes = [(batch, HEADS, 1, HEAD_DIM), (batch, KV_HEADS, n_keys, HEAD_DIM),
              (batch, KV_HEADS, n_keys, HEAD_DIM)]
    full = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    if dtype == "bfloat16":
        arrays = [x.astype(ml_dtypes.bfloat16) for x in full]
        tensors = [torch.from_numpy(x).to(torch.bfloat16) for x in full]
    else:
        arrays = [x.astype(dtype) for x in full]
        tensors = [torch.from_numpy(x) for x in arrays]
    padded = [np.concatenate([x, np.zeros_like(x[:, :, :64])], axis=2) for x in arrays[1:]]
    lengths = np.full(batch, n_keys, dtype=np.int32)
    return arrays, tensors, padded, lengths


def _calls(package, arrays, tensors, padded, lengths, dtype):
    q, k, v = arrays
    calls = {
        "kvcache": lambda: package.attention_with_kvcache(q, k, v),
        "kvcache-lens": lambda: package.attention_with_kvcache(
            q, *padded, cache_seqlens=lengths),
        "attention": lambda: package.attention(q, k, v, causal=True),
    }
    if dtype != "bfloat16":  # numpy cannot view torch's bfloat16
        calls["kvcache-tensors"] = lambda: package.attention_with_kvcache(*tensors)
    return calls


def _best_of(calls, repeats):
    """Microseconds per call of each of `calls`, best of `repeats` interleaved rounds."""
    loops = {}
    for name, call in calls.items():  # warm up, then size each loop to LOOP_SECONDS
        call()
        start = time.perf_counter()
        call()
        loops[name] = max(3, int(LOOP_SECONDS / max(time.perf_counter() - start, 1e-7)))
    best = dict.fromkeys(calls, float("inf"))
    names = list(calls)
    for r in range(repeats):
        # each round starts one further along: the call right after torch's finds its threads
        # still spinning on the other core (a 2-thread call there measured 1.3x slower)
        for name in names[r % len(names):] + names[:r % len(names)]:
            call, n = calls[name], loops[name]
            start = time.perf_counter()
            for _ in range(n):
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / n * 1e6)
    return best


def _as_float64(x):
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="2,1", help="thread counts, e.g. 2,1")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--keys", default="64,1024")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--baseline", default=None,
                        help="a git revision whose cpuflash is timed too (compiles its kernels "
                             "once, about 10 s per kernel and dtype)")
    args = parser.parse_args(argv)
    packages = {"": cpuflash}
    if args.baseline:
        import tempfile
        from pathlib import Path

        import compare_revisions  # bench/compare_revisions.py

        into = Path(tempfile.mkdtemp(prefix="cpuflash-overhead-"))
        sys.path.insert(0, str(into))
        packages = {"old ": compare_revisions.snapshot(args.baseline, into), "": cpuflash}
    rng = np.random.default_rng(0)
    print(f"cpuflash per-call cost against torch {torch.__version__} SDPA: q (B, {HEADS}, 1, "
          f"{HEAD_DIM}), k/v (B, {KV_HEADS}, n, {HEAD_DIM}); us per call, best of "
          f"{args.repeats}; 'x torch' = torch's time / cpuflash's (above 1: cpuflash faster)")
    for threads in (int(t) for t in args.threads.split(",")):
        numba.set_num_threads(threads)
        torch.set_num_threads(threads)
        for dtype in args.dtypes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                for n_keys in (int(n) for n in args.keys.split(",")):
                    arrays, tensors, padded, lengths = _inputs(rng, batch, n_keys, dtype)
                    tq, tk, tv = tensors
                    calls = {"torch": lambda: torch.nn.functional.scaled_dot_product_attention(
                        tq, tk, tv, enable_gqa=True)}
                    for prefix, package in packages.items():
                        for name, call in _calls(package, arrays, tensors, padded, lengths,
                                                 dtype).items():
                            calls[prefix + name] = call
                    expected = _as_float64(calls["torch"]())
                    tolerance = 1e-4 if dtype == "float32" else 3e-2
                    for name, call in calls.items():
                        np.testing.assert_allclose(_as_float64(call()), expected, atol=tolerance,
                                                   rtol=tolerance, err_msg=name)
                    with torch.inference_mode():
                        best = _best_of(calls, args.repeats)
                    line = ", ".join(f"{name} {best[name]:.1f}"
                                     + ("" if name == "torch"
                                        else f" ({best['torch'] / best[name]:.2f}x torch)")
                                     for name in calls)
                    print(f"threads={threads} {dtype} B={batch} n={n_keys}: {line}",
                          flush=True)


if __name__ == "__main__":
    main()
