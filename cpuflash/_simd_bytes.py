"""Integer byte dot products for Numba kernels: the opt-in integer Q K^T of 8-bit and 4-bit
caches (`attention_with_kvcache(..., integer_dot=True)`, `kernels._idot`).

A byte vector is one SIMD register of ``4 * LANES_F32`` bytes, seen as `LANES_F32` int32 lanes
(`IVec`); `bdot` adds to each lane the four products of its bytes, one unsigned and one signed,
as AVX512-VNNI's `vpdpbusd` does in one instruction. On a target without it the same sums come
from plain integer code that LLVM lowers as it can: integer sums are exact, so either way the
lanes hold the same numbers, and only the speed differs.

Contract as in `_simd`: `arr` is an array of a one-byte dtype (int8 or uint8) and `i` a byte
offset from its first element; nothing is checked. `bload` reads only the lanes it is told to
(a masked load), so a row's last bytes can be read without touching memory past it.
"""

from llvmlite import ir
from numba.core import codegen, config, errors, types
from numba.extending import intrinsic, models, register_model

from ._simd import (LANES_F32, _VEC, _check_index, _element_ptr, _fold_sums, _lane_mask,
                    _target_has_avx512f)

__all__ = ["VNNI", "INTEGER_ROUTE", "IVec", "bload", "bload_all", "bload_i32", "bflip",
           "bnibbles_low", "bnibbles_high", "bdot", "bfloat", "bgroup_sums", "vload_groups4",
           "vstore_key_sums"]


def _target_has_vnni(cpu_name, features):
    """Whether Numba compiles for AVX512-VNNI with 512-bit vectors: the host's features for the
    host, else an explicit feature string that names it (a named CPU without one: no, which is
    safe, `bdot` then compiles to plain integer code)."""
    if not _target_has_avx512f(cpu_name, features):
        return False
    if features is None:
        return "+avx512vnni" in codegen.get_host_cpu_features().split(",")
    return "+avx512vnni" in features.split(",")


VNNI = _target_has_vnni(config.CPU_NAME, config.CPU_FEATURES)
# Whether `integer_dot=True` takes the integer route (`kernels._idot`): only where `bdot` is one
# instruction. Without VNNI its plain integer code made a decoding call 2.3x slower than the
# exact route (AVX2 build, Zen 4, docs/quantized_kv.md), and AVX2's `vpmaddubsw` would not pay
# either (int8 bytes need a sign trick a (row, key) pair, int4 as many steps as the floats take).
# The tests set it to run the route's code on any CPU.
INTEGER_ROUTE = VNNI
_N = LANES_F32
_I32 = ir.IntType(32)
_LANES = ir.VectorType(_I32, _N)
_BYTES = ir.VectorType(ir.IntType(8), 4 * _N)


class IVec(types.Type):
    """Numba type of `LANES_F32` int32 lanes (four bytes each to `bdot`)."""

    def __init__(self):
        super().__init__(name="ivec%dxint32" % _N)


_IVEC = IVec()


@register_model(IVec)
class _IVecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _LANES)


def _byte_array(arr, name):
    if not (isinstance(arr, types.Array) and arr.dtype in (types.int8, types.uint8)):
        raise errors.TypingError("`%s` must be an int8 or uint8 array, got %s" % (name, arr))


def _splat_i32(value):
    return ir.Constant(_LANES, [ir.Constant(_I32, value)] * _N)


def _masked_load(builder, ptr, lanes_type, valid, zero, align=1):
    """Lanes 0 .. valid - 1 from `ptr` (aligned to `align` bytes), the others `zero` (nothing
    read past them)."""
    count, i64 = lanes_type.count, ir.IntType(64)
    iota = ir.Constant(ir.VectorType(i64, count), [ir.Constant(i64, k) for k in range(count)])
    limit = builder.insert_element(ir.Constant(iota.type, ir.Undefined), valid,
                                   ir.Constant(_I32, 0))
    limit = builder.shuffle_vector(limit, ir.Constant(iota.type, ir.Undefined),
                                   _lane_mask([0] * count))
    mask = builder.icmp_unsigned("<", iota, limit)
    name = "llvm.masked.load.v%d%s.p0" % (count, lanes_type.element.intrinsic_name)
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(
            lanes_type, [ptr.type, _I32, mask.type, lanes_type]), name)
    return builder.call(fn, [ptr, ir.Constant(_I32, align), mask, zero])


@intrinsic
def bload(typingctx, arr, i, valid):
    """The ``4 * valid`` bytes of `arr` from byte `i` as lanes 0 .. valid - 1 (`valid` <=
    `LANES_F32`), the other lanes zero."""
    _byte_array(arr, "arr")
    _check_index(i)
    _check_index(valid, "valid")

    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig, args, _LANES)
        count = context.cast(builder, args[2], sig.args[2], types.int64)
        return _masked_load(builder, ptr, _LANES, count, _splat_i32(0))

    return _IVEC(arr, i, valid), codegen


