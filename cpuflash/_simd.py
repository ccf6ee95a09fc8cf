"""Explicit SIMD vectors for Numba kernels.

Why this layer exists: Numba leaves vectorization to LLVM's loop vectorizer, which does not turn
plain loops into a register-blocked tile of accumulators, prefers 256-bit vectors on many CPUs,
and turns `math.exp` under fastmath into `llvm.exp` on vectors, lowered to one scalar `expf` call
per lane (the pip builds of llvmlite ship no SVML vector math library). The FA-2 micro-kernels
need the opposite: a dozen or more accumulator vectors that stay in registers for a whole K
panel, and a softmax whose exponential costs a handful of vector instructions. So this module
gives Numba a vector type whose data model is the LLVM vector `<LANES x float>`, and a few
operations on it written as `numba.extending` intrinsics that emit LLVM IR. The operations are
callable from `@njit` code only; vectors never cross into Python (no boxing).

The width follows the CPU that Numba compiles for (`NUMBA_CPU_NAME` / `NUMBA_CPU_FEATURES`, else
the host): one 512-bit register (16 float32 or 8 float64) with AVX-512F, else 8 float32 / 4
float64 (one AVX register; LLVM splits them where vectors are narrower, so any CPU runs the code).

Contract
--------
* `arr` is a float32 or float64 array and `i` an element offset from its first element: for a
  C-contiguous array of any ndim, the flat index. The `lanes` elements from there must be
  contiguous in memory and inside the array; nothing is checked (no bounds, no strides).
* A vector's element type is its array's dtype; the operands of one operation must agree.
* No operation carries fast-math flags, and NaN and +-inf behave as documented per function.
  Numba's `fastmath` adds flags to the floating-point instructions emitted here too: a flag set
  without `nnan`/`ninf` (as `cpuflash._jit.FASTMATH`) keeps these guarantees, `fastmath=True`
  does not.
"""

import os

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba.core import codegen, config, errors, types
from numba.extending import intrinsic, models, register_model

__all__ = [
    "LANES_F32", "LANES_F64", "lanes_for", "vload", "vload_f16", "vload_bf16", "vload_i8",
    "vload_e4m3", "vload_i4", "vload_i4_scaled", "E4M3_UNIT",
    "vload_rows", "vload_rows_f16", "vload_rows_bf16", "vstore", "vstore_f16", "vstore_bf16",
    "vbroadcast", "vsplat", "viota", "vzeros", "vfma", "vadd", "vsub", "vmul", "vabs", "vmax",
    "vfill_outside", "vhmax", "vhsum", "vstore_hsums", "vtranspose", "vexp2", "vtanh", "prefetch",
    "BF16_DOT", "vload_pairs", "vbroadcast_pair", "vdot_pairs", "vstore_pairs", "vload_rows_bits",
    "vload_bits", "vstore_bits", "vstore_interleaved",
]

# A function returning a 512-bit vector: with AVX-512F it is returned in zmm0.
_PROBE_IR = """
define <16 x float> @probe(<16 x float> %a, <16 x float> %b) {
  %c = fadd <16 x float> %a, %b
  ret <16 x float> %c
}
"""


def _cpu_model_has_avx512f(cpu_name):
    """Whether LLVM's model of `cpu_name` (no extra features) uses 512-bit registers."""
    try:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        machine = llvm.Target.from_default_triple().create_target_machine(cpu=cpu_name)
        module = llvm.parse_assembly(_PROBE_IR)
        return "zmm" in machine.emit_assembly(module)
    except Exception:  # an unknown CPU or a target without an assembly printer
        return False


def _target_has_avx512f(cpu_name, features):
    """Whether Numba, given `NUMBA_CPU_NAME` and `NUMBA_CPU_FEATURES`, compiles for AVX-512F.

    Numba's JIT passes the host's feature string unless `NUMBA_CPU_FEATURES` is set, even for a
    named CPU. A named CPU stands for the machine the code is meant for, so it only gets 512-bit
    vectors if LLVM's model of that CPU has them or the explicit feature string adds them.
    """
    if cpu_name in (None, "host") and features is None:
        return "+avx512f" in codegen.get_host_cpu_features().split(",")
    flags = features.split(",") if features else []
    if "+avx512f" in flags or "-avx512f" in flags:
        return "+avx512f" in flags
    if cpu_name in (None, "host"):
        cpu_name = llvm.get_host_cpu_name()
    return _cpu_model_has_avx512f(cpu_name)


LANES_F32 = 16 if _target_has_avx512f(config.CPU_NAME, config.CPU_FEATURES) else 8
LANES_F64 = LANES_F32 // 2

# fptrunc to bfloat is one vcvtneps2bf16 where the target has AVX512-BF16 and integer code
# elsewhere: LLVM compiles it for any CPU, unlike the AVX512-BF16 intrinsics, which abort the
# process (not a Python exception) on a target without the feature.
_BF16_PROBE_IR = """
define <16 x i16> @probe(<16 x float> %a) {
  %b = fptrunc <16 x float> %a to <16 x bfloat>
  %c = bitcast <16 x bfloat> %b to <16 x i16>
  ret <16 x i16> %c
}
"""


def _cpu_model_has_avx512bf16(cpu_name):
    """Whether LLVM's model of `cpu_name` (no extra features) has AVX512-BF16."""
    try:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        machine = llvm.Target.from_default_triple().create_target_machine(cpu=cpu_name)
        return "vcvtneps2bf16" in machine.emit_assembly(llvm.parse_assembly(_BF16_PROBE_IR))
    except Exception:  # an unknown CPU or a target without an assembly printer
        return False


def _target_has_avx512bf16(cpu_name, features):
    """Whether Numba, given `NUMBA_CPU_NAME` and `NUMBA_CPU_FEATURES`, compiles for AVX512-BF16
    with 512-bit vectors: the rule of `_target_has_avx512f` (the host's features for the host,
    else an explicit feature string, else LLVM's model of the named CPU), and AVX-512F too.
    Without an explicit feature string Numba passes the host's, which overrides the named CPU's
    model: a named CPU's AVX512-BF16 counts only where the host has it too (LLVM aborts on the
    intrinsics otherwise)."""
    if not _target_has_avx512f(cpu_name, features):
        return False
    if features is None:
        on_host = "+avx512bf16" in codegen.get_host_cpu_features().split(",")
        if cpu_name in (None, "host") or not on_host:
            return on_host
    flags = features.split(",") if features else []
    if "+avx512bf16" in flags or "-avx512bf16" in flags:
        return "+avx512bf16" in flags
    if cpu_name in (None, "host"):
        cpu_name = llvm.get_host_cpu_name()
    return _cpu_model_has_avx512bf16(cpu_name)


