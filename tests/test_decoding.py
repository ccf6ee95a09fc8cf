"""attention_varlen, attention_with_kvcache (split-KV, paged) and merge_states."""

import numpy as np
import pytest

import cpuflash
from cpuflash.reference import attention_reference

from accuracy import assert_close_to_reference, random_qkv


def packed(rng, lens_q, lens_k, hq=4, hk=2, d=40, d_v=24, dtype=np.float32):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, k, v = random_qkv(rng, (cu_q[-1], hq, d), (cu_k[-1], hk, d), d_v=d_v, dtype=dtype)
    return q, k, v, cu_q, cu_k


def heads_first(x):
    return np.swapaxes(x, 0, 1)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (17, 5)),
                                           (True, (30, -1))])
def test_varlen_matches_each_sequence(rng, causal, window):
    lens_q, lens_k = [5, 0, 130, 77, 1, 3], [9, 3, 200, 77, 0, 799]
    q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k)
    slopes = rng.uniform(0.01, 0.2, (len(lens_q), 4)).astype(np.float32)
    out, lse = cpuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window,
                                         alibi_slopes=slopes, softcap=8.0, return_lse=True)
    assert out.shape == (cu_q[-1], 4, 24) and lse.shape == (4, cu_q[-1])
    for b in range(len(lens_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        assert_close_to_reference(
            heads_first(out[rows]), heads_first(q[rows]), heads_first(k[keys]),
            heads_first(v[keys]), lse=lse[:, rows], causal=causal, window=window,
            alibi_slopes=slopes[b], softcap=8.0)


def test_varlen_equals_batched_call(rng):
    q, k, v = random_qkv(rng, (3, 4, 50, 32), (3, 2, 60, 32))
    expected = cpuflash.attention(q, k, v, causal=True)
    flat = [np.swapaxes(x, 1, 2).reshape(-1, x.shape[1], 32) for x in (q, k, v)]
    out = cpuflash.attention_varlen(*flat, np.arange(4) * 50, np.arange(4) * 60, causal=True)
    np.testing.assert_array_equal(out.reshape(3, 50, 4, 32), np.swapaxes(expected, 1, 2))


def cache_case(rng, batch=3, hq=8, hk=2, n_max=300, d=64, d_v=48, n_new=1, n_q=1,
               dtype=np.float32, seqlens=None):
    k_cache, v_cache = (rng.standard_normal((batch, hk, n_max, dd)).astype(dtype)
                        for dd in (d, d_v))
    q = rng.standard_normal((batch, hq, n_q, d)).astype(dtype)
    k = rng.standard_normal((batch, hk, n_new, d)).astype(dtype)
    v = rng.standard_normal((batch, hk, n_new, d_v)).astype(dtype)
    if seqlens is None:
        seqlens = rng.integers(0, n_max - n_new + 1, batch)
    return q, k_cache, v_cache, k, v, np.asarray(seqlens, dtype=np.int32)


def check_against_cache(out, lse, q, k_cache, v_cache, seqlens, n_new, **kwargs):
    """Each batch entry against the reference over its first seqlens + n_new cached keys."""
    for b in range(q.shape[0]):
        n = seqlens[b] + n_new
        slopes = kwargs.get("alibi_slopes")
        extra = dict(kwargs, alibi_slopes=None if slopes is None else slopes[b])
        assert_close_to_reference(out[b], q[b], k_cache[b, :, :n], v_cache[b, :, :n],
                                  lse=lse[b], **extra)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 8, 0])
def test_decode_writes_new_keys_and_attends(rng, num_splits):
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, seqlens=[0, 150, 299])
    before = k_cache.copy()
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                               cache_seqlens=seqlens, num_splits=num_splits,
                                               return_lse=True)
    for b, s in enumerate(seqlens):  # written at the right place, nothing else changed
        np.testing.assert_array_equal(k_cache[b, :, s], k[b, :, 0])
        np.testing.assert_array_equal(v_cache[b, :, s], v[b, :, 0])
        np.testing.assert_array_equal(np.delete(k_cache[b], s, axis=1),
                                      np.delete(before[b], s, axis=1))
    check_against_cache(out, lse, q, k_cache, v_cache, seqlens, 1, causal=True)


