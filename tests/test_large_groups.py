"""Decoding with large GQA/MQA groups (DeepSeek's absorbed MLA: 128 query heads on one latent
head): the streaming kernel takes the group's heads as its rows, or, for bfloat16 where the FA-2
tiles multiply pairs, the heads are folded into the query rows of one FA-2 tile
(`_run.forward_folded`); a few rows a head from a long cache fold the same way
(`_run.forward_folded_rows`), windows included. The routes against the dense reference, for
every option they take, and the same bits for any thread count."""

import numba
import numpy as np
import pytest

import cpuflash
from cpuflash import _run

from accuracy import assert_close_to_reference
from helpers import (assert_same_bits, cache_case, check_kvcache, low_precision_dtype, to_pages,
                     with_new_keys)


def route(monkeypatch, folded):
    """Make the calls that follow take the folded route (for bfloat16, on any CPU: where no
    pairs are multiplied the FA-2 tiles widen) or the streaming kernel; returns the list that
    records each folded call."""
    seen = []
    real = _run.forward_folded
    monkeypatch.setattr(_run, "FORWARD_PAIRS", folded)
    monkeypatch.setattr(_run, "forward_folded", lambda *a: seen.append(True) or real(*a))
    return seen


@pytest.mark.parametrize("folded", [False, True], ids=["streaming", "folded"])
@pytest.mark.parametrize("hq,hk", [(32, 1), (64, 2), (128, 1)])
@pytest.mark.parametrize("options", [dict(), dict(window=(100, 0)), dict(chunk_size=64),
                                     dict(softcap=20.0, scale=0.3),
                                     dict(causal=False, window=(-1, 3))])
def test_kvcache(rng, monkeypatch, folded, hq, hk, options):
    seen = route(monkeypatch, folded)
    dtype = low_precision_dtype("bfloat16") if folded else np.float32
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, batch=2, hq=hq, hk=hk, n_max=300,
                                                     d=72, d_v=40, seqlens=[250, 0], dtype=dtype)
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                               cache_seqlens=seqlens, return_lse=True, **options)
    assert bool(seen) == folded
    k_cache, v_cache = with_new_keys(k_cache, k, seqlens), with_new_keys(v_cache, v, seqlens)
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens + 1,
                  plain_dtype=dtype if folded else None, **dict(dict(causal=True), **options))


@pytest.mark.parametrize("n_q", [2, 8, 9])
@pytest.mark.parametrize("options", [dict(), dict(window=(60, 0)), dict(chunk_size=50)])
def test_a_few_rows_a_head(rng, n_q, options):
    """Speculative or multi-token decoding: a few query rows of a large group, new keys
    written (streamed up to `tiling.DECODE_MAX_QUERIES` rows, the FA-2 forward past it)."""
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, batch=2, hq=64, hk=2, n_max=300,
                                                     d=64, d_v=48, n_new=n_q, n_q=n_q,
                                                     seqlens=[250, 3])
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                               cache_seqlens=seqlens, return_lse=True, **options)
    k_cache, v_cache = with_new_keys(k_cache, k, seqlens), with_new_keys(v_cache, v, seqlens)
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens + n_q,
                  **dict(dict(causal=True), **options))


@pytest.mark.parametrize("n_q,hq,streams", [(12, 32, True), (16, 64, True), (9, 128, False)])
@pytest.mark.parametrize("options", ["", "window softcap", "chunk sinks", "alibi"])
def test_more_rows_a_head_stream_with_avx512(rng, monkeypatch, n_q, hq, streams, options):
    """With AVX-512 (forced here), float32 calls of up to 16 rows a head stream while a kv head
    has at most 128 rows; more rows a kv head, or bfloat16, take the FA-2 forward."""
    monkeypatch.setattr(_run, "LANES_F32", 16)
    forwards = []
    real = _run.forward
    monkeypatch.setattr(_run, "forward", lambda *a: forwards.append(True) or real(*a))
    per_head = np.linspace(0.01, 0.3, hq, dtype=np.float32)
    named = dict(window=dict(window=(60, 0)), softcap=dict(softcap=20.0),
                 chunk=dict(chunk_size=50), sinks=dict(sinks=per_head * 10 - 1.5),
                 alibi=dict(alibi_slopes=per_head))
    options = {key: value for name in options.split() for key, value in named[name].items()}
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, batch=2, hq=hq, hk=8, n_max=300,
                                                     d=64, d_v=48, n_new=n_q, n_q=n_q,
                                                     seqlens=[250, 3])
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                               cache_seqlens=seqlens, return_lse=True, **options)
    assert bool(forwards) != streams
    k_cache, v_cache = with_new_keys(k_cache, k, seqlens), with_new_keys(v_cache, v, seqlens)
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens + n_q,
                  **dict(dict(causal=True), **options))
    forwards.clear()
    half = low_precision_dtype("bfloat16")
    cpuflash.attention_with_kvcache(q.astype(half), k_cache.astype(half), v_cache.astype(half),
                                    cache_seqlens=seqlens, **options)
    assert forwards


