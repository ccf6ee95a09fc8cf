"""A key that a row cannot see contributes nothing to that row, even when its key or value holds
NaN or inf (API.md). The kernels work on groups of 6 query rows, panels of 32 keys (float32 on
AVX-512) and blocks of `block_k` keys, so a visibility edge that falls inside a group, a panel
or a block is where a hidden NaN could leak (0 * NaN); small forced tiles put the edges
everywhere.

Each check corrupts one key row, at positions around block and panel edges (a NaN in its key,
or NaN, inf and -inf in three lanes of its value), and compares two calls: one with those
elements non-finite, one with them 0. The reference (which sums each row over the keys it
sees) says which outputs are NaN or inf; every other output keeps the bits of the call with 0
there, which itself passes the accuracy rule.
"""

import numpy as np
import pytest

import cpuflash
from cpuflash.reference import attention_reference

from accuracy import assert_close_to_reference
from helpers import (assert_same_bits, assert_same_nonfinite, cache_case, heads_first, packed,
                     random_qkv, to_pages, visible)

# (which array, {column: the value put there} in one key row): a NaN key element, and a value
# row with NaN, inf and -inf in its first, second and last lanes
CORRUPTIONS = [("k", {0: np.nan}), ("v", {0: np.nan, 1: np.inf, -1: -np.inf})]


def key_positions(n_k, block_k=None):
    """Keys on and next to the edges of 32-key panels and of key blocks, and the last key."""
    edges = {0, 31, 32, 63, 64, 95, 96, 127, 128, n_k - 1}
    if block_k:
        edges |= {e + d for e in range(block_k, n_k, block_k) for d in (-1, 0, 1)}
    edges |= {101, 150}  # inside panels, at other offsets within a 6-row group
    return sorted(j for j in edges if 0 <= j < n_k)


def with_element(x, j, c, value):
    """A copy of the (..., N, D) array `x` with element [..., j, c] of every head set to `value`."""
    x = x.copy()
    x[..., j, c] = value
    return x


def with_row(x, j, values, zero=False):
    """A copy of `x` with key row j given `values` ({column: value}), or zeros there."""
    x = x.copy()
    for c, value in values.items():
        x[..., j, c] = 0.0 if zero else value
    return x


def reference(q, k, v, **kwargs):
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return attention_reference(q, k, v, return_lse=True, **kwargs)


def check_hidden_key(call, q, k, v, j, ref_kwargs, what, check_clean=False, rows_of=None):
    """Corrupt key row `j` of `k`, then of `v` (bhsd, keys on axis -2); `call(q, k, v)`
    gives ``(out, lse)``. Returns how many output rows saw the key and how many did not.

    `rows_of`, when given, maps ``(out, lse)`` to a list of ``(out, lse, q, k, v, ref_kwargs)``
    pieces to hold against the reference one by one (packed sequences); otherwise the whole
    result is one piece.
    """
    seen = hidden = 0
    for which, values in CORRUPTIONS:
        zeroed, bad = dict(k=k, v=v), dict(k=k, v=v)
        zeroed[which] = with_row(zeroed[which], j, values, zero=True)
        bad[which] = with_row(bad[which], j, values)
        clean = call(q, zeroed["k"], zeroed["v"])
        got = call(q, bad["k"], bad["v"])
        label = f"{what}: {which}[..., {j}, :] with {values}"
        pieces = [(got, clean, q, bad["k"], bad["v"], zeroed, ref_kwargs)] if rows_of is None \
            else rows_of(got, clean, bad, zeroed)
        for got_part, clean_part, pq, pk, pv, pzeroed, kwargs in pieces:
            ref, ref_lse = reference(pq, pk, pv, **kwargs)
            assert_same_nonfinite(got_part[0], ref, label + " out")
            assert_same_nonfinite(got_part[1], ref_lse, label + " lse")
            finite = np.isfinite(ref)
            assert_same_bits(got_part[0][finite], clean_part[0][finite],
                             label + ": the outputs the reference has finite vs the call with 0")
            finite = np.isfinite(ref_lse)
            assert_same_bits(got_part[1][finite], clean_part[1][finite], label + " lse")
            if which == "k":  # a NaN key: the rows that see it are NaN, the others not
                rows_nan = np.isnan(ref_lse)
                seen += int(rows_nan.sum())
                hidden += int((~rows_nan).sum())
            if check_clean:
                assert_close_to_reference(clean_part[0], pq, pzeroed["k"], pzeroed["v"],
                                          lse=clean_part[1], **kwargs)
        check_clean = False
    return seen, hidden


