"""bfloat16 on AVX512-BF16: the pair intrinsics of `cpuflash._simd`, the forward's bfloat16
dot-product path (`kernels/_pairs.py`) against a plain bfloat16 implementation
(`accuracy.bf16_dot_reference`: P rounded to bfloat16 before ``P V``), and the choice of that
path from the compile target's features (the widening path elsewhere, never an abort)."""

import os
import platform
import subprocess
import sys

import numba
import numpy as np
import pytest

import cpuflash
from accuracy import assert_close_to_reference, bf16_dot_reference
from cpuflash import _simd
from cpuflash.kernels import _layout, _pairs
from cpuflash._simd import (vbroadcast_pair, vdot_pairs, vload, vload_pairs, vload_rows_bits,
                            vstore, vstore_bits, vstore_interleaved, vstore_pairs, vtranspose)
from helpers import (cache_case, check_kvcache, check_varlen, explain, packed, run_python,
                     with_new_keys)

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
X86 = platform.machine().lower() in ("x86_64", "amd64")
N = _simd.LANES_F32


def bits(x):
    return np.ascontiguousarray(x).view(np.uint16)


# -- the intrinsics (on any CPU: without AVX512-BF16 they compile to float32 code)

@numba.njit(cache=True)
def _dots(acc, a, b, out, out_bcast):
    for i in range(0, acc.size, N):
        x = vload(acc, i)
        vstore(out, i, vdot_pairs(x, vload_pairs(a, 2 * i), vload_pairs(b, 2 * i)))
        vstore(out_bcast, i, vdot_pairs(x, vbroadcast_pair(a, 2 * i), vload_pairs(b, 2 * i)))


@numba.njit(cache=True)
def _moves(x, p, src, stride, interleaved, transposed):
    for i in range(0, x.size, 2 * N):
        vstore_pairs(p, i, vload(x, i), vload(x, i + N))
    vstore_interleaved(interleaved, 0, src, 0, stride)
    block = vtranspose(vload_rows_bits(src, 0, stride))
    for j in range(N):
        vstore_bits(transposed, 2 * N * j, block[j])


def test_dot_pairs_adds_both_exact_products_odd_first(rng):
    n = 4 * N
    acc = rng.standard_normal(n).astype(np.float32)
    a, b = (rng.standard_normal(2 * n).astype(BF16) for _ in range(2))
    out, out_bcast = np.empty(n, np.float32), np.empty(n, np.float32)
    _dots(acc, bits(a), bits(b), out, out_bcast)
    af, bf = a.astype(np.float64), b.astype(np.float64)  # products exact in float32 too

    def expected(a_odd, a_even):
        first = (acc + a_odd * bf[1::2]).astype(np.float32)
        return (first + a_even * bf[0::2]).astype(np.float32)
    np.testing.assert_array_equal(out, expected(af[1::2], af[0::2]))
    # the broadcast pair of lane block i is (a[2i], a[2i + 1]) of its first lane
    starts = np.repeat(np.arange(0, n, N), N)
    np.testing.assert_array_equal(out_bcast, expected(af[2 * starts + 1], af[2 * starts]))


def test_pair_moves(rng):
    x = (rng.standard_normal(4 * N) * 100).astype(np.float32)
    x[:4] = [np.inf, -np.inf, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8]  # ties go to even
    stride = 2 * N + 6
    src = np.arange(N * stride, dtype=np.uint16)
    p = np.empty(4 * N, np.uint16)
    interleaved = np.empty(2 * N, np.uint16)
    transposed = np.empty((N, 2 * N), np.uint16)
    _moves(x, p, src, stride, interleaved, transposed.reshape(-1))
    np.testing.assert_array_equal(p, bits(x.astype(BF16)))
    np.testing.assert_array_equal(interleaved, np.stack([src[:N], src[stride:stride + N]], 1)
                                  .reshape(-1))
    rows = src.reshape(N, stride)[:, :2 * N].reshape(N, N, 2)  # (key, pair, 2)
    np.testing.assert_array_equal(transposed, rows.transpose(1, 0, 2).reshape(N, 2 * N))


