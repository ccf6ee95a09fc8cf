"""cpuflash.attention against the float64 reference, on deliberately awkward sizes."""

import itertools
import os
import platform

import numpy as np
import pytest

import cpuflash
from cpuflash.reference import attention_reference

from accuracy import assert_close_to_reference
from helpers import assert_same_bits, explain, random_qkv, run_python, unaligned

SEQLEN_PAIRS = [(1, 239), (3, 799), (127, 513), (113, 203), (1023, 1024)]
SEQLEN_PAIRS += [(nk, nq) for nq, nk in SEQLEN_PAIRS]
HEAD_DIMS = [1, 40, 59, 64, 111, 128, 256, 512]
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


def grid():
    """Every seqlen pair and every head dim, with heads, causal and dtype cycling through."""
    cases = []
    flavours = itertools.cycle(itertools.product(HEADS, (False, True), (np.float32, np.float64)))
    for (n_q, n_k), d in itertools.product(SEQLEN_PAIRS, HEAD_DIMS):
        (hq, hk), causal, dtype = next(flavours)
        if n_q * n_k * d > 1024 * 1024 * 64:  # keep the reference's N x N matrix small
            d = 64
        cases.append(pytest.param(n_q, n_k, d, hq, hk, causal, dtype,
                                  id=f"{n_q}x{n_k}-d{d}-h{hq}/{hk}-{'causal' if causal else 'full'}"
                                     f"-{np.dtype(dtype).name}"))
    return cases


@pytest.mark.parametrize("n_q,n_k,d,hq,hk,causal,dtype", grid())
def test_matches_reference(rng, n_q, n_k, d, hq, hk, causal, dtype):
    q, k, v = random_qkv(rng, (1, hq, n_q, d), (1, hk, n_k, d), dtype=dtype)
    out, lse = cpuflash.attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == dtype and lse.dtype == dtype
    assert_close_to_reference(out, q, k, v, lse=lse, causal=causal)


@pytest.mark.parametrize("tiles", [(1, 1), (3, 5), (7, 33), (64, 17), (2048, 2048)])
@pytest.mark.parametrize("causal", [False, True])
def test_odd_tiles(rng, tiles, causal):
    q, k, v = random_qkv(rng, (2, 3, 113, 40), (2, 3, 203, 40), d_v=24)
    out, lse = cpuflash.attention(q, k, v, causal=causal, tiles=tiles, return_lse=True)
    assert_close_to_reference(out, q, k, v, lse=lse, causal=causal)


