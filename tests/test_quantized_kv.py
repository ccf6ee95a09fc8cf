"""Quantized KV caches: quantize_kv / dequantize_kv, and attention_with_kvcache reading int8 and
float8_e4m3 caches in place, against the reference on the dequantized cache."""

import numba
import numpy as np
import pytest

import cpuflash
from cpuflash import QuantizedKV, dequantize_kv, quantize_kv
from cpuflash._simd import E4M3_UNIT, LANES_F32, vload_e4m3, vload_i8, vstore
from cpuflash.kernels._convert import FLOAT8_E4M3, INT8, widen

from helpers import (assert_same_bits, cache_case, check_kvcache, check_modified_decoding,
                     low_precision_dtype, strided, to_pages, unaligned)

FORMATS = ["int8", "float8_e4m3"]
LIMIT = {"int8": 127, "float8_e4m3": 448}


def bshd(x):
    """A (B, H, N, D) array, or pages (P, H, rows, D), in flash-attn's layout (heads third)."""
    return np.ascontiguousarray(np.swapaxes(x, 1, 2))


def data_dtype(fmt):
    if fmt == "int8":
        return np.dtype(np.int8)
    return np.dtype(pytest.importorskip("ml_dtypes").float8_e4m3fn)


def quantized(rng, fmt, shape, spread=True):
    """A QuantizedKV of normal rows, each row of its own magnitude (so the scales differ)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if spread:
        x *= rng.uniform(0.1, 4.0, shape[:-1] + (1,)).astype(np.float32)
    data_dtype(fmt)
    return quantize_kv(x, fmt)


def quantize(x, fmt):
    """`quantize_kv` in `fmt`; "int4" in groups of 16 (they divide every head dim used here),
    "int4-32" in groups of 32 (whole units of two AVX-512 vectors: read in place, `_int4`)."""
    if fmt.startswith("int4"):
        return quantize_kv(x, "int4", group_size=32 if fmt == "int4-32" else 16)
    return quantize_kv(x, fmt)


def written(kq, new, seqlens, fmt):
    """The dequantized (B, Hk, Nmax, D) cache with the rows `new` written at `seqlens`, as
    attention_with_kvcache writes them (quantized)."""
    cache = dequantize_kv(kq)
    new = dequantize_kv(quantize(new, fmt))
    for b, s in enumerate(seqlens):
        cache[b, :, s:s + new.shape[2]] = new[b]
    return cache


# -- quantize_kv / dequantize_kv ------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_quantize_is_the_stated_rounding(rng, fmt, dtype):
    dtype = low_precision_dtype(dtype) if dtype in ("float16", "bfloat16") else np.dtype(dtype)
    x = (rng.standard_normal((2, 3, 50, 40)) * rng.uniform(1e-3, 1e3, (2, 3, 50, 1)))
    x = x.astype(dtype)
    kq = quantize_kv(x, dtype=fmt)
    assert isinstance(kq, QuantizedKV)
    assert kq.data.dtype == data_dtype(fmt) and kq.data.shape == x.shape
    assert kq.scale.dtype == np.float32 and kq.scale.shape == x.shape[:-1]
    x32 = x.astype(np.float32)
    amax = np.abs(x32).max(axis=-1)
    np.testing.assert_array_equal(kq.scale, amax / np.float32(LIMIT[fmt]))
    ratio = x32 / kq.scale[..., None]
    if fmt == "int8":
        np.testing.assert_array_equal(kq.data, np.clip(np.rint(ratio), -127, 127))
    else:
        np.testing.assert_array_equal(kq.data.astype(np.float32),
                                      np.clip(ratio, -448, 448).astype(kq.data.dtype)
                                      .astype(np.float32))
    # the largest magnitude of each row is stored as the format's largest
    assert np.all(np.abs(kq.data.astype(np.float32)).max(axis=-1) == LIMIT[fmt])


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_is_half_a_step(rng, fmt):
    x = rng.standard_normal((4, 100, 64)).astype(np.float32) * 3
    kq = quantize_kv(x, fmt)
    back = dequantize_kv(kq)
    assert back.dtype == np.float32 and back.shape == x.shape
    np.testing.assert_array_equal(back, kq.data.astype(np.float32) * kq.scale[..., None])
    error = np.abs(back - x)
    if fmt == "int8":  # half an integer step of the row's scale, plus the product's rounding
        bound = 0.5 * kq.scale[..., None] * (1 + 1e-5)
    else:  # 3 mantissa bits: half a unit in the last place, 2^-4 relative; subnormals 2^-10
        bound = np.maximum(np.abs(x) * 2.0 ** -4, kq.scale[..., None] * 2.0 ** -10) * (1 + 1e-5)
    assert np.all(error <= bound)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_and_nonfinite_rows(rng, fmt):
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    x[0, 1] = 0.0
    x[1, 2, 3] = np.inf
    x[2, 4, 0] = np.nan
    kq = quantize_kv(x, fmt)
    back = dequantize_kv(kq)
    assert kq.scale[0, 1] == 0 and np.all(kq.data[0, 1].astype(np.float32) == 0)
    assert np.all(back[0, 1] == 0)
    for row in [(1, 2), (2, 4)]:  # scale NaN, dequantized to NaN: propagates like the input
        assert np.isnan(kq.scale[row]) and np.all(np.isnan(back[row]))
    finite = np.ones((3, 5), bool)
    finite[1, 2] = finite[2, 4] = False
    assert np.all(np.isfinite(back[finite]))


@pytest.mark.parametrize("rows", [1, 3, 37, 256])
def test_compiled_rows_give_numpy_bits(rng, monkeypatch, rows):
    """Small inputs are quantized by a compiled loop (`kernels.quantize`), large ones by numpy's
    operations: the same bits, ties (x / scale at k + 1/2, to even) and special rows included."""
    from cpuflash import _quantize

    x = (rng.standard_normal((rows, 64)) * 10.0 ** rng.integers(-30, 30, (rows, 1)))
    x = x.astype(np.float32)
    ties = (rng.integers(-127, 127, 64) + 0.5).astype(np.float32)
    ties[0] = 127  # scale 1 before the factor: x / scale lands on k + 1/2
    x[0] = ties * np.float32(0.37)
    specials = [0.0, np.inf, np.nan, -np.inf, 1e-45, -0.0]
    for i, value in enumerate(specials[:rows - 1]):
        x[i + 1, i] = value
        if value in (0.0, 1e-45):
            x[i + 1] = value  # a row of zeros, or of the smallest subnormal (scale 0)
    assert x.size <= _quantize.COMPILED_SIZE
    got = quantize_kv(x, "int8")
    monkeypatch.setattr(_quantize, "COMPILED_SIZE", 0)
    want = quantize_kv(x, "int8")
    assert_same_bits(got.data, want.data)
    assert_same_bits(got.scale, want.scale)


def test_quantize_and_dequantize_errors():
    x = np.ones((2, 4, 8), np.float32)
    with pytest.raises(TypeError, match="`x` must be a float array, got dtype int32"):
        quantize_kv(np.ones((2, 8), np.int32))
    with pytest.raises(ValueError, match="`x` must have at least one axis"):
        quantize_kv(np.array(1.0, np.float32))
    with pytest.raises(ValueError, match="`dtype` must be one of \\('int8', 'float8_e4m3', "
                                         "'int4'\\), got 'int2'"):
        quantize_kv(x, dtype="int2")
    with pytest.raises(TypeError, match="`kq` must be a cpuflash.QuantizedKV"):
        dequantize_kv(x)
    with pytest.raises(TypeError, match="`kq.data` must be int8 or float8_e4m3fn \\(a scale per "
                                        "row\\), or uint8 \\(int4.*got float32"):
        dequantize_kv(QuantizedKV(x, np.ones((2, 4), np.float32)))
    kq = quantize_kv(x)
    with pytest.raises(TypeError, match="`kq.scale` must be float32, got float64"):
        dequantize_kv(QuantizedKV(kq.data, kq.scale.astype(np.float64)))
    with pytest.raises(ValueError, match="`kq.scale` must have the shape of `kq.data` without "
                                         "its last axis, \\(2, 4\\), got \\(2, 3\\)"):
        dequantize_kv(QuantizedKV(kq.data, kq.scale[:, :3]))


# -- the widening loads ---------------------------------------------------------------------------

@numba.njit(cache=True)
def _byte_loads(i8, e4m3, out):
    for i in range(0, i8.shape[0], LANES_F32):
        vstore(out[0], i, vload_i8(i8, i))
        vstore(out[1], i, vload_e4m3(e4m3, i))


@numba.njit(cache=True)
def _widen_scalars(i8, e4m3, out):
    for i in range(i8.shape[0]):
        out[0, i] = widen(i8[i], INT8)
        out[1, i] = widen(e4m3[i], FLOAT8_E4M3)


def test_every_8_bit_pattern_widens_exactly():
    """Every int8 and every float8_e4m3fn bit pattern (subnormals, +-0, NaN included), by the
    vector loads and by the scalar `widen` of the widened copies; float8 numbers come in
    units of E4M3_UNIT."""
    f8 = data_dtype("float8_e4m3")
    bits = np.arange(256, dtype=np.uint8)
    i8 = bits.view(np.int8)
    expected = np.stack([i8.astype(np.float32),
                         bits.view(f8).astype(np.float32) / np.float32(E4M3_UNIT)])
    for convert in (_byte_loads, _widen_scalars):
        out = np.zeros((2, 256), np.float32)
        convert(i8, bits, out)
        np.testing.assert_array_equal(out, expected)
        assert np.array_equal(np.signbit(out), np.signbit(expected))  # -0 stays -0


# -- attention on quantized caches ----------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_decode_writes_quantized_keys_and_attends(rng, fmt, num_splits):
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, seqlens=[0, 150, 299])
    kc, vc = quantize_kv(k_cache, fmt), quantize_kv(v_cache, fmt)
    before = [x.copy() for x in (kc.data, kc.scale, vc.data, vc.scale)]
    out, lse = cpuflash.attention_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=seqlens,
                                               num_splits=num_splits, return_lse=True)
    new_k, new_v = quantize_kv(k, fmt), quantize_kv(v, fmt)
    for b, s in enumerate(seqlens):  # the new rows and scales at their place, nothing else
        for cache, new, old in ((kc, new_k, before[:2]), (vc, new_v, before[2:])):
            assert np.array_equal(cache.data[b, :, s].view(np.uint8),
                                  new.data[b, :, 0].view(np.uint8))
            np.testing.assert_array_equal(cache.scale[b, :, s], new.scale[b, :, 0])
            assert np.array_equal(np.delete(cache.data[b], s, axis=1).view(np.uint8),
                                  np.delete(old[0][b], s, axis=1).view(np.uint8))
            np.testing.assert_array_equal(np.delete(cache.scale[b], s, axis=1),
                                          np.delete(old[1][b], s, axis=1))
    check_kvcache(out, lse, q, dequantize_kv(kc), dequantize_kv(vc), seqlens + 1, causal=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("d,d_v,hq,hk", [(64, 48, 8, 2), (128, 128, 32, 8), (40, 59, 6, 2),
                                         (128, 64, 4, 1)])
def test_modifiers_gqa_and_head_dims(rng, fmt, d, d_v, hq, hk):
    """Head dims read in place (whole vectors) and through widened copies (40, 59), groups of
    1 to 8 rows, with a window, softcap, ALiBi and sinks."""
    batch, n_max = 2, 333
    q = rng.standard_normal((batch, hq, 1, d)).astype(np.float32)
    kc = quantized(rng, fmt, (batch, hk, n_max, d))
    vc = quantized(rng, fmt, (batch, hk, n_max, d_v))
    check_modified_decoding(rng, q, kc, vc)


@pytest.mark.parametrize("fmt", FORMATS + ["int4", "int4-32"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("n_q", [1, 40], ids=["decode", "chunked prefill"])
def test_paged_layouts_and_chunked_prefill(rng, fmt, layout, n_q):
    """Pages shuffled across the batch, new keys written into them, in both layouts; 40 query
    rows (chunked prefill) stay in the decode kernel, which reads the rows in place."""
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, n_max=320, n_q=n_q, n_new=n_q,
                                                    d_v=64 if fmt == "int4-32" else 48,
                                                    seqlens=[5, 200, 280 - n_q])
    table = rng.permutation(3 * 20).reshape(3, 20).astype(np.int32)  # shuffled pages of 16
    kc, vc = (quantize(to_pages(c, 16, table), fmt) for c in (k_cache, v_cache))
    flat_k = quantize(k_cache, fmt)  # the same rows, unpaged, for the reference
    flat_v = quantize(v_cache, fmt)
    kwargs = dict(window=(70, -1), softcap=10.0)
    if layout == "bshd":
        args = (bshd(q), *(QuantizedKV(bshd(c.data), np.ascontiguousarray(
            np.swapaxes(c.scale, 1, 2))) for c in (kc, vc)))
        new = dict(k=bshd(k), v=bshd(v))
    else:
        args, new = (q, kc, vc), dict(k=k, v=v)
    out, lse = cpuflash.attention_with_kvcache(*args, **new, cache_seqlens=seqlens,
                                               block_table=table, layout=layout, num_splits=3,
                                               return_lse=True, **kwargs)
    if layout == "bshd":
        out = np.swapaxes(out, 1, 2)
        pages = [QuantizedKV(np.swapaxes(c.data, 1, 2), np.swapaxes(c.scale, 1, 2))
                 for c in args[1:]]
    else:
        pages = [kc, vc]
    for b in range(3):  # the new keys landed, quantized, in the right pages
        for i in range(n_q):
            pos = seqlens[b] + i
            at = (table[b, pos // 16], slice(None), pos % 16)
            np.testing.assert_array_equal(dequantize_kv(pages[0])[at],
                                          dequantize_kv(quantize(k[b, :, i], fmt)))
    references = [written(c, new_rows, seqlens, fmt) for c, new_rows in ((flat_k, k),
                                                                          (flat_v, v))]
    check_kvcache(out, lse, q, *references, seqlens + n_q, causal=True, **kwargs)


@pytest.mark.parametrize("fmt", FORMATS + ["int4", "int4-32"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_queries(rng, fmt, dtype):
    dtype = low_precision_dtype(dtype)
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, d=64, d_v=64)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    kc, vc = quantize(k_cache, fmt), quantize(v_cache, fmt)
    out = cpuflash.attention_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=seqlens)
    assert out.dtype == dtype
    expected = cpuflash.attention_with_kvcache(q.astype(np.float32), dequantize_kv(kc),
                                               dequantize_kv(vc), cache_seqlens=seqlens + 1)
    # the float32 result rounded once to the output's precision
    np.testing.assert_allclose(out.astype(np.float32), expected, rtol=2 * np.finfo(
        np.float16).eps if dtype == np.float16 else 2 ** -7, atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS + ["int4", "int4-32"])
def test_results_do_not_depend_on_the_thread_count(rng, fmt):
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, batch=5, n_max=700, d=64, d_v=64,
                                                    seqlens=[700, 0, 350, 1, 697])
    kc, vc = quantize(k_cache, fmt), quantize(v_cache, fmt)
    kwargs = dict(window=(300, 0), softcap=20.0, num_splits=2, return_lse=True)
    before = numba.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            numba.set_num_threads(threads)
            results.append(cpuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                                           **kwargs))
    finally:
        numba.set_num_threads(before)
    assert_same_bits(results[1], results[0], "2 threads against 1")


@pytest.mark.parametrize("fmt", FORMATS)
def test_nonfinite_rows_reach_only_the_rows_that_see_them(rng, fmt):
    """A key row quantized from inf (scale NaN) inside the window gives NaN; one outside it is
    never attended to (its NaN scale does not leak through the zero probabilities)."""
    k_cache = rng.standard_normal((2, 1, 64, 32)).astype(np.float32)
    v_cache = rng.standard_normal((2, 1, 64, 32)).astype(np.float32)
    v_cache[:, :, 3, 0] = np.inf  # outside a window of 20 from position 63 in entry 0
    kc, vc = quantize_kv(k_cache, fmt), quantize_kv(v_cache, fmt)
    q = rng.standard_normal((2, 2, 2, 32)).astype(np.float32)
    out = cpuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([64, 10]),
                                          window=(20, 0))
    assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1]))


# -- errors: before anything is written -----------------------------------------------------------

def test_errors_leave_the_caches_unchanged(rng):
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, batch=2, n_max=50, d=32, d_v=32)
    kc, vc = quantize_kv(k_cache), quantize_kv(v_cache)
    data_dtype("float8_e4m3")
    kf = quantize_kv(k_cache, "float8_e4m3")
    before = [x.copy() for x in (kc.data, kc.scale, vc.data, vc.scale)]
    call = cpuflash.attention_with_kvcache
    with pytest.raises(TypeError, match="`k_cache` and `v_cache` must both be QuantizedKV .* "
                                        "got `k_cache` a QuantizedKV and `v_cache` a ndarray"):
        call(q, kc, v_cache, k=k, v=v, cache_seqlens=seqlens)
    with pytest.raises(TypeError, match="got `k_cache` a ndarray and `v_cache` a QuantizedKV"):
        call(q, k_cache, vc, k=k, v=v, cache_seqlens=seqlens)
    with pytest.raises(TypeError, match="must share one format, got float8_e4m3 "
                                        "\\(float8_e4m3fn\\) and int8 \\(int8\\)"):
        call(q, kf, vc, k=k, v=v, cache_seqlens=seqlens)
    with pytest.raises(TypeError, match="`q` must be float32, float16 or bfloat16 with a "
                                        "quantized cache, got float64"):
        call(q.astype(np.float64), kc, vc, k=k, v=v, cache_seqlens=seqlens)
    with pytest.raises(TypeError, match="`k` and `v` must share one float dtype .* got int32 "
                                        "and int32"):
        call(q, kc, vc, k=k.astype(np.int32), v=v.astype(np.int32), cache_seqlens=seqlens)
    with pytest.raises(TypeError, match="`v_cache.scale` must be float32, got float16"):
        call(q, kc, QuantizedKV(vc.data, vc.scale.astype(np.float16)), k=k, v=v,
             cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="`k_cache.scale` must have the shape of "
                                         "`k_cache.data` without its last axis"):
        call(q, QuantizedKV(kc.data, kc.scale[:, :, :10]), vc, k=k, v=v, cache_seqlens=seqlens)
    with pytest.raises(TypeError, match="got `k_cache` a QuantizedKV and `v_cache` a tuple"):
        call(q, kc, (vc.data, vc.scale), k=k, v=v, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="`cache_seqlens` must lie in"):
        call(q, kc, vc, k=k, v=v, cache_seqlens=[10, 50])
    readonly = QuantizedKV(kc.data, kc.scale.copy())
    readonly.scale.flags.writeable = False
    with pytest.raises(ValueError, match="`k_cache.scale` is read-only"):
        call(q, readonly, vc, k=k, v=v, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="`k_cache` must be 4-D"):
        call(q, QuantizedKV(kc.data[0], kc.scale[0]), vc, cache_seqlens=seqlens)
    for now, then in zip((kc.data, kc.scale, vc.data, vc.scale), before):
        np.testing.assert_array_equal(now, then)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout,dtype", [("bhsd", "float32"), ("bshd", "float16")])
def test_a_repeated_call_takes_the_plan_and_gives_the_same_bits(rng, fmt, layout, dtype):
    """The second call with the same shapes and options skips to the kernel (`_plans`): the
    same results and the same writes as the full path, and its errors as the full path's."""
    from cpuflash import _plans

    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, d=64, d_v=32)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    swap = bshd if layout == "bshd" else (lambda x: x)

    def caches():
        return [QuantizedKV(swap(c.data), swap(c.scale[..., None])[..., 0])
                for c in (quantize_kv(k_cache, fmt), quantize_kv(v_cache, fmt))]

    results = []
    for fresh in (True, False, False):  # the full path, then twice the plan
        if fresh:
            _plans.clear()
        kc, vc = caches()
        result = cpuflash.attention_with_kvcache(swap(q), kc, vc, k=swap(k), v=swap(v),
                                                 cache_seqlens=seqlens, layout=layout,
                                                 return_lse=True)
        results.append((result, [x.copy() for x in (kc.data, kc.scale, vc.data, vc.scale)]))
    assert _plans._entries  # the plan was stored and found
    for (result, written_caches) in results[1:]:
        assert_same_bits(result, results[0][0], "the plan's call")
        for now, first in zip(written_caches, results[0][1]):
            assert np.array_equal(now.view(np.uint8), first.view(np.uint8))
    kc, vc = caches()
    with pytest.raises(ValueError, match="`cache_seqlens` must lie in"):
        cpuflash.attention_with_kvcache(swap(q), kc, vc, k=swap(k), v=swap(v),
                                        cache_seqlens=seqlens + 300, layout=layout)
    untouched = caches()
    fresh_k, fresh_v = untouched
    for now, then in zip((kc.data, kc.scale, vc.data, vc.scale),
                         (fresh_k.data, fresh_k.scale, fresh_v.data, fresh_v.scale)):
        assert np.array_equal(now.view(np.uint8), then.view(np.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("memory", [unaligned, strided])
@pytest.mark.parametrize("n_q", [1, 40], ids=["decode", "chunked prefill"])
def test_new_keys_land_in_caches_of_any_memory(rng, fmt, memory, n_q):
    """Unaligned scales, strided data and scales: the new rows and scales are written into the
    caller's arrays, and attended to (twice: the second call may take the first one's plan)."""
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, n_max=320, n_q=n_q, n_new=n_q,
                                                    d_v=64 if fmt == "int4-32" else 48,
                                                    seqlens=[5, 200, 280 - n_q])
    kc, vc = (QuantizedKV(memory(c.data), memory(c.scale[..., None])[..., 0])
              for c in (quantized(rng, fmt, k_cache.shape), quantized(rng, fmt, v_cache.shape)))
    for _ in range(2):
        expected = [written(c, new, seqlens, fmt) for c, new in ((kc, k), (vc, v))]
        out, lse = cpuflash.attention_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=seqlens,
                                                   return_lse=True)
        for cache, want in zip((kc, vc), expected):
            np.testing.assert_array_equal(dequantize_kv(cache), want)
        check_kvcache(out, lse, q, *expected, seqlens + n_q, causal=True)
        k, v = (rng.standard_normal(x.shape).astype(np.float32) for x in (k, v))