def _bf16_dot_pays(cpu_name, forced):
    """Whether `vdpbf16ps` does more multiply-adds per cycle than `fma` on the target's cores.

    Measured (`bench/bf16_ports.py`; docs/history.md, "bfloat16"): on AMD's cores that have
    it (Zen 4 and Zen 5) it does about twice as many, on Intel's AVX512-BF16 cores (Sapphire
    Rapids class) about half as many, so there the bfloat16 kernels would run slower than the
    widening path (Intel's fast bfloat16 unit is AMX, which cpuflash reaches through `_amx`
    instead). `forced` (``CPUFLASH_BF16_DOT``) is "1" or "0" to
    choose either way, for tests and for measuring a CPU this rule does not know.
    """
    if forced in ("0", "1"):
        return forced == "1"
    if cpu_name in (None, "host"):
        cpu_name = llvm.get_host_cpu_name()
    return cpu_name.startswith("znver")


# Whether the compile target has AVX512-BF16 with 512-bit vectors (decided before anything is
# compiled: see `_BF16_PROBE_IR`), and whether bfloat16 inputs take the dot-product kernels on it.
# Where BF16_DOT is False, `vdot_pairs` compiles to plain float32 code with the same results on
# normal numbers (and `vstore_pairs` to integer rounding, where BF16_ISA is False too), and the
# kernels widen bfloat16 instead, unless they take AMX tiles (`_amx`).
BF16_ISA = _target_has_avx512bf16(config.CPU_NAME, config.CPU_FEATURES)
BF16_DOT = BF16_ISA and _bf16_dot_pays(config.CPU_NAME, os.environ.get("CPUFLASH_BF16_DOT"))


def lanes_for(dtype):
    """Lanes of a vector of `dtype` (anything `np.dtype` accepts: float32 or float64)."""
    char = np.dtype(dtype).char  # (not `name`: numpy computes a dtype's name in Python)
    if char not in "fd":
        raise ValueError("`dtype` must be float32 or float64, got %s" % np.dtype(dtype).name)
    return LANES_F32 if char == "f" else LANES_F64


class Vec(types.Type):
    """Numba type of a SIMD vector of `lanes` values of the float type `dtype`."""

    def __init__(self, dtype, lanes):
        self.dtype = dtype
        self.lanes = lanes
        super().__init__(name="vec%dx%s" % (lanes, dtype))


_LL_FLOAT = {types.float32: ir.FloatType(), types.float64: ir.DoubleType()}
_VEC = {types.float32: Vec(types.float32, LANES_F32), types.float64: Vec(types.float64, LANES_F64)}
_I32 = ir.IntType(32)


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.VectorType(_LL_FLOAT[fe_type.dtype], fe_type.lanes))


# -- typing helpers: raise a TypingError naming the argument, as Numba reports it to the user

def _array_vec(arr, name, writable=False):
    if not (isinstance(arr, types.Array) and arr.dtype in _VEC):
        raise errors.TypingError("`%s` must be a float32 or float64 array, got %s" % (name, arr))
    if writable and not arr.mutable:
        raise errors.TypingError("`%s` is read-only" % name)
    return _VEC[arr.dtype]


def _check_index(i, name="i"):
    if not isinstance(i, types.Integer):
        raise errors.TypingError("`%s` must be an integer, got %s" % (name, i))


def _same_vec(*args):
    if not (isinstance(args[0], Vec) and all(a == args[0] for a in args)):
        raise errors.TypingError("expected vectors of one type, got %s" % ", ".join(map(str, args)))
    return args[0]


# -- IR helpers

def _vec_ll(vec):
    return ir.VectorType(_LL_FLOAT[vec.dtype], vec.lanes)


def _const(llvec, value):
    return ir.Constant(llvec, [ir.Constant(llvec.element, value)] * llvec.count)


def _lane_mask(indices):
    return ir.Constant(ir.VectorType(_I32, len(indices)), [ir.Constant(_I32, k) for k in indices])


def _call(builder, op, *args):
    """Call the overloaded LLVM intrinsic `llvm.<op>` on vectors of one type."""
    llvec = args[0].type
    name = "llvm.%s.v%d%s" % (op, llvec.count, llvec.element.intrinsic_name)
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(llvec, [llvec] * len(args)), name)
    return builder.call(fn, args)


def _element_ptr(context, builder, sig, args, llvec=None):
    """Address of element `args[1]` of array `args[0]`, as a pointer to `llvec` if given."""
    (arrty, ity), (arr, i) = sig.args[:2], args[:2]
    data = context.make_array(arrty)(context, builder, value=arr).data
    ptr = builder.gep(data, [context.cast(builder, i, ity, types.intp)], inbounds=True)
    return ptr if llvec is None else builder.bitcast(ptr, llvec.as_pointer())


def _splat(builder, scalar, llvec):
    one = builder.insert_element(ir.Constant(llvec, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, _lane_mask([0] * llvec.count))


def _max(builder, a, b):
    # a > b ? a : b gives b when either is NaN, so b's NaN survives; the second select keeps a's.
    larger = builder.select(builder.fcmp_ordered(">", a, b), a, b)
    return builder.select(builder.fcmp_unordered("uno", a, a), a, larger)


def _add(builder, a, b):
    return builder.fadd(a, b)


def _reduce(builder, vec, combine):
    """Fold the halves of `vec` onto each other until one lane is left: a log2(lanes) tree."""
    while vec.type.count > 1:
        half = vec.type.count // 2
        low = builder.shuffle_vector(vec, vec, _lane_mask(range(half)))
        high = builder.shuffle_vector(vec, vec, _lane_mask(range(half, 2 * half)))
        vec = combine(builder, low, high)
    return builder.extract_element(vec, ir.Constant(_I32, 0))


# -- memory

@intrinsic
def vload(typingctx, arr, i):
    """Load `arr[i : i + lanes]` (unaligned) into a vector."""
    vec = _array_vec(arr, "arr")
    _check_index(i)

    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig, args, _vec_ll(vec))
        return builder.load(ptr, align=arr.dtype.bitwidth // 8)

    return vec(arr, i), codegen


def _widening_load(name, widen_bits, bits=16, note=""):
    """An intrinsic loading `lanes` elements of an integer type of `bits` bits (uint16 for the
    half-precision formats, int8 or uint8 for 8-bit caches) as a float32 vector."""
    vec = _VEC[types.float32]
    element = {16: types.uint16, 8: types.int8 if name == "int8" else types.uint8}[bits]

    def load(typingctx, arr, i):
        if not (isinstance(arr, types.Array) and arr.dtype == element):
            raise errors.TypingError("`arr` must be a %s array (%s), got %s"
                                     % (element, name, arr))
        _check_index(i)

        def codegen(context, builder, sig, args):
            bits_type = ir.VectorType(ir.IntType(bits), vec.lanes)
            ptr = _element_ptr(context, builder, sig, args, bits_type)
            return widen_bits(builder, builder.load(ptr, align=bits // 8), vec.lanes)

        return vec(arr, i), codegen

    load.__name__ = "vload_" + name
    load.__doc__ = "Load `arr[i : i + lanes]`, %s numbers (their bits), as a float32 vector " \
        "(exactly: every %s is a float32).%s" % (name, name, note)
    return intrinsic(load)


def _widen_f16(builder, bits, lanes):  # fpext from half: one vcvtph2ps with F16C
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), lanes)),
                         ir.VectorType(ir.FloatType(), lanes))