# -- attention: causal edges, window edges, masks and -inf bias, with forced tiles ----------------

N = 200


def rule_kwargs(rng, rule, n_q, n_k):
    """The keywords of a visibility rule, for an (n_q, n_k) problem."""
    if rule == "mask":  # every other row of each 6-row group, and random keys
        mask = rng.random((n_q, n_k)) < 0.6
        mask[::2, :] |= rng.random((1, n_k)) < 0.5
        mask[1::2, :] &= rng.random((1, n_k)) < 0.5
        return dict(mask=mask)
    if rule == "bias -inf":
        return dict(bias=np.where(rng.random((n_q, n_k)) < 0.5, -np.inf, 0.0).astype(
            np.float32), causal=True)
    return dict(RULES[rule])


RULES = {
    "causal": dict(causal=True),
    "window left": dict(window=(45, 0)),
    "window right": dict(window=(-1, 7)),
    "window both": dict(window=(17, 23)),
    "window wide": dict(window=(100, 70)),
    "causal window": dict(causal=True, window=(40, -1)),
    "mask": None,
    "bias -inf": None,
}
TILES = [(24, 64), (12, 32), (27, 40), (6, 96), None]  # None: the tile chooser's (band blocks)
SHAPES = {"square": (N, N), "fewer queries": (150, N), "more queries": (N, 150)}


def attention_cases():
    cases = []
    for rule in RULES:
        for tiles in TILES:
            for shape in SHAPES:
                if shape != "square" and tiles not in ((12, 32), None):
                    continue
                cases.append(pytest.param(rule, tiles, shape,
                                          id=f"{rule}-{tiles and 'x'.join(map(str, tiles))}"
                                             f"-{shape}"))
    return cases


@pytest.mark.parametrize("rule,tiles,shape", attention_cases())
def test_attention_hidden_keys_add_nothing(rule, tiles, shape):
    rng = np.random.default_rng(list(RULES).index(rule))
    n_q, n_k = SHAPES[shape]
    q, k, v = random_qkv(rng, (1, 2, n_q, 32), (1, 1, n_k, 32), d_v=40)
    kwargs = rule_kwargs(rng, rule, n_q, n_k)

    def call(q, k, v):
        return cpuflash.attention(q, k, v, return_lse=True, tiles=tiles, **kwargs)

    seen = hidden = 0
    block_k = tiles[1] if tiles else None
    for i, j in enumerate(key_positions(n_k, block_k)):
        s, h = check_hidden_key(call, q, k, v, j, kwargs, f"{rule} tiles={tiles}",
                                check_clean=i == 0)
        seen, hidden = seen + s, hidden + h
    assert seen and hidden, "the rule should hide some corrupted keys from some rows only"


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
@pytest.mark.parametrize("rule", ["causal", "window both", "mask"])
def test_attention_hidden_keys_add_nothing_in_other_dtypes(dtype, rule):
    """float64 (panels of 16 keys on AVX-512) and float16 (widened as packed)."""
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, (1, 2, N, 32), (1, 1, N, 32), d_v=40, dtype=dtype)
    kwargs = rule_kwargs(rng, rule, N, N)

    def call(q, k, v):
        return cpuflash.attention(q, k, v, return_lse=True, tiles=(12, 32), **kwargs)

    for j in key_positions(N, 32):
        check_hidden_key(call, q, k, v, j, kwargs, f"{rule} {np.dtype(dtype).name}")


@pytest.mark.parametrize("window,rows", [((90, 0), [391, 392, 393, 394, 395]),
                                         ((40, 40), [258, 259, 341])])
