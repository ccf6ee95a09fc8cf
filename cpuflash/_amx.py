"""AMX tiles for Numba kernels: bfloat16 matrix products on Intel's tile unit.

Why this layer exists: on Intel's cores with AMX (Sapphire Rapids and later) bfloat16 products run
on a tile unit, eight 16 x 64-byte registers and a `tdpbf16ps` that multiplies a 16 x 32 bfloat16
tile by a 32 x 16 one into a 16 x 16 float32 tile: torch's bfloat16 matmul on it ran several
times as fast as its float32 one (measured: docs/history.md, "bfloat16"), while the AVX512-BF16 dot
product there does half the multiply-adds of `fma` (`bench/bf16_ports.py`). LLVM reaches the unit
through intrinsics that name a tile by an immediate number, so this module gives Numba one function
per instruction, the number a literal argument.

The tile numbers are fixed by role, set by `tile_config(tiles, m0, m1)`: C tiles 0, 1 (`m0`
rows) and 2, 3 (`m1` rows) of 16 float32 columns; A tiles 4 (`m0` rows) and 5 (`m1` rows) of 32
bfloat16 columns; B tiles 6 and 7 of 16 rows (pairs of the sum) by 16 columns of bfloat16 pairs.
A tile of 0 rows is left unconfigured and must not be used. Strides are in elements of the array.

Where the tiles run (`TILES`):

* ``"hardware"``: the compile target has AMX-BF16 and the Linux kernel grants the process its
  tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``: asked once, here, at import), unless
  ``CPUFLASH_AMX=0``.
* ``"emulated"``: ``CPUFLASH_AMX=emulate``, any CPU. Each function is a loop over a tile file in
  memory (`tile_file`), with the instruction's arithmetic (each pair's two products added to a
  float32 in turn), so the kernels built on tiles are tested where there is no AMX.
* ``None``: neither; the kernels never call these functions.

`tiles` is the value of `tile_file()`; the hardware functions ignore it. The intrinsics are only
ever generated for a target with AMX: LLVM aborts the process on them elsewhere.
"""

import ctypes
import errno as _errno
import os

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils, codegen, config, errors
from numba.extending import intrinsic, overload, register_jitable

from ._simd import BF16_ISA, _declare, _element_ptr

__all__ = ["TILES", "REASON", "tile_file", "tile_config", "tile_release", "tile_zero",
           "tile_load", "tile_store", "tile_dot"]

ROWS = 16  # rows of a tile, and pairs of a B tile's sum
WIDTH = 16  # float32 columns of a C tile, bfloat16 pairs of an A tile or a B tile row
_C0, _C1, _C2, _C3, _A0, _A1, _B0, _B1 = range(8)

# Linux: ask for the tile data state (`XFEATURE_XTILEDATA`) before the first AMX instruction
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def _target_has_amx(features):
    """Whether Numba compiles for a target with AMX-TILE and AMX-BF16: Numba's JIT passes the
    host's feature string unless ``NUMBA_CPU_FEATURES`` is set, even for a named CPU, and an
    explicit ``-amx-tile`` there overrides LLVM's model of the CPU."""
    flags = (codegen.get_host_cpu_features() if features is None else features).split(",")
    return "+amx-tile" in flags and "+amx-bf16" in flags


