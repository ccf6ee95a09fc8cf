"""Tests of the SIMD layer (`cpuflash._simd`) against numpy, for float32 and float64."""

import os
import platform
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numba
import numpy as np
import pytest
from numba.core import codegen
from numba.core.errors import TypingError

from cpuflash import _simd
from cpuflash._simd import (
    LANES_F32, LANES_F64, lanes_for, prefetch, vabs, vadd, vbroadcast, vexp2, vexp2_half,
    vfill_outside, vfma, vhmax, vhsum, viota, vload, vload_bf16, vload_f16, vload_rows,
    vload_rows_bf16, vload_rows_f16, vmax, vmul, vsplat, vstore, vstore_bf16, vstore_f16,
    vstore_hsums, vsub, vtanh, vtranspose, vzeros,
)

DTYPES = [np.float32, np.float64]
X86 = platform.machine().lower() in ("x86_64", "amd64")
# max relative error of vexp2 asserted here; the docstring states the measured values
EXP2_RTOL = {np.float32: 3e-7, np.float64: 5e-16}
# vexp2 is accurate on [-b + 1, b + 1/2), with b the exponent bias
EXP2_BIAS = {np.float32: 127, np.float64: 1023}


# -- the compiled wrappers: few, so a cold run compiles little (each is cached)