def _widen_bf16(builder, bits, lanes):  # bfloat16 is the top half of a float32
    wide = builder.zext(bits, ir.VectorType(_I32, lanes))
    return builder.bitcast(builder.shl(wide, _const(wide.type, 16)),
                           ir.VectorType(ir.FloatType(), lanes))


def _widen_i8(builder, bits, lanes):  # vpmovsxbd + vcvtdq2ps
    return builder.sitofp(bits, ir.VectorType(ir.FloatType(), lanes))


def _widen_e4m3(builder, bits, lanes):
    """float8_e4m3fn bits (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinity,
    NaN = S.1111.111) to float32 numbers 2^8 times smaller, exactly, through binary16: the sign
    bit moved to bit 15 and the other seven bits to bits 13..7 make a binary16 of the same
    fields (an exponent of bias 15, one bit wider; a mantissa seven bits longer), worth the
    number times 2^-8, subnormals included, as both formats scale their subnormals alike; one
    vcvtph2ps widens it. The caller applies the 2^8 with its scales (`E4M3_UNIT`): a multiply
    here, and a compare and select for NaN, cost a fifth of a decoding call."""
    i16s = ir.VectorType(ir.IntType(16), lanes)
    # sign-extended, the sign fills bits 15..7; shifted by 7 it lands in bits 15 and 14
    fields = builder.and_(builder.shl(builder.sext(bits, i16s), _const(i16s, 7)),
                          _const(i16s, 0xBF80))
    # NaN's seven bits (0x3F80 there) are the only ones that carry into bit 14: setting it
    # makes binary16's exponent all ones, a NaN
    fields = builder.or_(fields, builder.and_(builder.add(fields, _const(i16s, 0x80)),
                                              _const(i16s, 0x4000)))
    halves = builder.bitcast(fields, ir.VectorType(ir.HalfType(), lanes))
    return builder.fpext(halves, ir.VectorType(ir.FloatType(), lanes))


E4M3_UNIT = 2.0 ** 8  # what a number widened by `vload_e4m3` is worth


vload_f16 = _widening_load("float16", _widen_f16)
vload_bf16 = _widening_load("bfloat16", _widen_bf16)
vload_i8 = _widening_load("int8", _widen_i8, bits=8)
vload_e4m3 = _widening_load("float8_e4m3fn", _widen_e4m3, bits=8,
                            note=" Each number comes 2^8 times smaller (`E4M3_UNIT`).")


@intrinsic
def vload_i4(typingctx, arr, i):
    """Load ``lanes / 2`` bytes of `arr` (uint8) from element `i` as the float32 vector of their
    ``lanes`` signed 4-bit numbers (int4 caches, `cpuflash.quantize_kv`): byte m's low nibble
    is lane 2m, its high nibble lane 2m + 1, each two's complement, exactly."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8):
        raise errors.TypingError("`arr` must be a uint8 array (int4 pairs), got %s" % arr)
    _check_index(i)
    vec = _VEC[types.float32]
    half = vec.lanes // 2

    def codegen(context, builder, sig, args):
        i8s = ir.VectorType(ir.IntType(8), half)
        bytes_ = builder.load(_element_ptr(context, builder, sig, args, i8s), align=1)
        four = _const(i8s, 4)
        low = builder.ashr(builder.shl(bytes_, four), four)  # sign-extended from bit 3
        high = builder.ashr(bytes_, four)
        lanes = builder.shuffle_vector(low, high, _lane_mask(
            [k // 2 + (half if k % 2 else 0) for k in range(vec.lanes)]))
        return builder.sitofp(lanes, _vec_ll(vec))

    return vec(arr, i), codegen


@intrinsic
def vload_i4_scaled(typingctx, arr, i, factor):
    """Load the `lanes` bytes of `arr` (uint8) from element `i` as two float32 vectors, their
    low and their high nibbles (each a signed 4-bit number, two's complement) times `factor`, a
    vector of one value, each product rounded once: lane m is byte m's, so of an int4 row's
    ``2 * lanes`` numbers the first vector holds the even ones, the second the odd ones. With
    16 lanes each nibble picks its product from the 16 products ``factor * n`` (one `vpermps`
    a vector, which reads an index's low four bits); elsewhere it is shifted out of the
    sign-extended byte, converted and multiplied: the same bits."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8):
        raise errors.TypingError("`arr` must be a uint8 array (int4 pairs), got %s" % arr)
    _check_index(i)
    vec = _VEC[types.float32]
    if factor != vec:
        raise errors.TypingError("`factor` must be a %s, got %s" % (vec, factor))

    def codegen(context, builder, sig, args):
        i8s, i32s = ir.VectorType(ir.IntType(8), vec.lanes), ir.VectorType(_I32, vec.lanes)
        llvec = _vec_ll(vec)
        loaded = builder.load(_element_ptr(context, builder, sig, args, i8s), align=1)
        if vec.lanes == 16:
            # the products of the 16 nibble values 0..7, -8..-1, in nibble order
            numbers = ir.Constant(llvec, [ir.Constant(ir.FloatType(), float(m - 16 * (m > 7)))
                                          for m in range(16)])
            table = builder.fmul(numbers, args[2])
            wide = builder.zext(loaded, i32s)
            name = "llvm.x86.avx512.permvar.sf.512"
            fn = builder.module.globals.get(name)
            if fn is None:
                fn = ir.Function(builder.module, ir.FunctionType(llvec, [llvec, i32s]), name)
            low = builder.call(fn, [table, wide])
            high = builder.call(fn, [table, builder.lshr(wide, _const(i32s, 4))])
        else:
            wide = builder.sext(loaded, i32s)
            low = builder.sitofp(builder.ashr(builder.shl(wide, _const(i32s, 28)),
                                              _const(i32s, 28)), llvec)
            high = builder.sitofp(builder.ashr(wide, _const(i32s, 4)), llvec)
            low, high = builder.fmul(low, args[2]), builder.fmul(high, args[2])
        return context.make_tuple(builder, sig.return_type, (low, high))

    return types.UniTuple(vec, 2)(arr, i, factor), codegen


def _half_store(name, narrow_bits):
    """An intrinsic storing a float32 vector as `lanes` uint16 elements of a half format."""

    def store(typingctx, arr, i, vec):
        if not (isinstance(arr, types.Array) and arr.dtype == types.uint16 and arr.mutable):
            raise errors.TypingError("`arr` must be a writable uint16 array (%s bits), got %s"
                                     % (name, arr))
        _check_index(i)
        if vec != _VEC[types.float32]:
            raise errors.TypingError("`vec` must be a %s, got %s" % (_VEC[types.float32], vec))

        def codegen(context, builder, sig, args):
            bits_type = ir.VectorType(ir.IntType(16), vec.lanes)
            ptr = _element_ptr(context, builder, sig, args, bits_type)
            builder.store(narrow_bits(builder, args[2], vec.lanes), ptr, align=2)
            return context.get_dummy_value()

        return types.none(arr, i, vec), codegen

    store.__name__ = "vstore_" + name
    store.__doc__ = ("Store float32 `vec` into `arr[i : i + lanes]` as %s bits, rounded to "
                     "nearest even (a NaN stays a NaN)." % name)
    return intrinsic(store)


def _narrow_f16(builder, vec, lanes):  # fptrunc to half: one vcvtps2ph with F16C
    return builder.bitcast(builder.fptrunc(vec, ir.VectorType(ir.HalfType(), lanes)),
                           ir.VectorType(ir.IntType(16), lanes))


def _narrow_bf16(builder, vec, lanes):
    # the top 16 bits, rounded to nearest even; a NaN keeps its top bits with the quiet bit set
    # (rounding could carry it into infinity)
    wide = ir.VectorType(_I32, lanes)
    bits = builder.bitcast(vec, wide)
    top = builder.lshr(bits, _const(wide, 16))
    bias = builder.add(_const(wide, 0x7FFF), builder.and_(top, _const(wide, 1)))
    rounded = builder.lshr(builder.add(bits, bias), _const(wide, 16))
    quiet = builder.or_(top, _const(wide, 0x40))
    nan = builder.fcmp_unordered("uno", vec, vec)
    return builder.trunc(builder.select(nan, quiet, rounded), ir.VectorType(ir.IntType(16), lanes))


vstore_f16 = _half_store("float16", _narrow_f16)
vstore_bf16 = _half_store("bfloat16", _narrow_bf16)


@intrinsic
def vstore(typingctx, arr, i, vec):
    """Store `vec` into `arr[i : i + lanes]` (unaligned)."""
    if _array_vec(arr, "arr", writable=True) != vec:
        raise errors.TypingError("`vec` must be a %s, got %s" % (_VEC[arr.dtype], vec))
    _check_index(i)

    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig, args, _vec_ll(vec))
        builder.store(args[2], ptr, align=arr.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.none(arr, i, vec), codegen


@intrinsic
def vbroadcast(typingctx, arr, i):
    """The vector with `arr[i]` in every lane (one broadcast load)."""
    vec = _array_vec(arr, "arr")
    _check_index(i)

    def codegen(context, builder, sig, args):
        scalar = builder.load(_element_ptr(context, builder, sig, args))
        return _splat(builder, scalar, _vec_ll(vec))

    return vec(arr, i), codegen


# -- constants

def _like_vec(like):
    if isinstance(like, Vec):
        return like
    return _array_vec(like, "like")


@intrinsic
def vsplat(typingctx, x, like):
    """The vector with the number `x` in every lane; its type is that of `like`.

    `like` is a vector, or an array whose dtype gives the element type.
    """
    vec = _like_vec(like)
    if not isinstance(x, (types.Float, types.Integer)):
        raise errors.TypingError("`x` must be a real number, got %s" % x)

    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], x, vec.dtype), _vec_ll(vec))

    return vec(x, like), codegen


