"""Chunked local attention (`chunk_size`, Llama 4's): a query sees only the keys of its own chunk
of positions, in every kernel, against the dense reference; the tiles of other chunks are never
visited."""

import numpy as np
import pytest

import cpuflash
from cpuflash import _schedule
from cpuflash.reference import attention_reference

from accuracy import assert_close_to_reference
from helpers import (cache_case, check_kvcache, check_varlen, packed, random_qkv, to_pages,
                     with_new_keys)


def chunk_mask(n_q, n_k, chunk_size):
    """API.md's rule as a bool mask: ``(i + Nk - Nq) // C == j // C``."""
    rows = np.arange(n_q)[:, None] + (n_k - n_q)
    return rows // chunk_size == np.arange(n_k)[None, :] // chunk_size


def test_reference_rule():
    """The oracle's chunks are API.md's (and a mask of them gives the same result)."""
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, (1, 2, 37, 8), (1, 2, 90, 8))
    np.testing.assert_array_equal(
        attention_reference(q, k, v, chunk_size=16),
        attention_reference(q, k, v, mask=chunk_mask(37, 90, 16)))


@pytest.mark.parametrize("n_q,n_k", [(1, 1), (113, 239), (239, 113), (300, 300), (5, 70)])
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 100, 4096])
@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(window=(30, 5)),
                                     dict(causal=True, softcap=3.0)])
def test_forward(rng, n_q, n_k, chunk_size, options):
    q, k, v = random_qkv(rng, (2, 4, n_q, 40), (2, 2, n_k, 40), d_v=24)
    out, lse = cpuflash.attention(q, k, v, chunk_size=chunk_size, return_lse=True, **options)
    assert_close_to_reference(out, q, k, v, lse=lse, chunk_size=chunk_size, **options)


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_dtypes(rng, dtype):
    from helpers import low_precision_dtype

    dtype = np.dtype(dtype) if dtype == "float64" else low_precision_dtype(dtype)
    q, k, v = random_qkv(rng, (1, 4, 200, 64), (1, 2, 200, 64), dtype=dtype)
    out, lse = cpuflash.attention(q, k, v, causal=True, chunk_size=48, return_lse=True,
                                  layout="bhsd")
    assert_close_to_reference(out, q, k, v, lse=lse, causal=True, chunk_size=48,
                              plain_dtype=None if dtype == np.float64 else dtype)


def test_bshd_and_tiles(rng):
    q, k, v = random_qkv(rng, (2, 150, 4, 32), (2, 150, 2, 32))
    got = cpuflash.attention(q, k, v, causal=True, chunk_size=40, layout="bshd", tiles=(16, 24))
    assert_close_to_reference(got, q, k, v, causal=True, chunk_size=40, layout="bshd")


def test_modifiers(rng):
    """With ALiBi, a bias, a mask and sinks, chunks hide keys as a mask of them would."""
    q, k, v = random_qkv(rng, (2, 4, 130, 32), (2, 2, 130, 32))
    options = dict(causal=True, alibi_slopes=rng.uniform(0.01, 0.3, 4).astype(np.float32),
                   bias=rng.standard_normal((4, 1, 130)).astype(np.float32),
                   mask=rng.random((130, 130)) < 0.9,
                   sinks=rng.standard_normal(4).astype(np.float32))
    out, lse = cpuflash.attention(q, k, v, chunk_size=33, return_lse=True, **options)
    masked, masked_lse = cpuflash.attention(
        q, k, v, return_lse=True, **dict(options, mask=options["mask"] & chunk_mask(130, 130, 33)))
    np.testing.assert_allclose(out, masked, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, masked_lse, rtol=1e-5, atol=1e-6)


def test_varlen(rng):
    """Chunks start at each sequence's first key."""
    q, k, v, cu_q, cu_k = packed(rng, [5, 0, 130, 1, 77], [7, 3, 100, 0, 200])
    out, lse = cpuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, chunk_size=24,
                                         return_lse=True)
    check_varlen(out, lse, q, k, v, cu_q, cu_k, causal=True, chunk_size=24)


@pytest.mark.parametrize("n_q,n_new", [(1, 1), (4, 4), (6, 0)])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_kvcache(rng, n_q, n_new, num_splits):
    """Chunks of cache positions, the new keys written first; split or not."""
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, n_new=max(n_new, 1), n_q=n_q)
    if n_new == 0:
        k = v = None
    out, lse = cpuflash.attention_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, chunk_size=40,
        num_splits=num_splits, return_lse=True)
    if k is not None:
        k_cache, v_cache = (with_new_keys(c, new, seqlens) for c, new in ((k_cache, k),
                                                                        (v_cache, v)))
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens + n_new, causal=True, chunk_size=40)


