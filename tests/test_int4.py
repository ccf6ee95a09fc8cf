"""Four-bit KV caches: quantize_kv(..., "int4", group_size=...) and attention_with_kvcache
reading them (two numbers a byte, a scale per group of a row), against the reference on the
dequantized cache after the write."""

import numba
import numpy as np
import pytest

import cpuflash
from cpuflash import QuantizedKV, dequantize_kv, quantize_kv
from cpuflash._simd import LANES_F32, vload_i4, vstore

from helpers import (assert_same_bits, cache_case, check_kvcache, check_modified_decoding,
                     low_precision_dtype, strided)


def int4(x, group_size=32, rotate=False):
    return quantize_kv(x, "int4", group_size=group_size, rotate=rotate)


def numbers(kq):
    """The signed numbers of an int4 cache, unpacked by plain integer arithmetic."""
    low = (kq.data & 0x0F).astype(np.int16)
    high = (kq.data >> 4).astype(np.int16)
    low[low > 7] -= 16
    high[high > 7] -= 16
    out = np.empty(kq.data.shape[:-1] + (2 * kq.data.shape[-1],), np.int16)
    out[..., 0::2], out[..., 1::2] = low, high
    return out


def written(kq, new, seqlens, group_size=32):
    """The dequantized cache with the rows `new` written at `seqlens`, quantized."""
    cache = dequantize_kv(kq)
    new = dequantize_kv(int4(new, group_size))
    for b, s in enumerate(seqlens):
        cache[b, :, s:s + new.shape[2]] = new[b]
    return cache


# -- quantize_kv / dequantize_kv ------------------------------------------------------------------

