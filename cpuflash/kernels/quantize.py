"""Rows of float32 numbers to int8 with a scale per row, compiled (`_quantize.quantize_rows`;
an int4 cache's groups are such rows, with a limit of 7).

A decoding step quantizes one token's keys and values, a few rows: numpy's dozen small
operations were most of the cost of a cache layer's update in transformers (measured:
docs/history.md, "Inside Hugging Face transformers", what bounds the in-model targets); here
each row is one pass. The rule is
`quantize_rows`' own, with the same IEEE float32 divisions, so both give the same bits.
"""

import numpy as np
from numba import from_dtype as numba_from, types

from .._jit import Kernel, array


def _int8_rows(x, data, scale, limit):
    """Each row i of `x` into row i of `data` and scale[i]: ``amax / limit``, NaN for a row with
    inf or NaN (data 0), 0 for a row of zeros (data 0), else ``x / scale`` rounded to nearest
    even."""
    for i in range(x.shape[0]):
        amax = np.float32(0.0)
        finite = True
        for j in range(x.shape[1]):
            a = abs(x[i, j])
            amax = max(amax, a)
            finite = finite and a < np.inf  # (False for NaN too)
        factor = amax / limit if finite else np.float32(np.nan)
        scale[i] = factor
        for j in range(x.shape[1]):
            data[i, j] = np.int8(np.rint(x[i, j] / factor)) if factor > 0 else np.int8(0)


def _signature(_):
    return types.void(array(np.float32, 2, readonly=True), array(np.int8, 2),
                      array(np.float32, 1), types.float32)


# No fastmath flags: with them the division becomes a multiply by the reciprocal and the
# rounding to even a plain conversion. No compile notice: it compiles in a fraction of a second
# (docs/history.md, "Compile time"), and the one line a process gets belongs to the decoding
# kernel that a new token's quantization comes before.
int8_rows = Kernel(_int8_rows, _signature, None, parallel=False, fastmath=False)


def _hadamard_rows(rows, factor):
    """Each row of `rows` (a power of two long) turned in place by the Walsh-Hadamard
    butterflies, then times `factor` (1 / sqrt(D)): `_quantize.hadamard`'s passes, in the
    same order and precision, one row at a time."""
    d = rows.shape[1]
    for i in range(rows.shape[0]):
        half = 1
        while half < d:
            for start in range(0, d, 2 * half):
                for j in range(start, start + half):
                    first, second = rows[i, j], rows[i, j + half]
                    rows[i, j] = first + second
                    rows[i, j + half] = first - second
            half *= 2
        for j in range(d):
            rows[i, j] *= factor


def _hadamard_signature(dtype):
    return types.void(array(dtype, 2), numba_from(dtype))


# A decoding step turns q and the output of a rotated cache: a few short rows, where numpy's
# passes cost tens of microseconds. No fastmath (the sums are `hadamard`'s, bit for bit).
hadamard_rows = Kernel(_hadamard_rows, _hadamard_signature, None, parallel=False,
                       fastmath=False)