def test_large_scores_are_stable(rng):
    q, k, v = random_qkv(rng, (2, 200, 64), (2, 300, 64))
    out, lse = cpuflash.attention(q * 30, k * 30, v, return_lse=True, causal=True)
    assert np.isfinite(out).all()
    assert_close_to_reference(out, q * 30, k * 30, v, lse=lse, causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_finite_logits_give_the_reference(rng, dtype):
    q, k, v = random_qkv(rng, (1, 2, 60, 32), (1, 2, 75, 32), dtype=dtype)
    q = q * dtype(1e4)
    out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert_close_to_reference(out, q, k, v, lse=lse, causal=True)
    out = cpuflash.attention_with_kvcache(q[:, :, -1:], k, v, num_splits=3)
    assert np.isfinite(out).all()
    assert_close_to_reference(out, q[:, :, -1:], k, v, causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", [4, 17])
def test_large_logits_keep_the_accuracy_rule(seed, dtype):
    """scale = 6 with D = 45: scores of a few tens, a peaked but not one-hot softmax (the
    property tests found float64 cases with scale 1.5 already)."""
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, (1, 2, 20, 45), (1, 2, 37, 45), d_v=8, dtype=dtype)
    out, lse = cpuflash.attention(q, k, v, scale=6.0, return_lse=True)
    assert_close_to_reference(out, q, k, v, lse=lse, scale=6.0)


@pytest.mark.parametrize("causal", [False, True])
def test_dv_differs_from_d(rng, causal):
    q, k, v = random_qkv(rng, (2, 4, 70, 48), (2, 2, 90, 48), d_v=80)
    out = cpuflash.attention(q, k, v, causal=causal)
    assert out.shape == (2, 4, 70, 80)
    assert_close_to_reference(out, q, k, v, causal=causal)


@pytest.mark.parametrize("shape", [(50, 32), (3, 50, 32), (2, 3, 50, 32), (2, 1, 3, 50, 32)])
def test_any_number_of_leading_axes(rng, shape):
    q, k, v = random_qkv(rng, shape, shape)
    out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == shape and lse.shape == shape[:-1]
    assert_close_to_reference(out, q, k, v, lse=lse, causal=True)


def test_bshd_layout_matches_bhsd(rng):
    q, k, v = random_qkv(rng, (2, 77, 4, 32), (2, 90, 2, 32), d_v=16)
    out, lse = cpuflash.attention(q, k, v, layout="bshd", causal=True, return_lse=True)
    assert out.shape == (2, 77, 4, 16) and lse.shape == (2, 4, 77)
    swap = [np.swapaxes(x, 1, 2) for x in (q, k, v)]
    ref, ref_lse = cpuflash.attention(*swap, causal=True, return_lse=True)
    np.testing.assert_array_equal(out, np.swapaxes(ref, 1, 2))
    np.testing.assert_array_equal(lse, ref_lse)
    assert_close_to_reference(out, q, k, v, lse=lse, layout="bshd", causal=True)


def test_out_argument(rng):
    q, k, v = random_qkv(rng, (2, 4, 33, 16), (2, 2, 45, 16))
    expected = cpuflash.attention(q, k, v)
    out = np.full((2, 4, 33, 16), np.nan, dtype=np.float32)
    assert cpuflash.attention(q, k, v, out=out) is out
    np.testing.assert_array_equal(out, expected)
    # a strided destination (every other row of a bigger array) is written through its strides
    big = np.zeros((2, 4, 66, 16), dtype=np.float32)
    returned = cpuflash.attention(q, k, v, out=big[:, :, ::2])
    np.testing.assert_array_equal(big[:, :, ::2], expected)
    np.testing.assert_array_equal(big[:, :, 1::2], 0)
    np.testing.assert_array_equal(returned, expected)


def test_out_that_aliases_an_input(rng):
    q, k, v = random_qkv(rng, (1, 2, 40, 16), (1, 2, 40, 16))
    expected = cpuflash.attention(q, k, v)
    cpuflash.attention(q, k, v, out=q)  # q is read fully before it is overwritten
    np.testing.assert_array_equal(q, expected)


@pytest.mark.parametrize("n_q", [33, 1])
def test_unaligned_out(rng, n_q):
    """An `out` one byte off its alignment (which the kernels cannot write through) is written
    all the same, the FA-2 kernel's and the one-row kernel's result alike."""
    q, k, v = random_qkv(rng, (2, 4, n_q, 16), (2, 2, 45, 16))
    expected, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    out = unaligned(np.full(expected.shape, np.nan, dtype=np.float32))
    got, got_lse = cpuflash.attention(q, k, v, causal=True, return_lse=True, out=out)
    assert got is out
    assert_same_bits((out, got_lse), (expected, lse))


def test_out_that_cannot_be_flattened(rng):
    q, k, v = random_qkv(rng, (2, 3, 2, 20, 8), (2, 3, 2, 20, 8))
    expected = cpuflash.attention(q, k, v)
    out = np.zeros((3, 2, 2, 20, 8), dtype=np.float32).transpose(1, 0, 2, 3, 4)
    cpuflash.attention(q, k, v, out=out)
    np.testing.assert_array_equal(out, expected)


def test_bshd_out_argument(rng):
    """flash-attn's layout into a given `out`: contiguous, strided (a heads-first buffer seen
    as bshd, every other value column) and aliasing `q`."""
    q, k, v = random_qkv(rng, (2, 33, 4, 16), (2, 45, 2, 16))
    expected, lse = cpuflash.attention(q, k, v, layout="bshd", causal=True, return_lse=True)
    assert_close_to_reference(expected, q, k, v, lse=lse, layout="bshd", causal=True)
    out = np.full((2, 33, 4, 16), np.nan, dtype=np.float32)
    assert cpuflash.attention(q, k, v, layout="bshd", causal=True, out=out) is out
    assert_same_bits(out, expected, "contiguous out")
    big = np.zeros((2, 4, 33, 32), dtype=np.float32)
    strided = np.swapaxes(big, 1, 2)[..., ::2]
    got, got_lse = cpuflash.attention(q, k, v, layout="bshd", causal=True, out=strided,
                                      return_lse=True)
    assert got is strided
    assert_same_bits((strided, got_lse), (expected, lse), "strided out")
    np.testing.assert_array_equal(big[..., 1::2], 0)
    q_copy = q.copy()
    cpuflash.attention(q_copy, k, v, layout="bshd", causal=True, out=q_copy)
    assert_same_bits(q_copy, expected, "out aliasing q")


@pytest.mark.parametrize("n_q,n_k", [(0, 10), (10, 0), (0, 0)])
def test_empty_sequences(rng, n_q, n_k):
    q, k, v = random_qkv(rng, (2, 3, n_q, 8), (2, 3, n_k, 8), d_v=5)
    out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 3, n_q, 5) and lse.shape == (2, 3, n_q)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_causal_rows_with_no_visible_key(rng):
    # Nq > Nk: bottom-right alignment leaves the first Nq - Nk rows with no key
    q, k, v = random_qkv(rng, (1, 2, 9, 8), (1, 2, 4, 8))
    out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(out[:, :, :5] == 0) and np.all(lse[:, :, :5] == -np.inf)
    assert_close_to_reference(out, q, k, v, lse=lse, causal=True)