@pytest.mark.parametrize("group_size", [32, 8, 64, 5])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_quantize_is_the_stated_rounding(rng, group_size, dtype):
    dtype = low_precision_dtype(dtype) if dtype == "bfloat16" else np.dtype(dtype)
    d = 40 if group_size == 5 else 64
    x = (rng.standard_normal((2, 3, 50, d)) * rng.uniform(1e-3, 1e3, (2, 3, 50, 1))).astype(dtype)
    kq = int4(x, group_size)
    assert kq.data.dtype == np.uint8 and kq.data.shape == x.shape[:-1] + (d // 2,)
    assert kq.scale.dtype == np.float32 and kq.scale.shape == x.shape[:-1] + (d // group_size,)
    groups = x.astype(np.float32).reshape(x.shape[:-1] + (d // group_size, group_size))
    scale = np.max(np.abs(groups), axis=-1) / np.float32(7)
    np.testing.assert_array_equal(kq.scale, scale)
    expected = np.rint(groups / scale[..., None]).reshape(x.shape)
    np.testing.assert_array_equal(numbers(kq), expected)
    assert np.abs(numbers(kq)).max() == 7
    back = dequantize_kv(kq)
    np.testing.assert_array_equal(
        back, (expected.reshape(groups.shape).astype(np.float32) * scale[..., None]).reshape(
            x.shape))
    assert np.all(np.abs(back - x.astype(np.float32)) <= np.repeat(scale, group_size, -1)
                  * (0.5 + 1e-5))


def test_zero_and_nonfinite_groups(rng):
    x = rng.standard_normal((1, 1, 3, 64)).astype(np.float32)
    x[0, 0, 0, :32] = 0  # a group of zeros
    x[0, 0, 1, 40] = np.inf  # the second group of row 1
    x[0, 0, 2, 3] = np.nan
    kq = int4(x)
    assert kq.scale[0, 0, 0, 0] == 0 and np.all(dequantize_kv(kq)[0, 0, 0, :32] == 0)
    assert np.isnan(kq.scale[0, 0, 1, 1]) and np.isfinite(kq.scale[0, 0, 1, 0])
    assert np.all(np.isnan(dequantize_kv(kq)[0, 0, 1, 32:]))
    assert np.all(np.isfinite(dequantize_kv(kq)[0, 0, 1, :32]))
    assert np.isnan(kq.scale[0, 0, 2, 0]) and np.all(numbers(kq)[0, 0, 2, :32] == 0)


@pytest.mark.parametrize("rows", [1, 7, 600])  # compiled (few rows) and numpy (many)
def test_both_quantizers_give_the_same_bits(rng, rows):
    x = rng.standard_normal((1, 2, rows, 128)).astype(np.float32) * 3
    x[0, 0, 0, 5] = 0.5 * np.float32(x[0, 0, 0].max()) / 7  # halfway cases round to even
    whole = int4(x)
    parts = [int4(x[:, :, i:i + 1]) for i in range(min(rows, 4))]
    for i, part in enumerate(parts):
        assert np.array_equal(part.data[:, :, 0], whole.data[:, :, i])
        assert np.array_equal(part.scale[:, :, 0], whole.scale[:, :, i])


@numba.njit
def _unpack(data, out):
    vstore(out, 0, vload_i4(data, 0))


def test_every_byte_unpacks_exactly():
    """vload_i4 (the kernel's) against plain integer arithmetic, all 256 bytes."""
    values = np.arange(256, dtype=np.uint8)
    kq = QuantizedKV(values.reshape(1, 1, 1, 256), np.ones((1, 1, 1, 1), np.float32))
    expected = numbers(kq).reshape(-1)
    out = np.empty(LANES_F32, np.float32)
    for start in range(0, 256, LANES_F32 // 2):
        _unpack(values[start:start + LANES_F32 // 2], out)
        np.testing.assert_array_equal(out, expected[2 * start:2 * start + LANES_F32])


def test_quantize_errors(rng):
    x = rng.standard_normal((1, 1, 4, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="`group_size` applies to int4 only .* got 16"):
        quantize_kv(x, "int8", group_size=16)
    with pytest.raises(ValueError, match="an int4 cache needs an even head dim .* head dim 64 "
                                         "and group_size 48"):
        quantize_kv(x, "int4", group_size=48)
    with pytest.raises(ValueError, match="head dim 63"):
        quantize_kv(x[..., :63], "int4", group_size=1)
    with pytest.raises(TypeError, match="`group_size` must be an int, got float"):
        quantize_kv(x, "int4", group_size=32.0)
    with pytest.raises(ValueError, match="a rotated cache needs a head dim that is a power of "
                                         "two"):
        quantize_kv(x[..., :48], "int4", group_size=16, rotate=True)
    kq = int4(x)
    with pytest.raises(ValueError, match="`kq.scale` of an int4 cache must be"):
        dequantize_kv(QuantizedKV(kq.data, kq.scale[..., :1].repeat(3, -1)))
    with pytest.raises(TypeError, match="uint8 \\(int4: a scale per group"):
        dequantize_kv(QuantizedKV(kq.data.astype(np.int16), kq.scale))


# -- attention on int4 caches ---------------------------------------------------------------------

@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_decode_writes_quantized_keys_and_attends(rng, num_splits):
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, seqlens=[0, 150, 299], d_v=64)
    kc, vc = int4(k_cache), int4(v_cache)
    before = [x.copy() for x in (kc.data, kc.scale, vc.data, vc.scale)]
    out, lse = cpuflash.attention_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=seqlens,
                                               num_splits=num_splits, return_lse=True)
    new_k, new_v = int4(k), int4(v)
    for b, s in enumerate(seqlens):  # the new rows and scales at their place, nothing else
        for cache, new, old in ((kc, new_k, before[:2]), (vc, new_v, before[2:])):
            np.testing.assert_array_equal(cache.data[b, :, s], new.data[b, :, 0])
            np.testing.assert_array_equal(cache.scale[b, :, s], new.scale[b, :, 0])
            np.testing.assert_array_equal(np.delete(cache.data[b], s, axis=1),
                                          np.delete(old[0][b], s, axis=1))
            np.testing.assert_array_equal(np.delete(cache.scale[b], s, axis=1),
                                          np.delete(old[1][b], s, axis=1))
    check_kvcache(out, lse, q, dequantize_kv(kc), dequantize_kv(vc), seqlens + 1, causal=True)


@pytest.mark.parametrize("d,d_v,group_size,hq,hk", [
    (64, 64, 32, 8, 2), (128, 128, 32, 32, 8), (128, 64, 128, 4, 1), (32, 96, 32, 20, 4),
    (40, 24, 8, 6, 2), (20, 30, 5 , 6, 3), (48, 48, 16, 2, 2)], ids=str)
def test_modifiers_groups_and_head_dims(rng, d, d_v, group_size, hq, hk):
    """Groups of whole units of two vectors (read in place, `kernels._int4`: one unit and an odd
    number of them too), of whole vectors and of a few numbers (turned into float32 rows a
    vector or a number at a time), GQA groups of 1 to 5 rows, with a window, softcap, ALiBi
    and sinks."""
    batch, n_max = 2, 333
    q = rng.standard_normal((batch, hq, 1, d)).astype(np.float32)
    spread = rng.uniform(0.1, 4.0, (batch, hk, n_max, 1)).astype(np.float32)
    kc = quantize_kv(rng.standard_normal((batch, hk, n_max, d)).astype(np.float32) * spread,
                     "int4", group_size=group_size if d % group_size == 0 else 4)
    vc = quantize_kv(rng.standard_normal((batch, hk, n_max, d_v)).astype(np.float32) * spread,
                     "int4", group_size=group_size if d_v % group_size == 0 else 2)
    check_modified_decoding(rng, q, kc, vc)


@pytest.mark.parametrize("group_size", [16, 32])  # (32: read in place, `kernels._int4`)
def test_nonfinite_groups_reach_only_the_rows_that_see_them(rng, group_size):
    k_cache = rng.standard_normal((2, 1, 64, 64)).astype(np.float32)
    v_cache = rng.standard_normal((2, 1, 64, 64)).astype(np.float32)
    v_cache[:, :, 3, 0] = np.inf  # outside a window of 20 from position 63 in entry 0
    kc, vc = int4(k_cache, group_size), int4(v_cache, group_size)
    q = rng.standard_normal((2, 2, 2, 64)).astype(np.float32)
    out = cpuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([64, 10]),
                                          window=(20, 0))
    assert np.all(np.isfinite(out[0]))
    assert np.all(np.isnan(out[1, :, :, :group_size]))
    assert np.all(np.isfinite(out[1, :, :, group_size:]))


def test_a_repeated_call_takes_the_plan_and_gives_the_same_bits(rng):
    from cpuflash import _plans

    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, d=64, d_v=32)
    results = []
    for fresh in (True, False, False):  # the full path, then twice the plan
        if fresh:
            _plans.clear()
        kc, vc = int4(k_cache), int4(v_cache, 16)
        result = cpuflash.attention_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=seqlens,
                                                 return_lse=True)
        results.append((result, [x.copy() for x in (kc.data, kc.scale, vc.data, vc.scale)]))
    assert _plans._entries
    for result, caches in results[1:]:
        assert_same_bits(result, results[0][0], "the plan's call")
        for now, first in zip(caches, results[0][1]):
            assert np.array_equal(now.view(np.uint8), first.view(np.uint8))
    # another group size with the same data shapes is another plan: still right
    kc, vc = int4(k_cache, 8), int4(v_cache, 8)
    out, lse = cpuflash.attention_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=seqlens,
                                               return_lse=True)
    check_kvcache(out, lse, q, dequantize_kv(kc), dequantize_kv(vc), seqlens + 1)


def test_strided_caches(rng):
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, n_max=200, d_v=64, seqlens=[5, 100, 150])
    kc, vc = (QuantizedKV(strided(c.data), strided(c.scale)) for c in (int4(k_cache),
                                                                        int4(v_cache)))
    expected = [written(c, new, seqlens) for c, new in ((kc, k), (vc, v))]
    out, lse = cpuflash.attention_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=seqlens,
                                               return_lse=True)
    for cache, want in zip((kc, vc), expected):
        np.testing.assert_array_equal(dequantize_kv(cache), want)
    check_kvcache(out, lse, q, *expected, seqlens + 1, causal=True)


