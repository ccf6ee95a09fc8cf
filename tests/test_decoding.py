"""attention_with_kvcache (decoding and chunked prefill; split-KV, paged caches, both layouts)
and merge_states, against the reference."""

import numpy as np
import pytest

import cpuflash
from cpuflash.reference import attention_reference

from helpers import (assert_same_bits, cache_case, check_kvcache, low_precision_dtype,
                     random_qkv, strided, to_pages, unaligned, with_new_keys)


def bshd(x):
    """A (B, H, N, D) array, or pages (P, H, rows, D), in flash-attn's layout (heads third)."""
    return np.ascontiguousarray(np.swapaxes(x, 1, 2))


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
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens + 1, causal=True)


@pytest.mark.parametrize("n_q,n_new", [(4, 4), (3, 0), (37, 37), (64, 10)])
def test_chunked_prefill(rng, n_q, n_new):
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, n_q=n_q, n_new=n_new,
                                                    seqlens=[0, 100, 300 - n_new])
    kwargs = dict(causal=True, window=(50, -1), softcap=10.0,
                  alibi_slopes=rng.uniform(0.01, 0.1, (3, 8)).astype(np.float32))
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k if n_new else None,
                                               v=v if n_new else None, cache_seqlens=seqlens,
                                               return_lse=True, **kwargs)
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens + n_new, **kwargs)


def test_sinks_and_mqa_decode(rng):
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, hq=8, hk=1, n_max=2000,
                                                    seqlens=[0, 700, 1999])
    sinks = rng.standard_normal(8).astype(np.float32)
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, sinks=sinks,
                                               cache_seqlens=seqlens, return_lse=True,
                                               num_splits=4)
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens + 1, causal=True, sinks=sinks)


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
    swap = [bshd(x) for x in (q, k_cache, v_cache, k, v)]
    got = cpuflash.attention_with_kvcache(swap[0], swap[1], swap[2], k=swap[3], v=swap[4],
                                          cache_seqlens=seqlens, layout="bshd")
    np.testing.assert_allclose(np.swapaxes(got, 1, 2), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("paged", [False, True], ids=["unpaged", "paged"])
@pytest.mark.parametrize("n_q", [1, 40], ids=["decode", "chunked prefill"])
def test_bshd_paged_and_chunked_prefill(rng, paged, n_q):
    """flash-attn's layout: q (B, Nq, Hq, D), caches (B, Nmax, Hk, D) or pages (P, page_size,
    Hk, D); new keys written where the block table says, the result against the reference."""
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, n_max=320, n_q=n_q, n_new=n_q,
                                                    seqlens=[5, 200, 280 - n_q])
    table = rng.permutation(3 * 20).reshape(3, 20).astype(np.int32)  # shuffled pages of 16
    kwargs = dict(causal=True, window=(70, -1), softcap=10.0,
                  alibi_slopes=rng.uniform(0.01, 0.1, (3, 8)).astype(np.float32))
    if paged:
        caches = bshd(to_pages(k_cache, 16, table)), bshd(to_pages(v_cache, 16, table))
    else:
        caches = bshd(k_cache), bshd(v_cache)
    out, lse = cpuflash.attention_with_kvcache(
        bshd(q), *caches, k=bshd(k), v=bshd(v), cache_seqlens=seqlens, layout="bshd",
        block_table=table if paged else None, num_splits=3, return_lse=True, **kwargs)
    assert out.shape == (3, n_q, 8, 48) and lse.shape == (3, 8, n_q)
    for b in range(3):  # the new keys landed in the right rows (pages)
        for i in range(n_q):
            pos = seqlens[b] + i
            at = (table[b, pos // 16], pos % 16) if paged else (b, pos)
            np.testing.assert_array_equal(caches[0][at], k[b, :, i])
            np.testing.assert_array_equal(caches[1][at], v[b, :, i])
    written = [with_new_keys(c, new, seqlens) for c, new in ((k_cache, k), (v_cache, v))]
    check_kvcache(np.swapaxes(out, 1, 2), lse, q, *written, seqlens + n_q, **kwargs)


@pytest.mark.parametrize("hq,hk", [(6, 2), (8, 1), (4, 4)])  # groups of 3, 8 and 1 rows
def test_rows_read_in_place_with_wide_values(rng, hq, hk):
    """Head dims of whole vectors, D and Dv different (with AVX-512, the four-row Q K^T for
    D=64 and the two-row P V for Dv=128 up to four rows), with groups that are no multiple of 4
    rows."""
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, hq=hq, hk=hk, d=64, d_v=128, n_max=700)
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                               cache_seqlens=seqlens, return_lse=True)
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens + 1, causal=True)


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
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens, causal=True)
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
    check_kvcache(out, lse, q, k_cache, v_cache, [900], causal=True)


