"""The opt-in integer Q K^T of int8 and int4 caches (`attention_with_kvcache(...,
integer_dot=True)`): the float computation with each query row replaced by its int8 numbers
times ``amax / 127``, on the dequantized cache after the write.

The route runs only where the CPU has AVX512-VNNI (`_simd_bytes.INTEGER_ROUTE`); these tests
turn it on everywhere, so that its code (plain integer code without VNNI) runs on every CPU."""

import numba
import numpy as np
import pytest

import cpuflash
from cpuflash import _plans, _simd_bytes, dequantize_kv, quantize_kv
from cpuflash._quantize import hadamard

from helpers import assert_same_bits, check_kvcache, low_precision_dtype, to_pages


@pytest.fixture(autouse=True)
def integer_route(monkeypatch):
    """The integer route on, and no plan of a call made with it off (or on) kept."""
    monkeypatch.setattr(_simd_bytes, "INTEGER_ROUTE", True)
    _plans.clear()
    yield
    _plans.clear()


def quantized_rows(q):
    """Each row of q as the route reads it: rint(q * (1 / s)) * s, s = amax / 127 (float32)."""
    q = q.astype(np.float32)
    scale = np.abs(q).max(axis=-1, keepdims=True) / np.float32(127)
    safe = np.where(scale > 0, scale, np.float32(1))
    return np.rint(q * (np.float32(1) / safe)) * scale


def caches(rng, fmt, d, d_v=None, batch=2, hk=2, n_max=200, rotate=False, group_size=32):
    d_v = d if d_v is None else d_v
    k, v = (rng.standard_normal((batch, hk, n_max, dd)).astype(np.float32) for dd in (d, d_v))
    extra = {"group_size": group_size} if fmt == "int4" else {}
    return (quantize_kv(k, fmt, rotate=rotate, **extra),
            quantize_kv(v, fmt, rotate=rotate, **extra))


@pytest.mark.parametrize("fmt,d,d_v", [("int8", 64, 64), ("int8", 128, 48), ("int8", 100, 100),
                                       ("int4", 64, 64), ("int4", 128, 96), ("int4", 96, 256)])
@pytest.mark.parametrize("n_q", [1, 3])
def test_is_the_float_computation_on_quantized_rows(rng, fmt, d, d_v, n_q):
    k_cache, v_cache = caches(rng, fmt, d, d_v)
    q = rng.standard_normal((2, 8, n_q, d)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 2, dd)).astype(np.float32) for dd in (d, d_v))
    seqlens = np.array([37, 180])
    out = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens,
                                          integer_dot=True, softcap=30.0)
    check_kvcache(out, None, quantized_rows(q), dequantize_kv(k_cache), dequantize_kv(v_cache),
                  seqlens + 2, causal=True, softcap=30.0)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_rotated_paged_and_modified(rng, fmt):
    d, page = 64, 16
    k_cache, v_cache = caches(rng, fmt, d, n_max=128, rotate=True)
    q = rng.standard_normal((2, 6, 1, d)).astype(np.float32)
    seqlens = np.array([128, 77])
    slopes = rng.uniform(0.01, 0.2, 6)
    options = dict(window=(40, 0), alibi_slopes=slopes)
    order = rng.permutation(16).reshape(2, 8)
    paged = [cpuflash.QuantizedKV(to_pages(c.data, page, order),
                                  to_pages(c.scale[..., None] if c.scale.ndim == 3 else c.scale,
                                           page, order).reshape(
                                      (16, 2, page) + c.scale.shape[3:]), rotated=True)
             for c in (k_cache, v_cache)]
    out = cpuflash.attention_with_kvcache(q, *paged, cache_seqlens=seqlens, block_table=order,
                                          integer_dot=True, **options)
    turned = hadamard(quantized_rows(hadamard(q)))  # (the route quantizes q turned by H)
    check_kvcache(out, None, turned, dequantize_kv(k_cache), dequantize_kv(v_cache), seqlens,
                  causal=True, **options)


