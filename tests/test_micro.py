"""The register tile of the micro-kernels (`cpuflash.kernels._micro`): `fma_tile` sums are the
plain `vfma` / `vdot_pairs` chains, bit for bit, whatever the tile's shape, and close to numpy's
products; typing errors name the argument."""

import numba
import numpy as np
import pytest
from numba.core.errors import TypingError

from cpuflash._simd import LANES_F32, lanes_for, vbroadcast, vbroadcast_pair, vdot_pairs, vfma, \
    vload, vload_pairs, vstore, vzeros
from cpuflash.kernels._micro import fma_tile, zeros_tile

TERMS = 37  # terms of each sum


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


@numba.njit(cache=True)
def _store(tile, out, rows, n):
    """out[r, c * n : (c + 1) * n] = tile[r][c] for the first `rows` rows."""
    for r in range(rows):
        row = tile[r]
        for c in range(len(row)):
            vstore(out, r * out.shape[1] + c * n, row[c])


@numba.njit(cache=True)
def _tiles(a, b, out6x4, out6x2, out1x2, n, per):
    """The sums over x of a[r, per * x] * b[x] (b's row: four vectors, in panels of two) with
    a 6 x 4, a 6 x 2 and a 1 x 2 tile (each row of a from its own 1 x 2 tile)."""
    aw, bw = a.shape[1], b.shape[1]
    wide, narrow = zeros_tile(out6x4, 6, 2), zeros_tile(out6x4, 6, 1)
    for x in range(b.shape[0]):
        wide = fma_tile(wide, a, per * x, aw, b, x * bw, 2 * n)
        narrow = fma_tile(narrow, a, per * x, aw, b, x * bw, 2 * n)
    _store(wide, out6x4, 6, n // per)
    _store(narrow, out6x2, 6, n // per)
    for r in range(6):
        one = zeros_tile(out6x4, 1, 1)
        for x in range(b.shape[0]):
            one = fma_tile(one, a, r * aw + per * x, aw, b, x * bw, 2 * n)
        _store(one, out1x2[r:], 1, n // per)


@numba.njit(cache=True)
def _chains(a, b, out, n):
    """The plain chains: out[r, c] = vfma(a[r, x], b[x, c], ...) over x in order."""
    for r in range(a.shape[0]):
        for c in range(0, out.shape[1], n):
            total = vzeros(out)
            for x in range(b.shape[0]):
                total = vfma(vbroadcast(a, r * a.shape[1] + x), vload(b, x * b.shape[1] + c),
                             total)
            vstore(out, r * out.shape[1] + c, total)


@numba.njit(cache=True)
def _pair_chains(a, b, out):
    """The plain chains of `vdot_pairs` on bfloat16 pairs."""
    n = LANES_F32
    for r in range(a.shape[0]):
        for c in range(0, out.shape[1], n):
            total = vzeros(out)
            for x in range(b.shape[0]):
                total = vdot_pairs(total, vbroadcast_pair(a, r * a.shape[1] + 2 * x),
                                   vload_pairs(b, x * b.shape[1] + 2 * c))
            vstore(out, r * out.shape[1] + c, total)


def _run_tiles(a, b, n, per, dtype):
    width = b.shape[1] // per
    out6x4, out6x2, out1x2 = (np.full((6, w), np.nan, dtype) for w in (width, width // 2,
                                                                            width // 2))
    _tiles(a, b, out6x4, out6x2, out1x2, n, per)
    return out6x4, out6x2, out1x2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_tiles_are_the_plain_chains_in_every_shape(rng, dtype):
    n = lanes_for(dtype)
    a = rng.standard_normal((6, TERMS)).astype(dtype)
    b = rng.standard_normal((TERMS, 4 * n)).astype(dtype)
    out6x4, out6x2, out1x2 = _run_tiles(a, b, n, 1, dtype)
    chains = np.empty((6, 4 * n), dtype)
    _chains(a, b, chains, n)
    assert np.array_equal(out6x4, chains)
    assert np.array_equal(out6x2, chains[:, :2 * n])
    assert np.array_equal(out1x2, chains[:, :2 * n])
    expected = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(out6x4, expected, rtol=0, atol=1e-4 if dtype == np.float32
                               else 1e-12)


def test_pair_tiles_are_the_plain_dot_pair_chains(rng):
    """uint16 operands: pairs of bfloat16 numbers, two terms a lane (`vdot_pairs`)."""
    n = LANES_F32
    a = rng.integers(0x3f00, 0x4000, (6, 2 * TERMS)).astype(np.uint16)  # in [0.5, 2)
    b = rng.integers(0x3f00, 0x4000, (TERMS, 8 * n)).astype(np.uint16)
    out6x4, out6x2, out1x2 = _run_tiles(a, b, 2 * n, 2, np.float32)
    chains = np.empty((6, 4 * n), np.float32)
    _pair_chains(a, b, chains)
    assert np.array_equal(out6x4, chains)
    assert np.array_equal(out6x2, chains[:, :2 * n])
    assert np.array_equal(out1x2, chains[:, :2 * n])


def test_typing_errors():
    floats = np.zeros(64, np.float32)
    doubles = np.zeros(64, np.float64)
    halves = np.zeros(64, np.uint16)
    ints = np.zeros(64, np.int64)
    cases = [
        (lambda a, k: zeros_tile(a, k, 1), (floats, 2),
         "`rows` and `panels` must be constant positive integers"),
        (lambda a: zeros_tile(a, 6, 0), (floats,),
         "`rows` and `panels` must be constant positive integers"),
        (lambda a: zeros_tile(a, 6, 1), (ints,), "`like` must be a float32 or float64 array"),
        (lambda a: fma_tile(vzeros(a), a, 0, 1, a, 0, 1), (floats,),
         "`tile` must be a tile of `zeros_tile`"),
        (lambda a, b: fma_tile(zeros_tile(a, 1, 1), a, 0, 1, b, 0, 1), (floats, ints),
         "`b` must be a float32, float64 or uint16 array"),
        (lambda a, b: fma_tile(zeros_tile(a, 1, 1), b, 0, 1, a, 0, 1), (floats, halves),
         "`a` and `b` must both be float arrays or both uint16"),
        (lambda a: fma_tile(zeros_tile(a, 1, 1), a, 0.5, 1, a, 0, 1), (floats,),
         "`i` must be an integer"),
        (lambda a: fma_tile(zeros_tile(a, 1, 1), a, 0, 1, a, 0, 1.5), (floats,),
         "`gap` must be an integer"),
        (lambda a, b: fma_tile(zeros_tile(a, 1, 1), b, 0, 1, b, 0, 1), (doubles, halves),
         "expected a vec.*float32 and two"),  # (`vdot_pairs`: float32 sums)
        (lambda a, b: fma_tile(zeros_tile(a, 1, 1), b, 0, 1, b, 0, 1), (floats, doubles),
         "expected vectors of one type"),  # (`vfma`)
    ]
    for func, args, message in cases:
        with pytest.raises(TypingError, match=message):
            numba.njit(func)(*args)