def _request_tile_state():
    """(granted, why not): ask Linux for the process's AMX tile state, once."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        result = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except (OSError, AttributeError) as error:  # not Linux, or no syscall()
        return False, "no arch_prctl here (%s)" % error
    if result != 0:
        code = ctypes.get_errno()
        return False, "arch_prctl(ARCH_REQ_XCOMP_PERM) refused: %s" % (
            _errno.errorcode.get(code, code))
    return True, ""


def _choose(isa, forced, request):
    """(TILES, REASON) for a target with AMX or not (`isa`), ``CPUFLASH_AMX`` (`forced`) and
    the function that asks Linux for tile state (`request`, called only where it is needed)."""
    if forced == "emulate":
        return "emulated", "CPUFLASH_AMX=emulate: tile instructions emulated (for tests; slow)"
    if not isa:
        return None, "the compile target has no AMX-BF16"
    if forced == "0":
        return None, "CPUFLASH_AMX=0: AMX-BF16 present, not used"
    granted, why = request()
    if not granted:
        return None, "AMX-BF16 present, but " + why
    return "hardware", "the CPU has AMX-BF16; CPUFLASH_AMX=0 turns it off"


# AVX512-BF16 as `_simd` sees it too: a CPU named without it (``NUMBA_CPU_NAME=skylake-avx512``
# on an AMX CPU) is asked for code that runs there, though Numba passes the host's AMX features
TILES, REASON = _choose(_target_has_amx(config.CPU_FEATURES) and BF16_ISA,
                        os.environ.get("CPUFLASH_AMX"), _request_tile_state)
_EMULATED = TILES != "hardware"

# the tile file the hardware functions are given (and ignore): constants, no allocation
_NO_DATA = np.zeros((0, 0, 0), np.float32)
_NO_ROWS = np.zeros(0, np.int64)


def tile_file():
    """The `tiles` argument of the functions below: eight emulated tiles (each 16 rows of 32
    float32, a bfloat16 widened or a float32 per column) and their rows, or nothing."""


@overload(tile_file)
def _tile_file():
    if _EMULATED:
        return lambda: (np.zeros((8, ROWS, 2 * WIDTH), np.float32), np.zeros(8, np.int64))
    return lambda: (_NO_DATA, _NO_ROWS)


def tile_config(tiles, m0, m1):
    """Configure the tiles (``ldtilecfg``): C tiles 0, 1 and A tile 4 of `m0` rows, C tiles 2,
    3 and A tile 5 of `m1` rows (unconfigured where 0), B tiles 6 and 7 of 16."""


def tile_release(tiles):
    """Release the tile state (``tilerelease``), so that Linux need not save it."""


def tile_zero(tiles, t):
    """Tile `t` (a literal) = 0 (``tilezero``)."""


def tile_load(tiles, t, arr, i, stride):
    """Tile `t` (a literal) = its rows of 64 bytes from ``arr[i + r * stride]`` (``tileloadd``):
    a float32 array for a C tile, uint16 bfloat16 bits for an A or B tile."""


def tile_store(tiles, t, arr, i, stride):
    """C tile `t` (a literal) into float32 ``arr[i + r * stride :]`` (``tilestored``)."""


def tile_dot(tiles, c, a, b):
    """C tile `c` += A tile `a` @ B tile `b` (``tdpbf16ps``, literals): ``c[m, n] +=
    a[m, 2k] b[k, 2n] + a[m, 2k + 1] b[k, 2n + 1]`` over the 16 pairs k, float32."""


def _literal(t, name):
    if not isinstance(t, types.IntegerLiteral) or not 0 <= t.literal_value < 8:
        raise errors.TypingError("`%s` must be a literal tile number 0..7, got %s" % (name, t))
    return t.literal_value


# -- emulated: loops over the tile file

@register_jitable
def _widen_bits(bits):
    return _f32_from_bits(np.uint32(np.uint32(bits) << np.uint32(16)))


@intrinsic
def _f32_from_bits(typingctx, bits):
    """`kernels._convert._bits_to_f32` for uint32 only: this module sits beside `_simd`, below
    the kernels (the cache stamp reads it before any kernel module is imported)."""
    if bits != types.uint32:
        raise errors.TypingError("expected uint32")

    def codegen_(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(bits), codegen_


def _emulated(name):
    def config_(tiles, m0, m1):
        rows = tiles[1]
        rows[:] = ROWS
        rows[_C0] = rows[_C1] = rows[_A0] = m0
        rows[_C2] = rows[_C3] = rows[_A1] = m1

    def release(tiles):
        tiles[1][:] = 0

    def zero(tiles, t):
        _check_rows(tiles, t)
        tiles[0][t] = 0.0

    def load_bits(tiles, t, arr, i, stride):
        _check_rows(tiles, t)
        flat = arr.reshape(arr.size)
        for r in range(tiles[1][t]):
            for j in range(2 * WIDTH):
                tiles[0][t, r, j] = _widen_bits(flat[i + r * stride + j])

    def load_floats(tiles, t, arr, i, stride):
        _check_rows(tiles, t)
        flat = arr.reshape(arr.size)
        for r in range(tiles[1][t]):
            for j in range(WIDTH):
                tiles[0][t, r, j] = flat[i + r * stride + j]

    def store(tiles, t, arr, i, stride):
        _check_rows(tiles, t)
        flat = arr.reshape(arr.size)
        for r in range(tiles[1][t]):
            for j in range(WIDTH):
                flat[i + r * stride + j] = tiles[0][t, r, j]

    def dot(tiles, c, a, b):
        _check_rows(tiles, c)
        data = tiles[0]
        for m in range(tiles[1][c]):
            for n in range(WIDTH):
                total = data[c, m, n]
                for k in range(ROWS):
                    total += data[a, m, 2 * k] * data[b, k, 2 * n]
                    total += data[a, m, 2 * k + 1] * data[b, k, 2 * n + 1]
                data[c, m, n] = total

    return {"config": config_, "release": release, "zero": zero, "load_bits": load_bits,
            "load_floats": load_floats, "store": store, "dot": dot}[name]


def _check_rows(tiles, t):
    """(emulated) An unconfigured tile faults on hardware: here a 0-row tile raises."""


@overload(_check_rows)
def _check_rows_impl(tiles, t):
    def check(tiles, t):
        if tiles[1][t] == 0:
            raise ValueError("AMX tile used while unconfigured")
    return check


# -- hardware: one intrinsic per instruction

_I8, _I16, _I64, _VOID = ir.IntType(8), ir.IntType(16), ir.IntType(64), ir.VoidType()
_BYTES = ir.IntType(8).as_pointer()


def _stride_bytes(context, builder, arrty, stride, sty):
    items = context.cast(builder, stride, sty, types.int64)
    return builder.mul(items, ir.Constant(_I64, arrty.dtype.bitwidth // 8))


def _write_config(context, builder, base, sig, args):
    """The 64 bytes `ldtilecfg` reads, at `base`, for rows `args` = (m0, m1): palette 1 at byte
    0, tile t's bytes per row (u16) at 16 + 2 t and its rows (u8) at 48 + t, the rest 0."""
    cgutils.memset(builder, base, ir.Constant(_I64, 64), 0)

    def put(offset, value, ty):
        at = builder.bitcast(builder.gep(base, [ir.Constant(_I64, offset)]), ty.as_pointer())
        builder.store(value if isinstance(value, ir.Value) else ir.Constant(ty, value), at)

    put(0, 1, _I8)  # palette 1
    rows0 = builder.trunc(context.cast(builder, args[0], sig.args[0], types.int64), _I8)
    rows1 = builder.trunc(context.cast(builder, args[1], sig.args[1], types.int64), _I8)
    colsb1 = builder.select(builder.icmp_unsigned("!=", rows1, ir.Constant(_I8, 0)),
                            ir.Constant(_I16, 64), ir.Constant(_I16, 0))
    for t, rows in ((_C0, rows0), (_C1, rows0), (_A0, rows0)):
        put(16 + 2 * t, 64, _I16)
        put(48 + t, rows, _I8)
    for t, rows in ((_C2, rows1), (_C3, rows1), (_A1, rows1)):
        put(16 + 2 * t, colsb1, _I16)
        put(48 + t, rows, _I8)
    for t in (_B0, _B1):
        put(16 + 2 * t, 64, _I16)
        put(48 + t, ROWS, _I8)


