"""Time git revisions of cpuflash side by side, in one process, interleaved, best of N.

    python bench/compare_revisions.py HEAD~3 HEAD                  # causal and window cases
    python bench/compare_revisions.py 4abaa0e WORKTREE --cases window,short --repeats 9
    python bench/compare_revisions.py HEAD WORKTREE --cases decode,decode-mqa --repeats 15

Each revision's `cpuflash/` is copied (``git archive``; ``WORKTREE`` copies the working tree)
into a temporary folder as a package of its own, so all of them can be imported at once, and
each compiles its kernels on first use (7-20 s each on 2 cores; the cache lives in the copy). Every
revision is checked against the first one's output before timing. Prints ns per visible
query-key pair (summed over heads) and each case's time against the last revision's. On a
shared machine this is the fair way to tell whether a change is faster: the revisions meet the
same noise, round after round. Name the base revision twice (``HEAD HEAD WORKTREE``) for a
control: two copies of the same code can differ by a few percent (docs/performance.md), so a
gain smaller than the copies' difference is not one.
"""

import argparse
import importlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import runner  # bench/runner.py

REPO = Path(__file__).resolve().parent.parent
HEADS, HEAD_DIM = 8, 128


def _slopes(heads=HEADS):
    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)


# name -> (Nq, Nk, options, Hq, Hk, D, dtype); the score-modifier cases of
# bench/test_bench_features.py, a dense short-key case (each row sees 256 keys, as a window of
# 256 does), and the decoding cases of bench/test_bench_decode.py (`attention_with_kvcache`),
# with a float16 cache, with D=64, with groups of one and two query heads per KV head, paged
# (pages of 16 and 256 rows, shuffled), and with int8, float8_e4m3 and int4 (groups of 32) caches
# (a dtype named by its `cpuflash.quantize_kv` format) too, and 16 query rows a head from a cache
# (a prefill chunk, speculative decoding's draft rows), with a window too, and 32 rows a head
# with ALiBi (the heads of a kv head share each packed key block)
CASES = {
    "causal": (4096, 4096, dict(causal=True), HEADS, HEADS, HEAD_DIM, np.float32),
    "window": (16384, 16384, dict(window=(256, 0)), HEADS, HEADS, HEAD_DIM, np.float32),
    "full": (4096, 4096, {}, HEADS, HEADS, HEAD_DIM, np.float32),
    "alibi": (4096, 4096, dict(causal=True, alibi_slopes=_slopes()), HEADS, HEADS, HEAD_DIM,
              np.float32),
    "softcap": (4096, 4096, dict(causal=True, softcap=30.0), HEADS, HEADS, HEAD_DIM, np.float32),
    "short": (16384, 256, {}, HEADS, HEADS, HEAD_DIM, np.float32),
    "decode": (1, 16384, {}, 32, 8, HEAD_DIM, np.float32),
    "decode-mqa": (1, 16384, {}, 8, 1, HEAD_DIM, np.float32),
    "decode-f16": (1, 16384, {}, 32, 8, HEAD_DIM, np.float16),
    "decode-d64": (1, 16384, {}, 32, 8, 64, np.float32),
    "decode-mha": (1, 16384, {}, 8, 8, HEAD_DIM, np.float32),
    "decode-g2": (1, 16384, {}, 16, 8, HEAD_DIM, np.float32),
    "decode-pages16": (1, 16384, dict(page_size=16), 32, 8, HEAD_DIM, np.float32),
    "decode-pages256": (1, 16384, dict(page_size=256), 32, 8, HEAD_DIM, np.float32),
    "decode-int8": (1, 16384, {}, 32, 8, HEAD_DIM, "int8"),
    "decode-mha-int8": (1, 16384, {}, 8, 8, HEAD_DIM, "int8"),
    "decode-e4m3": (1, 16384, {}, 32, 8, HEAD_DIM, "float8_e4m3"),
    "decode-int4": (1, 16384, {}, 32, 8, HEAD_DIM, "int4"),
    "decode-mha-int4": (1, 16384, {}, 8, 8, HEAD_DIM, "int4"),
    "decode-rows16": (16, 16384, {}, 32, 8, HEAD_DIM, np.float32),
    "decode-rows16-window": (16, 16384, dict(window=(8192, 0)), 32, 8, HEAD_DIM, np.float32),
    "decode-rows32-alibi": (32, 16384, dict(alibi_slopes=_slopes(32)), 32, 8, HEAD_DIM,
                            np.float32),
}


