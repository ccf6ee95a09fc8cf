"""Quantized KV caches: rows of int8 or float8_e4m3fn numbers with one float32 scale per row,
or of 4-bit integers with one scale per group of a row.

A row is one (token, head) of a key or value cache. In the 8-bit formats its `D` numbers share
the symmetric scale ``amax / 127`` (``/ 448``, the largest float8_e4m3fn) and are stored as
``x / scale`` rounded to nearest. In int4, each group of `group_size` consecutive numbers has
its own scale ``amax / 7``, the numbers are in [-7, 7], and two share a byte (element ``2m`` in
the low nibble, two's complement). The decode kernel reads the rows in place
(`cpuflash.kernels.decode`); this module holds the numpy side: the `QuantizedKV` pair,
quantizing rows (`quantize_kv`, and the new keys a call writes into a quantized cache) and
dequantizing them.
"""

from typing import NamedTuple

import numpy as np

from .kernels.quantize import hadamard_rows, int8_rows

# the largest magnitude each format holds, by the names `quantize_kv` takes
QUANT_MAX = {"int8": 127.0, "float8_e4m3": 448.0, "int4": 7.0}
FLOAT8_NAME = "float8_e4m3fn"  # ml_dtypes' name of the float8 dtype
# The most numbers quantized by the compiled loop, whose bits are those of the numpy operations
# below: faster for a few rows, slower for many (measured: docs/history.md, "Inside Hugging
# Face transformers", what bounds the in-model targets)
COMPILED_SIZE = 1 << 14


class QuantizedKV(NamedTuple):
    """A quantized key or value cache: ``data`` (..., Hk, N, D) int8 or float8_e4m3fn and
    ``scale`` (..., Hk, N) float32, one symmetric scale per (token, head); or for int4,
    ``data`` (..., Hk, N, D // 2) uint8, two numbers a byte, and ``scale`` (..., Hk, N,
    D // group_size), one per group. The row's numbers are ``data * scale``, turned back by
    the Walsh-Hadamard matrix when `rotated` (`hadamard`). Made by `cpuflash.quantize_kv`;
    `cpuflash.attention_with_kvcache` reads and writes it in place."""

    data: np.ndarray
    scale: np.ndarray
    rotated: bool = False