@intrinsic
def viota(typingctx, like):
    """The vector 0, 1, ..., lanes - 1; its type is that of `like` (as for `vsplat`)."""
    vec = _like_vec(like)

    def codegen(context, builder, sig, args):
        llvec = _vec_ll(vec)
        return ir.Constant(llvec, [ir.Constant(llvec.element, float(k)) for k in range(vec.lanes)])

    return vec(like), codegen


@intrinsic
def vzeros(typingctx, like):
    """The zero vector of the type of `like` (a vector, or an array giving the dtype)."""
    vec = _like_vec(like)

    def codegen(context, builder, sig, args):
        return _const(_vec_ll(vec), 0.0)

    return vec(like), codegen


# -- lane-wise arithmetic

@intrinsic
def vfma(typingctx, a, b, c):
    """`a * b + c` with a single rounding (`llvm.fma`)."""
    vec = _same_vec(a, b, c)
    return vec(a, b, c), lambda context, builder, sig, args: _call(builder, "fma", *args)


@intrinsic
def vadd(typingctx, a, b):
    """`a + b`, lane by lane."""
    vec = _same_vec(a, b)
    return vec(a, b), lambda context, builder, sig, args: builder.fadd(*args)


@intrinsic
def vsub(typingctx, a, b):
    """`a - b`, lane by lane."""
    vec = _same_vec(a, b)
    return vec(a, b), lambda context, builder, sig, args: builder.fsub(*args)


@intrinsic
def vmul(typingctx, a, b):
    """`a * b`, lane by lane."""
    vec = _same_vec(a, b)
    return vec(a, b), lambda context, builder, sig, args: builder.fmul(*args)


@intrinsic
def vabs(typingctx, a):
    """`|a|`, lane by lane (`llvm.fabs`: clears the sign bit, NaN stays NaN)."""
    vec = _same_vec(a)
    return vec(a), lambda context, builder, sig, args: _call(builder, "fabs", *args)


@intrinsic
def vmax(typingctx, a, b):
    """Lane-wise maximum that propagates NaN from either operand, as `np.maximum` does.

    A running max over scores holding a NaN is therefore NaN, and so is everything computed from
    it. Of +0.0 and -0.0 either may come out. Costs two compares and a blend: no x86 max
    instruction keeps a NaN from both sides.
    """
    vec = _same_vec(a, b)
    return vec(a, b), lambda context, builder, sig, args: _max(builder, *args)


@intrinsic
def vfill_outside(typingctx, vec, first, end, value):
    """`vec` with the lanes outside ``first .. end - 1`` set to `value` (any integers: a range
    past either side keeps no lane or every lane). Two compares and a blend; the lanes kept
    keep their bits."""
    _same_vec(vec)
    _check_index(first, "first")
    _check_index(end, "end")
    if not isinstance(value, (types.Float, types.Integer)):
        raise errors.TypingError("`value` must be a real number, got %s" % value)

    def codegen(context, builder, sig, args):
        vec_arg, first_arg, end_arg, value_arg = args
        llvec = vec_arg.type
        i64 = ir.IntType(64)
        lanes = ir.Constant(ir.VectorType(i64, llvec.count),
                            [ir.Constant(i64, k) for k in range(llvec.count)])
        lo = _splat(builder, context.cast(builder, first_arg, first, types.int64), lanes.type)
        hi = _splat(builder, context.cast(builder, end_arg, end, types.int64), lanes.type)
        keep = builder.and_(builder.icmp_signed(">=", lanes, lo),
                            builder.icmp_signed("<", lanes, hi))
        fill = _splat(builder, context.cast(builder, value_arg, value, vec.dtype), llvec)
        return builder.select(keep, vec_arg, fill)

    return vec(vec, first, end, value), codegen


