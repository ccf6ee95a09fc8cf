"""Large query groups: DeepSeek's absorbed MLA and MQA decoding, cpuflash against torch, side by
side in one process, interleaved, best of N.

    python bench/large_groups.py                      # 2 threads, then 1
    python bench/large_groups.py --threads 2 --repeats 9 --cases mla-128,mqa-64

Cases (float32 unless named; one query row a head, the whole cache attended):

* ``mla-128``: q (1, 128, 1, 576) on one latent head of N rows, whose first 512 dims are the
  values (``v_cache = k_cache[..., :512]``), N = 8192 and 65536; ``mla-16``: one tensor-parallel
  shard of it (16 heads); ``mla-128-bf16``: the latent cache in bfloat16 (q too), against
  cpuflash on the same cache in float32 too;
* ``mqa-64``: 64 heads on one kv head, D = 128, N = 16384;
* ``prefill-64``: Hq 64 on Hk 1, N = 4096, D = 128, causal (torch SDPA with ``enable_gqa``);
* ``chunk-64``: the same group, 16 new query rows a head against a cache of 16384 (a chunk of
  a prefill, or speculative decoding's draft tokens checked at once), causal;
* ``mla-128-top2048``: the MLA step over 2048 listed keys of 32768 (`key_indices`, DeepSeek
  V3.2's sparse attention) against the same step over all 32768 (values inside the keys,
  ``value_dim=512``).

Competitors: torch's "three lines" (``softmax(q K^T * scale) @ V`` as two GEMMs over the group's
heads, the way MLA decoding is written in torch) and torch SDPA with ``enable_gqa=True`` (not at
D = 576, where it computes densely: seconds a call). Rates are GFLOP/s of
``2 * Hq * N * (D + Dv)`` (half of that under the causal mask for prefill), and the best sgemm
sample of the same run (torch, 2048^3) gives "% of sgemm". Every decoding output is checked
against the three lines in float64, prefill against SDPA, before timing.
"""

import argparse
import time

import numba
import numpy as np
import torch
import torch.nn.functional as F

import cpuflash

CASES = {  # name: (Hq, Hk, Nq, N, D, Dv, dtype)
    "mla-128": (128, 1, 1, 8192, 576, 512, "float32"),
    "mla-128-64k": (128, 1, 1, 65536, 576, 512, "float32"),
    "mla-128-bf16": (128, 1, 1, 8192, 576, 512, "bfloat16"),
    "mla-16": (16, 1, 1, 8192, 576, 512, "float32"),
    "mqa-64": (64, 1, 1, 16384, 128, 128, "float32"),
    "prefill-64": (64, 1, 4096, 4096, 128, 128, "float32"),
    "chunk-64": (64, 1, 16, 16384, 128, 128, "float32"),
    "mla-128-top2048": None,  # (`run_top_k`)
}