def test_rotated(rng):
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, d=64, d_v=64)
    kc, vc = int4(k_cache, rotate=True), int4(v_cache, rotate=True)
    assert kc.rotated
    out, lse = cpuflash.attention_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=seqlens,
                                               return_lse=True)
    check_kvcache(out, lse, q, dequantize_kv(kc), dequantize_kv(vc), seqlens + 1, causal=True)


def test_values_inside_the_keys_and_listed_keys(rng):
    """DeepSeek MLA's latent cache in int4 (values: the keys' first groups), and top-k keys."""
    q = rng.standard_normal((2, 16, 1, 96)).astype(np.float32)
    latent = int4(rng.standard_normal((2, 1, 300, 96)).astype(np.float32))
    new = rng.standard_normal((2, 1, 1, 96)).astype(np.float32)
    seqlens = np.array([210, 250])
    before = QuantizedKV(latent.data.copy(), latent.scale.copy())
    out, lse = cpuflash.attention_with_kvcache(q, latent, None, k=new, value_dim=64,
                                               cache_seqlens=seqlens, return_lse=True)
    keys = written(before, new, seqlens)
    np.testing.assert_array_equal(dequantize_kv(latent), keys)
    check_kvcache(out, lse, q, keys, keys[..., :64], seqlens + 1)
    listed = np.sort(rng.choice(200, (2, 1, 50), replace=False), axis=-1).astype(np.int32)
    got = cpuflash.attention_with_kvcache(q, latent, None, value_dim=64, cache_seqlens=seqlens,
                                          key_indices=listed)
    for b in range(2):
        rows = keys[b:b + 1, :, listed[b, 0]]
        want = cpuflash.attention(q[b:b + 1], rows, rows[..., :64])
        np.testing.assert_allclose(got[b:b + 1], want, atol=2e-6)
    with pytest.raises(ValueError, match="`value_dim` must be a multiple of the int4 cache's "
                                         "group size 32, got 48"):
        cpuflash.attention_with_kvcache(q, latent, None, value_dim=48)