# -- horizontal reductions

@intrinsic
def vhmax(typingctx, vec):
    """Largest lane of `vec`; NaN if any lane is NaN (the semantics of `vmax`)."""
    _same_vec(vec)
    return vec.dtype(vec), lambda context, builder, sig, args: _reduce(builder, args[0], _max)


@intrinsic
def vhsum(typingctx, vec):
    """Sum of the lanes of `vec`, added as a pairwise tree (halves onto halves)."""
    _same_vec(vec)
    return vec.dtype(vec), lambda context, builder, sig, args: _reduce(builder, args[0], _add)


def _fold_sums(builder, level, n, block):
    """Codegen: the pairwise sums of the (vector, owners) pairs of `level` (`owners`: which sum
    each of the `n` lanes' partial sum belongs to), folded a level at a time until each sum is
    a block of `block` lanes: each level adds the halves of blocks of lanes as `vhsum` adds a
    vector's halves, two vectors into one, x's halves into a block's first half and y's into
    its second (one operand a blend of x and y, the other a swap of halves). An odd one out
    folds with itself (its lanes then appear twice). Returns the folded pairs."""
    half = n // 2
    while half >= block:
        if len(level) % 2:
            level = level + [level[-1]]
        lo = [k for j in range(0, n, 2 * half)
              for k in list(range(j, j + half)) + list(range(n + j + half, n + j + 2 * half))]
        hi = [k + half if k < n else k - half for k in lo]
        level = [(builder.fadd(builder.shuffle_vector(x, y, _lane_mask(lo)),
                               builder.shuffle_vector(x, y, _lane_mask(hi))),
                  [(x_of + y_of)[k] for k in lo])
                 for (x, x_of), (y, y_of) in zip(level[0::2], level[1::2])]
        half //= 2
    return level