@intrinsic
def bload_all(typingctx, arr, i):
    """The ``4 * LANES_F32`` bytes of `arr` from byte `i` as lanes (`bload` of every lane, one
    plain load)."""
    _byte_array(arr, "arr")
    _check_index(i)

    def codegen(context, builder, sig, args):
        return builder.load(_element_ptr(context, builder, sig, args, _LANES), align=1)

    return _IVEC(arr, i), codegen


@intrinsic
def bload_i32(typingctx, arr, i):
    """``arr[i : i + LANES_F32]`` of an int32 array as lanes."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int32):
        raise errors.TypingError("`arr` must be an int32 array, got %s" % arr)
    _check_index(i)

    def codegen(context, builder, sig, args):
        return builder.load(_element_ptr(context, builder, sig, args, _LANES), align=4)

    return _IVEC(arr, i), codegen


def _bytewise(name, doc, body):
    def op(typingctx, a):
        if a != _IVEC:
            raise errors.TypingError("`a` must be an %s, got %s" % (_IVEC, a))
        return _IVEC(a), lambda context, builder, sig, args: body(builder, args[0])
    op.__name__, op.__doc__ = name, doc
    return intrinsic(op)


bflip = _bytewise(
    "bflip", "Each signed byte b as the unsigned byte b + 128 (its top bit flipped).",
    lambda builder, a: builder.xor(a, _splat_i32(-0x7F7F7F80)))  # 0x80808080
bnibbles_low = _bytewise(
    "bnibbles_low", "Each byte's low nibble n, a signed 4-bit number, as the byte n + 8.",
    lambda builder, a: builder.xor(builder.and_(a, _splat_i32(0x0F0F0F0F)),
                                   _splat_i32(0x08080808)))
bnibbles_high = _bytewise(
    "bnibbles_high", "Each byte's high nibble n, a signed 4-bit number, as the byte n + 8.",
    lambda builder, a: builder.xor(builder.and_(builder.lshr(a, _splat_i32(4)),
                                                _splat_i32(0x0F0F0F0F)),
                                   _splat_i32(0x08080808)))


@intrinsic
def bdot(typingctx, acc, a, b):
    """``acc`` plus, in each lane, the four products of its bytes of `a` (unsigned) and `b`
    (signed): one `vpdpbusd` with AVX512-VNNI (no saturation), plain integer code elsewhere."""
    if not (acc == a == b == _IVEC):
        raise errors.TypingError("`acc`, `a` and `b` must be %s, got %s, %s, %s"
                                 % (_IVEC, acc, a, b))

    def codegen(context, builder, sig, args):
        acc_, a_, b_ = args
        if VNNI:
            name = "llvm.x86.avx512.vpdpbusd.512"
            fn = builder.module.globals.get(name)
            if fn is None:
                fn = ir.Function(builder.module, ir.FunctionType(_LANES, [_LANES] * 3), name)
            return builder.call(fn, [acc_, a_, b_])
        wide = ir.VectorType(_I32, 4 * _N)
        products = builder.mul(builder.zext(builder.bitcast(a_, _BYTES), wide),
                               builder.sext(builder.bitcast(b_, _BYTES), wide))
        total = acc_
        for k in range(4):  # byte k of every lane
            total = builder.add(total, builder.shuffle_vector(
                products, products, _lane_mask([4 * j + k for j in range(_N)])))
        return total

    return _IVEC(acc, a, b), codegen


@intrinsic
def bfloat(typingctx, a):
    """The lanes as a float32 vector (exact below 2 ** 24)."""
    if a != _IVEC:
        raise errors.TypingError("`a` must be an %s, got %s" % (_IVEC, a))
    vec = _VEC[types.float32]

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], ir.VectorType(ir.FloatType(), _N))

    return vec(a), codegen


@intrinsic
def bgroup_sums(typingctx, a, b, c, d):
    """Lane 4g + k: the sum of lanes 4g .. 4g + 3 of the k-th argument, exactly: four keys'
    sums over each group of four lanes (an int4 group of 32 numbers), group by group. Two
    levels of unpacks within 128-bit blocks (of 32-bit, then of 64-bit pieces) and adds."""
    if not (a == b == c == d == _IVEC):
        raise errors.TypingError("`a` .. `d` must be %s, got %s, %s, %s, %s"
                                 % (_IVEC, a, b, c, d))

    def codegen(context, builder, sig, args):
        def fold(x, y, width):  # lanes 0 + 2, 1 + 3 of each block (width 1) or 0 + 1 (2)
            pieces = [[j, _N + j, j + 1, _N + j + 1] if width == 1 else
                      [j, j + 1, _N + j, _N + j + 1] for j in range(0, _N, 4)]
            lo = [k for piece in pieces for k in piece]
            hi = [k + 2 for k in lo]
            return builder.add(builder.shuffle_vector(x, y, _lane_mask(lo)),
                               builder.shuffle_vector(x, y, _lane_mask(hi)))
        return fold(fold(args[0], args[1], 1), fold(args[2], args[3], 1), 2)

    return _IVEC(a, b, c, d), codegen


@intrinsic
def vload_groups4(typingctx, arr, i0, i1, i2, i3, groups):
    """Of a float32 array, lane 4g + k: ``arr[i_k + g]`` for g < `groups` (at most
    ``LANES_F32 // 4``), 0 for the others: four keys' group scales, group by group."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32):
        raise errors.TypingError("`arr` must be a float32 array, got %s" % arr)
    for name, index in (("i0", i0), ("i1", i1), ("i2", i2), ("i3", i3), ("groups", groups)):
        _check_index(index, name)
    vec = _VEC[types.float32]
    per = _N // 4

    def codegen(context, builder, sig, args):
        quarter = ir.VectorType(ir.FloatType(), per)
        zero = ir.Constant(quarter, [ir.Constant(ir.FloatType(), 0.0)] * per)
        count = context.cast(builder, args[5], sig.args[5], types.int64)
        loaded = []
        data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        for k in range(4):
            at = context.cast(builder, args[k + 1], sig.args[k + 1], types.intp)
            ptr = builder.bitcast(builder.gep(data, [at], inbounds=True), quarter.as_pointer())
            loaded.append(_masked_load(builder, ptr, quarter, count, zero, align=4))
        pairs = [builder.shuffle_vector(loaded[k], loaded[k + 1], _lane_mask(range(2 * per)))
                 for k in (0, 2)]
        whole = builder.shuffle_vector(pairs[0], pairs[1], _lane_mask(range(4 * per)))
        return builder.shuffle_vector(whole, whole, _lane_mask(
            [k * per + g for g in range(per) for k in range(4)]))

    return vec(arr, i0, i1, i2, i3, groups), codegen


@intrinsic
def vstore_key_sums(typingctx, arr, i, stride, vecs, rows, keys):
    """For r < `rows` and k < `keys` (both at most 4): ``arr[i + r * stride + k]`` = the sum of
    lanes k, k + 4, k + 8, ... of ``vecs[r]`` (four float32 vectors, lane 4g + k as
    `bgroup_sums` and `vload_groups4` place them), added pairwise as `vhsum` adds a vector's
    halves: lane k + 8 to lane k, then lane k + 4 (16 lanes). The rows' trees share their
    shuffles (`_simd._fold_sums`, as in `_simd.vstore_hsums`); each row's sums end as four
    lanes side by side, stored in one piece when `keys` is 4."""
    vec = _VEC[types.float32]
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32):
        raise errors.TypingError("`arr` must be a float32 array, got %s" % arr)
    if not (isinstance(vecs, types.UniTuple) and vecs.dtype == vec and len(vecs) == 4):
        raise errors.TypingError("`vecs` must be four %s, got %s" % (vec, vecs))
    for name, index in (("i", i), ("stride", stride), ("rows", rows), ("keys", keys)):
        _check_index(index, name)

    def codegen(context, builder, sig, args):
        i64, flt = ir.IntType(64), ir.FloatType()
        level = _fold_sums(builder, [(builder.extract_value(args[3], r), [r] * _N)
                                    for r in range(4)], _N, 4)
        data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        start = context.cast(builder, args[1], sig.args[1], types.int64)
        step = context.cast(builder, args[2], sig.args[2], types.int64)
        n_rows = context.cast(builder, args[4], sig.args[4], types.int64)
        n_keys = context.cast(builder, args[5], sig.args[5], types.int64)
        four = ir.VectorType(flt, 4)
        for r in range(4):
            v, lane = next((v, owners.index(r)) for v, (_, owners) in enumerate(level)
                           if r in owners)
            sums = builder.shuffle_vector(level[v][0], level[v][0],
                                          _lane_mask(range(lane, lane + 4)))
            at = builder.add(start, builder.mul(step, ir.Constant(i64, r)))
            ptr = builder.gep(data, [at], inbounds=True)
            with builder.if_then(builder.icmp_signed(">", n_rows, ir.Constant(i64, r))):
                with builder.if_else(builder.icmp_signed("==", n_keys, ir.Constant(i64, 4))) \
                        as (whole, part):
                    with whole:
                        builder.store(sums, builder.bitcast(ptr, four.as_pointer()), align=4)
                    with part:
                        for k in range(3):
                            more = builder.icmp_signed(">", n_keys, ir.Constant(i64, k))
                            with builder.if_then(more):
                                builder.store(builder.extract_element(sums, ir.Constant(_I32, k)),
                                              builder.gep(ptr, [ir.Constant(i64, k)],
                                                          inbounds=True))
        return context.get_dummy_value()

    return types.void(arr, i, stride, vecs, rows, keys), codegen
