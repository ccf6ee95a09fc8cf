"""Calls whose bits Python threads, fork and thread counts must not change.

Shared by test_threads.py and test_determinism.py and imported by the scripts they run in fresh
interpreters (after ``sys.path.insert(0, TESTS_DIR)``), so it imports no test module and no
pytest.
"""

import numpy as np

import cpuflash

from helpers import packed, random_qkv


def workload(seed=7):
    """name -> zero-argument call of a public entry point, on fixed random inputs.

    Sizes are small but span several work items and query/key blocks. Calls that write new
    keys into a cache write into a fresh copy and return it, so they can be repeated.
    """
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, (2, 4, 150, 40), (2, 2, 170, 40), d_v=24)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    bias = rng.standard_normal((150, 170)).astype(np.float32)
    slopes = rng.uniform(0.01, 0.2, 4).astype(np.float32)
    vq, vk, vv, cu_q, cu_k = packed(rng, [3, 0, 100, 47], [10, 5, 100, 120])
    dq = rng.standard_normal((2, 4, 1, 40)).astype(np.float32)
    pq = rng.standard_normal((2, 4, 20, 40)).astype(np.float32)
    k_cache = rng.standard_normal((2, 2, 300, 40)).astype(np.float32)
    v_cache = rng.standard_normal((2, 2, 300, 24)).astype(np.float32)
    new_k = rng.standard_normal((2, 2, 1, 40)).astype(np.float32)
    new_v = rng.standard_normal((2, 2, 1, 24)).astype(np.float32)
    seqlens = np.array([50, 299], np.int32)

    out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)

    def with_new_keys():
        kc, vc = k_cache.copy(), v_cache.copy()
        out, lse = cpuflash.attention_with_kvcache(dq, kc, vc, k=new_k, v=new_v,
                                                   cache_seqlens=seqlens - 1, num_splits=2,
                                                   return_lse=True)
        return out, lse, kc, vc

    return {
        "attention": lambda: cpuflash.attention(q, k, v, causal=True, window=(60, -1),
                                                bias=bias, alibi_slopes=slopes,
                                                return_lse=True),
        "attention_f64": lambda: cpuflash.attention(q64, k64, v64, softcap=5.0, return_lse=True),
        # (calls of the common kinds: repeated, they run from stored plans, `cpuflash._plans`)
        "attention_causal": lambda: cpuflash.attention(q, k, v, causal=True, return_lse=True),
        "backward": lambda: cpuflash.attention_backward(dout, q, k, v, out, lse, causal=True),
        "varlen": lambda: cpuflash.attention_varlen(vq, vk, vv, cu_q, cu_k, causal=True,
                                                    return_lse=True),
        "kvcache_decode": lambda: cpuflash.attention_with_kvcache(
            dq, k_cache, v_cache, cache_seqlens=seqlens, num_splits=3, return_lse=True),
        "kvcache_prefill": lambda: cpuflash.attention_with_kvcache(
            pq, k_cache, v_cache, cache_seqlens=seqlens, num_splits=1, return_lse=True),
        "kvcache_new_keys": with_new_keys,
    }


def determinism_cases():
    """name -> zero-argument call. One head and 300 rows: the tile chooser shrinks `block_q`
    when there are fewer work items than twice the threads (240 rows with 1 thread, 72 with 2),
    so thread counts really change the schedule."""
    rng = np.random.default_rng(11)
    cases = {}
    for dtype in (np.float32, np.float64, np.float16):
        q, k, v = random_qkv(rng, (1, 1, 300, 40), (1, 1, 333, 40), d_v=24, dtype=dtype)
        n = np.dtype(dtype).name
        bias = rng.standard_normal((300, 333)).astype(np.float32)
        mask = rng.random((300, 333)) < 0.8
        slopes = rng.uniform(0.01, 0.3, 1).astype(np.float32)
        sinks = rng.standard_normal(1).astype(np.float32)
        for what, kwargs in {"plain": {}, "causal": dict(causal=True),
                             "window": dict(window=(40, 7)), "alibi": dict(alibi_slopes=slopes),
                             "bias": dict(bias=bias), "mask": dict(mask=mask),
                             "sinks": dict(sinks=sinks, causal=True),
                             "softcap": dict(softcap=3.0)}.items():
            cases[f"attention-{what}-{n}"] = (
                lambda q=q, k=k, v=v, kw=kwargs: cpuflash.attention(q, k, v, return_lse=True,
                                                                    **kw))
    for dtype in (np.float32, np.float16):  # rows of whole vectors: packed and written as such
        q, k, v = random_qkv(rng, (1, 1, 300, 64), (1, 1, 333, 64), d_v=64, dtype=dtype)
        bias = rng.standard_normal((300, 333)).astype(np.float32)
        for what, kwargs in {"causal": dict(causal=True), "window": dict(window=(40, 7)),
                             "bias": dict(bias=bias)}.items():
            cases[f"attention-{what}-{np.dtype(dtype).name}-d64"] = (
                lambda q=q, k=k, v=v, kw=kwargs: cpuflash.attention(q, k, v, return_lse=True,
                                                                    **kw))
    vq, vk, vv, cu_q, cu_k = packed(rng, [290, 3, 0, 17], [300, 5, 9, 200])
    cases["varlen"] = lambda: cpuflash.attention_varlen(vq, vk, vv, cu_q, cu_k, causal=True,
                                                        window=(100, -1), return_lse=True)
    oq, ok, ov, o_cu_q, o_cu_k = packed(rng, [300], [333], hq=1, hk=1)
    cases["varlen-one-sequence"] = lambda: cpuflash.attention_varlen(
        oq, ok, ov, o_cu_q, o_cu_k, causal=True, return_lse=True)
    cases["varlen-one-sequence-window"] = lambda: cpuflash.attention_varlen(
        oq, ok, ov, o_cu_q, o_cu_k, window=(40, 7), return_lse=True)
    dq = rng.standard_normal((1, 4, 1, 40)).astype(np.float32)
    pq = rng.standard_normal((1, 4, 40, 40)).astype(np.float32)
    k_cache = rng.standard_normal((1, 1, 2000, 40)).astype(np.float32)
    v_cache = rng.standard_normal((1, 1, 2000, 24)).astype(np.float32)
    for splits in (1, 3):
        for name, qq in (("decode", dq), ("prefill", pq)):
            cases[f"kvcache-{name}-splits{splits}"] = (
                lambda qq=qq, s=splits: cpuflash.attention_with_kvcache(
                    qq, k_cache, v_cache, cache_seqlens=np.array([1900], np.int32),
                    num_splits=s, return_lse=True))
    # cache rows read in place: GQA groups of 3 rows (the 4-row micro-kernels with a short group)
    gq = rng.standard_normal((1, 6, 1, 64)).astype(np.float32)
    gk = rng.standard_normal((1, 2, 2000, 64)).astype(np.float32)
    gv = rng.standard_normal((1, 2, 2000, 128)).astype(np.float32)
    for splits in (1, 3):
        cases[f"kvcache-in-place-splits{splits}"] = (
            lambda s=splits: cpuflash.attention_with_kvcache(gq, gk, gv, num_splits=s,
                                                             return_lse=True))
    return cases
