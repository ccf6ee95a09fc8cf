"""Listed keys (`key_indices`, DeepSeek V3.2's top-k sparse attention): a query row sees only its
listed key positions AND the other rules, in `attention`, `attention_with_kvcache` and
`attention_backward`, against the dense reference with the listed keys as a mask."""

import numba
import numpy as np
import pytest

import cpuflash

from accuracy import assert_close_to_reference
from helpers import assert_same_bits, low_precision_dtype, random_qkv, to_pages


def listing(rng, batch, kv_heads, n_q, n_k, topk, unused=3):
    """Random distinct positions per (batch, kv head, query row), a few slots unused (-1)."""
    keys = np.stack([rng.permutation(n_k)[:topk] for _ in range(batch * kv_heads * n_q)])
    keys = keys.reshape(batch, kv_heads, n_q, topk).astype(np.int32)
    keys[..., :unused] = -1
    return keys


def as_mask(keys, n_heads, n_k):
    """The listed keys as a bool mask (B, Hq, Nq, Nk) for the dense reference."""
    batch, kv_heads, n_q, _ = keys.shape
    group = n_heads // kv_heads
    mask = np.zeros((batch, n_heads, n_q, n_k), dtype=bool)
    for b, hk, i in np.ndindex(batch, kv_heads, n_q):
        listed = keys[b, hk, i]
        mask[b, hk * group:(hk + 1) * group, i, listed[listed >= 0]] = True
    return mask


@pytest.mark.parametrize("n_q,n_k", [(1, 300), (37, 90), (64, 64)])
@pytest.mark.parametrize("options", [dict(causal=True), dict(), dict(window=(20, 5)),
                                     dict(causal=True, chunk_size=30, softcap=3.0)])
def test_attention(rng, n_q, n_k, options):
    q, k, v = random_qkv(rng, (2, 8, n_q, 40), (2, 2, n_k, 40), d_v=24)
    keys = listing(rng, 2, 2, n_q, n_k, min(n_k, 24))
    out, lse = cpuflash.attention(q, k, v, key_indices=keys, return_lse=True, **options)
    assert_close_to_reference(out, q, k, v, lse=lse, mask=as_mask(keys, 8, n_k), **options)


def test_one_list_for_every_kv_head_and_bshd(rng):
    q, k, v = random_qkv(rng, (2, 30, 8, 32), (2, 50, 2, 32))
    keys = listing(rng, 2, 1, 30, 50, 12)[:, 0]  # (B, Nq, topk)
    out = cpuflash.attention(q, k, v, layout="bshd", causal=True, key_indices=keys)
    mask = as_mask(np.repeat(keys[:, None], 2, axis=1), 8, 50)
    assert_close_to_reference(out, q, k, v, layout="bshd", causal=True,
                              mask=mask)


def test_order_of_a_list_changes_no_bit(rng):
    q, k, v = random_qkv(rng, (1, 4, 9, 32), (1, 1, 200, 32))
    keys = listing(rng, 1, 1, 9, 200, 50)
    shuffled = keys[..., rng.permutation(50)]
    assert_same_bits(cpuflash.attention(q, k, v, key_indices=keys),
                     cpuflash.attention(q, k, v, key_indices=shuffled))


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_dtypes(rng, dtype):
    dtype = np.dtype(dtype) if dtype == "float64" else low_precision_dtype(dtype)
    q, k, v = random_qkv(rng, (1, 16, 5, 64), (1, 1, 300, 64), dtype=dtype)
    keys = listing(rng, 1, 1, 5, 300, 64)
    out = cpuflash.attention(q, k, v, causal=True, key_indices=keys)
    assert_close_to_reference(out, q, k, v, causal=True, mask=as_mask(keys, 16, 300),
                              plain_dtype=None if dtype == np.float64 else dtype)