@intrinsic
def vstore_hsums(typingctx, arr, i, stride, vecs):
    """Store the lane sums of vectors as rows: ``arr[i + r * stride + c] = vhsum(v)`` for the
    vector v in row r, column c, each bit for bit `vhsum`'s. `vecs` is a tuple of ``4 * R``
    vectors (R rows of four, row by row) or a tuple of R tuples of W vectors (R rows of W).

    The pairwise trees of all the sums share their shuffles: each level folds two vectors into
    one, adding the halves of blocks of lanes as `vhsum` adds the halves of a vector, so 16 sums
    of 16 lanes take 15 folds of two shuffles and an add, where 16 `vhsum` calls take 64 steps
    of one shuffle and an add. For the dot products of the decode kernel, which end in one sum
    per (query row, key).
    """
    _array_vec(arr, "arr", writable=True)
    _check_index(i)
    _check_index(stride, "stride")
    nested = isinstance(vecs, types.UniTuple) and isinstance(vecs.dtype, types.UniTuple)
    inner = vecs.dtype if nested else vecs
    if not (isinstance(inner, types.UniTuple) and isinstance(inner.dtype, Vec)
            and inner.dtype.dtype == arr.dtype
            and (len(inner) > 0 if nested else len(vecs) % 4 == 0)):
        raise errors.TypingError("`vecs` must be a tuple of 4 * R vectors of %s or a tuple of "
                                 "R tuples of W vectors, got %s" % (arr.dtype, vecs))
    vec = inner.dtype
    width = len(inner) if nested else 4
    count = len(vecs) * width if nested else len(vecs)

    def codegen(context, builder, sig, args):
        n, i64 = vec.lanes, ir.IntType(64)
        if nested:
            flat = [builder.extract_value(builder.extract_value(args[3], r), c)
                    for r in range(len(vecs)) for c in range(width)]
        else:
            flat = [builder.extract_value(args[3], k) for k in range(count)]
        # each vector with, per lane, which of the input vectors its partial sum belongs to;
        # a power of two of them enter in bit-reversed order, which leaves the sums in order in
        # the last vector (so a row's sums are one block of lanes, stored without a gather)
        order = range(count)
        if 1 < count <= n and count & (count - 1) == 0:
            bits = count.bit_length() - 1
            order = [int(format(k, "0%db" % bits)[::-1], 2) for k in order]
        level = _fold_sums(builder, [(flat[k], [k] * n) for k in order], n, 1)
        where = {}  # input vector -> (folded vector, lane) holding its whole sum
        for v, (_, owners) in enumerate(level):
            for lane, owner in enumerate(owners):
                where[owner] = (v, lane)
        base = _element_ptr(context, builder, sig, args)
        stride_value = context.cast(builder, args[2], sig.args[2], types.int64)
        row_type = ir.VectorType(_LL_FLOAT[vec.dtype], width)
        for r in range(count // width):
            spots = [where[width * r + c] for c in range(width)]
            ptr = builder.gep(base, [builder.mul(stride_value, ir.Constant(i64, r))],
                              inbounds=True)
            sources = sorted({v for v, _ in spots})
            if width > 1 and len(sources) <= 2:  # one shuffle gathers the row's sums
                x, y = level[sources[0]][0], level[sources[-1]][0]
                row = builder.shuffle_vector(x, y, _lane_mask(
                    [lane + n * sources.index(v) for v, lane in spots]))
                builder.store(row, builder.bitcast(ptr, row_type.as_pointer()),
                              align=vec.dtype.bitwidth // 8)
                continue
            for c, (v, lane) in enumerate(spots):
                value = builder.extract_element(level[v][0], ir.Constant(_I32, lane))
                builder.store(value, builder.gep(ptr, [ir.Constant(i64, c)], inbounds=True))
        return context.get_dummy_value()

    return types.void(arr, i, stride, vecs), codegen


def _rows_load(name=None, widen_bits=None):
    """An intrinsic loading a square block, `lanes` vectors from `arr[i + j * stride]`: of a
    float array, or (`widen_bits`) of the uint16 bits of the half-precision format `name`."""

    def load_rows(typingctx, arr, i, stride):
        if widen_bits is None:
            vec = _array_vec(arr, "arr")
        elif isinstance(arr, types.Array) and arr.dtype == types.uint16:
            vec = _VEC[types.float32]
        else:
            raise errors.TypingError("`arr` must be a uint16 array (%s bits), got %s"
                                     % (name, arr))
        _check_index(i)
        _check_index(stride, "stride")
        block = types.UniTuple(vec, vec.lanes)

        def codegen(context, builder, sig, args):
            stored = ir.IntType(16) if widen_bits else _LL_FLOAT[vec.dtype]
            memory = ir.VectorType(stored, vec.lanes).as_pointer()
            start = _element_ptr(context, builder, sig, args)
            step = context.cast(builder, args[2], sig.args[2], types.intp)
            result = ir.Constant(context.get_value_type(block), ir.Undefined)
            for j in range(vec.lanes):
                ptr = builder.gep(start, [builder.mul(step, ir.Constant(step.type, j))],
                                  inbounds=True)
                row = builder.load(builder.bitcast(ptr, memory), align=arr.dtype.bitwidth // 8)
                if widen_bits:
                    row = widen_bits(builder, row, vec.lanes)
                result = builder.insert_value(result, row, j)
            return result

        return block(arr, i, stride), codegen

    load_rows.__name__ = "vload_rows" + ("_" + name if name else "")
    widened = ", the %s bits widened to float32" % name if name else ""
    load_rows.__doc__ = ("The square block of `lanes` vectors ``arr[i + j * stride :][:lanes]`` "
                         "(rows j), as a tuple%s." % widened)
    return intrinsic(load_rows)


vload_rows = _rows_load()
vload_rows_f16 = _rows_load("float16", _widen_f16)
vload_rows_bf16 = _rows_load("bfloat16", _widen_bf16)


@intrinsic
def vtranspose(typingctx, vecs):
    """The transpose of a square block: a tuple of `lanes` vectors (row i = vecs[i]) in, the
    tuple of its columns out. log2(lanes) rounds of two-source shuffles, `lanes` per round
    (64 shuffles for 16 x 16 float32). For packing key panels, which are K transposed."""
    if not (isinstance(vecs, types.UniTuple) and isinstance(vecs.dtype, Vec)
            and len(vecs) == vecs.dtype.lanes):
        raise errors.TypingError("`vecs` must be a tuple of as many vectors as they have lanes, "
                                 "got %s" % vecs)
    n = len(vecs)

    def codegen(context, builder, sig, args):
        rows = [builder.extract_value(args[0], i) for i in range(n)]
        half = n // 2
        while half >= 1:  # swap the off-diagonal half x half blocks of every 2half x 2half block
            for i in range(n):
                if i & half:
                    continue
                a, c = rows[i], rows[i + half]
                rows[i] = builder.shuffle_vector(a, c, _lane_mask(
                    [j if not j & half else n + j - half for j in range(n)]))
                rows[i + half] = builder.shuffle_vector(a, c, _lane_mask(
                    [j + half if not j & half else n + j for j in range(n)]))
            half //= 2
        result = ir.Constant(context.get_value_type(sig.return_type), ir.Undefined)
        for i, row in enumerate(rows):
            result = builder.insert_value(result, row, i)
        return result

    return vecs(vecs), codegen


# -- exp2

# Remez minimax fits of 2**f on [-1/2, 1/2] for relative error, with the constant term pinned to
# 1 so that exp2(0) == 1 exactly; coefficients of f**1 .. f**d. Approximation error alone:
# 2.6e-9 (degree 6) and 1.8e-17 (degree 11), well under the rounding error of the evaluation.
_EXP2_POLY = {
    types.float32: (0.69314724, 0.24022652, 0.055503104, 0.009617693, 0.0013406643,
                    0.00015594678),
    types.float64: (0.6931471805599457, 0.24022650695910097, 0.05550410866479039,
                    0.009618129107607003, 0.0013333558153440052, 0.00015403530441572384,
                    1.5252727385118282e-05, 1.3215442675178602e-06, 1.0180647687984384e-07,
                    7.07257044116385e-09, 4.0780679325849204e-10),
}
# degree 4, fitted to 2**f on [-1/2, 1/2] for the least largest relative error: 2.9e-6 in
# float32, for results that end in 16-bit floats (`vexp2_half`)
_EXP2_POLY_HALF = (0.6931241750717163, 0.24024099111557007, 0.05590633675456047,
                   0.0095828203484416)
# (mantissa bits, exponent bias, integer type of the same width)
_FLOAT_LAYOUT = {
    types.float32: (23, 127, ir.IntType(32)),
    types.float64: (52, 1023, ir.IntType(64)),
}


def _exp2(builder, x, dtype, coeffs=None):
    llvec = x.type
    mbits, bias, int_t = _FLOAT_LAYOUT[dtype]
    ivec = ir.VectorType(int_t, llvec.count)
    # Clamp to [-bias, bias + 1] (NaN passes through: both compares are false): the extreme
    # exponents below give exactly 0 (so -inf -> 0) and +inf.
    low, high = _const(llvec, -bias), _const(llvec, bias + 1)
    x = builder.select(builder.fcmp_ordered("<", x, low), low, x)
    x = builder.select(builder.fcmp_ordered(">", x, high), high, x)
    # 2**x = 2**n * 2**f with n the nearest integer and f in [-1/2, 1/2]. roundeven rather than
    # the add-and-subtract-1.5*2**mbits trick, which the `reassoc` flag of the caller would fold.
    n = _call(builder, "roundeven", x)
    f = builder.fsub(x, n)
    # Horner with FMA: p = 1 + f*(c1 + f*(c2 + ...))
    coeffs = coeffs or _EXP2_POLY[dtype]
    p = _const(llvec, coeffs[-1])
    for c in reversed((1.0,) + coeffs[:-1]):
        p = _call(builder, "fma", p, f, _const(llvec, c))
    # 2**n from its bits: n + 1.5*2**mbits is exact and carries n in its low mantissa bits;
    # shifting them into the exponent field drops the rest. This sidesteps fptosi, which is
    # poison for NaN. The biased exponent is 0 for n = -bias (giving +0.0) and all ones for
    # n = bias + 1 (giving +inf).
    shifted = builder.fadd(n, _const(llvec, 1.5 * 2.0 ** mbits))
    exponent = builder.shl(builder.bitcast(shifted, ivec), _const(ivec, mbits))
    scale = builder.bitcast(builder.add(exponent, _const(ivec, bias << mbits)), llvec)
    return builder.fmul(p, scale)


@intrinsic
def vexp2(typingctx, vec):
    """2**x lane by lane: clamp, round, a polynomial with FMA, then scale by 2**n.

    About 15 vector instructions for float32 (degree-6 polynomial), 20 for float64 (degree 11).
    Max relative error, measured over exhaustive float32 ranges and 4e7 random float64 inputs
    against `np.exp2` in float64 (for float64: long double): 8.4e-8 for float32 (1.4 ulp) and
    1.6e-16 for float64 (0.7 ulp). That holds for x in [-b + 1, b + 1/2), with b = 127 (float32)
    or 1023 (float64). Below, the result goes subnormal for x in [-b + 1/2, -b + 1), then is
    exactly +0.0 (no further gradual underflow). From b + 1/2 on it is +inf, a little early:
    the true value is finite up to b + 1. Exact: exp2(0) == exp2(-0.0) == 1, exp2(-inf) == 0,
    exp2(+inf) == +inf, and exp2(NaN) is NaN.
    """
    _same_vec(vec)
    return vec(vec), lambda context, builder, sig, args: _exp2(builder, args[0], vec.dtype)


@intrinsic
def vexp2_half(typingctx, vec):
    """`vexp2` of float32 to 2.9e-6 relative (18 bits) instead of 8.4e-8, with two FMAs fewer
    (a degree-4 polynomial): for probabilities of bfloat16 or float16 inputs, whose P is
    rounded to bfloat16 (2^-9) or whose output to float16 (2^-11) next. Its edge cases are
    `vexp2`'s."""
    _same_vec(vec)
    if vec.dtype != types.float32:
        raise errors.TypingError("vexp2_half takes float32 vectors, got %s" % vec)
    return vec(vec), lambda context, builder, sig, args: _exp2(builder, args[0], vec.dtype,
                                                                _EXP2_POLY_HALF)


# tanh's Taylor series, odd terms y^1 .. y^19: for |y| < 0.55 the first omitted term is below
# 3e-9 of tanh(y), under half an ulp of float32.
_TANH_TAYLOR = (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925, 21844 / 6081075,
                -929569 / 638512875, 6404582 / 10854718875, -443861162 / 1856156927625)
_TANH_SERIES_LIMIT = 0.55
_LOG2E = 1.4426950408889634


def _tanh(builder, y):
    llvec = y.type
    # |y| < limit: the odd series, Horner in y^2 (no cancellation near 0)
    y2 = builder.fmul(y, y)
    p = _const(llvec, _TANH_TAYLOR[-1])
    for c in reversed(_TANH_TAYLOR[:-1]):
        p = _call(builder, "fma", p, y2, _const(llvec, c))
    series = builder.fmul(p, y)
    # elsewhere: 1 - 2 / (2**(2 y log2 e) + 1), which goes to +-1 (exp2 gives +inf or 0 at the
    # ends) and loses at most a bit to cancellation for |y| >= limit
    e = _exp2(builder, builder.fmul(y, _const(llvec, 2 * _LOG2E)), types.float32)
    one = _const(llvec, 1.0)
    tail = builder.fsub(one, builder.fdiv(_const(llvec, 2.0), builder.fadd(e, one)))
    small = builder.fcmp_ordered("<", _call(builder, "fabs", y), _const(llvec, _TANH_SERIES_LIMIT))
    # NaN: both compares false, the tail computes NaN from it
    return builder.select(small, series, tail)


@intrinsic
def vtanh(typingctx, vec):
    """tanh lane by lane, float32 only (the softcap of the float32 kernels).

    The odd Taylor series to y^19 for |y| < 0.55, else ``1 - 2 / (exp2(2 y log2(e)) + 1)``;
    tanh(+-inf) = +-1, tanh(NaN) is NaN. Max error against `np.tanh` in float64 over a dense
    sweep of [-20, 20]: 3.1 ulp of float32 (relative 3e-7, near |y| = 1.6, where the division
    and exp2 errors add up).
    """
    _same_vec(vec)
    if vec.dtype != types.float32:
        raise errors.TypingError("vtanh takes float32 vectors, got %s" % vec)
    return vec(vec), lambda context, builder, sig, args: _tanh(builder, args[0])


@intrinsic
def prefetch(typingctx, arr, i):
    """Hint the CPU to bring the cache line holding `arr[i]` into the caches (for reading).

    For a loop that streams two arrays in turns, where the hardware prefetcher starts each turn
    cold. No effect on results; `i` may be past the end of the array (a prefetch never faults,
    and the address is computed without LLVM's in-bounds assumption). Any array dtype.
    """
    if not isinstance(arr, types.Array):
        raise errors.TypingError("`arr` must be an array, got %s" % arr)
    _check_index(i)

    def codegen(context, builder, sig, args):
        (arrty, ity), (arr, i) = sig.args, args
        data = context.make_array(arrty)(context, builder, value=arr).data
        ptr = builder.gep(data, [context.cast(builder, i, ity, types.intp)])  # may be past the end
        ptr = builder.bitcast(ptr, ir.IntType(8).as_pointer())
        name = "llvm.prefetch.p0"
        fn = builder.module.globals.get(name)
        if fn is None:
            fn = ir.Function(builder.module, ir.FunctionType(
                ir.VoidType(), [ptr.type, _I32, _I32, _I32]), name)
        # read, keep in all levels (locality 3), data cache
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.void(arr, i), codegen


# -- bfloat16 pairs (AVX512-BF16)
#
# A pair vector holds 2 * LANES_F32 bfloat16 numbers, as LANES_F32 32-bit lanes of two each: lane
# j is the pair (element 2j, element 2j + 1) of the uint16 array it was loaded from, element 2j in
# the low half (x86 is little-endian). `vdot_pairs` multiplies two such vectors pair by pair and
# adds both products to a float32 lane: two multiply-adds per lane, in one `vdpbf16ps`.


class PairVec(types.Type):
    """Numba type of a vector of `lanes` bfloat16 pairs (see above)."""

    def __init__(self, lanes):
        self.lanes = lanes
        super().__init__(name="bf16pairs%d" % lanes)


PAIRS = PairVec(LANES_F32)


@register_model(PairVec)
class _PairVecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.VectorType(_I32, fe_type.lanes))


def _bits_array(arr, name, writable=False):
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint16):
        raise errors.TypingError("`%s` must be a uint16 array (bfloat16 bits), got %s"
                                 % (name, arr))
    if writable and not arr.mutable:
        raise errors.TypingError("`%s` is read-only" % name)


def _declare(builder, name, ret, args):
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(ret, args), name)
    return fn