def test_the_first_reported_leak(window, rows):
    """N = 700, D = 32, automatic tiles, V[300] = NaN: these rows cannot see key 300 and came out
    NaN."""
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, (1, 1, 700, 32), (1, 1, 700, 32))
    bad = with_element(v, 300, slice(None), np.nan)
    out = cpuflash.attention(q, k, bad, window=window)
    assert not visible(700, 700, window=window)[rows, 300].any()
    assert np.isfinite(out[0, 0, rows]).all()
    clean = cpuflash.attention(q, k, with_element(v, 300, slice(None), 0.0), window=window)
    hidden = ~visible(700, 700, window=window)[:, 300]
    assert_same_bits(out[0, 0, hidden], clean[0, 0, hidden], "the rows that cannot see key 300")


@pytest.mark.parametrize("tiles", [None, (1, 1)])
def test_bias_minus_inf_on_every_visible_key_and_a_nan_value(tiles):
    """Row 1 sees only key 0 (causal, Nq = 4 > Nk = 3), whose bias is -inf: the reference's
    row sum is 0, so the row is 0 with lse -inf as a row that sees nothing; its value NaN must
    not make it NaN."""
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, (1, 1, 4, 8), (1, 1, 3, 8))
    bias = np.zeros((4, 3), np.float32)
    bias[:, 0] = -np.inf
    v[0, 0, 0, 0] = np.nan
    ref, ref_lse = reference(q, k, v, bias=bias, causal=True)
    assert np.all(ref[0, 0, 1] == 0) and ref_lse[0, 0, 1] == -np.inf
    out, lse = cpuflash.attention(q, k, v, bias=bias, causal=True, return_lse=True, tiles=tiles)
    assert_same_nonfinite(out, ref, "out")
    assert_same_nonfinite(lse, ref_lse, "lse")
    assert np.all(out[0, 0, 1] == 0)


# -- attention_varlen: a sequence's neighbours never see its keys ---------------------------------

@pytest.fixture
def small_tiles(monkeypatch):
    """Make the tile chooser pick 12 x 32 tiles (varlen and KV-cache calls take no `tiles`)."""
    monkeypatch.setattr(cpuflash.tiling, "choose_tiles",
                        lambda *args, **kwargs: cpuflash.TileConfig(12, 32))


@pytest.mark.parametrize("forced", [False, True], ids=["chosen tiles", "12x32 tiles"])
@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(window=(20, 5)), {}],
                         ids=["causal", "window", "full"])
def test_varlen_neighbours_and_hidden_keys_add_nothing(request, forced, kwargs):
    if forced:
        request.getfixturevalue("small_tiles")
    rng = np.random.default_rng(7)
    lens_q, lens_k = [37, 50, 0, 61, 13], [45, 64, 9, 70, 13]
    q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k, hq=2, hk=1, d=32, d_v=40)
    as_bhsd = [heads_first(x)[None] for x in (q, k, v)]  # (1, H, tokens, D): keys on axis -2

    def call(q4, k4, v4):
        out, lse = cpuflash.attention_varlen(*(heads_first(x[0]) for x in (q4, k4, v4)),
                                             cu_q, cu_k, return_lse=True, **kwargs)
        return heads_first(out)[None], lse[None]

    def per_sequence(got, clean, bad, zeroed):
        pieces = []
        for b in range(len(lens_q)):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            pieces.append(((got[0][..., rows, :], got[1][..., rows]),
                           (clean[0][..., rows, :], clean[1][..., rows]),
                           as_bhsd[0][..., rows, :], bad["k"][..., keys, :], bad["v"][..., keys, :],
                           {name: x[..., keys, :] for name, x in zeroed.items()}, kwargs))
        return pieces

    # the first and last key of every sequence, and keys inside the long ones
    keys = sorted({int(x) for b in range(len(lens_k)) if lens_k[b]
                   for x in (cu_k[b], cu_k[b + 1] - 1)} | {60, 100, 130})
    for i, j in enumerate(keys):
        check_hidden_key(call, *as_bhsd, j, kwargs, f"varlen {kwargs}", check_clean=i == 0,
                         rows_of=per_sequence)