def test_scale(rng):
    q, k, v = random_qkv(rng, (1, 2, 50, 16), (1, 2, 60, 16))
    out = cpuflash.attention(q, k, v, scale=0.7, causal=True)
    assert_close_to_reference(out, q, k, v, scale=0.7, causal=True)


def test_bottom_right_alignment_matches_decoding(rng):
    """The last Nq rows of a causal self-attention equal a causal Nq x Nk call."""
    q, k, v = random_qkv(rng, (1, 2, 64, 16), (1, 2, 64, 16))
    full = cpuflash.attention(q, k, v, causal=True)
    tail = cpuflash.attention(q[:, :, -5:], k, v, causal=True)
    np.testing.assert_allclose(tail, full[:, :, -5:], rtol=1e-5, atol=1e-6)


def test_reference_is_plain_softmax(rng):
    """The oracle itself, against the textbook formula on one head."""
    q, k, v = random_qkv(rng, (5, 7), (6, 7), dtype=np.float64)
    s = q @ k.T / np.sqrt(7)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    expected = (p / p.sum(axis=1, keepdims=True)) @ v
    np.testing.assert_allclose(attention_reference(q, k, v), expected, rtol=1e-12)


AVX2_SCRIPT = """
import numpy as np, cpuflash, cpuflash._simd as simd
from cpuflash.reference import attention_reference
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 4, n, 59)).astype(np.float32) for n in (113, 203, 203))
kwargs = dict(causal=True, window=(80, -1), softcap=20.0)
out = cpuflash.attention(q, k[:, :2], v[:, :2], **kwargs)
ref = attention_reference(q, k[:, :2], v[:, :2], **kwargs)
plain = attention_reference(q, k[:, :2], v[:, :2], dtype=np.float32, **kwargs)
assert np.abs(out - ref).max() <= 2 * np.abs(plain - ref).max() + 1e-6
dec = cpuflash.attention_with_kvcache(q[:, :, :1], k, v, num_splits=3)
assert np.allclose(dec, attention_reference(q[:, :, :1], k, v, causal=True), atol=1e-5)
# rows of whole vectors (8 lanes; 4 for float64): transposed packing, vector bias and output
for dtype in (np.float32, np.float64, np.float16):
    qd, kd, vd = (rng.standard_normal((1, 2, n, 64)).astype(dtype) for n in (70, 90, 90))
    bias = rng.standard_normal((70, 90)).astype(np.float32)
    got = cpuflash.attention(qd, kd, vd, causal=True, bias=bias).astype(np.float64)
    ref = attention_reference(qd, kd, vd, causal=True, bias=bias)
    assert np.allclose(got, ref, atol=2e-3 if dtype == np.float16 else 1e-5)
# decoding with rows read in place: 4-lane float64 sums, float16 bits widened as loaded
for dtype in (np.float64, np.float16):
    qd, kd, vd = (rng.standard_normal((1, h, n, 64)).astype(dtype) for h, n in
                  ((8, 1), (2, 300), (2, 300)))
    dec = cpuflash.attention_with_kvcache(qd, kd, vd)
    ref = attention_reference(qd, kd, vd, causal=True)
    assert np.allclose(dec.astype(np.float64), ref, atol=2e-3 if dtype == np.float16 else 1e-12)
print(simd.LANES_F32)
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 only")
def test_avx2_code_path(tmp_path):
    """The kernels compiled for an AVX2 CPU without AVX-512 (8-lane vectors) are correct."""
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="-avx512f",
               NUMBA_CACHE_DIR=str(tmp_path))
    result = run_python(AVX2_SCRIPT, env=env, timeout=600)
    assert result.returncode == 0, explain(result)
    assert result.stdout.strip() == "8"


def test_huge_tiles_and_windows_are_the_unbounded_case(rng):
    q, k, v = random_qkv(rng, (1, 2, 37, 16), (1, 2, 50, 16))
    expected = cpuflash.attention(q, k, v, causal=True, tiles=(64, 64))
    np.testing.assert_array_equal(cpuflash.attention(q, k, v, causal=True, tiles=(2**40, 10**12)),
                                  expected)
    for window in [(2**63 - 1, 2**63 - 1), (2**70, 0), (0, 2**63 - 1)]:
        out = cpuflash.attention(q, k, v, window=window)
        assert_close_to_reference(out, q, k, v, window=(min(window[0], 10**6),
                                                         min(window[1], 10**6)))