def test_kvcache_contiguous_paged_and_int8(rng):
    """Cache positions after the write; float, paged and 8-bit caches; values in the keys."""
    q = rng.standard_normal((2, 64, 1, 96)).astype(np.float32)
    latent = rng.standard_normal((2, 1, 256, 96)).astype(np.float32)
    new = rng.standard_normal((2, 1, 1, 96)).astype(np.float32)
    seqlens = np.array([200, 60], np.int32)
    keys = np.stack([listing(rng, 1, 1, 1, n + 1, 40)[0] for n in seqlens])
    written = latent.copy()
    out = cpuflash.attention_with_kvcache(q, written, None, k=new, cache_seqlens=seqlens,
                                          value_dim=64, key_indices=keys)
    for b in range(2):
        n = seqlens[b] + 1
        assert_close_to_reference(out[b], q[b], written[b, :, :n], written[b, :, :n, :64],
                                  causal=True, mask=as_mask(keys[b:b + 1], 64, n)[0])
    order = rng.permutation(8).reshape(2, 4).astype(np.int32)
    paged = cpuflash.attention_with_kvcache(q, to_pages(written, 64, order), None,
                                            cache_seqlens=seqlens + 1, block_table=order,
                                            value_dim=64, key_indices=keys)
    np.testing.assert_allclose(paged, out, rtol=1e-6, atol=1e-6)
    for fmt in ("int8", "float8_e4m3", "int4"):  # (float8 once gathered its bits as numbers)
        kq = cpuflash.quantize_kv(written, fmt)
        out8 = cpuflash.attention_with_kvcache(q, kq, None, cache_seqlens=seqlens + 1,
                                               value_dim=64, key_indices=keys)
        deq = cpuflash.dequantize_kv(kq)
        for b in range(2):
            n = seqlens[b] + 1
            assert_close_to_reference(out8[b], q[b], deq[b, :, :n], deq[b, :, :n, :64],
                                      causal=True, mask=as_mask(keys[b:b + 1], 64, n)[0])


@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(10, 3)),
                                     dict(causal=True, chunk_size=16, softcap=2.0),
                                     dict(causal=True, sinks=np.linspace(-1, 1, 8,
                                                                         dtype=np.float32))])
def test_backward(rng, options):
    """The gradients equal those of the same listed keys given as a dense mask."""
    q, k, v = random_qkv(rng, (2, 8, 37, 32), (2, 2, 90, 32), d_v=24)
    keys = listing(rng, 2, 2, 37, 90, 20)
    out, lse = cpuflash.attention(q, k, v, key_indices=keys, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    got = cpuflash.attention_backward(dout, q, k, v, out, lse, key_indices=keys, **options)
    mask = as_mask(keys, 8, 90)
    dense_out, dense_lse = cpuflash.attention(q, k, v, mask=mask, return_lse=True, **options)
    want = cpuflash.attention_backward(dout, q, k, v, dense_out, dense_lse, mask=mask, **options)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6)


def test_thread_count_changes_no_bit(rng):
    q, k, v = random_qkv(rng, (1, 32, 20, 64), (1, 1, 500, 64))
    keys = listing(rng, 1, 1, 20, 500, 128)
    before = numba.get_num_threads()
    results = []
    try:
        for threads in sorted({1, before}):
            numba.set_num_threads(threads)
            out, lse = cpuflash.attention(q, k, v, causal=True, key_indices=keys,
                                          return_lse=True)
            dout = np.ones_like(out)
            results.append((out, lse) + cpuflash.attention_backward(
                dout, q, k, v, out, lse, causal=True, key_indices=keys))
    finally:
        numba.set_num_threads(before)
    assert_same_bits(results[0], results[-1])


@pytest.mark.parametrize("change,match", [
    (lambda keys: keys * 0 + 200, "key positions 0 .. 199"),
    (lambda keys: keys * 0 - 2, "-1"),
    (lambda keys: keys[..., None], "must be"),
    (lambda keys: keys.astype(np.float32), "integer"),
])
def test_bad_key_indices(rng, change, match):
    q, k, v = random_qkv(rng, (1, 4, 3, 16), (1, 2, 200, 16))
    keys = listing(rng, 1, 2, 3, 200, 8)
    error = TypeError if match == "integer" else ValueError
    with pytest.raises(error, match=match):
        cpuflash.attention(q, k, v, key_indices=change(keys))


def test_cache_positions_past_the_write_are_refused(rng):
    q = rng.standard_normal((1, 4, 1, 16)).astype(np.float32)
    cache = rng.standard_normal((1, 2, 100, 16)).astype(np.float32)
    before = cache.copy()
    new = rng.standard_normal((1, 2, 1, 16)).astype(np.float32)
    keys = np.array([[[3, 50]]], np.int32)  # position 50: past the 40 + 1 filled
    with pytest.raises(ValueError, match="key_indices"):
        cpuflash.attention_with_kvcache(q, cache, cache.copy(), k=new, v=new,
                                        cache_seqlens=np.array([40], np.int32),
                                        key_indices=keys)
    np.testing.assert_array_equal(cache, before)