@pytest.mark.parametrize("n_q,n_new", [(4, 4), (3, 0), (37, 37), (64, 10)])
def test_chunked_prefill(rng, n_q, n_new):
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, n_q=n_q, n_new=n_new,
                                                    seqlens=[0, 100, 300 - n_new])
    kwargs = dict(causal=True, window=(50, -1), softcap=10.0,
                  alibi_slopes=rng.uniform(0.01, 0.1, (3, 8)).astype(np.float32))
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k if n_new else None,
                                               v=v if n_new else None, cache_seqlens=seqlens,
                                               return_lse=True, **kwargs)
    check_against_cache(out, lse, q, k_cache, v_cache, seqlens, n_new, **kwargs)


def test_sinks_and_mqa_decode(rng):
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, hq=8, hk=1, n_max=2000,
                                                    seqlens=[0, 700, 1999])
    sinks = rng.standard_normal(8).astype(np.float32)
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, sinks=sinks,
                                               cache_seqlens=seqlens, return_lse=True,
                                               num_splits=4)
    check_against_cache(out, lse, q, k_cache, v_cache, seqlens, 1, causal=True, sinks=sinks)


def to_pages(cache, page_size, order):
    """A paged copy of a (B, H, Nmax, D) cache: page p of batch b goes to order[b, p]."""
    batch, heads, n_max, d = cache.shape
    pages = np.empty((order.size, heads, page_size, d), dtype=cache.dtype)
    for b in range(batch):
        for p in range(n_max // page_size):
            pages[order[b, p]] = cache[b, :, p * page_size:(p + 1) * page_size]
    return pages


@pytest.mark.parametrize("n_q", [1, 40])
def test_paged_equals_unpaged(rng, n_q):
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, n_max=320, n_q=n_q, n_new=n_q,
                                                    seqlens=[5, 200, 280])
    table = rng.permutation(3 * 20).reshape(3, 20).astype(np.int32)  # shuffled pages of 16
    k_pages, v_pages = to_pages(k_cache, 16, table), to_pages(v_cache, 16, table)
    expected = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                               cache_seqlens=seqlens, num_splits=3)
    got = cpuflash.attention_with_kvcache(q, k_pages, v_pages, k=k, v=v, cache_seqlens=seqlens,
                                          block_table=table, num_splits=3)
    np.testing.assert_array_equal(got, expected)
    for b in range(3):  # the new keys landed in the right pages
        for i in range(n_q):
            pos = seqlens[b] + i
            np.testing.assert_array_equal(k_pages[table[b, pos // 16], :, pos % 16], k[b, :, i])


def test_bshd_cache_layout(rng):
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng)
    expected = cpuflash.attention_with_kvcache(q, k_cache.copy(), v_cache.copy(), k=k, v=v,
                                               cache_seqlens=seqlens)
    swap = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k_cache, v_cache, k, v)]
    got = cpuflash.attention_with_kvcache(swap[0], swap[1], swap[2], k=swap[3], v=swap[4],
                                          cache_seqlens=seqlens, layout="bshd")
    np.testing.assert_allclose(np.swapaxes(got, 1, 2), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("hq,hk", [(6, 2), (8, 1), (4, 4)])  # groups of 3, 8 and 1 rows
def test_rows_read_in_place_with_wide_values(rng, hq, hk):
    """Head dims of whole vectors, D and Dv different (with AVX-512, the four-row Q K^T for
    D=64 and the two-row P V for Dv=128 up to four rows), with groups that are no multiple of 4
    rows."""
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, hq=hq, hk=hk, d=64, d_v=128, n_max=700)
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                               cache_seqlens=seqlens, return_lse=True)
    check_against_cache(out, lse, q, k_cache, v_cache, seqlens, 1, causal=True)


@pytest.mark.parametrize("dtype,d", [(np.float32, 128), (np.float64, 64), (np.float64, 128)])
@pytest.mark.parametrize("hq,hk", [(8, 2), (6, 2), (4, 4), (16, 2)])  # groups of 4, 3, 1, 8
def test_head_dim_of_eight_vectors_paged_and_not(rng, dtype, d, hq, hk):
    """A head dim of eight vectors with AVX-512 (128 float32 or 64 float64 lanes): Q K^T in one
    pass for three or four rows, two rows at a time for one or two, P V two rows at a time, the
    four-row micro-kernels past four rows; float64 at D = 128, or AVX2, take the four-row ones.
    In pages of 7 rows, so a key block is cut into runs of every length mod 4 (odd tails, and
    the prefetch following the runs); the paged result is the unpaged one bit for bit."""
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, hq=hq, hk=hk, d=d, d_v=d,
                                                    n_max=700, dtype=dtype, n_new=0)
    table = rng.permutation(3 * 100).reshape(3, 100).astype(np.int32)
    k_pages, v_pages = to_pages(k_cache, 7, table), to_pages(v_cache, 7, table)
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                               num_splits=2, return_lse=True)
    check_against_cache(out, lse, q, k_cache, v_cache, seqlens, 0, causal=True)
    paged = cpuflash.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,
                                            block_table=table, num_splits=2)
    np.testing.assert_array_equal(paged, out)