def test_kvcache_paged_and_int8(rng):
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, batch=2, n_max=256, d_v=64, n_q=2)
    order = rng.permutation(2 * 4).reshape(2, 4).astype(np.int32)
    paged = cpuflash.attention_with_kvcache(
        q, to_pages(k_cache, 64, order), to_pages(v_cache, 64, order), cache_seqlens=seqlens,
        block_table=order, chunk_size=50)
    check_kvcache(paged, None, q, k_cache, v_cache, seqlens, causal=True, chunk_size=50)
    kq, vq = cpuflash.quantize_kv(k_cache), cpuflash.quantize_kv(v_cache)
    out = cpuflash.attention_with_kvcache(q, kq, vq, cache_seqlens=seqlens, chunk_size=50)
    check_kvcache(out, None, q, cpuflash.dequantize_kv(kq), cpuflash.dequantize_kv(vq), seqlens,
                  causal=True, chunk_size=50)


def rel(score, b, h, q_idx, kv_idx, table):
    return score + table[h, q_idx - kv_idx + 300]


def odd_keys(b, h, q_idx, kv_idx):
    return kv_idx % 3 != 1


def test_flex_with_user_functions(rng):
    """With a score_mod, a mask_mod and its block mask: chunks AND the user's mask; gradients."""
    q, k, v = random_qkv(rng, (1, 2, 200, 32), (1, 2, 200, 32))
    table = rng.standard_normal((2, 601)).astype(np.float32)
    bias = table[:, np.arange(200)[:, None] - np.arange(200)[None, :] + 300][None]
    shown = np.arange(200) % 3 != 1
    expected = attention_reference(q, k, v, causal=True, chunk_size=50, bias=bias,
                                   mask=np.broadcast_to(shown, (200, 200)))
    block_mask = cpuflash.block_mask(odd_keys, 1, 1, 200, 200)
    for masks in (dict(mask_mod=odd_keys), dict(block_mask=block_mask)):
        out, lse = cpuflash.flex_attention(q, k, v, score_mod=rel, score_args=(table,),
                                           causal=True, chunk_size=50, return_lse=True, **masks)
        np.testing.assert_allclose(out, expected, atol=2e-6)
        dout = rng.standard_normal(out.shape).astype(np.float32)
        grads = cpuflash.flex_attention_backward(
            dout, q, k, v, out, lse, score_mod=rel, score_args=(table,), causal=True,
            chunk_size=50, **masks)
        with_bias = cpuflash.attention_backward(
            dout, q, k, v, out, lse, causal=True, bias=bias, chunk_size=50,
            mask=np.broadcast_to(shown, (200, 200)))
        for got, want in zip(grads, with_bias):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_decoding_with_user_functions(rng):
    """In a KV-cache call, `q_idx` and the chunks both count cache positions."""
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, batch=2, hq=4, n_max=200, n_q=3,
                                                     seqlens=[150, 97])
    out = cpuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                          chunk_size=32, mask_mod=odd_keys)
    for b in range(2):
        n = seqlens[b]
        assert_close_to_reference(out[b], q[b], k_cache[b, :, :n], v_cache[b, :, :n],
                                  causal=True, chunk_size=32,
                                  mask=np.broadcast_to(np.arange(n) % 3 != 1, (3, n)))


def test_other_chunks_are_never_visited():
    """The tiles the forward and the backward visit hold only the query tiles' own chunks: a 32k
    causal prefill in chunks of 8192 does at most 1/3.5 of the causal work (in pairs of the
    tiles visited; the kernels read their ranges from the same `_band.visible_keys`)."""
    seqs = _schedule.sequence_table(32768, 32768, 1)
    causal = _schedule.work_items(seqs, 1, 128, (-1, 0), 0, 128)[1].sum()
    chunked = _schedule.work_items(seqs, 1, 128, (-1, 0), 8192, 128)[1].sum()
    assert chunked <= causal / 3.5
    keys = _schedule.key_items(seqs, 1, 1, 128, 96, (-1, 0), 8192)[1].sum()
    assert keys <= _schedule.key_items(seqs, 1, 1, 128, 96, (-1, 0), 0)[1].sum() / 3.5


def test_chunk_bigger_than_the_sequence_changes_nothing(rng):
    q, k, v = random_qkv(rng, (1, 2, 100, 32), (1, 2, 100, 32))
    np.testing.assert_array_equal(cpuflash.attention(q, k, v, causal=True, chunk_size=100),
                                  cpuflash.attention(q, k, v, causal=True, chunk_size=10**12))


@pytest.mark.parametrize("value,error", [(0, ValueError), (-3, ValueError), (2.5, TypeError),
                                         (True, TypeError), ("8", TypeError)])
def test_bad_chunk_size(rng, value, error):
    q, k, v = random_qkv(rng, (1, 2, 10, 8), (1, 2, 10, 8))
    with pytest.raises(error, match="chunk_size"):
        cpuflash.attention(q, k, v, chunk_size=value)
    with pytest.raises(error, match="chunk_size"):
        cpuflash.attention_with_kvcache(q, k, v, chunk_size=value)