@numba.njit(cache=True)
def _all_ops(a, b, c, out, reduced, lanes):
    """Every operation on a, b, c in steps of `lanes`: out (10, n), reduced (2, n // lanes)."""
    for i in range(0, out.shape[1], lanes):
        x, y, z = vload(a, i), vload(b, i), vload(c, i)
        vstore(out[0], i, vadd(x, y))
        vstore(out[1], i, vsub(x, y))
        vstore(out[2], i, vmul(x, y))
        vstore(out[3], i, vfma(x, y, z))
        vstore(out[4], i, vmax(x, y))
        vstore(out[5], i, vexp2(x))
        vstore(out[6], i, vbroadcast(a, i + 1))
        vstore(out[7], i, vsplat(2.5, x))
        vstore(out[8], i, vsplat(3, a))
        vstore(out[9], i, vzeros(a))
        reduced[0, i // lanes] = vhmax(x)
        reduced[1, i // lanes] = vhsum(x)


@numba.njit(cache=True)
def _exp2_flat(x, out, lanes):
    for i in range(0, x.size, lanes):
        vstore(out, i, vexp2(vload(x, i)))


@numba.njit(cache=True)
def _exp2_half_flat(x, out, lanes):
    for i in range(0, x.size, lanes):
        vstore(out, i, vexp2_half(vload(x, i)))


def exp2(x, flat=_exp2_flat):
    """vexp2 (or `flat`'s exponential) over a 1-D array of any length (padded to whole
    vectors)."""
    lanes = lanes_for(x.dtype)
    padded = np.zeros(-(-x.size // lanes) * lanes, x.dtype)
    padded[: x.size] = x
    out = np.empty_like(padded)
    flat(padded, out, lanes)
    return out[: x.size]


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


def run_all_ops(rng, dtype, n_vectors=7):
    lanes = lanes_for(dtype)
    n = n_vectors * lanes
    # one spare element for the broadcast of a[i + 1]; starting at element 1 makes the loads
    # unaligned
    a, b, c = (rng.uniform(-3, 3, n + 2).astype(dtype)[1:] for _ in range(3))
    out = np.full((10, n), np.nan, dtype)
    reduced = np.full((2, n_vectors), np.nan, dtype)
    _all_ops(a, b, c, out, reduced, lanes)
    return a[:n], b[:n], c[:n], out, reduced


# -- width

def test_lanes():
    assert LANES_F32 in (8, 16)
    assert LANES_F64 == LANES_F32 // 2
    assert lanes_for(np.float32) == lanes_for("float32") == LANES_F32
    assert lanes_for(np.dtype(np.float64)) == LANES_F64
    if numba.config.CPU_NAME is None and numba.config.CPU_FEATURES is None:
        host = codegen.get_host_cpu_features().split(",")
        assert (LANES_F32 == 16) == ("+avx512f" in host)


def test_lanes_for_rejects_other_dtypes():
    with pytest.raises(ValueError, match="`dtype` must be float32 or float64, got int32"):
        lanes_for(np.int32)


@pytest.mark.parametrize(
    "cpu_name, features, expected",
    [
        ("haswell", None, False),  # Numba passes the host's features: the CPU name decides
        ("haswell", "+avx512f", True),
        ("skylake-avx512", None, True),
        ("skylake-avx512", "+avx2,-avx512f", False),
        ("skylake-avx512", "", True),
        ("generic", "", False),
    ],
)
def test_target_width_rule(cpu_name, features, expected):
    if not X86:
        pytest.skip("x86 CPU names")
    assert _simd._target_has_avx512f(cpu_name, features) is expected


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="x86 CPU names")
def test_haswell_target_gets_avx2_width():
    """With NUMBA_CPU_NAME=haswell on any x86 host: 8 lanes, 256-bit code, correct results."""
    script = (
        "import numba, numpy as np\n"
        "from cpuflash import _simd as s\n"
        "@numba.njit\n"
        "def f(x, out):\n"
        "    for i in range(0, x.size, s.LANES_F32):\n"
        "        v = s.vload(x, i)\n"
        "        s.vstore(out, i, s.vfma(s.vexp2(v), v, s.vbroadcast(x, 0)))\n"
        "x = np.linspace(-20, 20, 64).astype(np.float32)\n"
        "out = np.empty_like(x)\n"
        "f(x, out)\n"
        "ref = np.exp2(x.astype(float)) * x + x[0]\n"
        "err = np.max(np.abs(out - ref) / (np.abs(ref) + 1))\n"
        "print(s.LANES_F32, s.LANES_F64, err, 'zmm' in f.inspect_asm(f.signatures[0]))\n"
    )
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", PYTHONPATH=path)
    env.pop("NUMBA_CPU_FEATURES", None)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lanes32, lanes64, err, uses_zmm = result.stdout.split()
    assert (lanes32, lanes64, uses_zmm) == ("8", "4", "False")
    assert float(err) < 1e-6


# -- lane-wise operations and reductions

@pytest.mark.parametrize("dtype", DTYPES)
def test_lanewise_ops_match_numpy(rng, dtype):
    a, b, c, out, _ = run_all_ops(rng, dtype)
    np.testing.assert_array_equal(out[0], a + b)
    np.testing.assert_array_equal(out[1], a - b)
    np.testing.assert_array_equal(out[2], a * b)
    # fused: within half an ulp of the exact a*b + c, and not always the unfused result
    for got, ai, bi, ci in zip(out[3].tolist(), a.tolist(), b.tolist(), c.tolist()):
        exact = Fraction(ai) * Fraction(bi) + Fraction(ci)
        assert abs(Fraction(got) - exact) <= abs(Fraction(float(np.spacing(dtype(got))))) / 2
    assert (out[3] != a * b + c).any()
    np.testing.assert_array_equal(out[4], np.maximum(a, b))
    np.testing.assert_allclose(out[5], np.exp2(a.astype(np.float64)), rtol=EXP2_RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_splat_zeros(rng, dtype):
    a, _, _, out, _ = run_all_ops(rng, dtype)
    lanes = lanes_for(dtype)
    np.testing.assert_array_equal(out[6], np.repeat(a[1::lanes], lanes))
    assert np.all(out[7] == 2.5) and np.all(out[8] == 3) and np.all(out[9] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_horizontal_reductions(rng, dtype):
    a, _, _, _, reduced = run_all_ops(rng, dtype)
    rows = a.reshape(-1, lanes_for(dtype))
    np.testing.assert_array_equal(reduced[0], rows.max(axis=1))
    # the documented order: fold the upper half onto the lower half until one lane is left
    tree = rows
    while tree.shape[1] > 1:
        half = tree.shape[1] // 2
        tree = tree[:, :half] + tree[:, half:]
    np.testing.assert_array_equal(reduced[1], tree[:, 0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_vmax_propagates_nan_from_either_side(dtype):
    lanes = lanes_for(dtype)
    n = 4 * lanes
    a = np.linspace(-2, 2, n + 2).astype(dtype)
    b = a[::-1].copy()
    a[3], b[5] = np.nan, np.nan
    a[lanes + 2] = b[lanes + 2] = np.nan
    a[2 * lanes:3 * lanes] = -np.inf  # a whole vector of -inf: max and hmax stay -inf
    b[2 * lanes:3 * lanes] = -np.inf
    out = np.empty((10, n), dtype)
    reduced = np.empty((2, 4), dtype)
    _all_ops(a, b, b, out, reduced, lanes)
    expected = np.maximum(a[:n], b[:n])
    assert np.isnan(expected[[3, 5, lanes + 2]]).all()
    np.testing.assert_array_equal(out[4], expected)  # equal_nan: NaN where either is NaN
    np.testing.assert_array_equal(reduced[0], [np.nan, np.nan, -np.inf, a[3 * lanes:n].max()])


def test_nd_arrays_take_flat_offsets(rng):
    x = rng.uniform(-4, 4, (3, 2, 4 * LANES_F32)).astype(np.float32)
    out = np.empty_like(x)
    x.flags.writeable = False  # loads from read-only arrays are fine
    _exp2_flat(x, out, LANES_F32)
    np.testing.assert_allclose(out, np.exp2(x.astype(np.float64)), rtol=EXP2_RTOL[np.float32])


# -- exp2 over its whole range

@pytest.mark.parametrize("dtype", DTYPES)
def test_exp2_accuracy_over_the_normal_range(rng, dtype):
    bias = EXP2_BIAS[dtype]
    halves = (np.arange(-bias + 1, bias) + 0.5).astype(dtype)  # f = +-1/2: the polynomial's ends
    x = np.concatenate([
        np.linspace(-bias - 3, bias + 3, 1_000_001),
        rng.uniform(-1, 1, 200_000),
        halves, np.nextafter(halves, -np.inf), np.nextafter(halves, np.inf),
    ]).astype(dtype)
    x = x[(x >= -bias + 1) & (x < bias + 0.5)]
    # long double holds 2**x with some bits to spare for float64 on x86 (there: 64-bit mantissa)
    ref = np.exp2(x.astype(np.float64 if dtype == np.float32 else np.longdouble))
    rel = np.abs((exp2(x) / ref - 1).astype(np.float64))
    assert rel.max() <= EXP2_RTOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_exp2_special_values_and_range_ends(dtype):
    bias = EXP2_BIAS[dtype]
    tiny = np.finfo(dtype).smallest_subnormal
    x = np.array([0.0, -0.0, tiny, -tiny, np.finfo(dtype).tiny, -np.inf, np.inf, np.nan,
                  -bias + 0.5, -bias - 0.5, -200, -2000, -1e30,
                  bias + 0.25, bias + 0.5, bias + 1, 1e30], dtype)
    got = exp2(x)
    np.testing.assert_array_equal(got[:8], [1, 1, 1, 1, 1, 0, np.inf, np.nan])
    # the subnormal band [-b + 1/2, -b + 1): off by at most one subnormal step
    assert 0 < got[8] and abs(got[8] - np.exp2(np.float64(x[8]))) <= tiny
    # below it, exactly +0.0 (no negative zeros either)
    low = got[9:13] if dtype == np.float32 else got[[9, 11, 12]]
    np.testing.assert_array_equal(low, 0)
    assert not np.signbit(low).any()
    assert np.isfinite(got[13]) and np.isposinf(got[14:]).all()


def test_exp2_half_accuracy_and_special_values(rng):
    """`vexp2_half`: 2.9e-6 relative on the normal range, `vexp2`'s edge cases."""
    x = np.concatenate([np.linspace(-126, 127, 1_000_001), rng.uniform(-1, 1, 200_000),
                        np.arange(-126, 127) + 0.5]).astype(np.float32)
    rel = np.abs(exp2(x, _exp2_half_flat) / np.exp2(x.astype(np.float64)) - 1)
    assert 1e-6 < rel.max() <= 3e-6  # (above 1e-6: not vexp2's polynomial)
    special = np.array([0.0, -0.0, -np.inf, np.inf, np.nan, -200, 1e30], np.float32)
    np.testing.assert_array_equal(exp2(special, _exp2_half_flat), [1, 1, 0, np.inf, np.nan, 0,
                                                                   np.inf])


@pytest.mark.parametrize("dtype", DTYPES)
def test_exp2_dense_sweep_is_monotone(dtype):
    wide = 130 if dtype == np.float32 else 1030
    x = np.linspace(-wide, wide, 400_001).astype(dtype)
    got = exp2(x)
    assert not np.isnan(got).any()
    assert (got[1:] >= got[:-1]).all()
    assert got[0] == 0 and got[-1] == np.inf


# -- typing errors name the argument

def test_typing_errors():
    ints = np.zeros(32, np.int64)
    floats = np.zeros(32, np.float32)
    doubles = np.zeros(32, np.float64)
    frozen = np.zeros(32, np.float32)
    frozen.flags.writeable = False
    halves = np.zeros(32, np.uint16)
    frozen_halves = np.zeros(32, np.uint16)
    frozen_halves.flags.writeable = False
    cases = [
        (lambda a: vload(a, 0), (ints,), "`arr` must be a float32 or float64 array"),
        (lambda a: vload(a, 0.5), (floats,), "`i` must be an integer"),
        (lambda a: vstore(a, 0, vload(floats, 0)), (frozen,), "`arr` is read-only"),
        (lambda a, b: vstore(a, 0, vload(b, 0)), (floats, doubles), "`vec` must be a vec"),
        (lambda a, b: vadd(vload(a, 0), vload(b, 0)), (floats, doubles), "vectors of one type"),
        (lambda a: vhsum(a), (floats,), "vectors of one type"),
        (lambda a: vsplat(a, a), (floats,), "`x` must be a real number"),
        (lambda a: vzeros(a), (ints,), "`like` must be a float32 or float64 array"),
        (lambda a: vstore_f16(a, 0, vload(a, 0)), (floats,),
         "`arr` must be a writable uint16 array \\(float16 bits\\)"),
        (lambda a: vstore_bf16(a, 0, vzeros(floats)), (frozen_halves,),
         "`arr` must be a writable uint16 array \\(bfloat16 bits\\)"),
        (lambda a, b: vstore_f16(a, 0, vload(b, 0)), (halves, doubles), "`vec` must be a"),
        (lambda a: vfill_outside(vload(a, 0), 0, 1, a), (floats,),
         "`value` must be a real number"),
        (lambda a: vfill_outside(vload(a, 0), 0.5, 1, 0.0), (floats,),
         "`first` must be an integer"),
        (lambda a: vload_rows(a, 0, 1.5), (floats,), "`stride` must be an integer"),
        (lambda a: vload_rows_f16(a, 0, 1), (floats,), "`arr` must be a uint16 array"),
        (lambda a: vtranspose((vload(a, 0), vload(a, 0))), (floats,),
         "`vecs` must be a tuple of as many vectors as they have lanes"),
        (lambda a: prefetch(a[0], 0), (floats,), "`arr` must be an array"),
    ]
    for func, args, message in cases:
        with pytest.raises(TypingError, match=message):
            numba.njit(func)(*args)


@numba.njit(cache=True)
def _tanh_flat(x, out):
    for i in range(0, x.size, LANES_F32):
        vstore(out, i, vtanh(vload(x, i)))


def test_tanh_accuracy_and_special_values():
    sweep = np.linspace(-20, 20, 400_001, dtype=np.float32)
    specials = np.array([0.0, -0.0, 1e-30, -1e-30, 0.55, -0.55, np.nextafter(0.55, 0), 88.0,
                         -88.0, np.inf, -np.inf, np.nan], dtype=np.float32)
    x = np.concatenate([sweep, specials])
    x = np.pad(x, (0, -x.size % LANES_F32))
    out = np.empty_like(x)
    _tanh_flat(x, out)
    ref = np.tanh(x.astype(np.float64))
    finite = ~np.isnan(ref)
    ulps = np.abs(out[finite] - ref[finite]) / np.spacing(np.abs(ref[finite]).astype(np.float32))
    assert ulps.max() <= 4  # measured: 3.1 ulp (at -1.59), see the vtanh docstring
    assert np.isnan(out[~finite]).all()
    np.testing.assert_array_equal(out[np.isinf(x)], np.sign(x[np.isinf(x)]))


def test_tanh_is_float32_only():
    @numba.njit
    def tanh64(x):
        return vtanh(vload(x, 0))

    with pytest.raises(TypingError, match="vtanh takes float32 vectors"):
        tanh64(np.zeros(LANES_F64))


@numba.njit(cache=True)
def _row_sums(x, out, ref):
    """x (groups, 16, lanes) -> out (groups, 4, 4) through vstore_hsums, with R = 1, 2, 3, 4
    rows per call as the group number cycles; ref through vhsum."""
    for g in range(x.shape[0]):
        v = x[g]
        a = (vload(v[0], 0), vload(v[1], 0), vload(v[2], 0), vload(v[3], 0))
        b = (vload(v[4], 0), vload(v[5], 0), vload(v[6], 0), vload(v[7], 0))
        c = (vload(v[8], 0), vload(v[9], 0), vload(v[10], 0), vload(v[11], 0))
        d = (vload(v[12], 0), vload(v[13], 0), vload(v[14], 0), vload(v[15], 0))
        rows = g % 4 + 1
        if rows == 1:
            vstore_hsums(out[g], 0, 4, a)
        elif rows == 2:
            vstore_hsums(out[g], 0, 4, a + b)
        elif rows == 3:
            vstore_hsums(out[g], 0, 4, a + b + c)
        else:
            vstore_hsums(out[g], 0, 4, a + b + c + d)
        for j in range(4 * rows):
            ref[g, j // 4, j % 4] = vhsum(vload(v[j], 0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_sums_share_a_tree_and_equal_vhsum_bit_for_bit(rng, dtype):
    x = (rng.standard_normal((32, 16, lanes_for(dtype))) * 1e3).astype(dtype)
    out, ref = np.full((32, 4, 4), np.nan, dtype), np.full((32, 4, 4), np.nan, dtype)
    _row_sums(x, out, ref)
    # untouched rows stay NaN in both
    np.testing.assert_array_equal(out, ref)
    rows = np.arange(32) % 4 + 1
    expected = x.astype(np.float64).sum(axis=2).reshape(32, 4, 4)
    for g in range(32):
        np.testing.assert_allclose(out[g, :rows[g]], expected[g, :rows[g]],
                                   rtol=1e-5 if dtype == np.float32 else 1e-13,
                                   atol=1e-3 if dtype == np.float32 else 1e-9)
        assert np.isnan(out[g, rows[g]:]).all()


@numba.njit(cache=True)
def _narrow_row_sums(x, out, ref):
    """x (8, lanes) -> out (4, 4) through vstore_hsums with rows given as tuples: four rows of
    two in columns 0-1, then two rows of one in column 2 of rows 0-1; ref through vhsum."""
    a, b, c, d = vload(x[0], 0), vload(x[1], 0), vload(x[2], 0), vload(x[3], 0)
    e, f, g, h = vload(x[4], 0), vload(x[5], 0), vload(x[6], 0), vload(x[7], 0)
    vstore_hsums(out, 0, 4, ((a, b), (c, d), (e, f), (g, h)))
    vstore_hsums(out, 2, 4, ((a,), (h,)))
    for j in range(8):
        ref[j // 2, j % 2] = vhsum(vload(x[j], 0))
    ref[0, 2], ref[1, 2] = vhsum(a), vhsum(h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_sums_of_any_width_equal_vhsum_bit_for_bit(rng, dtype):
    x = (rng.standard_normal((8, lanes_for(dtype))) * 1e3).astype(dtype)
    out, ref = np.full((4, 4), np.nan, dtype), np.full((4, 4), np.nan, dtype)
    _narrow_row_sums(x, out, ref)
    np.testing.assert_array_equal(out, ref)  # the columns left alone stay NaN in both
    assert np.isnan(out[2:, 2:]).all() and np.isnan(out[:, 3]).all()


def test_row_sums_need_rows_of_four():
    @numba.njit
    def three(x):
        v = vload(x, 0)
        vstore_hsums(x, 0, 4, (v, v, v))

    with pytest.raises(TypingError, match="tuple of 4 \\* R vectors"):
        three(np.zeros(64, np.float32))


@numba.njit(cache=True)
def _half_loads(f16, bf16, out):
    for i in range(0, f16.shape[0], LANES_F32):
        vstore(out[0], i, vload_f16(f16, i))
        vstore(out[1], i, vload_bf16(bf16, i))


def test_half_precision_loads_widen_exactly(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = (rng.standard_normal(8 * LANES_F32) * 100).astype(np.float32)
    x[:6] = [np.inf, -np.inf, np.nan, -0.0, 6e-8, 1e-40]  # specials and subnormals
    f16, bf16 = x.astype(np.float16), x.astype(ml_dtypes.bfloat16)
    out = np.zeros((2, x.size), np.float32)
    _half_loads(f16.view(np.uint16), bf16.view(np.uint16), out)
    np.testing.assert_array_equal(out[0], f16.astype(np.float32))
    np.testing.assert_array_equal(out[1], bf16.astype(np.float32))


def test_half_precision_loads_take_uint16_bits():
    @numba.njit
    def load(x):
        return vhsum(vload_bf16(x, 0))

    with pytest.raises(TypingError, match="must be a uint16 array"):
        load(np.zeros(LANES_F32, np.float32))


def test_prefetch_never_faults():
    @numba.njit
    def touch(x, far):
        prefetch(x, 0)
        prefetch(x, far)  # far past the end: only a hint
        return x[0]

    assert touch(np.ones(4, np.uint16), 1 << 40) == 1


@numba.njit(cache=True)
def _transposed_blocks(x, stride, out):
    """out[j] = column j of the square block whose rows are x[j * stride:][:lanes]."""
    for j, column in enumerate(vtranspose(vload_rows(x, 0, stride))):
        vstore(out[j], 0, column)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transpose_of_a_square_block_read_with_a_stride(rng, dtype):
    n = lanes_for(dtype)
    stride = n + 5  # rows further apart than they are long
    x = rng.standard_normal(n * stride).astype(dtype)
    out = np.zeros((n, n), dtype)
    _transposed_blocks(x, stride, out)
    block = np.lib.stride_tricks.as_strided(x, (n, n), (stride * x.itemsize, x.itemsize))
    np.testing.assert_array_equal(out, block.T)


@numba.njit(cache=True)
def _half_blocks(f16, bf16, stride, out):
    for j, row in enumerate(vload_rows_f16(f16, 0, stride)):
        vstore(out[0, j], 0, row)
    for j, row in enumerate(vload_rows_bf16(bf16, 0, stride)):
        vstore(out[1, j], 0, row)


def test_half_precision_blocks_widen_exactly(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    n, stride = LANES_F32, LANES_F32 + 3
    x = (rng.standard_normal(n * stride) * 100).astype(np.float32)
    f16, bf16 = x.astype(np.float16), x.astype(ml_dtypes.bfloat16)
    out = np.zeros((2, n, n), np.float32)
    _half_blocks(f16.view(np.uint16), bf16.view(np.uint16), stride, out)
    rows = np.arange(n)[:, None] * stride + np.arange(n)
    np.testing.assert_array_equal(out[0], f16.astype(np.float32)[rows])
    np.testing.assert_array_equal(out[1], bf16.astype(np.float32)[rows])


@numba.njit(cache=True)
def _half_stores(x, f16, bf16):
    for i in range(0, x.shape[0], LANES_F32):
        vstore_f16(f16, i, vload(x, i))
        vstore_bf16(bf16, i, vload(x, i))


def test_half_precision_stores_round_to_nearest_even_as_numpy(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = (rng.standard_normal(64 * LANES_F32) * np.exp(rng.uniform(-40, 40, 64 * LANES_F32)))
    x = x.astype(np.float32)
    x[:8] = [np.nan, -np.nan, np.inf, -np.inf, -0.0, 3.4e38, 65520.0, 1e-8]  # specials, ties
    f16, bf16 = np.zeros(x.size, np.uint16), np.zeros(x.size, np.uint16)
    _half_stores(x, f16, bf16)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(f16, x.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(bf16, x.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_abs_clears_the_sign_and_keeps_nan(dtype):
    @numba.njit
    def absolute(x, out, n):
        for i in range(0, x.shape[0], n):
            vstore(out, i, vabs(vload(x, i)))

    n = lanes_for(dtype)
    x = np.array([-2.5, 0.0, -0.0, np.inf, -np.inf, np.nan, 3.0, -1e-30] * n, dtype)[:2 * n]
    out = np.empty_like(x)
    absolute(x, out, n)
    np.testing.assert_array_equal(out, np.abs(x))
    assert not np.signbit(out).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fill_outside_keeps_a_range_of_lanes_bit_for_bit(dtype):
    @numba.njit
    def fill(x, out, first, end, value):
        vstore(out, 0, vfill_outside(vload(x, 0), first, end, value))

    n = lanes_for(dtype)
    x = np.array([np.nan, -0.0, np.inf, -np.inf, 1.5, -2.0, 3e-30, 7.0] * n, dtype)[:n]
    out = np.empty_like(x)
    lane = np.arange(n)
    for first, end in ((0, n), (1, n - 1), (3, 3), (5, 2), (-7, 2), (n - 1, 10 * n),
                       (-(1 << 40), 1 << 40), (n, n + 4)):
        for value in (-np.inf, 0.0):
            fill(x, out, first, end, value)
            keep = (lane >= first) & (lane < end)
            expected = np.where(keep, x, value).astype(dtype)
            np.testing.assert_array_equal(out.view(f"u{x.itemsize}"),
                                          expected.view(f"u{x.itemsize}"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_iota_counts_the_lanes(dtype):
    @numba.njit
    def iota(out):
        vstore(out, 0, viota(out))

    out = np.zeros(lanes_for(dtype), dtype)
    iota(out)
    np.testing.assert_array_equal(out, np.arange(out.size))