def test_combinations_not_taken(rng):
    q, k, v = random_qkv(rng, (1, 4, 3, 16), (1, 2, 20, 16))
    keys = listing(rng, 1, 2, 3, 20, 5)
    with pytest.raises(ValueError, match="cannot be combined with `alibi_slopes`"):
        cpuflash.attention(q, k, v, key_indices=keys,
                           alibi_slopes=np.ones(4, np.float32))
    with pytest.raises(ValueError, match="`score_args` given without a `score_mod`"):
        cpuflash.attention_with_kvcache(q, k, v, key_indices=keys, score_args=(1,))
    with pytest.raises(TypeError, match="`score_args` must be a tuple"):
        cpuflash.attention_with_kvcache(q, k, v, key_indices=keys, score_args=1,
                                        score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(ValueError, match="`mask_args` given without a `mask_mod`"):
        cpuflash.attention_with_kvcache(q, k, v, key_indices=keys, mask_args=(1,))
    with pytest.raises(TypeError, match="`mask_mod` .* must return a bool"):
        cpuflash.attention_with_kvcache(q, k, v, key_indices=keys,
                                        mask_mod=lambda b, h, i, j: 1.5)
    # the functions are checked before the new keys are written
    cache, new = k.copy(), np.ones((1, 2, 1, 16), np.float32)
    with pytest.raises(TypeError, match="`score_mod` .* cannot be compiled by Numba"):
        cpuflash.attention_with_kvcache(q, cache, cache.copy(), k=new, v=new, cache_seqlens=19,
                                        key_indices=keys, score_mod=lambda s, b, h, i, j: s[0])
    np.testing.assert_array_equal(cache, k)


def _every_third_by_head(b, h, q_idx, kv_idx):
    return (kv_idx + h) % 3 != 0


def _below(b, h, q_idx, kv_idx, limit):
    return kv_idx < limit[b]


@pytest.mark.parametrize("mask_mod,by_head", [(_every_third_by_head, True), (_below, False)])
def test_mask_mod_hides_listed_keys(rng, mask_mod, by_head):
    """A KV-cache call's mask_mod AND its lists (and causal): heads of a group that keep other
    keys (one head of each group at a time), or the same ones (folded), with sinks; the mask
    sees the queries' cache positions."""
    batch, hq, hk, n_q, n_k = 2, 6, 2, 3, 80
    q = rng.standard_normal((batch, hq, n_q, 32)).astype(np.float32)
    k, v = (rng.standard_normal((batch, hk, n_k, 32)).astype(np.float32) for _ in range(2))
    seqlens = np.array([50, 80])
    keys = listing(rng, batch, hk, n_q, 50, 30)
    sinks = rng.standard_normal(hq).astype(np.float32)
    limit = np.array([40, 20], np.int64)
    args = () if by_head else (limit,)
    out, lse = cpuflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True,
                                               key_indices=keys, mask_mod=mask_mod,
                                               mask_args=args, sinks=sinks, return_lse=True)
    for b in range(batch):
        n = seqlens[b]
        mask = as_mask(keys[b:b + 1], hq, n)[0]
        for h, i, j in np.ndindex(hq, n_q, n):
            mask[h, i, j] &= bool(mask_mod(b, h, n - n_q + i, j, *args))
        assert_close_to_reference(out[b], q[b], k[b, :, :n], v[b, :, :n], causal=True,
                                  mask=mask, sinks=sinks)


def _biased(score, b, h, q_idx, kv_idx, bias, slope):
    return score + bias[b, h, kv_idx] - slope * (q_idx - kv_idx)


@pytest.mark.parametrize("mask", [False, True])
def test_score_mod_sees_the_listed_keys_positions(rng, mask):
    """A KV-cache call's score_mod on listed keys gets the call's batch entry, head, the
    query's cache position and the key's (here a bias by key and ALiBi's slope, against the
    reference with that bias), alone and with a mask_mod."""
    batch, hq, hk, n_q, n_k = 2, 4, 2, 3, 70
    q = rng.standard_normal((batch, hq, n_q, 32)).astype(np.float32)
    k, v = (rng.standard_normal((batch, hk, n_k, 32)).astype(np.float32) for _ in range(2))
    seqlens = np.array([40, 70])
    keys = listing(rng, batch, hk, n_q, 40, 25)
    bias = rng.standard_normal((batch, hq, n_k)).astype(np.float32)
    extra = dict(mask_mod=_every_third_by_head) if mask else {}
    out, lse = cpuflash.attention_with_kvcache(
        q, k, v, cache_seqlens=seqlens, causal=True, key_indices=keys, score_mod=_biased,
        score_args=(bias, 0.05), return_lse=True, **extra)
    for b in range(batch):
        n = seqlens[b]
        visible = as_mask(keys[b:b + 1], hq, n)[0]
        if mask:
            for h, i, j in np.ndindex(hq, n_q, n):
                visible[h, i, j] &= _every_third_by_head(b, h, n - n_q + i, j)
        positions = np.arange(n - n_q, n)[:, None] - np.arange(n)[None, :]
        dense_bias = bias[b, :, None, :n] - 0.05 * positions[None]
        assert_close_to_reference(out[b], q[b], k[b, :, :n], v[b, :, :n], causal=True,
                                  mask=visible, bias=dense_bias.astype(np.float32))
