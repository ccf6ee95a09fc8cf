"""Reading and writing elements of any input dtype as the compute dtype, inside kernels.

float16 and bfloat16 arrays reach the kernels as their uint16 bits (Numba has no bfloat16), and
are widened to float32 while a tile is packed (or, in the decode kernel, as cache rows are
loaded), so no full-size float32 copy of q, k or v is ever made, and outputs are rounded back as
they are stored. `widen` and `narrow` convert one element; `load_widened`, `load_block` and
`store_narrowed` whole SIMD vectors of rows that `vector_rows` approves. All are generic over the
array dtype: for float32 and float64 arrays the conversions compile to nothing. The 8-bit rows
of a quantized KV cache (int8, and float8_e4m3fn as its uint8 bits) are widened the same way,
unscaled (float8 numbers 2^8 times smaller, `unit`): the decode kernel applies their scales, and
the unit, to scores and probabilities.
"""

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload

from .. import _simd
from .._jit import HELPER_OPTIONS, STRICT_OPTIONS, jit

FLOAT16, BFLOAT16 = 1, 2  # half-precision kinds (`_validate` imports them; 0 is native)
# 8-bit kinds of quantized KV caches: int8, and float8_e4m3fn read as its uint8 bits
INT8, FLOAT8_E4M3 = 3, 4


@intrinsic
def _bits_to_f32(typingctx, bits):
    """Reinterpret the low 32 bits of an unsigned integer as a float32."""
    if not isinstance(bits, types.Integer) or bits.signed or bits.bitwidth < 32:
        raise TypingError("expected an unsigned integer of at least 32 bits")

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32))
                               if bits.bitwidth > 32 else args[0], ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_to_bits(typingctx, x):
    """Reinterpret a float32 as its uint32 bits."""
    if x != types.float32:
        raise TypingError("expected float32")

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


@intrinsic
def _half_bits_to_f32(typingctx, bits):
    """IEEE binary16 bits (uint16) to float32, exactly (LLVM's fpext from half)."""
    if bits != types.uint16:
        raise TypingError("expected uint16")

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_to_half_bits(typingctx, x):
    """float32 to IEEE binary16 bits, rounded to nearest even (LLVM's fptrunc to half)."""
    if x != types.float32:
        raise TypingError("expected float32")

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


def widen(x, kind):
    """Element `x` of an input array as the compute dtype (float32 for uint16 half bits; for
    float8_e4m3fn bits, in units of `unit`)."""


def narrow(value, like, kind):
    """`value` (compute dtype) as an element of an array of dtype `like` (``arr.dtype``),
    rounded to nearest even."""


@overload(widen, jit_options=STRICT_OPTIONS)
def _widen(x, kind):
    if isinstance(x, types.Float):
        return lambda x, kind: x
    if x == types.int8:
        return lambda x, kind: np.float32(x)
    if x == types.uint8:
        return lambda x, kind: _e4m3_to_f32(x)
    if x == types.uint16:
        def impl(x, kind):
            if kind == BFLOAT16:
                return _bits_to_f32(np.uint32(x) << np.uint32(16))
            return _half_bits_to_f32(x)
        return impl


@jit
def _e4m3_to_f32(bits):
    """float8_e4m3fn bits to float32, 2^8 times smaller, as `_simd.vload_e4m3` widens them."""
    magnitude = np.uint32(bits) & np.uint32(0x7F)
    if magnitude == 0x7F:
        value = np.float32(np.nan)
    elif magnitude < 8:  # subnormal: the mantissa times 2^-9
        value = np.float32(magnitude) * np.float32(2.0 ** -9)
    else:
        value = _bits_to_f32((magnitude << np.uint32(20)) + np.uint32(120 << 23))
    value *= np.float32(1.0 / _simd.E4M3_UNIT)  # exact: the smallest number becomes 2^-17
    return -value if bits & 0x80 else value


@overload(narrow, jit_options=STRICT_OPTIONS)
def _narrow(value, like, kind):
    if isinstance(like, types.DType):
        like = like.dtype
    if isinstance(like, types.Float):
        return lambda value, like, kind: value
    if like == types.uint16:
        def impl(value, like, kind):
            x = np.float32(value)
            if kind != BFLOAT16:
                return _f32_to_half_bits(x)
            bits = _f32_to_bits(x)
            if x != x:  # NaN: keep it a (quiet) NaN rather than rounding into infinity
                return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
            rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
            return np.uint16((bits + rounding) >> np.uint32(16))
        return impl