def rows_route(monkeypatch, kept_bytes=None):
    """Record each call that folds its heads' rows (`_run.forward_folded_rows`); with
    `kept_bytes`, as if a thread kept that many bytes of packed keys (0: every call of a few
    rows a head folds, whatever its cache)."""
    seen = []
    real = _run.forward_folded_rows
    monkeypatch.setattr(_run, "forward_folded_rows", lambda *a: seen.append(True) or real(*a))
    if kept_bytes is not None:
        monkeypatch.setattr(_run, "KEPT_BYTES", kept_bytes)
    return seen


@pytest.mark.parametrize("n_q", [9, 16])
@pytest.mark.parametrize("options", [dict(), dict(softcap=20.0, scale=0.3), dict(causal=False),
                                     dict(sinks=np.linspace(-2, 2, 32, dtype=np.float32)),
                                     dict(chunk_size=100), dict(chunk_size=100, causal=False)])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_rows_of_a_group_folded(rng, monkeypatch, n_q, options, layout):
    """Chunked prefill from a cache (or draft tokens checked at once) with a group's heads
    folded into one tile's rows: the keys every row sees folded, causal's last ones a head at
    a time, the parts merged. Forced here for small caches; every batch entry's own length."""
    seen = rows_route(monkeypatch, kept_bytes=0)
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, batch=2, hq=32, hk=2, n_max=300,
                                                     d=64, d_v=48, n_new=n_q, n_q=n_q,
                                                     seqlens=[250, 3])
    turn = (lambda x: np.ascontiguousarray(x.swapaxes(1, 2))) if layout == "bshd" else \
        (lambda x: x.copy())
    out, lse = cpuflash.attention_with_kvcache(
        turn(q), turn(k_cache), turn(v_cache), k=turn(k), v=turn(v), cache_seqlens=seqlens,
        return_lse=True, layout=layout, **options)
    assert seen
    k_cache, v_cache = with_new_keys(k_cache, k, seqlens), with_new_keys(v_cache, v, seqlens)
    check_kvcache(turn(out), lse, q, k_cache, v_cache, seqlens + n_q,
                  **dict(dict(causal=True), **options))


def test_folded_rows_from_a_long_cache(rng, monkeypatch):
    """Unforced: a kv head's keys beyond what a thread keeps packed fold, in both functions;
    the bits do not depend on the thread count (the tiles of rows do)."""
    seen = rows_route(monkeypatch)
    q = rng.standard_normal((1, 16, 12, 64), dtype=np.float32)
    k, v = (rng.standard_normal((1, 1, 8300, 64), dtype=np.float32) for _ in range(2))
    before = numba.get_num_threads()
    results = []
    try:
        for threads in sorted({1, 2, before}):
            numba.set_num_threads(threads)
            results.append(cpuflash.attention_with_kvcache(q, k, v, return_lse=True))
    finally:
        numba.set_num_threads(before)
    assert len(seen) == len(results)
    for other in results[1:]:
        assert_same_bits(results[0], other)
    out, lse = results[0]
    assert_close_to_reference(out, q, k, v, lse=lse, causal=True)
    out = cpuflash.attention(q, k, v, causal=True)
    assert len(seen) == len(results) + 1
    assert_close_to_reference(out, q, k, v, causal=True)


def test_folded_rows_paged_and_values_inside_the_keys(rng, monkeypatch):
    """The folded rows read gathered pages, and a latent cache whose values are its keys'
    first columns (a chunk of an MLA prefill)."""
    seen = rows_route(monkeypatch, kept_bytes=0)
    paged_latent_call(rng, n_q=12)
    assert seen


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [True, False])
def test_folded_rows_in_half_precision(rng, monkeypatch, dtype, causal):
    """The parts are computed and merged unrounded, the output rounded once."""
    seen = rows_route(monkeypatch, kept_bytes=0)
    dtype = low_precision_dtype(dtype)
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, batch=2, hq=32, hk=2, n_max=150, n_q=12,
                                                     seqlens=[150, 40], dtype=dtype)
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                               causal=causal, return_lse=True)
    assert seen and out.dtype == dtype
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens, causal=causal, plain_dtype=dtype)


