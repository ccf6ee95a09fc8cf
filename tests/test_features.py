"""Windows, softcap, ALiBi, bias, masks and sinks, alone and together, against the reference."""

import numpy as np
import pytest

import cpuflash

from accuracy import assert_close_to_reference
from helpers import low_precision_dtype, random_qkv

SIZES = [(1, 239), (113, 203), (127, 127), (239, 113), (3, 70)]


def random_window(rng, n_k):
    """A window with each side unbounded, zero, inside or wider than the keys."""
    sides = [-1, 0, int(rng.integers(1, max(2, n_k))), n_k + 5]
    return int(rng.choice(sides)), int(rng.choice(sides))


@pytest.mark.parametrize("n_q,n_k", SIZES)
@pytest.mark.parametrize("causal", [False, True])
def test_windows(rng, n_q, n_k, causal):
    q, k, v = random_qkv(rng, (2, 4, n_q, 40), (2, 2, n_k, 40))
    for _ in range(4):
        window = random_window(rng, n_k)
        out, lse = cpuflash.attention(q, k, v, window=window, causal=causal, return_lse=True,
                                      tiles=(32, 32))
        assert_close_to_reference(out, q, k, v, lse=lse, window=window, causal=causal)


def test_zero_width_window_is_the_diagonal(rng):
    q, k, v = random_qkv(rng, (1, 2, 50, 16), (1, 2, 50, 16))
    out = cpuflash.attention(q, k, v, window=(0, 0))
    np.testing.assert_allclose(out, v, rtol=1e-6)


@pytest.mark.parametrize("n_q,n_k", SIZES)
def test_softcap_with_large_scores(rng, n_q, n_k):
    q, k, v = random_qkv(rng, (2, 2, n_q, 32), (2, 2, n_k, 32))
    q *= 20
    out, lse = cpuflash.attention(q, k, v, softcap=30.0, causal=True, return_lse=True)
    assert_close_to_reference(out, q, k, v, lse=lse, softcap=30.0, causal=True)


@pytest.mark.parametrize("slopes_shape", ["heads", "batch_heads"])
@pytest.mark.parametrize("n_q,n_k", SIZES)
def test_alibi(rng, n_q, n_k, slopes_shape):
    q, k, v = random_qkv(rng, (2, 4, n_q, 24), (2, 2, n_k, 24))
    shape = (4,) if slopes_shape == "heads" else (2, 4)
    slopes = rng.uniform(0.01, 0.5, size=shape).astype(np.float32)
    out, lse = cpuflash.attention(q, k, v, alibi_slopes=slopes, return_lse=True)
    assert_close_to_reference(out, q, k, v, lse=lse, alibi_slopes=slopes)


@pytest.mark.parametrize("slopes_shape", [(4,), (2, 3, 4)], ids=["heads", "leading_heads"])
def test_alibi_with_two_leading_axes(rng, slopes_shape):
    """q (2, 3, Hq, N, D): slopes per head, or per (leading axes, head)."""
    q, k, v = random_qkv(rng, (2, 3, 4, 50, 24), (2, 3, 2, 70, 24), d_v=16)
    slopes = rng.uniform(0.01, 0.5, size=slopes_shape).astype(np.float32)
    out, lse = cpuflash.attention(q, k, v, alibi_slopes=slopes, causal=True, return_lse=True)
    assert out.shape == (2, 3, 4, 50, 16) and lse.shape == (2, 3, 4, 50)
    assert_close_to_reference(out, q, k, v, lse=lse, alibi_slopes=slopes, causal=True)
    if len(slopes_shape) == 3:  # each leading entry reads its own slopes
        first = cpuflash.attention(q[1, 2], k[1, 2], v[1, 2], alibi_slopes=slopes[1, 2],
                                   causal=True)
        np.testing.assert_array_equal(out[1, 2], first)


BROADCAST_SHAPES = [(2, 4, 113, 203), (113, 203), (1, 1, 113, 203), (2, 1, 1, 203),
                    (4, 113, 1), (203,), (2, 4, 1, 1)]


@pytest.mark.parametrize("shape", BROADCAST_SHAPES)
def test_bias_broadcasts(rng, shape):
    q, k, v = random_qkv(rng, (2, 4, 113, 32), (2, 2, 203, 32))
    bias = rng.standard_normal(shape).astype(np.float32)
    out, lse = cpuflash.attention(q, k, v, bias=bias, causal=True, return_lse=True)
    assert_close_to_reference(out, q, k, v, lse=lse, bias=bias, causal=True)


@pytest.mark.parametrize("shape", BROADCAST_SHAPES)
def test_mask_broadcasts(rng, shape):
    q, k, v = random_qkv(rng, (2, 4, 113, 32), (2, 2, 203, 32))
    mask = rng.random(shape) < 0.7
    out, lse = cpuflash.attention(q, k, v, mask=mask, return_lse=True)
    assert_close_to_reference(out, q, k, v, lse=lse, mask=mask)