@pytest.mark.parametrize("fmt,d", [("int8", 128), ("int4", 128), ("int4", 96)])
def test_a_keys_bits_do_not_depend_on_its_neighbours(rng, fmt, d):
    """Keys go four at a time, and the last ones of a run of consecutive rows fewer: in pages
    of five rows the runs, and so the keys beside each key, differ from one contiguous
    cache's, and the bits do not."""
    page = 5
    k_cache, v_cache = caches(rng, fmt, d, n_max=200)
    q = rng.standard_normal((2, 8, 1, d)).astype(np.float32)
    order = rng.permutation(80).reshape(2, 40)
    paged = [cpuflash.QuantizedKV(to_pages(c.data, page, order),
                                  to_pages(c.scale[..., None] if c.scale.ndim == 3 else c.scale,
                                           page, order).reshape(
                                      (80, 2, page) + c.scale.shape[3:]))
             for c in (k_cache, v_cache)]
    seqlens = np.array([200, 131])
    whole = cpuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                            integer_dot=True)
    in_pages = cpuflash.attention_with_kvcache(q, *paged, cache_seqlens=seqlens,
                                               block_table=order, integer_dot=True)
    assert_same_bits(in_pages, whole)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_queries(rng, dtype):
    """q in half precision is widened to float32, then quantized; the output has q's dtype."""
    dtype = low_precision_dtype(dtype) if dtype == "bfloat16" else np.dtype(dtype)
    k_cache, v_cache = caches(rng, "int4", 64)
    q = rng.standard_normal((2, 4, 1, 64)).astype(dtype)
    out = cpuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=150,
                                          integer_dot=True)
    assert out.dtype == dtype
    expected = cpuflash.attention_with_kvcache(q.astype(np.float32), k_cache, v_cache,
                                               cache_seqlens=150, integer_dot=True)
    # the float32 result rounded once to the output's precision
    np.testing.assert_allclose(out.astype(np.float32), expected, rtol=2 * np.finfo(
        np.float16).eps if dtype == np.float16 else 2 ** -7, atol=1e-6)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_same_bits_for_any_thread_count(rng, fmt):
    k_cache, v_cache = caches(rng, fmt, 128, n_max=600)
    q = rng.standard_normal((2, 8, 1, 128)).astype(np.float32)
    before = numba.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            numba.set_num_threads(threads)
            results.append(cpuflash.attention_with_kvcache(q, k_cache, v_cache, num_splits=3,
                                                           integer_dot=True))
    finally:
        numba.set_num_threads(before)
    assert_same_bits(results[1], results[0])


@pytest.mark.parametrize("fmt,d,group_size", [("int4", 64, 16), ("int8", 6, 32)])
def test_caches_it_cannot_read_run_exactly(rng, fmt, d, group_size):
    """int4 groups other than 32 and int8 rows not whole lanes take the exact route."""
    k_cache, v_cache = caches(rng, fmt, d, group_size=group_size)
    q = rng.standard_normal((2, 4, 1, d)).astype(np.float32)
    assert_same_bits(cpuflash.attention_with_kvcache(q, k_cache, v_cache, integer_dot=True),
                     cpuflash.attention_with_kvcache(q, k_cache, v_cache))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_row_that_is_not_finite_is_nan(rng, fmt):
    k_cache, v_cache = caches(rng, fmt, 64)
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    q[1, 2, 0, 5] = np.inf
    q[0, 1] = 0.0  # a zero row: every score 0
    out = cpuflash.attention_with_kvcache(q, k_cache, v_cache, integer_dot=True)
    assert np.isnan(out[1, 2]).all()
    out[1, 2] = 0.0
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0, 1, 0], dequantize_kv(v_cache)[0, 0].mean(axis=0),
                               rtol=1e-5, atol=1e-6)


def test_without_vnni_it_is_the_exact_route(rng, monkeypatch):
    monkeypatch.setattr(_simd_bytes, "INTEGER_ROUTE", _simd_bytes.VNNI)
    k_cache, v_cache = caches(rng, "int4", 64)
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    got = cpuflash.attention_with_kvcache(q, k_cache, v_cache, integer_dot=True)
    exact = cpuflash.attention_with_kvcache(q, k_cache, v_cache)
    assert np.array_equal(got, exact) != _simd_bytes.VNNI


def test_a_later_call_keeps_its_own_route(rng):
    """The stored plan of a call (`_plans`) is keyed on `integer_dot` too."""
    k_cache, v_cache = caches(rng, "int8", 64)
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    seqlens = np.array([150, 199])
    first = [cpuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                             integer_dot=flag) for flag in (True, False)]
    again = [cpuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                             integer_dot=flag) for flag in (True, False)]
    assert_same_bits(again[0], first[0])
    assert_same_bits(again[1], first[1])
    assert not np.array_equal(first[0], first[1])


def test_errors(rng):
    k_cache, v_cache = caches(rng, "int8", 64)
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    with pytest.raises(TypeError, match="`integer_dot` must be a bool, got 'yes'"):
        cpuflash.attention_with_kvcache(q, k_cache, v_cache, integer_dot="yes")
    k, v = dequantize_kv(k_cache), dequantize_kv(v_cache)
    with pytest.raises(ValueError, match="needs int8 or int4 caches .* got a float cache"):
        cpuflash.attention_with_kvcache(q, k, v, integer_dot=True)
    k8, v8 = quantize_kv(k, "float8_e4m3"), quantize_kv(v, "float8_e4m3")
    with pytest.raises(ValueError, match="got a float8_e4m3 cache"):
        cpuflash.attention_with_kvcache(q, k8, v8, integer_dot=True, cache_seqlens=10)


def test_transformers_cache_option():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import cpuflash.transformers as cft
    config = transformers.LlamaConfig(num_hidden_layers=2)
    assert all(layer.integer_dot for layer in
               cft.QuantizedKVCache(config, "int4", integer_dot=True).layers)
    with pytest.raises(TypeError, match="`integer_dot` must be True or False, got 1"):
        cft.QuantizedKVCache(config, "int8", integer_dot=1)
    with pytest.raises(ValueError, match="needs dtype 'int8' or 'int4', got 'float8_e4m3'"):
        cft.QuantizedKVCache(config, "float8_e4m3", integer_dot=True)