@intrinsic
def vload_pairs(typingctx, arr, i):
    """The pair vector of ``arr[i : i + 2 * lanes]`` (uint16 bfloat16 bits, unaligned)."""
    _bits_array(arr, "arr")
    _check_index(i)

    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig, args, ir.VectorType(_I32, PAIRS.lanes))
        return builder.load(ptr, align=2)

    return PAIRS(arr, i), codegen


@intrinsic
def vbroadcast_pair(typingctx, arr, i):
    """The pair ``(arr[i], arr[i + 1])`` in every lane (one 32-bit broadcast load)."""
    _bits_array(arr, "arr")
    _check_index(i)

    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig, args, _I32)
        return _splat(builder, builder.load(ptr, align=2), ir.VectorType(_I32, PAIRS.lanes))

    return PAIRS(arr, i), codegen


def _pair_halves(builder, pairs):
    """The float32 vectors of the even and the odd elements of a pair vector (exact)."""
    f32 = ir.VectorType(ir.FloatType(), pairs.type.count)
    even = builder.shl(pairs, _const(pairs.type, 16))
    odd = builder.and_(pairs, _const(pairs.type, -65536))
    return builder.bitcast(even, f32), builder.bitcast(odd, f32)


@intrinsic
def vdot_pairs(typingctx, acc, a, b):
    """``acc + a_odd * b_odd + a_even * b_even`` lane by lane, for pair vectors `a` and `b` and a
    float32 vector `acc`: `vdpbf16ps` where `BF16_DOT`. Each product is exact in float32, each
    addition rounds to nearest even, the odd elements' product first (Intel's definition). The
    instruction treats subnormal inputs and results as 0; the float32 code elsewhere does not
    (bfloat16 subnormals are below 1.2e-38)."""
    vec = _VEC[types.float32]
    if acc != vec or a != PAIRS or b != PAIRS:
        raise errors.TypingError("expected a %s and two %s, got %s, %s, %s"
                                 % (vec, PAIRS, acc, a, b))

    def codegen(context, builder, sig, args):
        acc_v, a_v, b_v = args
        if BF16_DOT:
            fn = _declare(builder, "llvm.x86.avx512bf16.dpbf16ps.512", acc_v.type,
                          [acc_v.type, a_v.type, b_v.type])  # (LLVM upgrades <16 x i32> to bfloat)
            return builder.call(fn, [acc_v, a_v, b_v])
        a_even, a_odd = _pair_halves(builder, a_v)
        b_even, b_odd = _pair_halves(builder, b_v)
        return _call(builder, "fma", a_even, b_even, _call(builder, "fma", a_odd, b_odd, acc_v))

    return vec(acc, a, b), codegen