@pytest.mark.parametrize(
    "cpu_name, features, expected",
    [
        ("znver4", "", True),
        # LLVM's model of the named CPU decides, where the host has the feature too (Numba
        # passes the host's features, which override the model's)
        ("sapphirerapids", None, "host"),
        ("skylake-avx512", None, False),
        ("skylake-avx512", "+avx512bf16", True),
        ("znver4", "+avx512f,-avx512bf16", False),
        ("haswell", "+avx512bf16,-avx512f", False),  # no 512-bit vectors: no pairs
        ("haswell", None, False),
    ],
)
def test_target_bf16_rule(cpu_name, features, expected):
    if not X86:
        pytest.skip("x86 CPU names")
    if expected == "host":
        from numba.core import codegen
        expected = "+avx512bf16" in codegen.get_host_cpu_features().split(",")
    assert _simd._target_has_avx512bf16(cpu_name, features) is expected


def test_named_cpu_on_a_host_without_bf16(monkeypatch):
    """NUMBA_CPU_NAME names a CPU with AVX512-BF16 on a host without it (and no feature string):
    Numba compiles with the host's features, so no pairs (their intrinsics would abort LLVM)."""
    if not X86:
        pytest.skip("x86 CPU names")
    monkeypatch.setattr(_simd.codegen, "get_host_cpu_features",
                        lambda: "+avx2,+avx512f,-avx512bf16")
    assert _simd._target_has_avx512bf16("sapphirerapids", None) is False
    assert _simd._target_has_avx512bf16("sapphirerapids", "+avx512bf16") is True


def test_host_rule_matches_the_host():
    if numba.config.CPU_NAME is None and numba.config.CPU_FEATURES is None:
        from numba.core import codegen
        host = codegen.get_host_cpu_features().split(",")
        assert _simd.BF16_ISA == ("+avx512bf16" in host and "+avx512f" in host)
    pays = _simd._bf16_dot_pays(numba.config.CPU_NAME, os.environ.get("CPUFLASH_BF16_DOT"))
    assert _simd.BF16_DOT == (_simd.BF16_ISA and pays)


@pytest.mark.parametrize(
    "cpu_name, forced, expected",
    [
        ("znver4", None, True),  # vdpbf16ps does twice the multiply-adds of fma
        ("znver5", "", True),
        ("sapphirerapids", None, False),  # half of them: the widening path is faster
        ("graniterapids", None, False),
        ("sapphirerapids", "1", True),
        ("znver4", "0", False),
    ],
)
def test_dot_products_where_they_pay(cpu_name, forced, expected):
    assert _simd._bf16_dot_pays(cpu_name, forced) is expected


# -- the kernels

def random_bf16(rng, *shapes):
    return tuple(rng.standard_normal(s).astype(BF16) for s in shapes)


CASES = [  # (n_q, n_k, d, d_v, options)
    (1, 239, 64, 64, dict(causal=True)),
    (3, 127, 40, 24, dict(window=(50, 3))),
    (113, 239, 59, 59, dict(causal=True, alibi_slopes=np.full(4, 0.05, np.float32))),
    (127, 113, 111, 48, dict(softcap=20.0)),
    (239, 239, 128, 128, dict(causal=True, window=(70, -1))),
    (127, 3, 256, 256, {}),
    (113, 127, 1, 3, dict(causal=True)),
]


@pytest.mark.parametrize("n_q, n_k, d, d_v, options", CASES)
def test_attention_within_rule_of_plain_bf16(rng, n_q, n_k, d, d_v, options):
    q, k, v = random_bf16(rng, (2, 4, n_q, d), (2, 2, n_k, d), (2, 2, n_k, d_v))
    out, lse = cpuflash.attention(q, k, v, return_lse=True, tiles=(48, 64), **options)
    assert out.dtype == BF16 and lse.dtype == np.float32
    assert_close_to_reference(out, q, k, v, lse=lse, plain=bf16_dot_reference, **options)


def _alternate(b, h, q_idx, kv_idx, doc):
    return doc[q_idx] == doc[kv_idx]


