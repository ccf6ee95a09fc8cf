"""Odd but valid input gives the usual bits: any strides (Fortran order, negative strides,
slices, transposed copies), read-only arrays, and the smallest sizes (head dim 1, one query
and one key). Inputs are never modified."""

import numpy as np
import pytest

import cpuflash

from accuracy import assert_close_to_reference
from helpers import (assert_same_bits, check_kvcache, check_varlen, fortran, heads_first,
                     negative, packed, random_qkv, readonly)


# -- any strides ----------------------------------------------------------------------------------

def strided_views(rng, d=24):
    """Views of the same (2, 3, 60, d) data with unusual strides."""
    base = rng.standard_normal((2, 3, 60, d)).astype(np.float32)
    transposed = np.ascontiguousarray(base.transpose(3, 2, 1, 0)).transpose(3, 2, 1, 0)
    sliced = np.repeat(base, 2, axis=-1)[..., ::2]
    flipped = np.ascontiguousarray(base[:, :, ::-1, ::-1])[:, :, ::-1, ::-1]
    return base, {"fortran": fortran(base), "transposed": transposed, "sliced": sliced,
                  "negative": flipped, "readonly": readonly(base)}


@pytest.mark.parametrize("d", [24, 64])  # 64: rows of whole vectors where the strides allow
def test_any_strides_give_the_same_bits(rng, d):
    base, views = strided_views(rng, d)
    expected = cpuflash.attention(base, base, base, causal=True)
    for name, view in views.items():
        np.testing.assert_array_equal(view, base)
        got = cpuflash.attention(view, view, view, causal=True)
        np.testing.assert_array_equal(got, expected, err_msg=name)
        out = np.zeros(view.shape[:-1] + (2 * d,), np.float32)[..., ::2]  # strided rows
        cpuflash.attention(view, view, view, causal=True, out=out)
        np.testing.assert_array_equal(out, expected, err_msg=name + " into a strided out")


@pytest.mark.parametrize("view", [fortran, negative, readonly])
def test_varlen_any_strides(rng, view):
    q, k, v, cu_q, cu_k = packed(rng, [30, 0, 71], [45, 3, 60])
    expected = cpuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    vq, vk, vv = view(q), view(k), view(v)
    assert not vq.flags.c_contiguous or not vq.flags.writeable
    got = cpuflash.attention_varlen(vq, vk, vv, view(cu_q), view(cu_k), causal=True,
                                    return_lse=True)
    assert_same_bits(got, expected, view.__name__)
    check_varlen(*got, q, k, v, cu_q, cu_k, causal=True)
    got = cpuflash.attention_varlen(vq, k, v, cu_q, cu_k, causal=True, return_lse=True)
    assert_same_bits(got, expected, f"{view.__name__} q only")


@pytest.mark.parametrize("view", [fortran, negative, readonly])
@pytest.mark.parametrize("n_q", [1, 24])  # the decode kernel, and chunked prefill
def test_kvcache_any_strides(rng, view, n_q):
    q = rng.standard_normal((2, 4, n_q, 32)).astype(np.float32)
    k_cache = rng.standard_normal((2, 2, 100, 32)).astype(np.float32)
    v_cache = rng.standard_normal((2, 2, 100, 16)).astype(np.float32)
    seqlens = np.array([30, 100], np.int32)
    kw = dict(cache_seqlens=seqlens, num_splits=2, return_lse=True)
    expected = cpuflash.attention_with_kvcache(q, k_cache, v_cache, **kw)
    got = cpuflash.attention_with_kvcache(view(q), view(k_cache), view(v_cache), **kw)
    assert_same_bits(got, expected, view.__name__)
    check_kvcache(*got, q, k_cache, v_cache, seqlens, causal=True)
    # new keys: read-only or strided `k`/`v`, written into a strided (writeable) cache
    new_k = rng.standard_normal((2, 2, n_q, 32)).astype(np.float32)
    new_v = rng.standard_normal((2, 2, n_q, 16)).astype(np.float32)
    seqlens = np.array([10, 100 - n_q], np.int32)
    kc, vc = k_cache.copy(), v_cache.copy()
    expected = cpuflash.attention_with_kvcache(q, kc, vc, k=new_k, v=new_v, **dict(
        kw, cache_seqlens=seqlens))
    cache_view = fortran if view is readonly else view
    kc2, vc2 = cache_view(k_cache), cache_view(v_cache)
    got = cpuflash.attention_with_kvcache(view(q), kc2, vc2, k=view(new_k), v=view(new_v),
                                          **dict(kw, cache_seqlens=seqlens))
    assert_same_bits(got, expected, f"{view.__name__} with new keys")
    np.testing.assert_array_equal(kc2, kc)
    np.testing.assert_array_equal(vc2, vc)


