"""Rotated 8-bit caches (`quantize_kv(..., rotate=True)`): rows turned by the orthonormal
Walsh-Hadamard matrix before quantizing; `attention_with_kvcache` turns q and the output itself,
and its result is the float computation on `dequantize_kv` of the cache after the write."""

import numpy as np
import pytest

import cpuflash
from cpuflash._quantize import hadamard

from accuracy import assert_close_to_reference
from helpers import cache_case, check_kvcache, low_precision_dtype, to_pages


def sylvester(d):
    """The orthonormal Walsh-Hadamard matrix of size d, built as Sylvester's Kronecker powers."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h / np.sqrt(d)


@pytest.mark.parametrize("d", [1, 2, 8, 64, 512])
def test_hadamard_is_the_orthonormal_matrix_and_its_own_inverse(rng, d):
    x = rng.standard_normal((3, 5, d))
    np.testing.assert_allclose(hadamard(x), x @ sylvester(d), atol=1e-12)
    np.testing.assert_allclose(hadamard(hadamard(x)), x, atol=1e-12)
    assert hadamard(x.astype(np.float32)).dtype == np.float32


def test_rotation_spreads_an_outlier(rng):
    """A channel 30x the others: the rotated int8 cache dequantizes its rows closer (a shared
    scale no longer set by one number). float8's error is relative per number: it gains
    nothing there."""
    x = rng.standard_normal((2, 4, 256, 128)).astype(np.float32)
    x[..., 7] *= 30
    plain = cpuflash.quantize_kv(x)
    turned = cpuflash.quantize_kv(x, rotate=True)
    assert turned.rotated and not plain.rotated
    error = [np.abs(cpuflash.dequantize_kv(kq) - x).mean() for kq in (plain, turned)]
    assert error[1] < 0.7 * error[0], error


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3"])
@pytest.mark.parametrize("n_q,n_new", [(1, 1), (3, 3), (1, 0)])
def test_attention_on_a_rotated_cache(rng, fmt, n_q, n_new):
    if fmt == "float8_e4m3":
        low_precision_dtype("bfloat16")
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, batch=2, hq=8, hk=2, n_max=200, d=64,
                                                     d_v=32, n_new=max(n_new, 1), n_q=n_q)
    kq, vq = (cpuflash.quantize_kv(c, fmt, rotate=True) for c in (k_cache, v_cache))
    if n_new == 0:
        k = v = None
    out, lse = cpuflash.attention_with_kvcache(q, kq, vq, k=k, v=v, cache_seqlens=seqlens,
                                               return_lse=True)
    check_kvcache(out, lse, q, cpuflash.dequantize_kv(kq), cpuflash.dequantize_kv(vq),
                  seqlens + n_new, causal=True)
    if k is not None:  # the new rows were turned, then quantized
        written = cpuflash.dequantize_kv(kq)[0, :, seqlens[0]]
        again = cpuflash.dequantize_kv(cpuflash.quantize_kv(k[0, :, 0], fmt, rotate=True))
        np.testing.assert_allclose(written, again, rtol=1e-6, atol=1e-6)


def test_paged_bshd_half_queries_and_listed_keys(rng):
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, batch=2, hq=16, hk=2, n_max=256, d=64,
                                                     d_v=64, n_q=2, seqlens=[256, 90])
    kq, vq = (cpuflash.quantize_kv(c, rotate=True) for c in (k_cache, v_cache))
    kd, vd = cpuflash.dequantize_kv(kq), cpuflash.dequantize_kv(vq)
    order = rng.permutation(8).reshape(2, 4).astype(np.int32)
    pages = [cpuflash.QuantizedKV(to_pages(c.data, 64, order),
                                  to_pages(c.scale[..., None], 64, order)[..., 0], rotated=True)
             for c in (kq, vq)]
    out = cpuflash.attention_with_kvcache(q, *pages, cache_seqlens=seqlens, block_table=order)
    check_kvcache(out, None, q, kd, vd, seqlens, causal=True)
    half = q.astype(np.float16)
    bshd = cpuflash.attention_with_kvcache(
        half.swapaxes(1, 2), *(cpuflash.QuantizedKV(c.data.swapaxes(1, 2), c.scale.swapaxes(1, 2),
                                                    rotated=True) for c in (kq, vq)),
        cache_seqlens=seqlens, layout="bshd")
    check_kvcache(bshd.swapaxes(1, 2), None, half, kd, vd, seqlens, causal=True,
                  plain_dtype=np.float16)
    keys = np.stack([rng.permutation(int(n))[:20] for n in seqlens])[:, None].astype(np.int32)
    keys = np.repeat(keys, 2, axis=1)
    listed = cpuflash.attention_with_kvcache(q, kq, vq, cache_seqlens=seqlens, key_indices=keys)
    for b in range(2):
        n = int(seqlens[b])
        mask = np.zeros((2, n), dtype=bool)
        mask[:, keys[b, 0]] = True
        assert_close_to_reference(listed[b], q[b], kd[b, :, :n], vd[b, :, :n], causal=True,
                                  mask=mask)


def test_errors(rng):
    x = rng.standard_normal((1, 2, 10, 48)).astype(np.float32)
    with pytest.raises(ValueError, match="power of two"):
        cpuflash.quantize_kv(x, rotate=True)
    with pytest.raises(TypeError, match="rotate"):
        cpuflash.quantize_kv(x, rotate="yes")
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    cache = rng.standard_normal((1, 2, 10, 64)).astype(np.float32)
    turned, plain = cpuflash.quantize_kv(cache, rotate=True), cpuflash.quantize_kv(cache)
    with pytest.raises(ValueError, match="both be rotated or neither"):
        cpuflash.attention_with_kvcache(q, turned, plain)
    with pytest.raises(ValueError, match="value_dim"):
        cpuflash.attention_with_kvcache(q, turned, None, value_dim=32)
    odd = cpuflash.QuantizedKV(turned.data[..., :48], turned.scale, rotated=True)
    with pytest.raises(ValueError, match="power of two"):
        cpuflash.attention_with_kvcache(q[..., :48], odd, odd)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_a_repeated_call_takes_the_plan_with_the_same_bits(rng, monkeypatch, layout):
    """Decoding steps on a rotated cache: the second call with the same key goes through the
    stored plan (`_run.decode_again`), turning q, the new rows and the output as the full path
    does, bit for bit."""
    from cpuflash import _run

    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, batch=2, hq=8, hk=2, n_max=100, d=64,
                                                     d_v=64, seqlens=[40, 70])
    swap = (lambda x: x.swapaxes(1, 2)) if layout == "bshd" else (lambda x: x)
    kq, vq = (cpuflash.quantize_kv(c, rotate=True) for c in (k_cache, v_cache))

    def caches():
        return [cpuflash.QuantizedKV(swap(c.data.copy()), swap(c.scale[..., None].copy())[..., 0],
                                     rotated=True) for c in (kq, vq)]

    seen = []
    real = _run.decode_again
    monkeypatch.setattr(_run, "decode_again", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    results = []
    for _ in range(2):
        cache = caches()
        out, lse = cpuflash.attention_with_kvcache(swap(q), *cache, k=swap(k), v=swap(v),
                                                   cache_seqlens=seqlens, layout=layout,
                                                   return_lse=True)
        results.append((out, lse, cache[0].data, cache[0].scale, cache[1].data, cache[1].scale))
    assert seen, "the second call did not take the plan"
    for got, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, want)
    first = results[0]
    kd, vd = (cpuflash.dequantize_kv(cpuflash.QuantizedKV(
        swap(data), swap(scale[..., None])[..., 0], rotated=True))
        for data, scale in ((first[2], first[3]), (first[4], first[5])))
    check_kvcache(swap(results[0][0]), None, q, kd, vd, seqlens + 1, causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_compiled_turn_gives_numpy_passes_bits(rng, monkeypatch, dtype):
    """Few rows go through one compiled pass a row (`kernels.quantize.hadamard_rows`), many
    through numpy's passes: the same sums in the same order."""
    from cpuflash import _quantize

    x = rng.standard_normal((7, 128)).astype(dtype)
    compiled = hadamard(x)
    monkeypatch.setattr(_quantize, "COMPILED_SIZE", 0)
    np.testing.assert_array_equal(compiled, hadamard(x))