# -- attention_with_kvcache: cache rows past the filled length, and keys hidden in range ----------

def fill_past(cache, n_keys, value):
    """A copy of a (B, H, Nmax, D) cache with every row from n_keys[b] on set to `value`."""
    cache = cache.copy()
    for b, n in enumerate(n_keys):
        cache[b, :, n:] = value
    return cache


@pytest.mark.parametrize("forced", [False, True], ids=["chosen tiles", "12x32 tiles"])
@pytest.mark.parametrize("paged", [False, True], ids=["unpaged", "paged"])
@pytest.mark.parametrize("n_q,n_new", [(1, 0), (1, 1), (4, 4), (20, 3)],
                         ids=["decode", "decode new key", "decode 4 rows", "prefill"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_kvcache_rows_past_the_filled_length_add_nothing(request, forced, paged, n_q, n_new,
                                                         num_splits, value):
    """Whatever the cache holds past ``cache_seqlens + Nnew`` (np.empty's garbage, NaN, inf),
    the result has the bits it has with zeros there."""
    if forced:
        request.getfixturevalue("small_tiles")
    rng = np.random.default_rng(11)
    q, k_cache, v_cache, k, v, seqlens = cache_case(
        rng, batch=3, hq=4, hk=2, n_max=160, d=32, d_v=40, n_new=n_new, n_q=n_q,
        seqlens=[0, 37, 157 - n_new])
    n_keys = seqlens + n_new
    table = rng.permutation(3 * 10).reshape(3, 10).astype(np.int32)  # pages of 16 rows

    def run(fill):
        kc, vc = fill_past(k_cache, seqlens, fill), fill_past(v_cache, seqlens, fill)
        if paged:
            kc, vc = to_pages(kc, 16, table), to_pages(vc, 16, table)
        new = dict(k=k, v=v) if n_new else {}
        return cpuflash.attention_with_kvcache(
            q, kc, vc, cache_seqlens=seqlens, num_splits=num_splits, return_lse=True,
            block_table=table if paged else None, **new)

    clean = run(0.0)
    assert_same_bits(run(value), clean, f"cache rows past cache_seqlens + Nnew = {value}")
    written = [fill_past(c, seqlens, 0.0) for c in (k_cache, v_cache)]
    for b, n in enumerate(n_keys):
        written[0][b, :, seqlens[b]:n], written[1][b, :, seqlens[b]:n] = k[b], v[b]
        assert_close_to_reference(clean[0][b], q[b], written[0][b, :, :n], written[1][b, :, :n],
                                  lse=clean[1][b], causal=True)


@pytest.mark.parametrize("forced", [False, True], ids=["chosen tiles", "12x32 tiles"])
@pytest.mark.parametrize("n_q", [4, 20], ids=["decode 4 rows", "prefill"])
@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(window=(10, 0))],
                         ids=["causal", "window"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_keys_hidden_in_range_add_nothing(request, forced, n_q, kwargs, num_splits):
    """Keys within the filled length that causal or a window hides from some query rows: the
    decode kernel (4 rows x a GQA group of 2) and chunked prefill (20 rows)."""
    if forced:
        request.getfixturevalue("small_tiles")
    rng = np.random.default_rng(13)
    n_keys = 100
    q, k_cache, v_cache, _, _, _ = cache_case(rng, batch=1, hq=4, hk=2, n_max=n_keys, d=32,
                                              d_v=40, n_new=0, n_q=n_q, seqlens=[n_keys])

    def call(q, kc, vc):
        return cpuflash.attention_with_kvcache(q, kc, vc, num_splits=num_splits,
                                               return_lse=True, **kwargs)

    ref_kwargs = dict(kwargs, causal=kwargs.get("causal", True))
    seen = hidden = 0
    for i, j in enumerate([0, 31, 32, 63, 64, 80, 85, 90, 96, 97, 99]):
        s, h = check_hidden_key(call, q, k_cache, v_cache, j, ref_kwargs, f"kvcache {kwargs}",
                                check_clean=i == 0)
        seen, hidden = seen + s, hidden + h
    assert seen and hidden