# -- read-only and unmodified inputs --------------------------------------------------------------

def test_inputs_are_not_modified(rng):
    q, k, v = random_qkv(rng, (2, 4, 33, 16), (2, 2, 45, 16))
    copies = [x.copy() for x in (q, k, v)]
    cpuflash.attention(q, k, v, causal=True)
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)


def test_readonly_inputs_everywhere(rng):
    q, k, v = (readonly(x) for x in random_qkv(rng, (2, 4, 50, 16), (2, 2, 60, 16)))
    bias, mask = readonly(rng.standard_normal((50, 60)).astype(np.float32)), \
        readonly(rng.random((50, 60)) < 0.9)
    slopes, sinks = readonly(np.full(4, 0.1, np.float32)), readonly(np.zeros(4, np.float32))
    kwargs = dict(bias=bias, mask=mask, alibi_slopes=slopes, sinks=sinks, causal=True)
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **kwargs)
    assert_close_to_reference(out, q, k, v, lse=lse, **kwargs)
    out, lse = cpuflash.attention_with_kvcache(q[:, :, :1], k, v, cache_seqlens=readonly(
        np.array([10, 60], np.int32)), alibi_slopes=slopes, sinks=sinks, return_lse=True)
    check_kvcache(out, lse, q[:, :, :1], k, v, [10, 60], causal=True, alibi_slopes=slopes,
                  sinks=sinks)
    parts = [cpuflash.attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True)
             for a, b in ((0, 25), (25, 60))]
    merged, merged_lse = cpuflash.merge_states([readonly(p[0]) for p in parts],
                                               readonly(np.stack([p[1] for p in parts])))
    assert_close_to_reference(merged, q, k, v, lse=merged_lse)


# -- the smallest sizes ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_head_dim_one(rng, dtype):
    q, k, v = random_qkv(rng, (2, 2, 37, 1), (2, 1, 41, 1), d_v=1, dtype=dtype)
    for kwargs in ({}, dict(causal=True), dict(window=(3, 0), alibi_slopes=np.ones(2, np.float32))):
        out, lse = cpuflash.attention(q, k, v, return_lse=True, **kwargs)
        assert_close_to_reference(out, q, k, v, lse=lse, **kwargs)
    vq, vk, vv, cu_q, cu_k = packed(rng, [5, 1, 30], [7, 1, 30], hq=2, hk=1, d=1, d_v=1,
                                    dtype=dtype)
    out, lse = cpuflash.attention_varlen(vq, vk, vv, cu_q, cu_k, causal=True, return_lse=True)
    check_varlen(out, lse, vq, vk, vv, cu_q, cu_k, causal=True)
    out, lse = cpuflash.attention_with_kvcache(q[:, :, :1], k, v, cache_seqlens=[9, 41],
                                               num_splits=2, return_lse=True)
    check_kvcache(out, lse, q[:, :, :1], k, v, [9, 41], causal=True)


def test_one_query_one_key(rng):
    q, k, v = random_qkv(rng, (1, 3, 1, 16), (1, 3, 1, 16), d_v=4)
    for causal in (False, True):
        out, lse = cpuflash.attention(q, k, v, causal=causal, return_lse=True)
        assert_close_to_reference(out, q, k, v, lse=lse, causal=causal)
        np.testing.assert_allclose(out, v, rtol=1e-6)  # the one key gets all the weight
    flat = [heads_first(x[0]) for x in (q, k, v)]
    cu = np.array([0, 1], np.int32)
    out, lse = cpuflash.attention_varlen(*flat, cu, cu, causal=True, return_lse=True)
    check_varlen(out, lse, *flat, cu, cu, causal=True)
    for n_new in (0, 1):  # the one key in the cache, or the one new key into an empty cache
        k_cache, v_cache = k.copy(), v.copy()
        new = dict(k=k, v=v, cache_seqlens=[0]) if n_new else {}
        out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, return_lse=True, **new)
        check_kvcache(out, lse, q, k, v, [1], causal=True)