def hadamard(x):
    """``x @ H`` along the last axis, ``H`` the orthonormal Walsh-Hadamard matrix of its size (a
    power of two; Sylvester's +-1 matrix over its square root), in float32 (float64 stays):
    ``log2(D)`` butterfly passes over a copy, O(D log D) a row. ``H`` is symmetric and its own
    inverse, so the same call turns rows back.

    A rotation spreads a row's outliers over all of its numbers before one scale is shared by
    them (llama.cpp turns keys so for its 4-bit caches); dot products are unchanged, since
    ``(q H) . (k H) = q . k``."""
    wide = np.float64 if x.dtype == np.float64 else np.float32
    d = x.shape[-1]
    rows = np.array(x, dtype=wide).reshape(-1, d)
    if rows.size <= COMPILED_SIZE:  # a decoding step's few rows: one compiled pass a row
        hadamard_rows.specialize(np.dtype(wide))(rows, wide(1 / np.sqrt(d)))
        return rows.reshape(x.shape)
    half = 1
    while half < d:
        pairs = rows.reshape(rows.shape[0], d // (2 * half), 2, half)
        first, second = pairs[:, :, 0], pairs[:, :, 1]
        difference = first - second
        first += second
        second[...] = difference
        half *= 2
    rows *= wide(1 / np.sqrt(d))
    return rows.reshape(x.shape)


def format_name(dtype, scale_ndim, data_ndim):
    """The `quantize_kv` name of a cache's data dtype ("int8", "float8_e4m3", "int4": uint8
    data with a scale of as many axes, one a group), or None."""
    if dtype == np.int8:
        return "int8"
    if dtype.kind == "V" and dtype.name == FLOAT8_NAME:
        return "float8_e4m3"
    if dtype == np.uint8 and scale_ndim == data_ndim:
        return "int4"
    return None


def float8_dtype():
    """ml_dtypes' float8_e4m3fn (imported only when a float8 cache is made)."""
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError("float8_e4m3 caches need ml_dtypes (pip install ml_dtypes)") from None
    return np.dtype(ml_dtypes.float8_e4m3fn)


def quantize_rows(x, name, groups=1):
    """(data, scale) of the float array `x` quantized row by row (the last axis) to the format
    `name`; for int4, each of a row's `groups` groups of consecutive numbers as a row of its
    own, then packed (`pack_int4`), scale (..., groups). The scale is the float32 division
    ``amax / QUANT_MAX[name]``; an all-zero row gets scale 0 and data 0; a row holding inf or
    NaN gets scale NaN and data 0 (it dequantizes to NaN, and NaN propagates through attention
    as in the float computation)."""
    x = np.asarray(x, dtype=np.float32)
    limit = np.float32(QUANT_MAX[name])
    if name == "int4":
        grouped = x.reshape(x.shape[:-1] + (groups, x.shape[-1] // groups))
        numbers, scale = _integers(grouped, limit)
        return pack_int4(numbers.reshape(x.shape)), scale
    if name == "int8":
        return _integers(x, limit)
    ratio, scale = _ratios(x, limit)
    # (clipped first: past 448 float8_e4m3fn has only NaN; ml_dtypes rounds to nearest even)
    return np.clip(ratio, -limit, limit).astype(float8_dtype()), scale


def _integers(x, limit):
    """(int8 numbers, scale) of the rows of `x`: ``x / scale`` rounded to nearest even."""
    if 0 < x.size <= COMPILED_SIZE:  # one pass a row (`kernels.quantize`), the same bits
        rows = x.reshape(-1, x.shape[-1])
        data = np.empty(rows.shape, dtype=np.int8)
        scale = np.empty(rows.shape[0], dtype=np.float32)
        int8_rows.specialize(np.int8)(rows, data, scale, limit)
        return data.reshape(x.shape), scale.reshape(x.shape[:-1])
    ratio, scale = _ratios(x, limit)
    return np.rint(ratio).astype(np.int8), scale


def _ratios(x, limit):
    """(``x / scale``, scale) of the rows of `x`, ``scale = amax / limit`` (see
    `quantize_rows` for rows of zeros, inf or NaN)."""
    scale = np.asarray(np.max(np.abs(x), axis=-1, initial=np.float32(0)) / limit)
    if np.all(scale > 0) and np.all(scale < np.inf):  # the common case: few numpy calls
        return x / scale[..., None], scale  # at most limit * (1 + 2^-23): rounds to +-limit
    usable = (scale > 0) & (scale < np.inf)
    ratio = np.zeros(x.shape, dtype=np.float32)
    np.divide(x, scale[..., None], out=ratio, where=usable[..., None])
    scale[~(scale >= 0)] = np.nan  # inf or NaN in the row (NaN fails every comparison)
    scale[scale == np.inf] = np.nan
    return ratio, scale


def pack_int4(numbers):
    """int8 numbers in [-8, 7], (..., D) with D even, as bytes: element 2m in the low nibble,
    2m + 1 in the high one, both two's complement."""
    low = numbers[..., 0::2].view(np.uint8) & np.uint8(0x0F)
    return low | (numbers[..., 1::2].view(np.uint8) << np.uint8(4))


def unpack_int4(data):
    """The int8 numbers of int4 bytes (..., D // 2): (..., D), as `pack_int4` packed them."""
    signed = data.view(np.int8)
    numbers = np.empty(data.shape[:-1] + (2 * data.shape[-1],), dtype=np.int8)
    numbers[..., 0::2] = (signed << np.int8(4)) >> np.int8(4)  # the low nibble, sign-extended
    numbers[..., 1::2] = signed >> np.int8(4)
    return numbers


def dequantize_rows(data, scale):
    """float32 ``data * scale``: one scale per row (the last axis of `data`), or for int4
    data (`scale` with as many axes) one per group of the row."""
    if scale.ndim == data.ndim:
        numbers = unpack_int4(data).astype(np.float32)
        groups = numbers.reshape(scale.shape + (-1,))
        return (groups * scale[..., None]).reshape(numbers.shape)
    return data.astype(np.float32) * scale[..., None]