def test_user_functions(rng):
    """A score_mod compiled into the int4 kernel: ALiBi's bias with slope 0.01, written as one,
    against the reference with that slope."""
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, d=64, d_v=64)
    kc, vc = int4(k_cache), int4(v_cache)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - 0.01 * (q_idx - kv_idx)

    out, lse = cpuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                               score_mod=score_mod, return_lse=True)
    check_kvcache(out, lse, q, dequantize_kv(kc), dequantize_kv(vc), seqlens,
                  alibi_slopes=np.full(q.shape[1], 0.01, np.float32))


def test_errors_leave_the_caches_unchanged(rng):
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, batch=2, n_max=50, d=32, d_v=32)
    kc, vc = int4(k_cache), int4(v_cache)
    before = [x.copy() for x in (kc.data, kc.scale, vc.data, vc.scale)]
    call = cpuflash.attention_with_kvcache
    with pytest.raises(TypeError, match="must share one format, got int4 \\(uint8\\) and int8"):
        call(q, kc, quantize_kv(v_cache), k=k, v=v, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="`cache_seqlens` must lie in"):
        call(q, kc, vc, k=k, v=v, cache_seqlens=[10, 50])
    with pytest.raises(ValueError, match="`k_cache` has head dim 32 but `q` has 64"):
        call(np.concatenate([q, q], -1), kc, vc, k=k, v=v, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="`v_cache.scale` of an int4 cache must be"):
        call(q, kc, QuantizedKV(vc.data, vc.scale[:, :, :10]), k=k, v=v, cache_seqlens=seqlens)
    for now, then in zip((kc.data, kc.scale, vc.data, vc.scale), before):
        np.testing.assert_array_equal(now, then)