def test_one_value_row_repeated_stays_within_the_rule(rng):
    """Every key and value row the same: each block's P V is one chain of equal terms, whose
    rounding grows with the block. 512-key blocks broke the rule here (4x the error of a plain
    float32 computation), 256-key ones do not."""
    k_row, v_row = (rng.standard_normal((1, 2, 1, 128)).astype(np.float32) for _ in range(2))
    k_cache, v_cache = (np.repeat(row, 900, axis=2) for row in (k_row, v_row))
    q = rng.standard_normal((1, 4, 1, 128)).astype(np.float32)
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, num_splits=1,
                                               return_lse=True)
    check_against_cache(out, lse, q, k_cache, v_cache, [900], 0, causal=True)


@pytest.mark.parametrize("which", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 40])  # rows read in place (widened as loaded) / copied
def test_half_precision_cache(rng, which, d):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dtype = np.dtype(np.float16 if which == "float16" else ml_dtypes.bfloat16)
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, dtype=dtype, n_max=600, d=d, hq=8,
                                                    hk=1)
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                               cache_seqlens=seqlens, return_lse=True)
    assert out.dtype == dtype and lse.dtype == np.float32
    for b in range(3):
        n = seqlens[b] + 1
        assert_close_to_reference(out[b], q[b], k_cache[b, :, :n], v_cache[b, :, :n],
                                  lse=lse[b], causal=True, plain_dtype=dtype)


def test_split_results_do_not_depend_on_split_count_beyond_rounding(rng):
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, n_max=4000, seqlens=[4000] * 3,
                                                    n_new=0)
    outs = [cpuflash.attention_with_kvcache(q, k_cache, v_cache, num_splits=n)
            for n in (1, 2, 7)]
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], rtol=2e-5, atol=2e-6)


def test_merge_states_is_exact(rng):
    q, k, v = random_qkv(rng, (2, 3, 20, 16), (2, 3, 90, 16), dtype=np.float64)
    expected, expected_lse = attention_reference(q, k, v, return_lse=True)
    parts = [(0, 30), (30, 30), (30, 75), (75, 90)]  # one part is empty
    outs, lses = zip(*[attention_reference(q, k[:, :, a:b], v[:, :, a:b], return_lse=True)
                       for a, b in parts])
    out, lse = cpuflash.merge_states(list(outs), list(lses))
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-12)
    out, lse = cpuflash.merge_states(np.stack(outs[1:2]), np.stack(lses[1:2]))
    assert np.all(out == 0) and np.all(lse == -np.inf)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(cu_seqlens_q=np.array([1, 5]), cu_seqlens_k=np.array([0, 5])), ValueError,
     r"`cu_seqlens_q` must start at 0, got 1"),
    (dict(cu_seqlens_q=np.array([0, 6, 5]), cu_seqlens_k=np.array([0, 2, 5])), ValueError,
     r"`cu_seqlens_q` must be non-decreasing, got 6 then 5 at index 1"),
    (dict(cu_seqlens_q=np.array([0, 4]), cu_seqlens_k=np.array([0, 5])), ValueError,
     r"`cu_seqlens_q` must end at the number of rows \(5\), got 4"),
    (dict(cu_seqlens_q=np.array([0, 5]), cu_seqlens_k=np.array([0, 2, 5])), ValueError,
     r"`cu_seqlens_k` has 3 entries but `cu_seqlens_q` has 2"),
    (dict(cu_seqlens_q=np.array([0.0, 5.0]), cu_seqlens_k=np.array([0, 5])), TypeError,
     r"`cu_seqlens_q` must be an integer array, got dtype float64"),
    (dict(cu_seqlens_q=np.zeros((2, 2), int), cu_seqlens_k=np.array([0, 5])), ValueError,
     r"`cu_seqlens_q` must be 1-D"),
    (dict(cu_seqlens_q=np.array([0, 2**64 - 1, 5], np.uint64), cu_seqlens_k=np.array([0, 2, 5])),
     ValueError, r"`cu_seqlens_q` values must be at most the number of rows \(5\), got 1844"),
])
def test_varlen_rejects_bad_cu_seqlens(kwargs, exc, match):
    x = np.ones((5, 2, 8), np.float32)
    with pytest.raises(exc, match=match):
        cpuflash.attention_varlen(x, x, x, **kwargs)