@pytest.mark.parametrize("which", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 40])  # rows read in place (widened as loaded) / copied
def test_half_precision_cache(rng, which, d):
    dtype = low_precision_dtype(which)
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, dtype=dtype, n_max=600, d=d, hq=8,
                                                    hk=1)
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                               cache_seqlens=seqlens, return_lse=True)
    assert out.dtype == dtype and lse.dtype == np.float32
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens + 1, causal=True, plain_dtype=dtype)


@pytest.mark.parametrize("which", ["float16", "bfloat16"])
@pytest.mark.parametrize("paged", [False, True], ids=["unpaged", "paged"])
def test_half_precision_chunked_prefill(rng, which, paged):
    """40 query rows of a GQA group of 4: the packed FA-2 kernel over the cache (its pages
    gathered first), widening float16/bfloat16 tile by tile."""
    dtype = low_precision_dtype(which)
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, dtype=dtype, n_max=320, d=64, hq=8,
                                                    hk=2, n_q=40, n_new=40,
                                                    seqlens=[0, 100, 280])
    table = rng.permutation(3 * 20).reshape(3, 20).astype(np.int32)
    caches = (to_pages(k_cache, 16, table), to_pages(v_cache, 16, table)) if paged else \
        (k_cache.copy(), v_cache.copy())
    kwargs = dict(causal=True, window=(90, -1), softcap=20.0,
                  alibi_slopes=np.full(8, 0.05, np.float32))
    out, lse = cpuflash.attention_with_kvcache(q, *caches, k=k, v=v, cache_seqlens=seqlens,
                                               block_table=table if paged else None,
                                               return_lse=True, **kwargs)
    assert out.dtype == dtype and lse.dtype == np.float32
    written = [with_new_keys(c, new, seqlens) for c, new in ((k_cache, k), (v_cache, v))]
    check_kvcache(out, lse, q, *written, seqlens + 40, plain_dtype=dtype, **kwargs)


@pytest.mark.parametrize("seqlens", [37, np.int64(37), np.uint8(37), [37, 37, 37],
                                     np.array([37] * 3, np.int64),
                                     np.array([37] * 3, np.uint16)],
                         ids=["int", "numpy int64", "numpy uint8", "list", "int64 array",
                              "uint16 array"])
@pytest.mark.parametrize("n_q", [1, 40], ids=["decode", "chunked prefill"])
def test_integer_cache_seqlens(rng, seqlens, n_q):
    """Any integer type, and one int for every batch entry, give what int32 lengths give."""
    q, k_cache, v_cache, k, v, lengths = cache_case(rng, n_max=80, n_q=n_q, n_new=2,
                                                    seqlens=[37] * 3)
    kc, vc = k_cache.copy(), v_cache.copy()
    expected = cpuflash.attention_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=lengths,
                                               return_lse=True)
    got = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens,
                                          return_lse=True)
    assert_same_bits(got, expected)
    assert_same_bits((k_cache, v_cache), (kc, vc), "the caches")
    check_kvcache(*got, q, k_cache, v_cache, [39] * 3, causal=True)


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


@pytest.mark.parametrize("dtype,strided", [(np.float32, False), (np.float32, True),
                                           (np.float16, False)])