@jit
def contiguous_rows(arr):
    """Whether the rows of the 4-D `arr` (its last axis) are contiguous and every stride is a
    whole number of elements (0 included: broadcast axes), so `row_offset` is exact."""
    size = arr.itemsize
    return (arr.strides[3] == size and arr.strides[0] % size == 0
            and arr.strides[1] % size == 0 and arr.strides[2] % size == 0)


@jit
def vector_rows(arr, n):
    """Whether the rows of the 4-D `arr` can be read as whole SIMD vectors of `n` lanes:
    `contiguous_rows`, and a whole number of vectors long."""
    return contiguous_rows(arr) and arr.shape[3] % n == 0


def like_dtype(value, arr):
    """The number `value` as a scalar of `arr`'s dtype (rounded once, like every element)."""


@overload(like_dtype, jit_options=HELPER_OPTIONS)
def _like_dtype(value, arr):
    dtype = arr.dtype
    return lambda value, arr: dtype(value)


@jit
def row_offset(arr, i, j, row):
    """The element offset of ``arr[i, j, row, 0]`` from ``arr[0, 0, 0, 0]`` (see `vector_rows`)."""
    return (i * arr.strides[0] + j * arr.strides[1] + row * arr.strides[2]) // arr.itemsize


def load_widened(arr, i, half_kind):
    """`_simd.vload(arr, i)`, the bits of a half-precision `arr` (`half_kind` says which) widened
    to float32; an int8 `arr` or a uint8 one (float8_e4m3fn bits) too, unscaled (in units of
    `unit`)."""


@overload(load_widened, jit_options=HELPER_OPTIONS)
def _load_widened(arr, i, half_kind):
    if isinstance(arr.dtype, types.Float):
        return lambda arr, i, half_kind: _simd.vload(arr, i)
    if arr.dtype == types.int8:
        return lambda arr, i, half_kind: _simd.vload_i8(arr, i)
    if arr.dtype == types.uint8:
        return lambda arr, i, half_kind: _simd.vload_e4m3(arr, i)

    def load_half(arr, i, half_kind):
        return _simd.vload_bf16(arr, i) if half_kind == BFLOAT16 else _simd.vload_f16(arr, i)
    return load_half


def unit(arr):
    """What one of `arr`'s elements widened by `widen` or `load_widened` is worth: 2^8 for
    float8_e4m3fn bits (`_simd.E4M3_UNIT`), else 1 (a float32 constant in kernels)."""


@overload(unit, jit_options=STRICT_OPTIONS)
def _unit(arr):
    value = np.float32(_simd.E4M3_UNIT if arr.dtype == types.uint8 else 1.0)
    return lambda arr: value


def load_block(arr, i, stride, half_kind):
    """`_simd.vload_rows(arr, i, stride)`, half-precision bits widened as `load_widened` does."""


@overload(load_block, jit_options=HELPER_OPTIONS)
def _load_block(arr, i, stride, half_kind):
    if isinstance(arr.dtype, types.Float):
        return lambda arr, i, stride, half_kind: _simd.vload_rows(arr, i, stride)

    def load_half(arr, i, stride, half_kind):
        if half_kind == BFLOAT16:
            return _simd.vload_rows_bf16(arr, i, stride)
        return _simd.vload_rows_f16(arr, i, stride)
    return load_half


def store_narrowed(arr, i, vec, half_kind):
    """`_simd.vstore(arr, i, vec)`, rounded to the half-precision `arr`'s format as `narrow`
    rounds."""


@overload(store_narrowed, jit_options=HELPER_OPTIONS)
def _store_narrowed(arr, i, vec, half_kind):
    if isinstance(arr.dtype, types.Float):
        return lambda arr, i, vec, half_kind: _simd.vstore(arr, i, vec)

    def store_half(arr, i, vec, half_kind):
        if half_kind == BFLOAT16:
            _simd.vstore_bf16(arr, i, vec)
        else:
            _simd.vstore_f16(arr, i, vec)
    return store_half