@pytest.mark.parametrize("n_q", [9, 16])
@pytest.mark.parametrize("options", [dict(window=(100, 0)), dict(window=(15, 0)),
                                     dict(window=(100, 0), chunk_size=140),
                                     dict(window=(40, -1), causal=False),
                                     dict(window=(100, 0), sinks=np.linspace(-2, 2, 32,
                                                                           dtype=np.float32))])
def test_rows_of_a_group_folded_with_a_window(rng, monkeypatch, n_q, options):
    """A window's left side shows the first rows keys the last ones do not: those go a query
    row at a time with its group's heads folded (`_run._window_heads`), the rows that see none
    of them with no key; one entry's rows see keys from 0, where the window cuts none."""
    seen = rows_route(monkeypatch, kept_bytes=0)
    rows = []
    real = _run._window_heads
    monkeypatch.setattr(_run, "_window_heads", lambda *a: rows.append(True) or real(*a))
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, batch=2, hq=32, hk=2, n_max=300,
                                                     d=64, d_v=48, n_new=n_q, n_q=n_q,
                                                     seqlens=[250, 3])
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                               cache_seqlens=seqlens, return_lse=True,
                                               **options)
    assert seen and rows
    k_cache, v_cache = with_new_keys(k_cache, k, seqlens), with_new_keys(v_cache, v, seqlens)
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens + n_q,
                  **dict(dict(causal=True), **options))


def test_a_window_that_hides_no_key_folds_as_none(rng, monkeypatch):
    """A window wider than the cache changes nothing: the same bits as without one."""
    seen = rows_route(monkeypatch, kept_bytes=0)
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, batch=2, hq=32, hk=2, n_max=150, n_q=12,
                                                     seqlens=[150, 40])
    results = [cpuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                               return_lse=True, **options)
               for options in (dict(), dict(window=(150, 0)))]
    assert len(seen) == 2
    assert_same_bits(*results)


@pytest.mark.parametrize("options", [
    dict(window=(10, 0)), dict(alibi_slopes=np.linspace(0.01, 0.3, 32, dtype=np.float32)),
    dict(chunk_size=140)])  # (rows at 138 .. 149: two chunks)
def test_rows_that_differ_are_not_folded(rng, monkeypatch, options):
    seen = rows_route(monkeypatch, kept_bytes=0)
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, batch=1, hq=32, hk=2, n_max=150, n_q=12,
                                                     seqlens=[150])
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, return_lse=True, **options)
    assert not seen
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens, causal=True, **options)


@pytest.mark.parametrize("splits,threads,taken_splits,options", [
    (2, None, 2, dict()), (3, None, 3, dict(window=(1500, 0))), (3, None, 3, dict(chunk_size=1536)),
    (0, 3, 3, dict()), (0, 3, 2, dict(window=(1500, 0))), (0, 2, 1, dict()), (0, 4, 1, dict())])
def test_folded_keys_split(rng, monkeypatch, splits, threads, taken_splits, options):
    """The folded route's keys split (each thread packing the key blocks of its split), the
    parts merged: by `num_splits`, or automatically where the groups and their tiles of rows
    would leave threads idle (here as if there were `threads`: two groups on three threads take
    three splits each, on two or four none; 1501 keys make at most two splits of 512 keys);
    a split may hold no key of a short sequence."""
    seen = route(monkeypatch, True)
    taken = []
    real = _run._folded_splits
    monkeypatch.setattr(_run, "_folded_splits", lambda *a: taken.append(real(*a)) or taken[-1])
    if threads:
        monkeypatch.setattr(_run._threads, "thread_count", lambda: threads)
    dtype = low_precision_dtype("bfloat16")
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, batch=2, hq=32, hk=1, n_max=2100,
                                                     d=72, d_v=40, seqlens=[2090, 300],
                                                     dtype=dtype)
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                               cache_seqlens=seqlens, return_lse=True,
                                               num_splits=splits, **options)
    assert seen and taken[0][0] == taken_splits
    k_cache, v_cache = with_new_keys(k_cache, k, seqlens), with_new_keys(v_cache, v, seqlens)
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens + 1, plain_dtype=dtype,
                  **dict(dict(causal=True), **options))