def test_bias_with_minus_inf_hides_keys(rng):
    q, k, v = random_qkv(rng, (1, 2, 30, 16), (1, 2, 40, 16))
    bias = np.where(rng.random((30, 40)) < 0.5, -np.inf, 0.0).astype(np.float32)
    bias[3] = -np.inf  # a row that sees nothing
    out, lse = cpuflash.attention(q, k, v, bias=bias, return_lse=True)
    assert np.all(out[:, :, 3] == 0) and np.all(lse[:, :, 3] == -np.inf)
    assert_close_to_reference(out, q, k, v, lse=lse, bias=bias)


@pytest.mark.parametrize("n_q,n_k", SIZES)
def test_sinks(rng, n_q, n_k):
    q, k, v = random_qkv(rng, (2, 4, n_q, 32), (2, 1, n_k, 32))
    sinks = rng.standard_normal(4).astype(np.float32) * 3
    out, lse = cpuflash.attention(q, k, v, sinks=sinks, causal=True, return_lse=True)
    assert_close_to_reference(out, q, k, v, lse=lse, sinks=sinks, causal=True)


def test_rows_with_nothing_visible_everywhere(rng):
    """Whichever rule hides a row, it gives 0 and lse -inf (the sink with sinks)."""
    q, k, v = random_qkv(rng, (1, 2, 8, 16), (1, 2, 4, 16))
    sinks = np.array([0.5, -2.0], dtype=np.float32)
    mask = np.ones((8, 4), dtype=bool)
    mask[6] = False
    for kwargs in ({"causal": True}, {"window": (2, 0)}, {"mask": mask}):
        out, lse = cpuflash.attention(q, k, v, return_lse=True, **kwargs)
        hidden = ~np.isfinite(lse)
        assert hidden.any() and np.all(out[hidden] == 0)
        out, lse = cpuflash.attention(q, k, v, return_lse=True, sinks=sinks, **kwargs)
        assert np.all(out[hidden] == 0)
        np.testing.assert_allclose(lse[hidden], np.broadcast_to(sinks[None, :, None],
                                                                lse.shape)[hidden])


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_everything_at_once(rng, layout, dtype):
    n_q, n_k, hq, hk = 127, 239, 4, 2
    if layout == "bhsd":
        q, k, v = random_qkv(rng, (2, hq, n_q, 59), (2, hk, n_k, 59), d_v=33, dtype=dtype)
    else:
        q, k, v = random_qkv(rng, (2, n_q, hq, 59), (2, n_k, hk, 59), d_v=33, dtype=dtype)
    kwargs = dict(
        causal=True, window=(60, -1), softcap=5.0, scale=0.3,
        alibi_slopes=rng.uniform(0.01, 0.1, (2, hq)).astype(np.float32),
        bias=rng.standard_normal((hq, 1, n_k)).astype(dtype),
        mask=rng.random((2, 1, n_q, n_k)) < 0.9,
        sinks=rng.standard_normal(hq).astype(np.float32),
    )
    out, lse = cpuflash.attention(q, k, v, layout=layout, return_lse=True, tiles=(48, 64),
                                  **kwargs)
    assert_close_to_reference(out, q, k, v, lse=lse, layout=layout, **kwargs)


@pytest.mark.parametrize("which", ["float16", "bfloat16"])
@pytest.mark.parametrize("n_q,n_k,d", [(1, 239, 64), (113, 203, 59), (239, 113, 128)])
def test_half_precision(rng, which, n_q, n_k, d):
    dtype = low_precision_dtype(which)
    q, k, v = random_qkv(rng, (2, 4, n_q, d), (2, 2, n_k, d), dtype=dtype)
    kwargs = dict(causal=True, alibi_slopes=np.full(4, 0.05, np.float32), softcap=20.0)
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **kwargs)
    assert out.dtype == dtype and lse.dtype == np.float32
    # the plain implementation computes in the low precision itself
    assert_close_to_reference(out, q, k, v, lse=lse, plain_dtype=dtype, **kwargs)


def test_half_precision_rounds_to_nearest_and_keeps_specials(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    values = np.array([1.0, -2.5, 1e-3, 65504.0, np.inf, -np.inf, np.nan, 3.0e38], np.float32)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        # one key: the output is that key's value row, bit for bit
        with np.errstate(over="ignore"):
            v = values.astype(dtype).reshape(1, 1, 8)
        q = np.ones((1, 1, 8), dtype)
        out = cpuflash.attention(q, q, v)
        np.testing.assert_array_equal(out.view(np.uint16), v.view(np.uint16))
        # two keys with equal scores: the mean, computed in float32 and rounded to nearest even
        v = rng.standard_normal((1, 2, 64)).astype(dtype)
        q = np.zeros((1, 1, 64), dtype)
        expected = v.astype(np.float32).mean(axis=1, keepdims=True).astype(dtype)
        out = cpuflash.attention(q, q[:, [0, 0]], v)
        np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))