@pytest.mark.parametrize("n_max", [40, 700])  # little work (one thread runs it all) and more
def test_an_entry_does_not_depend_on_its_neighbours_or_the_thread_count(
        rng, dtype, strided, n_max):
    """The decode kernel's threads reuse their buffers from work item to work item: each item
    must start from the same state, so an entry's bits do not change when the entries around it
    (their lengths, their values) or the thread count do."""
    import numba

    b, hq, hk, d = 5, 8, 2, 64
    q = rng.standard_normal((b, hq, 1, d)).astype(dtype)
    width = d + 16 if strided else d  # strided rows: the kernel's widened copies
    k_cache = rng.standard_normal((b, hk, n_max, width)).astype(dtype)[..., :d]
    v_cache = rng.standard_normal((b, hk, n_max, width)).astype(dtype)[..., :d]
    v_cache[1, 0, 3] = np.inf  # a non-finite value row in entry 1, which sees no key
    v_cache[0, 0, n_max - 1, 5] = np.inf  # and one that entry 0 sees: its rows' sums are inf
    seqlens = np.array([n_max, 0, n_max // 2, 1, n_max - 3], dtype=np.int32)
    kwargs = dict(window=(n_max // 3, 0), softcap=20.0, num_splits=2, return_lse=True,
                  alibi_slopes=rng.uniform(0.01, 0.1, hq).astype(np.float32))
    order = [4, 2, 0, 3, 1]
    before = numba.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            numba.set_num_threads(threads)
            results.append(cpuflash.attention_with_kvcache(q, k_cache, v_cache,
                                                           cache_seqlens=seqlens, **kwargs))
            out, lse = cpuflash.attention_with_kvcache(q[order], k_cache[order], v_cache[order],
                                                       cache_seqlens=seqlens[order], **kwargs)
            back = np.argsort(order)
            assert_same_bits((out[back], lse[back]), results[0], f"{threads} threads, reordered")
    finally:
        numba.set_num_threads(before)
    assert_same_bits(results[1], results[0], "2 threads against 1")
    out, lse = results[0]
    rule = dict(causal=True, plain_dtype=dtype, window=kwargs["window"], softcap=20.0)
    slopes = kwargs["alibi_slopes"]
    check_kvcache(out[1:], lse[1:], q[1:], k_cache[1:], v_cache[1:], seqlens[1:],
                  alibi_slopes=slopes, **rule)
    # entry 0: the KV head after the one with the inf value row (its item follows that one's)
    check_kvcache(out[:1, 4:], lse[:1, 4:], q[:1, 4:], k_cache[:1, 1:], v_cache[:1, 1:],
                  seqlens[:1], alibi_slopes=slopes[4:], **rule)


@pytest.mark.parametrize("memory", [unaligned, strided])
@pytest.mark.parametrize("which", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("paged", [False, True], ids=["unpaged", "paged"])
@pytest.mark.parametrize("n_q", [1, 40], ids=["decode", "chunked prefill"])
def test_new_keys_land_in_a_cache_the_kernel_cannot_read_as_given(rng, memory, which, paged,
                                                                  n_q):
    """An unaligned cache is copied for the kernel: the new keys must be in that copy (taken
    after they are written) and in the caller's cache, which stays the one written."""
    dtype = np.dtype(which) if which == "float32" else low_precision_dtype(which)
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, dtype=dtype, n_max=320, n_q=n_q,
                                                    n_new=n_q, seqlens=[5, 200, 280 - n_q])
    table = rng.permutation(3 * 20).reshape(3, 20).astype(np.int32)  # shuffled pages of 16
    caches = [memory(to_pages(c, 16, table) if paged else c) for c in (k_cache, v_cache)]
    for _ in range(2):  # the second call with the same shapes may take the plan of the first
        written = [c.copy() for c in caches]
        out, lse = cpuflash.attention_with_kvcache(q, *caches, k=k, v=v, cache_seqlens=seqlens,
                                                   block_table=table if paged else None,
                                                   return_lse=True)
        for b in range(3):
            for i in range(n_q):
                pos = seqlens[b] + i
                at = (table[b, pos // 16], slice(None), pos % 16) if paged else \
                    (b, slice(None), pos)
                np.testing.assert_array_equal(caches[0][at], k[b, :, i])
                np.testing.assert_array_equal(caches[1][at], v[b, :, i])
                written[0][at], written[1][at] = k[b, :, i], v[b, :, i]
        np.testing.assert_array_equal(caches[0], written[0])  # nothing else changed
        np.testing.assert_array_equal(caches[1], written[1])
        dense = [with_new_keys(c, new, seqlens) for c, new in ((k_cache, k), (v_cache, v))]
        check_kvcache(out, lse, q, *dense, seqlens + n_q, causal=True,
                      plain_dtype=None if which == "float32" else dtype)
        k, v = (rng.standard_normal(x.shape).astype(dtype) for x in (k, v))  # the next step's


@pytest.mark.parametrize("memory", [unaligned, strided])
def test_read_only_cache_without_new_keys(rng, memory):
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, n_max=320)
    caches = [memory(c) for c in (k_cache, v_cache)]
    for c in caches:
        c.flags.writeable = False
    out, lse = cpuflash.attention_with_kvcache(q, *caches, cache_seqlens=seqlens,
                                               return_lse=True)
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens, causal=True)