def test_folded_attention_is_not_split(rng, monkeypatch):
    """An `attention` call's bits may not depend on the thread count: its keys stay whole."""
    route(monkeypatch, True)
    taken = []
    real = _run._folded_splits
    monkeypatch.setattr(_run, "_folded_splits", lambda *a: taken.append(real(*a)) or taken[-1])
    monkeypatch.setattr(_run._threads, "thread_count", lambda: 4)
    dtype = low_precision_dtype("bfloat16")
    q = rng.standard_normal((1, 64, 1, 64)).astype(dtype)
    k, v = (rng.standard_normal((1, 2, 3000, 64)).astype(dtype) for _ in range(2))
    out = cpuflash.attention(q, k, v)
    assert taken == [(1, 3072)]
    assert_close_to_reference(out[0], q[0], k[0], v[0], plain_dtype=dtype)


@pytest.mark.parametrize("folded", [False, True], ids=["streaming", "folded"])
def test_mla_values_inside_the_keys(rng, monkeypatch, folded):
    """DeepSeek's absorbed MLA: 128 heads of 576 dims on one latent row, whose first 512 dims
    are the values (a numpy view of the key cache)."""
    seen = route(monkeypatch, folded)
    dtype = low_precision_dtype("bfloat16") if folded else np.float32
    q = rng.standard_normal((1, 128, 1, 576)).astype(dtype)
    latent = rng.standard_normal((1, 1, 700, 576)).astype(dtype)
    out = cpuflash.attention_with_kvcache(q, latent, latent[..., :512], scale=0.05)
    assert bool(seen) == folded and out.shape == (1, 128, 1, 512)
    assert_close_to_reference(out, q, latent, latent[..., :512], scale=0.05, causal=True,
                              plain_dtype=dtype if folded else None)


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_dtypes(rng, dtype):
    dtype = np.dtype(dtype) if dtype == "float64" else low_precision_dtype(dtype)
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, batch=2, hq=48, hk=2, n_max=200,
                                                     dtype=dtype, seqlens=[200, 77])
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                               return_lse=True)
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens, causal=True,
                  plain_dtype=None if dtype == np.float64 else dtype)


def test_paged_and_bshd(rng):
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, batch=2, hq=64, hk=1, n_max=256, d_v=64,
                                                     seqlens=[256, 100])
    order = rng.permutation(8).reshape(2, 4).astype(np.int32)
    paged = cpuflash.attention_with_kvcache(
        q, to_pages(k_cache, 64, order), to_pages(v_cache, 64, order), cache_seqlens=seqlens,
        block_table=order)
    check_kvcache(paged, None, q, k_cache, v_cache, seqlens, causal=True)
    bshd = cpuflash.attention_with_kvcache(
        q.swapaxes(1, 2), k_cache.swapaxes(1, 2), v_cache.swapaxes(1, 2), cache_seqlens=seqlens,
        layout="bshd")
    np.testing.assert_array_equal(bshd.swapaxes(1, 2), paged)


@pytest.mark.parametrize("folded", [False, True], ids=["streaming", "folded"])
def test_attention_one_row(rng, monkeypatch, folded):
    """`cpuflash.attention` with one query row takes the same routes."""
    seen = route(monkeypatch, folded)
    dtype = low_precision_dtype("bfloat16") if folded else np.float32
    q = rng.standard_normal((2, 64, 1, 64)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, 333, 64)).astype(dtype) for _ in range(2))
    out, lse = cpuflash.attention(q, k, v, causal=True, window=(50, 0), return_lse=True)
    assert bool(seen) == folded
    assert_close_to_reference(out, q, k, v, lse=lse, causal=True, window=(50, 0),
                              plain_dtype=dtype if folded else None)


@pytest.mark.parametrize("options", [
    dict(alibi_slopes=np.linspace(0.01, 0.3, 64, dtype=np.float32)),
    dict(sinks=np.linspace(-1, 1, 64, dtype=np.float32))])
def test_head_dependent_steps_are_not_folded(rng, monkeypatch, options):
    seen = route(monkeypatch, True)
    dtype = low_precision_dtype("bfloat16")
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, batch=1, hq=64, hk=2, n_max=150,
                                                     seqlens=[150], dtype=dtype)
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, return_lse=True, **options)
    assert not seen
    check_kvcache(out, lse, q, k_cache, v_cache, seqlens, causal=True, plain_dtype=dtype,
                  **options)