def _paged(k, v, options, rng):
    """(k, v, options) with the caches cut into pages of ``options["page_size"]`` rows, stored
    in a shuffled order and found through a block table; unchanged without a page size."""
    if "page_size" not in options:
        return k, v, options
    options = dict(options)
    size = options.pop("page_size")
    n_pages = k.shape[2] // size
    order = rng.permutation(n_pages)
    paged = []
    for cache in (k, v):
        pages = cache[0].reshape(cache.shape[1], n_pages, size, cache.shape[3]).swapaxes(0, 1)
        store = np.empty_like(pages)
        store[order] = pages
        paged.append(store)
    options["block_table"] = order[None, :].astype(np.int32)
    return paged[0], paged[1], options


def _call(package, name, q, k, v, options):
    if name.startswith("decode"):
        return package.attention_with_kvcache(q, k, v, **options)
    return package.attention(q, k, v, **options)


def _caches(package, k, v, dtype):
    """k and v as `package` takes them: quantized by its own `quantize_kv` where `dtype` names
    a quantized format (each revision's `QuantizedKV` is a class of its own)."""
    if isinstance(dtype, str):
        return package.quantize_kv(k, dtype), package.quantize_kv(v, dtype)
    return k, v


def snapshot(revision, into):
    """Import `revision`'s cpuflash as a package named after its position."""
    name = f"cpuflash_rev{len(list(into.iterdir()))}"
    target = into / name
    if revision == "WORKTREE":
        shutil.copytree(REPO / "cpuflash", target,
                        ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "cpuflash"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
        (into / "cpuflash").rename(target)
    return importlib.import_module(name)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="+", help="git revisions, or WORKTREE")
    parser.add_argument("--cases", default="causal,window",
                        help="comma-separated, of: " + ", ".join(CASES))
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    names = args.cases.split(",")
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")

    with tempfile.TemporaryDirectory(prefix="cpuflash-revisions-") as folder:
        sys.path.insert(0, folder)
        packages = [snapshot(revision, Path(folder)) for revision in args.revisions]
        rng = np.random.default_rng(0)
        inputs = {}
        for name in names:
            n_q, n_k, options, heads, kv_heads, d, dtype = CASES[name]
            floats = np.float32 if isinstance(dtype, str) else dtype
            q = rng.standard_normal((1, heads, n_q, d), dtype=np.float32).astype(floats)
            k, v = (rng.standard_normal((1, kv_heads, n_k, d), dtype=np.float32).astype(floats)
                    for _ in range(2))
            k, v, options = _paged(k, v, options, rng)
            caches = [_caches(package, k, v, dtype) for package in packages]
            causal = options.get("causal", False) or name.startswith("decode")
            pairs = heads * runner.visible_pairs(n_q, n_k, causal, options.get("window"))
            first = _call(packages[0], name, q, *caches[0], options)
            for revision, package, kv in zip(args.revisions[1:], packages[1:], caches[1:]):
                error = float(np.abs(_call(package, name, q, *kv, options)
                                     - first).astype(np.float32).max())
                if not error <= (1e-5 if floats == np.float32 else 2e-3):
                    raise SystemExit(f"{revision} differs from {args.revisions[0]} on {name} "
                                     f"by {error:.3g}")
            inputs[name] = (q, caches, options, pairs)

        best = {(name, i): float("inf") for name in names for i in range(len(packages))}
        for _ in range(max(1, args.repeats)):
            for name, (q, caches, options, _) in inputs.items():
                for i, package in enumerate(packages):
                    call = (lambda package=package, kv=caches[i]:
                            _call(package, name, q, *kv, options))
                    runner.settle(call, cheap=name.startswith("decode"))
                    start = time.perf_counter()
                    call()
                    best[(name, i)] = min(best[(name, i)], time.perf_counter() - start)

    print(f"ns per visible pair, best of {args.repeats} interleaved rounds (B=1; H={HEADS}, "
          f"D={HEAD_DIM}, float32 unless the case says otherwise)")
    print(f"{'case':10}" + "".join(f"{revision:>16}" for revision in args.revisions)
          + "   first/last time")
    for name, (*_, pairs) in inputs.items():
        seconds = [best[(name, i)] for i in range(len(packages))]
        print(f"{name:10}" + "".join(f"{s / pairs * 1e9:16.4f}" for s in seconds)
              + f"   {seconds[0] / seconds[-1]:.3f}")


if __name__ == "__main__":
    main()