def test_varlen_rejects_wrong_ndim():
    x = np.ones((1, 5, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"`q` must be 3-D \(total_tokens, heads, dim\)"):
        cpuflash.attention_varlen(x, x, x, np.array([0, 5]), np.array([0, 5]))


def bad_cache_calls():
    rng = np.random.default_rng(1)
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, batch=2, n_max=64, seqlens=[3, 10])
    ro = k_cache.copy()
    ro.flags.writeable = False
    table = np.array([[0, 1], [2, 3]], np.int32)
    pages = np.zeros((4, 2, 32, 64), np.float32)
    return [
        (dict(k=k), ValueError, r"`k` and `v` must be given together"),
        (dict(k=k, v=v, cache_seqlens=[3, 64]), ValueError,
         r"`cache_seqlens` must lie in \[0, 63\] .*got \[3, 64\]"),
        (dict(k=k, v=v, cache_seqlens=[-1, 0]), ValueError, r"`cache_seqlens` must lie in"),
        (dict(k=k, v=v, cache_seqlens=[1, 2, 3]), ValueError,
         r"`cache_seqlens` must have shape \(2,\)"),
        (dict(k=k, v=v, cache_seqlens=np.array([1.0, 2.0])), TypeError,
         r"`cache_seqlens` must be an integer array"),
        (dict(k=k.astype(np.float64), v=v, cache_seqlens=seqlens), TypeError,
         r"`k` and `v` must have the dtype of the cache"),
        (dict(k=k[:, :, :, :5], v=v, cache_seqlens=seqlens), ValueError,
         r"`k` and `v` must be \(batch, kv heads, new, dim\)"),
        (dict(k_cache=ro, k=k, v=v, cache_seqlens=seqlens), ValueError,
         r"`k_cache` is read-only"),
        (dict(num_splits=-1), ValueError, r"`num_splits` must be >= 0 \(0 = automatic\), got -1"),
        (dict(num_splits=1.5), TypeError, r"`num_splits` must be an int \(0 = automatic\)"),
        (dict(v_cache=np.zeros((1, 2, 64, 48), np.float32), k=k, v=v, cache_seqlens=seqlens),
         ValueError, r"`v_cache` has 1 batch entries but `k_cache` has 2"),
        (dict(k_cache=pages, v_cache=pages[:2, ..., :48], block_table=table), ValueError,
         r"`v_cache` has 2 pages but `k_cache` has 4"),
        (dict(k=k, v=v), ValueError,
         r"`cache_seqlens` must lie in \[0, 63\] .*got None \(a full cache\)"),
        (dict(k_cache=pages, v_cache=pages[..., :48], block_table=table[:1]), ValueError,
         r"`block_table` must have shape \(batch=2, max_pages\)"),
        (dict(k_cache=pages, v_cache=pages[..., :48], block_table=table + 2,
              cache_seqlens=[40, 10]), ValueError, r"`block_table` entries .* \[0, 4\)"),
        (dict(k_cache=pages, v_cache=pages[..., :48], block_table=table.astype(float)),
         TypeError, r"`block_table` must be an integer array"),
        (dict(layout="x"), ValueError, r"`layout` must be one of"),
        (dict(q=q[0]), ValueError, r"`q` must be 4-D"),
    ], (q, k_cache, v_cache)


@pytest.mark.parametrize("case", range(len(bad_cache_calls()[0])))
def test_kvcache_rejects_bad_input_and_writes_nothing(case):
    cases, (q, k_cache, v_cache) = bad_cache_calls()
    kwargs, exc, match = cases[case]
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache)
    args.update(kwargs)
    before = {name: x.copy() for name, x in args.items() if name in ("k_cache", "v_cache")}
    with pytest.raises(exc, match=match):
        cpuflash.attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                        **args)
    for name, x in before.items():
        np.testing.assert_array_equal(x, kwargs.get(name, locals()[name]))


@pytest.mark.parametrize("outs,lses,exc,match", [
    (np.ones((2, 3, 4)), np.ones((2, 4)), ValueError, r"`outs` must be \(S, \.\.\., Dv\)"),
    (np.ones((2, 3, 4), np.int32), np.ones((2, 3)), TypeError, r"`outs` must be float32"),
    (np.ones((0, 3, 4)), np.ones((0, 3)), ValueError, r"at least one partial result"),
])
def test_merge_states_rejects_bad_input(outs, lses, exc, match):
    with pytest.raises(exc, match=match):
        cpuflash.merge_states(outs, lses)