@pytest.mark.parametrize("folded", [False, True], ids=["streaming", "folded"])
def test_thread_count_changes_no_bit(rng, monkeypatch, folded):
    """For a given `num_splits` (the streaming kernel's automatic choice follows the threads,
    as for any KV-cache call); the folded route's tiles of rows follow them too, its bits not."""
    route(monkeypatch, folded)
    dtype = low_precision_dtype("bfloat16") if folded else np.float32
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, batch=1, hq=128, hk=1, n_max=1000,
                                                     d=128, d_v=128, seqlens=[999], dtype=dtype)
    before = numba.get_num_threads()
    results = []
    try:
        for threads in sorted({1, before}):
            numba.set_num_threads(threads)
            results.append(cpuflash.attention_with_kvcache(q, k_cache, v_cache,
                                                           cache_seqlens=seqlens, num_splits=3,
                                                           return_lse=True))
    finally:
        numba.set_num_threads(before)
    assert_same_bits(results[0], results[-1])


# -- values inside the keys (`value_dim`)

@pytest.mark.parametrize("hq", [8, 64])
def test_value_dim_float_with_new_keys(rng, hq):
    """New latent rows are written once, through `k`; the values are their first columns."""
    q = rng.standard_normal((2, hq, 1, 96)).astype(np.float32)
    latent = rng.standard_normal((2, 1, 300, 96)).astype(np.float32)
    new = rng.standard_normal((2, 1, 1, 96)).astype(np.float32)
    seqlens = np.array([200, 0], np.int32)
    written = latent.copy()
    out, lse = cpuflash.attention_with_kvcache(q, written, None, k=new, cache_seqlens=seqlens,
                                               value_dim=64, return_lse=True)
    assert out.shape == (2, hq, 1, 64)
    expected = with_new_keys(latent, new, seqlens)
    np.testing.assert_array_equal(written, expected)
    check_kvcache(out, lse, q, expected, expected[..., :64], seqlens + 1, causal=True)


def paged_latent_call(rng, n_q):
    """`n_q` rows a head of 32 heads on a paged latent cache whose values are its keys' first
    48 columns, checked against the reference; returns (q, latent)."""
    q = rng.standard_normal((2, 32, n_q, 64)).astype(np.float32)
    latent = rng.standard_normal((2, 1, 256, 64)).astype(np.float32)
    seqlens = np.array([256, 70], np.int32)
    order = rng.permutation(8).reshape(2, 4).astype(np.int32)
    paged = cpuflash.attention_with_kvcache(q, to_pages(latent, 64, order), None,
                                            cache_seqlens=seqlens, block_table=order,
                                            value_dim=48)
    check_kvcache(paged, None, q, latent, latent[..., :48], seqlens, causal=True)
    return q, latent


def test_value_dim_paged_and_int8(rng):
    q, latent = paged_latent_call(rng, n_q=1)
    kq = cpuflash.quantize_kv(latent)
    new = rng.standard_normal((2, 1, 1, 64)).astype(np.float32)
    seqlens = np.array([100, 70], np.int32)
    out = cpuflash.attention_with_kvcache(q, kq, None, k=new, cache_seqlens=seqlens,
                                          value_dim=48)
    keys = cpuflash.dequantize_kv(kq)  # after the write: the new rows quantized once
    np.testing.assert_array_equal(
        keys[:, :, 100:101][0], cpuflash.dequantize_kv(cpuflash.quantize_kv(new))[0])
    check_kvcache(out, None, q, keys, keys[..., :48], seqlens + 1, causal=True)


@pytest.mark.parametrize("arguments,error,match", [
    (dict(value_dim=0), ValueError, "value_dim"),
    (dict(value_dim=65), ValueError, "value_dim"),
    (dict(value_dim=2.0), TypeError, "value_dim"),
    (dict(value_dim=8, v_cache="cache"), ValueError, "v_cache"),
    (dict(value_dim=8, v="new"), ValueError, "`v` must be None"),
    (dict(), TypeError, "v_cache"),
])
def test_value_dim_errors(rng, arguments, error, match):
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    latent = rng.standard_normal((1, 1, 10, 64)).astype(np.float32)
    before = latent.copy()
    arguments = dict(arguments)
    v_cache = latent if arguments.pop("v_cache", None) else None
    new = rng.standard_normal((1, 1, 1, 64)).astype(np.float32)
    if arguments.pop("v", None):
        arguments.update(k=new, v=new, cache_seqlens=np.array([5], np.int32))
    with pytest.raises(error, match=match):
        cpuflash.attention_with_kvcache(q, latent, v_cache, **arguments)
    np.testing.assert_array_equal(latent, before)