def inputs(hq, hk, n_q, n, d, dv, dtype, seed=0):
    """numpy q, k_cache, v_cache (values inside the keys where Dv < D) and torch views."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    q = rng.standard_normal((1, hq, n_q, d), dtype=np.float32).astype(np_dtype)
    k = rng.standard_normal((1, hk, n, d), dtype=np.float32).astype(np_dtype)
    v = k[..., :dv] if dv < d else rng.standard_normal((1, hk, n, dv)).astype(np_dtype)
    as_torch = (lambda a: torch.from_numpy(np.ascontiguousarray(a))) if dtype == "float32" else \
        (lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16))
    return (q, k, v), tuple(map(as_torch, (q, k, v)))


def three_lines(tq, tk, tv, scale, visible=None):
    """MLA decoding as torch code writes it: the group's heads as the rows of two GEMMs
    (`visible`: an (Nq, N) bool mask of each head's rows)."""
    hk, group = tk.shape[1], tq.shape[1] // tk.shape[1]
    s = tq.reshape(hk, group * tq.shape[2], -1) @ tk[0].transpose(-1, -2) * scale
    if visible is not None:
        s = s.view(hk, group, *visible.shape).masked_fill(~visible, -torch.inf).view(s.shape)
    return (torch.softmax(s.float(), -1).to(tv.dtype) @ tv[0]).reshape(tq.shape[:3] + (-1,))


def best_of(functions, repeats):
    """Best seconds of each function, timed interleaved, in turns forward and back: a call
    right after another over the same cache finds it in L3 (MLA's 9.4 MB latent cache fits
    a 32 MB L3), which a fixed order would give to the same function every round."""
    best = [float("inf")] * len(functions)
    for round_ in range(repeats):
        order = list(enumerate(functions))
        for i, fn in (order if round_ % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def run_top_k(threads, repeats, n=32768, topk=2048):
    """The MLA step over `topk` listed keys of `n` against the step over all of them."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 128, 1, 576), dtype=np.float32)
    latent = rng.standard_normal((1, 1, n, 576), dtype=np.float32)
    keys = np.sort(rng.permutation(n)[:topk])[None, None].astype(np.int32)
    top = lambda: cpuflash.attention_with_kvcache(q, latent, None, value_dim=512,  # noqa: E731
                                                  key_indices=keys)
    every = lambda: cpuflash.attention_with_kvcache(q, latent, None, value_dim=512)  # noqa: E731
    (tq, tk) = (torch.from_numpy(q), torch.from_numpy(latent[:, :, keys[0, 0]]))
    expected = three_lines(tq.double(), tk.double(), tk[..., :512].double(), 1 / 24)
    assert np.abs(top() - expected.numpy()).max() < 1e-4
    every()
    t_top, t_every = best_of([top, every], repeats)
    print(f"mla-128-top{topk} {threads}t {t_top * 1e3:8.2f} ms; all {n} keys "
          f"{t_every * 1e3:.2f} ms ({t_every / t_top:.1f}x)", flush=True)


def run(name, threads, repeats):
    if name == "mla-128-top2048":
        return run_top_k(threads, repeats)
    hq, hk, n_q, n, d, dv, dtype = CASES[name]
    (q, k, v), (tq, tk, tv) = inputs(hq, hk, n_q, n, d, dv, dtype)
    scale = 1 / np.sqrt(d)
    prefill, visible = n_q == n, None
    if 1 < n_q < n:  # new rows against a cache: causal from the bottom right
        visible = torch.arange(n)[None, :] <= torch.arange(n_q)[:, None] + (n - n_q)
        ours = lambda: cpuflash.attention_with_kvcache(q, k, v, causal=True)  # noqa: E731
        theirs = {"three lines": lambda: three_lines(tq, tk, tv, scale, visible),
                  "sdpa": lambda: F.scaled_dot_product_attention(tq, tk, tv, attn_mask=visible,
                                                                 enable_gqa=True)}
    elif prefill:
        ours = lambda: cpuflash.attention(q, k, v, causal=True)  # noqa: E731
        theirs = {"sdpa": lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                                 enable_gqa=True)}
    else:
        ours = lambda: cpuflash.attention_with_kvcache(q, k, v, causal=False)  # noqa: E731
        theirs = {"three lines": lambda: three_lines(tq, tk, tv, scale)}
        if d == dv:  # (at D = 576 SDPA computes densely in its math kernel: seconds a call)
            theirs["sdpa"] = lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        if dtype == "bfloat16":  # the target: the same step on a float32 cache, interleaved
            wide = [np.asarray(x, dtype=np.float32) for x in (q, k)]
            wide.append(wide[1][..., :dv] if dv < d else np.asarray(v, dtype=np.float32))
            theirs["cpuflash float32 cache"] = lambda: cpuflash.attention_with_kvcache(
                *wide, causal=False)
    if prefill:  # (a float64 reference would hold Nq x Nk scores per head)
        expected = theirs["sdpa"]().double().numpy()
    else:
        expected = three_lines(tq.double(), tk.double(), tv.double(), scale, visible).numpy()
    got = np.asarray(ours(), dtype=np.float64)
    limit = 2e-2 if dtype == "bfloat16" else 1e-4
    assert np.abs(got - expected).max() < limit * np.abs(expected).max(), name
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    functions = [ours, *theirs.values(), lambda: a @ b]
    for fn in functions:
        fn()
    times = best_of(functions, repeats)
    sgemm = 2 * 2048 ** 3 / times[-1] / 1e9
    work = 2 * hq * n * (d + dv) * n_q * (0.5 if prefill else 1)
    rate = work / times[0] / 1e9
    cells = [f"{name:13s} {threads}t {times[0] * 1e3:8.2f} ms {rate:6.0f} GF/s "
             f"({100 * rate / sgemm:3.0f}% of sgemm {sgemm:.0f})"]
    cells += [f"{label} {t * 1e3:.2f} ms ({t / times[0]:.2f}x)"
              for label, t in zip(theirs, times[1:-1])]
    print("; ".join(cells), flush=True)
    return times[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="*", default=[2, 1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    for threads in args.threads:
        numba.set_num_threads(threads)
        torch.set_num_threads(threads)
        for name in args.cases.split(","):
            run(name, threads, args.repeats)


if __name__ == "__main__":
    main()