def _check_rows_args(m0, m1):
    if not (isinstance(m0, types.Integer) and isinstance(m1, types.Integer)):
        raise errors.TypingError("`m0` and `m1` must be integers, got %s, %s" % (m0, m1))


@intrinsic
def _hw_config(typingctx, m0, m1):
    def codegen_(context, builder, sig, args):
        base = builder.bitcast(cgutils.alloca_once(builder, ir.ArrayType(_I8, 64)), _BYTES)
        _write_config(context, builder, base, sig, args)
        builder.call(_declare(builder, "llvm.x86.ldtilecfg", _VOID, [_BYTES]), [base])
        return context.get_dummy_value()

    _check_rows_args(m0, m1)
    return types.none(m0, m1), codegen_


@intrinsic
def config_bytes(typingctx, out, m0, m1):
    """Write into the uint8 array `out` (64 bytes) the configuration `tile_config(tiles, m0,
    m1)` loads on the hardware: the same code, for tests on any CPU."""
    _tile_array(out, "out", (types.uint8,))

    def codegen_(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        _write_config(context, builder, builder.bitcast(data, _BYTES), sig.replace(
            args=sig.args[1:]), args[1:])
        return context.get_dummy_value()

    _check_rows_args(m0, m1)
    return types.none(out, m0, m1), codegen_


@intrinsic
def _hw_release(typingctx):
    def codegen_(context, builder, sig, args):
        builder.call(_declare(builder, "llvm.x86.tilerelease", _VOID, []), [])
        return context.get_dummy_value()

    return types.none(), codegen_


def _hw_numbered(kind, numbers):
    """An intrinsic for one instruction on the tiles `numbers` (their values baked in)."""
    tiles = [ir.Constant(_I8, t) for t in numbers]

    if kind == "zero":
        def typer(typingctx):
            def codegen_(context, builder, sig, args):
                builder.call(_declare(builder, "llvm.x86.tilezero", _VOID, [_I8]), tiles)
                return context.get_dummy_value()
            return types.none(), codegen_
    elif kind == "dot":
        def typer(typingctx):
            def codegen_(context, builder, sig, args):
                builder.call(_declare(builder, "llvm.x86.tdpbf16ps", _VOID, [_I8] * 3), tiles)
                return context.get_dummy_value()
            return types.none(), codegen_
    else:
        name = "llvm.x86.tileloadd64" if kind == "load" else "llvm.x86.tilestored64"

        def typer(typingctx, arr, i, stride):
            def codegen_(context, builder, sig, args):
                ptr = builder.bitcast(_element_ptr(context, builder, sig, args), _BYTES)
                step = _stride_bytes(context, builder, sig.args[0], args[2], sig.args[2])
                builder.call(_declare(builder, name, _VOID, [_I8, _BYTES, _I64]),
                             [tiles[0], ptr, step])
                return context.get_dummy_value()
            return types.none(arr, i, stride), codegen_
    return intrinsic(typer)


_HW = {}


def _hw(kind, *numbers):
    key = (kind,) + numbers
    if key not in _HW:
        _HW[key] = _hw_numbered(kind, numbers)
    return _HW[key]


def _tile_array(arr, name, dtypes):
    if not (isinstance(arr, types.Array) and arr.dtype in dtypes and arr.layout == "C"):
        raise errors.TypingError("`%s` must be a C-contiguous %s array, got %s"
                                 % (name, " or ".join(map(str, dtypes)), arr))


# -- the public functions: the hardware's or the emulation's, chosen as they are typed

@overload(tile_config)
def _tile_config(tiles, m0, m1):
    if _EMULATED:
        return _emulated("config")
    return lambda tiles, m0, m1: _hw_config(m0, m1)


@overload(tile_release)
def _tile_release(tiles):
    if _EMULATED:
        return _emulated("release")
    return lambda tiles: _hw_release()


@overload(tile_zero, prefer_literal=True)
def _tile_zero(tiles, t):
    number = _literal(t, "t")
    if _EMULATED:
        return _emulated("zero")
    fn = _hw("zero", number)
    return lambda tiles, t: fn()


@overload(tile_load, prefer_literal=True)
def _tile_load(tiles, t, arr, i, stride):
    number = _literal(t, "t")
    _tile_array(arr, "arr", (types.float32, types.uint16) if number < _A0 else (types.uint16,))
    if _EMULATED:
        return _emulated("load_bits" if arr.dtype == types.uint16 else "load_floats")
    fn = _hw("load", number)
    return lambda tiles, t, arr, i, stride: fn(arr, i, stride)


@overload(tile_store, prefer_literal=True)
def _tile_store(tiles, t, arr, i, stride):
    number = _literal(t, "t")
    _tile_array(arr, "arr", (types.float32,))
    if number >= _A0:
        raise errors.TypingError("only C tiles (0..3) are stored, got tile %d" % number)
    if _EMULATED:
        return _emulated("store")
    fn = _hw("store", number)
    return lambda tiles, t, arr, i, stride: fn(arr, i, stride)


@overload(tile_dot, prefer_literal=True)
def _tile_dot(tiles, c, a, b):
    numbers = (_literal(c, "c"), _literal(a, "a"), _literal(b, "b"))
    if not (numbers[0] < _A0 and _A0 <= numbers[1] < _B0 and numbers[2] >= _B0):
        raise errors.TypingError("tile_dot takes a C, an A and a B tile, got %s" % (numbers,))
    if _EMULATED:
        return _emulated("dot")
    fn = _hw("dot", *numbers)
    return lambda tiles, c, a, b: fn()