# -- a work item of several heads: each key block packed once for a group's heads

def heads_route(monkeypatch, several):
    """Make the FA-2 forward's work items run several heads of a kv head each where the call
    allows it (as if a thread kept no packed keys), or one head each; returns the list of the
    heads an item that each FA-2 call took."""
    taken = []
    real = _run._heads_an_item
    monkeypatch.setattr(_run, "KEPT_BYTES", 0)
    monkeypatch.setattr(_run, "_heads_an_item", lambda *a: taken.append(
        real(*a) if several else 1) or taken[-1])
    return taken


def rel(score, b, h, q_idx, kv_idx, table):
    return score + table[h, q_idx - kv_idx + 300]


def odd_keys(b, h, q_idx, kv_idx):
    return kv_idx % 3 != 1


HEAD_TABLE = np.random.default_rng(7).standard_normal((32, 601)).astype(np.float32)


@pytest.mark.parametrize("options", [
    dict(alibi_slopes=np.linspace(0.01, 0.3, 32, dtype=np.float32)),
    dict(window=(10, 0), sinks=np.linspace(-2, 2, 32, dtype=np.float32)),
    dict(chunk_size=140, softcap=10.0), dict(causal=False, window=(30, 5)),
    dict(score_mod=rel, score_args=(HEAD_TABLE,)), dict(mask_mod=odd_keys)],
    ids=["alibi", "window-sinks", "chunks-softcap", "window-both-sides", "score_mod",
         "mask_mod"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_several_heads_an_item_give_the_bits_of_one(rng, monkeypatch, options, dtype):
    """Chunked prefill from a cache with steps the folded rows do not take: the heads of a
    kv head share each packed key block, with the bits of a head at a time."""
    dtype = low_precision_dtype(dtype)
    q, k_cache, v_cache, _, _, seqlens = cache_case(rng, batch=2, hq=32, hk=2, n_max=300,
                                                     n_q=12, seqlens=[300, 40], dtype=dtype)
    results = []
    for several in (True, False):
        taken = heads_route(monkeypatch, several)
        results.append(cpuflash.attention_with_kvcache(q, k_cache, v_cache, return_lse=True,
                                                       cache_seqlens=seqlens, **options))
        assert (max(taken) > 1) == several
    assert_same_bits(*results)
    reference = dict(options, causal=options.get("causal", True))
    if "score_mod" in options:
        del reference["score_mod"], reference["score_args"]
        n = np.arange(300)
        reference["bias"] = HEAD_TABLE[:, n[288:, None] - n[None] + 300]
    if "mask_mod" in options:
        del reference["mask_mod"]
        reference["mask"] = np.broadcast_to(np.arange(300) % 3 != 1, (12, 300))
    out, lse = results[0]
    if "bias" not in reference and "mask" not in reference:
        check_kvcache(out, lse, q, k_cache, v_cache, seqlens, plain_dtype=dtype, **reference)
    else:  # (batch entry 0, the one whose 300 keys the bias and mask are built for)
        assert_close_to_reference(out[0], q[0], k_cache[0], v_cache[0], lse=lse[0],
                                  plain_dtype=dtype, **reference)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_several_heads_an_item_in_attention(rng, monkeypatch, dtype):
    """`attention` of a few rows over many keys with a bias and a mask (MQA: the heads of the
    one kv head are dealt to items of several heads); the same bits as a head an item."""
    q = rng.standard_normal((1, 8, 20, 64)).astype(dtype)
    k, v = (rng.standard_normal((1, 1, 500, 64)).astype(dtype) for _ in range(2))
    bias = rng.standard_normal((1, 8, 20, 500)).astype(np.float32)
    mask = rng.random((20, 500)) < 0.8
    results = []
    for several in (True, False):
        taken = heads_route(monkeypatch, several)
        results.append(cpuflash.attention(q, k, v, bias=bias, mask=mask, return_lse=True))
        assert (max(taken) > 1) == several
    assert_same_bits(*results)
    assert_close_to_reference(results[0][0][0], q[0], k[0], v[0], lse=results[0][1][0],
                              bias=bias[0], mask=mask, plain_dtype=q.dtype)