@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_key_blocks_kept_between_query_tiles(rng, dtype):
    """A thread packs a head's key blocks once for its query tiles (`_layout.kept_block`):
    blocks visited out of order (a block mask whose query tiles see blocks 0 and 2, then 1 and
    3) or in part (a window) give the bits of every block visited in order (a dense mask),
    within the rule; and where there are more blocks than a thread keeps, in turn."""
    plain = bf16_dot_reference if dtype == BF16 else None
    n, d = 256, 64
    doc = np.repeat(np.arange(4) % 2, n // 4)  # 0, 1, 0, 1 by quarters
    q, k, v = (x.astype(dtype) for x in random_bf16(rng, (1, 4, n, d), (1, 2, n, d),
                                                     (1, 2, n, d)))
    mask = doc[:, None] == doc[None, :]
    expected = cpuflash.attention(q, k, v, mask=mask, tiles=(64, 64))
    bm = cpuflash.block_mask(_alternate, 1, 1, n, n, args=(doc,), block=64)
    got = cpuflash.flex_attention(q, k, v, block_mask=bm, tiles=(64, 64))
    np.testing.assert_array_equal(got, expected)
    assert_close_to_reference(got, q, k, v, mask=mask, plain=plain)
    for options in (dict(window=(90, 20)), dict(causal=True, window=(40, -1))):
        out = cpuflash.attention(q, k, v, tiles=(32, 64), **options)
        assert_close_to_reference(out, q, k, v, plain=plain, **options)
    n_k = 20_000  # 313 blocks of 64 keys; a thread keeps 128-256 at D = 64
    assert n_k // 64 > _layout.KEPT_BYTES // (2 * 64 * 64 * 2)
    q, k, v = (x.astype(dtype) for x in random_bf16(rng, (1, 2, 64, d), (1, 1, n_k, d),
                                                     (1, 1, n_k, d)))
    out = cpuflash.attention(q, k, v, tiles=(32, 64))
    assert_close_to_reference(out, q, k, v, plain=plain)


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_scale_taken_into_q_gives_the_same_bits(rng, d):
    """On AMX tiles a power-of-two scale (D = 16, 64, 256) multiplies Q as it is packed
    (`_pairs.folded_scale`): exact, so the bits of a call with a zero bias, whose product is
    scaled after the sums."""
    q, k, v = random_bf16(rng, (1, 4, 150, d), (1, 2, 170, d), (1, 2, 170, d))
    expected = cpuflash.attention(q, k, v, causal=True, bias=np.zeros((4, 150, 170), np.float32))
    np.testing.assert_array_equal(bits(cpuflash.attention(q, k, v, causal=True)), bits(expected))


def test_bias_mask_sinks_and_bshd(rng):
    n_q, n_k, d = 113, 127, 59
    q, k, v = random_bf16(rng, (2, n_q, 4, d), (2, n_k, 2, d), (2, n_k, 2, d))
    options = dict(bias=rng.standard_normal((4, n_q, n_k)).astype(np.float32),
                   mask=rng.random((2, 1, n_q, n_k)) > 0.2,
                   sinks=rng.standard_normal(4).astype(np.float32))
    out, lse = cpuflash.attention(q, k, v, layout="bshd", return_lse=True, **options)
    assert_close_to_reference(out, q, k, v, lse=lse, layout="bshd", plain=bf16_dot_reference,
                              **options)


def test_strided_inputs_give_the_same_bits(rng):
    """Rows read as whole vectors (packed with vector moves, from any offset) or element by
    element (a Fortran-ordered array) give the same bits."""
    q, k, v = random_bf16(rng, (1, 2, 70, 64), (1, 2, 90, 64), (1, 2, 90, 64))
    expected = cpuflash.attention(q, k, v, causal=True)
    wide = [np.zeros(x.shape[:-1] + (80,), BF16) for x in (q, k, v)]
    for w, x in zip(wide, (q, k, v)):
        w[..., 3:67] = x
    got = cpuflash.attention(*(w[..., 3:67] for w in wide), causal=True)
    np.testing.assert_array_equal(bits(got), bits(expected))
    got = cpuflash.attention(*(np.asfortranarray(x) for x in (q, k, v)), causal=True)
    np.testing.assert_array_equal(bits(got), bits(expected))


def test_pairs_path_rounds_p(rng):
    """With AVX512-BF16 (or AMX tiles), P is rounded to bfloat16 (the widening path equals the
    float32 kernel on the widened inputs, rounded once)."""
    q, k, v = random_bf16(rng, (1, 2, 100, 64), (1, 2, 100, 64), (1, 2, 100, 64))
    widened = cpuflash.attention(*(x.astype(np.float32) for x in (q, k, v))).astype(BF16)
    same = np.array_equal(bits(cpuflash.attention(q, k, v)), bits(widened))
    assert same != _pairs.FORWARD_PAIRS


def test_hidden_infinite_values_stay_hidden(rng):
    q, k, v = random_bf16(rng, (1, 2, 50, 64), (1, 2, 50, 64), (1, 2, 50, 64))
    v[0, 0, 40] = np.inf
    v[0, 1, 45, 3] = np.nan
    out = cpuflash.attention(q, k, v, causal=True).astype(np.float32)
    assert np.isfinite(out[0, 0, :40]).all() and not np.isfinite(out[0, 0, 40:]).all()
    assert np.isfinite(out[0, 1, :45]).all() and np.isnan(out[0, 1, 45:, 3]).all()
    assert np.isfinite(np.delete(out[0, 1, 45:], 3, axis=-1)).all()


def test_hidden_infinite_value_of_an_earlier_block_stays_hidden(rng):
    """A key hidden by the mask holds inf in the first key block; the second, shorter block
    must not read it (the tiles of the last step pass the block's end)."""
    q, k, v = random_bf16(rng, (1, 2, 30, 64), (1, 2, 100, 64), (1, 2, 100, 64))
    mask = np.ones((30, 100), bool)
    mask[:, 40] = False
    hidden = v.copy()
    hidden[0, :, 40] = np.inf
    out = cpuflash.attention(q, k, hidden, mask=mask, tiles=(48, 64))
    assert np.isfinite(out.astype(np.float32)).all()
    assert_close_to_reference(out, q, k, v, mask=mask, plain=bf16_dot_reference)


def test_bits_do_not_depend_on_threads(rng):
    q, k, v = random_bf16(rng, (1, 4, 300, 64), (1, 2, 300, 64), (1, 2, 300, 64))
    before = numba.get_num_threads()
    try:
        outs = []
        for threads in {1, before}:
            numba.set_num_threads(threads)
            outs.append(bits(cpuflash.attention(q, k, v, causal=True)))
    finally:
        numba.set_num_threads(before)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


@pytest.mark.parametrize("d", [64, 59])
def test_varlen(rng, d):
    q, k, v, cu_q, cu_k = packed(rng, [5, 0, 130, 77, 1], [9, 3, 200, 77, 40], d=d, d_v=d,
                                 dtype=BF16)
    options = dict(causal=True, window=(60, -1), softcap=20.0,
                   alibi_slopes=np.full(4, 0.05, np.float32))
    out, lse = cpuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    check_varlen(out, lse, q, k, v, cu_q, cu_k, plain=bf16_dot_reference, **options)


def test_kvcache_chunked_prefill(rng):
    q, k_cache, v_cache, k, v, seqlens = cache_case(rng, dtype=BF16, n_max=320, d=64, d_v=48,
                                                    hq=8, hk=2, n_q=40, n_new=40,
                                                    seqlens=[0, 100, 280])
    out, lse = cpuflash.attention_with_kvcache(q, k_cache.copy(), v_cache.copy(), k=k, v=v,
                                               cache_seqlens=seqlens, causal=True,
                                               return_lse=True)
    written = [with_new_keys(c, new, seqlens) for c, new in ((k_cache, k), (v_cache, v))]
    check_kvcache(out, lse, q, *written, seqlens + 40, causal=True, plain=bf16_dot_reference)


# -- the backward: its five products as bfloat16 dot products (P and dS rounded)

@pytest.mark.parametrize("fused", [False, True])
def test_backward_within_rule_and_schemes_agree(rng, monkeypatch, fused):
    from cpuflash import _run_backward
    from test_backward import assert_gradients_close

    q, k, v = random_bf16(rng, (2, 4, 113, 59), (2, 2, 203, 59), (2, 2, 203, 40))
    options = dict(causal=True, alibi_slopes=np.full(4, 0.05, np.float32), softcap=20.0)
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(BF16)
    results = []
    for scheme in (fused, not fused):
        monkeypatch.setattr(_run_backward, "_fuse", lambda *args, scheme=scheme: scheme)
        results.append(cpuflash.attention_backward(dout, q, k, v, out, lse, **options))
    # the plain implementation computes in bfloat16 itself (as for the widening path)
    assert_gradients_close(results[0], dout, q, k, v, plain_dtype=BF16, **options)
    for a, b in zip(results[0], results[1]):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_backward_nonfinite_where_float32_has_them(rng):
    """A hidden infinite key reaches the gradients of the rows that see it only: the same
    entries as the float32 kernel's on the widened inputs are not finite."""
    q, k, v = random_bf16(rng, (1, 2, 60, 64), (1, 2, 60, 64), (1, 2, 60, 64))
    k[0, 0, 50] = np.inf
    dout = rng.standard_normal(q.shape).astype(BF16)
    grads = []
    for dtype in (BF16, np.float32):
        args = [x.astype(dtype) for x in (q, k, v)]
        out, lse = cpuflash.attention(*args, return_lse=True, causal=True)
        grads.append(cpuflash.attention_backward(dout.astype(dtype), *args, out, lse,
                                                 causal=True))
    for g16, g32 in zip(*grads):
        np.testing.assert_array_equal(np.isfinite(g16.astype(np.float32)), np.isfinite(g32))
    assert np.isfinite(grads[0][0].astype(np.float32)[0, :, :50]).all()


# -- a compile target without AVX512-BF16: the widening path, chosen before anything compiles

NO_BF16_SCRIPT = """
import numpy as np, ml_dtypes
import cpuflash
from cpuflash import _simd
from cpuflash.kernels import _pairs, _steps
from cpuflash.__main__ import info_lines
rng = np.random.default_rng(5)
q, k, v = (rng.standard_normal((1, 2, 70, 59)).astype(ml_dtypes.bfloat16) for _ in range(3))
out = cpuflash.attention(q, k, v, causal=True)
widened = cpuflash.attention(*(x.astype(np.float32) for x in (q, k, v)), causal=True)
same = np.array_equal(out.view(np.uint16), widened.astype(ml_dtypes.bfloat16).view(np.uint16))
line = [x for x in info_lines() if x.startswith("bfloat16:")][0]
print(_simd.LANES_F32, _simd.BF16_DOT, same, "widened" in line)
"""


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="x86 CPU names")
def test_target_without_bf16_widens(tmp_path):
    """An AVX-512 CPU without AVX512-BF16 (Skylake-X): 16 lanes, bfloat16 widened to float32
    (bit for bit the float32 kernel's result, rounded), no abort."""
    env = dict(os.environ, NUMBA_CPU_NAME="skylake-avx512", NUMBA_CACHE_DIR=str(tmp_path),
               CPUFLASH_QUIET="1")
    env.pop("NUMBA_CPU_FEATURES", None)
    result = run_python(NO_BF16_SCRIPT, env=env, timeout=600)
    assert result.returncode == 0, explain(result)
    assert result.stdout.split() == ["16", "False", "True", "True"], explain(result)


@pytest.mark.slow
@pytest.mark.skipif(not _simd.BF16_ISA, reason="no AVX512-BF16 in the compile target: one route")
@pytest.mark.skipif("CPUFLASH_BF16_DOT" in os.environ, reason="the route is forced here")
def test_the_other_route(tmp_path):
    """On a CPU with AVX512-BF16 both routes can run (the dot products, or widening where they
    do not pay): this file again, on the route this CPU does not take by default, so that CI
    checks both on either kind of CPU (with AMX tiles off: they take the products of both)."""
    other = "0" if _simd.BF16_DOT else "1"
    env = dict(os.environ, CPUFLASH_BF16_DOT=other, CPUFLASH_AMX="0",
               NUMBA_CACHE_DIR=str(tmp_path), CPUFLASH_QUIET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-m", "not slow", __file__], capture_output=True, text=True,
                            env=env, timeout=900, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 0, explain(result)
    assert " passed" in result.stdout and "skipped" not in result.stdout, explain(result)
