"""NaN and inf in the inputs propagate as in the reference, to the rows that meet them and no
others; they never crash or hang. (Non-finite keys and values that a row cannot see, at every
tile edge: test_hidden_nonfinite.py.)"""

import numpy as np
import pytest

import cpuflash
from cpuflash.reference import attention_reference

from helpers import assert_same_bits, assert_same_nonfinite, random_qkv


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_in_one_query_row_stays_in_that_row(rng, dtype):
    q, k, v = random_qkv(rng, (2, 4, 70, 40), (2, 2, 90, 40), dtype=dtype)
    clean, clean_lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    bad = q.copy()
    bad[1, 2, 33, 5] = np.nan
    out, lse = cpuflash.attention(bad, k, v, causal=True, return_lse=True)
    assert np.isnan(out[1, 2, 33]).all() and np.isnan(lse[1, 2, 33])
    others = np.ones(out.shape[:-1], dtype=bool)
    others[1, 2, 33] = False
    assert_same_bits(out[others], clean[others], "other rows")
    assert_same_bits(lse[others], clean_lse[others], "other lse")


def test_nan_in_one_key_reaches_exactly_the_rows_that_see_it(rng):
    q, k, v = random_qkv(rng, (1, 2, 80, 32), (1, 1, 80, 32))
    bad = k.copy()
    bad[0, 0, 50, 3] = np.nan
    # causal: rows i >= 50 see key 50, rows i < 50 do not
    clean, clean_lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    out, lse = cpuflash.attention(q, bad, v, causal=True, return_lse=True)
    assert np.isnan(out[:, :, 50:]).all() and np.isnan(lse[:, :, 50:]).all()
    assert_same_bits((out[:, :, :50], lse[:, :, :50]), (clean[:, :, :50], clean_lse[:, :, :50]),
                     "rows before the NaN key")
    # a window that excludes the key from some rows does the same
    clean = cpuflash.attention(q, k, v, window=(5, 5))
    out = cpuflash.attention(q, bad, v, window=(5, 5))
    sees = np.abs(np.arange(80) - 50) <= 5
    assert np.isnan(out[:, :, sees]).all()
    assert_same_bits(out[:, :, ~sees], clean[:, :, ~sees], "rows outside the window")
    # without a mask, every row sees it
    out = cpuflash.attention(q, bad, v)
    assert np.isnan(out).all()


@pytest.mark.parametrize("value", [np.inf, -np.inf])
def test_infinite_query_gives_the_reference_s_nan(rng, value):
    """An infinite query entry makes that row's scores infinite: the reference's row is NaN
    (inf - inf in the softmax), and so is the kernel's; the other rows keep their bits."""
    q, k, v = random_qkv(rng, (1, 2, 40, 16), (1, 2, 50, 16))
    clean, clean_lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    bad = q.copy()
    bad[0, 1, 20, 0] = value
    with np.errstate(invalid="ignore"):
        ref, ref_lse = attention_reference(bad, k, v, causal=True, return_lse=True)
    out, lse = cpuflash.attention(bad, k, v, causal=True, return_lse=True)
    assert np.isnan(ref[0, 1, 20]).all()
    assert_same_nonfinite(out, ref, "out")
    assert_same_nonfinite(lse, ref_lse, "lse")
    others = np.ones(out.shape[:-1], dtype=bool)
    others[0, 1, 20] = False
    assert_same_bits((out[others], lse[others]), (clean[others], clean_lse[others]),
                     "other rows")
    # all of q infinite, through the forward and the decode kernel: NaN wherever the
    # reference has it, and a result rather than a crash or a hang
    for function, queries, kwargs in [
            (cpuflash.attention, np.full_like(q, value), {}),
            (cpuflash.attention_with_kvcache, np.full((1, 2, 1, 16), value, np.float32),
             dict(num_splits=2))]:
        out, lse = function(queries, k, v, causal=True, return_lse=True, **kwargs)
        with np.errstate(invalid="ignore"):
            ref, ref_lse = attention_reference(queries, k, v, causal=True, return_lse=True)
        assert np.isnan(ref).all()
        assert_same_nonfinite(out, ref, function.__name__)
        assert_same_nonfinite(lse, ref_lse, function.__name__ + " lse")


def test_minus_inf_bias_everywhere_gives_zero_and_minus_inf(rng):
    q, k, v = random_qkv(rng, (2, 2, 30, 16), (2, 1, 40, 16))
    bias = np.full((30, 40), -np.inf, np.float32)
    slopes = np.array([0.1, 0.3], np.float32)
    for kwargs in ({}, dict(causal=True), dict(softcap=5.0, alibi_slopes=slopes),
                   dict(window=(3, 3), scale=10.0)):
        out, lse = cpuflash.attention(q, k, v, bias=bias, return_lse=True, **kwargs)
        assert np.all(out == 0) and np.all(lse == -np.inf), kwargs
    sinks = np.array([0.5, -1.5], np.float32)
    out, lse = cpuflash.attention(q, k, v, bias=bias, sinks=sinks, return_lse=True)
    assert np.all(out == 0)
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks[None, :, None], lse.shape))
