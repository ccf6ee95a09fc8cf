"""attention_varlen (flash-attn's packed "thd" sequences) against the reference, sequence by
sequence."""

import numpy as np
import pytest

import cpuflash

from helpers import check_varlen, low_precision_dtype, packed, random_qkv


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (17, 5)),
                                           (True, (30, -1))])
def test_varlen_matches_each_sequence(rng, causal, window):
    lens_q, lens_k = [5, 0, 130, 77, 1, 3], [9, 3, 200, 77, 0, 799]
    q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k)
    slopes = rng.uniform(0.01, 0.2, (len(lens_q), 4)).astype(np.float32)
    out, lse = cpuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window,
                                         alibi_slopes=slopes, softcap=8.0, return_lse=True)
    assert out.shape == (cu_q[-1], 4, 24) and lse.shape == (4, cu_q[-1])
    check_varlen(out, lse, q, k, v, cu_q, cu_k, causal=causal, window=window,
                 alibi_slopes=slopes, softcap=8.0)


def test_varlen_equals_batched_call(rng):
    q, k, v = random_qkv(rng, (3, 4, 50, 32), (3, 2, 60, 32))
    expected = cpuflash.attention(q, k, v, causal=True)
    flat = [np.swapaxes(x, 1, 2).reshape(-1, x.shape[1], 32) for x in (q, k, v)]
    out = cpuflash.attention_varlen(*flat, np.arange(4) * 50, np.arange(4) * 60, causal=True)
    np.testing.assert_array_equal(out.reshape(3, 50, 4, 32), np.swapaxes(expected, 1, 2))


@pytest.mark.parametrize("which", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 59])  # rows of whole vectors, and not
def test_half_precision_varlen(rng, which, d):
    dtype = low_precision_dtype(which)
    q, k, v, cu_q, cu_k = packed(rng, [5, 0, 130, 77, 1], [9, 3, 200, 77, 40], d=d, d_v=d,
                                 dtype=dtype)
    kwargs = dict(causal=True, window=(60, -1), softcap=20.0,
                  alibi_slopes=np.full(4, 0.05, np.float32))
    out, lse = cpuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kwargs)
    assert out.dtype == dtype and lse.dtype == np.float32
    # the plain implementation computes in the low precision itself
    check_varlen(out, lse, q, k, v, cu_q, cu_k, plain_dtype=dtype, **kwargs)