@intrinsic
def vstore_pairs(typingctx, arr, i, lo, hi):
    """Store float32 vectors `lo` then `hi` into ``arr[i : i + 2 * lanes]`` as bfloat16 bits,
    rounded to nearest even (`vcvtne2ps2bf16` where `BF16_ISA`, which flushes subnormals to 0;
    `vstore_bf16`'s rounding elsewhere)."""
    _bits_array(arr, "arr", writable=True)
    _check_index(i)
    vec = _VEC[types.float32]
    if lo != vec or hi != vec:
        raise errors.TypingError("`lo` and `hi` must be %s, got %s, %s" % (vec, lo, hi))

    def codegen(context, builder, sig, args):
        n = vec.lanes
        bits_type = ir.VectorType(ir.IntType(16), 2 * n)
        if BF16_ISA:
            fn = _declare(builder, "llvm.x86.avx512bf16.cvtne2ps2bf16.512", bits_type,
                          [args[2].type, args[3].type])
            bits = builder.call(fn, [args[3], args[2]])  # lanes 0 .. n - 1 from the second
        else:
            bits = builder.shuffle_vector(_narrow_bf16(builder, args[2], n),
                                          _narrow_bf16(builder, args[3], n),
                                          _lane_mask(range(2 * n)))
        ptr = _element_ptr(context, builder, sig, args, bits_type)
        builder.store(bits, ptr, align=2)
        return context.get_dummy_value()

    return types.none(arr, i, lo, hi), codegen


@intrinsic
def vload_rows_bits(typingctx, arr, i, stride):
    """``lanes`` rows of ``2 * lanes`` uint16 each, from ``arr[i + j * stride]``, as float32
    vectors carrying the bits (lane k of row j holds elements 2k, 2k + 1): for `vtranspose`,
    which moves 32-bit lanes without looking at them, and `vstore_bits`."""
    _bits_array(arr, "arr")
    _check_index(i)
    _check_index(stride, "stride")
    vec = _VEC[types.float32]
    block = types.UniTuple(vec, vec.lanes)

    def codegen(context, builder, sig, args):
        memory = _vec_ll(vec).as_pointer()
        start = _element_ptr(context, builder, sig, args)
        step = context.cast(builder, args[2], sig.args[2], types.intp)
        result = ir.Constant(context.get_value_type(block), ir.Undefined)
        for j in range(vec.lanes):
            ptr = builder.gep(start, [builder.mul(step, ir.Constant(step.type, j))],
                              inbounds=True)
            result = builder.insert_value(result, builder.load(builder.bitcast(ptr, memory),
                                                               align=2), j)
        return result

    return block(arr, i, stride), codegen


@intrinsic
def vload_bits(typingctx, arr, i):
    """``arr[i : i + 2 * lanes]`` of a uint16 array as a float32 vector carrying the bits (for
    `vstore_bits`: a copy)."""
    _bits_array(arr, "arr")
    _check_index(i)
    vec = _VEC[types.float32]

    def codegen(context, builder, sig, args):
        return builder.load(_element_ptr(context, builder, sig, args, _vec_ll(vec)), align=2)

    return vec(arr, i), codegen


@intrinsic
def vstore_bits(typingctx, arr, i, vec):
    """Store the bits of a float32 vector (as `vload_rows_bits` made it) into
    ``arr[i : i + 2 * lanes]`` of a uint16 array."""
    _bits_array(arr, "arr", writable=True)
    _check_index(i)
    if vec != _VEC[types.float32]:
        raise errors.TypingError("`vec` must be a %s, got %s" % (_VEC[types.float32], vec))

    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig, args, _vec_ll(vec))
        builder.store(args[2], ptr, align=2)
        return context.get_dummy_value()

    return types.none(arr, i, vec), codegen


@intrinsic
def vstore_interleaved(typingctx, dst, o, src, a, b):
    """``dst[o + 2j] = src[a + j]`` and ``dst[o + 2j + 1] = src[b + j]`` for j < lanes: two
    rows of uint16 into one row of pairs (the values of two keys, for `vdot_pairs`)."""
    _bits_array(dst, "dst", writable=True)
    _bits_array(src, "src")
    for index, name in ((o, "o"), (a, "a"), (b, "b")):
        _check_index(index, name)
    n = LANES_F32

    def codegen(context, builder, sig, args):
        half = ir.VectorType(ir.IntType(16), n)
        src_ty, src_data = sig.args[2], args[2]
        data = context.make_array(src_ty)(context, builder, value=src_data).data
        rows = []
        for k in (3, 4):
            ptr = builder.gep(data, [context.cast(builder, args[k], sig.args[k], types.intp)],
                              inbounds=True)
            rows.append(builder.load(builder.bitcast(ptr, half.as_pointer()), align=2))
        mixed = builder.shuffle_vector(rows[0], rows[1], _lane_mask(
            [k for j in range(n) for k in (j, n + j)]))
        ptr = _element_ptr(context, builder, sig, args, mixed.type)
        builder.store(mixed, ptr, align=2)
        return context.get_dummy_value()

    return types.none(dst, o, src, a, b), codegen
