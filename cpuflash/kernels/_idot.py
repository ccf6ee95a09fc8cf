"""The opt-in integer Q K^T of the decoding kernel on int8 and int4 caches
(`attention_with_kvcache(..., integer_dot=True)`).

The exact route widens every cached number to float32 and multiplies it by a float query: on
a 2-core machine that arithmetic, not the memory, sets the speed of an 8-bit or 4-bit cache
(docs/quantized_kv.md, "What binds"). Here each query row is quantized once per work item, as
llama.cpp does for its quantized caches: ``scale = amax / 127`` of the row (float32), numbers
``rint(q * (1 / scale))`` in int8. Then a key row's bytes multiply the query's bytes four at a time
into int32 lanes (`_simd_bytes.bdot`: one `vpdpbusd` with AVX512-VNNI), exactly; only the
lanes' sums are floats. So the result is the float computation with q replaced by
``rint(q * (1 / scale)) * scale`` (plus the order of the sums), and that replacement is the route's
whole error: it is opt-in.

`bdot` multiplies an unsigned byte by a signed one. The cache's bytes are made unsigned by an
offset (an int8 number b as b + 128, an int4 nibble n as n + 8), and each query row's lanes
start from minus the offset times the sum of its bytes in that lane (`corr`), which takes the
offset's products back out. An int4 row's nibbles are split in registers into two byte
vectors (its even and its odd numbers), so a query row is stored per chunk of ``4 * lanes``
cache bytes as the bytes of its even numbers, then of its odd ones. The int4 groups' scales
multiply the lanes (a group of 32 numbers is four lanes) before their sum; an int8 row's one
scale multiplies the sum, as in the exact route.
"""

import numpy as np

from .. import _jit
from .._simd import vfma, vhsum, vzeros
from .._simd_bytes import (bdot, bflip, bfloat, bload, bload_i32, bnibbles_high, bnibbles_low,
                           vload_repeat4)
from . import _layout
from ._convert import contiguous_rows
from ._layout import row_starts

jit_borrowing = _jit.jit_borrowing_any_constants

INT4_GROUP = 32  # the int4 group size the route reads (four lanes of a chunk's)


@jit_borrowing
def applies_int8(k_cache):
    """Whether the route reads this int8 key cache (else the kernel keeps the exact one): rows
    contiguous, of whole lanes (four bytes)."""
    return contiguous_rows(k_cache) and k_cache.shape[3] % 4 == 0


@jit_borrowing
def applies_int4(k_cache, k_scale):
    """`applies_int8`, and groups of `INT4_GROUP` numbers, their scales contiguous."""
    return (applies_int8(k_cache) and 2 * k_cache.shape[3] // k_scale.shape[3] == INT4_GROUP
            and k_scale.strides[3] == k_scale.itemsize)


@jit_borrowing
def buffer_shapes(rows, row_bytes, int4, like):
    """The shapes of the query bytes and the lane offsets of `rows` rows for key rows of
    `row_bytes` bytes: (rows, chunks x chunk bytes, x2 for int4) and (rows, chunks x lanes)."""
    n = _layout.lanes(like)
    chunks = -(-row_bytes // (4 * n))
    return (rows, chunks * 4 * n * (2 if int4 else 1)), (rows, chunks * n)


@jit_borrowing
def quantize_rows(q_rows, rows, d, int4, qi, q_scale, corr):
    """Rows 0 .. rows - 1 of `q_rows` (their first `d` columns) as int8 numbers in `qi`, in the
    byte order the key rows take (see the module's note), their float32 scales in `q_scale`
    and in `corr` each lane's offset correction (int8 keys: one set of lanes for all chunks,
    which share one accumulator; int4: a set a chunk). A row with a number that is not finite
    gets a NaN scale, so its scores are NaN, as the exact route's would be."""
    n = _layout.lanes(q_rows)
    chunk = 4 * n
    offset = 8 if int4 else 128
    for r in range(rows):
        for x in range(qi.shape[1]):
            qi[r, x] = 0
        for x in range(corr.shape[1]):
            corr[r, x] = 0
        amax = np.float32(0.0)
        finite = True
        for x in range(d):
            value = q_rows[r, x]
            if not np.isfinite(value):
                finite = False
            amax = max(amax, abs(value))
        scale = amax / np.float32(127.0)
        if not finite:
            q_scale[r] = np.nan
            continue
        q_scale[r] = scale
        if scale == 0:
            continue
        # (q / scale as llama.cpp computes it, a product with the reciprocal: the documented
        # numbers, whatever LLVM's `arcp` flag would make of a division)
        inverse = np.float32(1.0) / scale
        for x in range(d):
            number = np.int32(np.rint(q_rows[r, x] * inverse))
            if int4:  # key byte x // 2 of its chunk, its low (even x) or high nibble
                byte = x // 2
                c, m = byte // chunk, byte % chunk
                qi[r, 2 * c * chunk + (x & 1) * chunk + m] = number
                corr[r, c * n + m // 4] -= offset * number
            else:
                qi[r, x] = number
                corr[r, x % chunk // 4] -= offset * number


@jit_borrowing
def dot_rows_int8(qi, q_scale, corr, keys, runs, scores, rows):
    """scores[r, c] = the integer dot product of query row r (`quantize_rows`) and the int8 key
    row of block column c (`runs` as `decode._dot_rows` takes them), times the row's scale.
    Rows four at a time and keys four at a time, as `decode._dot4x4`."""
    for r in range(0, rows, 4):
        _dot4x4_int8(qi, corr, r, min(4, rows - r), keys, runs, scores)
    _scale_rows(scores, rows, runs[0][runs[2]], q_scale)


@jit_borrowing
def dot_rows_int4(qi, q_scale, corr, keys, k_scale, runs, scale_runs, scores, rows):
    """`dot_rows_int8` for int4 key rows, each lane times its group's scale before the lanes'
    sum: `scale_runs` = (starts, row step) of the key rows' scales in `k_scale`."""
    for r in range(0, rows, 4):
        _dot4x4_int4(qi, corr, r, min(4, rows - r), keys, runs, scores, k_scale, scale_runs)
    _scale_rows(scores, rows, runs[0][runs[2]], q_scale)


@jit_borrowing
def _scale_rows(scores, rows, cols, q_scale):
    for r in range(rows):
        factor = q_scale[r]
        for c in range(cols):
            scores[r, c] *= factor


@jit_borrowing
def _bdot4(b, ys, s0, s1, s2, s3):
    return bdot(s0, ys[0], b), bdot(s1, ys[1], b), bdot(s2, ys[2], b), bdot(s3, ys[3], b)


@jit_borrowing
def _dot4x4_int8(qi, corr, r, count, keys, runs, scores):
    n = _layout.lanes(scores)
    chunk, row_bytes, sw = 4 * n, keys.shape[3], scores.shape[1]
    run_cols, starts, n_runs, step = runs
    q0, q1, q2, q3 = row_starts(r, count, qi.shape[1])
    o0, o1, o2, o3 = row_starts(r, count, corr.shape[1])
    c0, c1, c2, c3 = (bload_i32(corr, o0), bload_i32(corr, o1), bload_i32(corr, o2),
                      bload_i32(corr, o3))
    for i in range(n_runs):
        c, end, k = run_cols[i], run_cols[i + 1], starts[i]
        while c + 4 <= end:
            k0, k1, k2, k3 = k, k + step, k + 2 * step, k + 3 * step
            s00 = s01 = s02 = s03 = c0
            s10 = s11 = s12 = s13 = c1
            s20 = s21 = s22 = s23 = c2
            s30 = s31 = s32 = s33 = c3
            for x in range(0, row_bytes, chunk):
                valid = min(n, (row_bytes - x) // 4)
                ys = (bflip(bload(keys, k0 + x, valid)), bflip(bload(keys, k1 + x, valid)),
                      bflip(bload(keys, k2 + x, valid)), bflip(bload(keys, k3 + x, valid)))
                s00, s01, s02, s03 = _bdot4(bload(qi, q0 + x, n), ys, s00, s01, s02, s03)
                if count > 1:
                    s10, s11, s12, s13 = _bdot4(bload(qi, q1 + x, n), ys, s10, s11, s12, s13)
                if count > 2:
                    s20, s21, s22, s23 = _bdot4(bload(qi, q2 + x, n), ys, s20, s21, s22, s23)
                if count > 3:
                    s30, s31, s32, s33 = _bdot4(bload(qi, q3 + x, n), ys, s30, s31, s32, s33)
            _layout.store_row_sums(scores, r * sw + c, sw, count, (
                bfloat(s00), bfloat(s01), bfloat(s02), bfloat(s03),
                bfloat(s10), bfloat(s11), bfloat(s12), bfloat(s13),
                bfloat(s20), bfloat(s21), bfloat(s22), bfloat(s23),
                bfloat(s30), bfloat(s31), bfloat(s32), bfloat(s33)))
            c += 4
            k += 4 * step
        for c in range(c, end):  # the run's last keys, one at a time
            for j in range(count):
                total = bload_i32(corr, (r + j) * corr.shape[1])
                for x in range(0, row_bytes, chunk):
                    valid = min(n, (row_bytes - x) // 4)
                    total = bdot(total, bflip(bload(keys, k + x, valid)),
                                 bload(qi, (r + j) * qi.shape[1] + x, n))
                scores[r + j, c] = vhsum(bfloat(total))
            k += step


@jit_borrowing
def _int4_pair(corr_lanes, y, qe, qo):
    """The lanes of one (row, key) pair over a chunk: the even numbers, then the odd ones."""
    return bdot(bdot(corr_lanes, bnibbles_low(y), qe), bnibbles_high(y), qo)


@jit_borrowing
def _int4_row(qi, at, n, corr_lanes, ys, fs, t0, t1, t2, t3):
    """A query row's chunk (its even numbers' bytes at `at` of `qi`, its odd ones' a chunk on)
    against four keys' chunks `ys`: each pair's lanes as floats, times the keys' lane scales
    `fs`, added to t0 .. t3."""
    qe, qo = bload(qi, at, n), bload(qi, at + 4 * n, n)
    return (vfma(bfloat(_int4_pair(corr_lanes, ys[0], qe, qo)), fs[0], t0),
            vfma(bfloat(_int4_pair(corr_lanes, ys[1], qe, qo)), fs[1], t1),
            vfma(bfloat(_int4_pair(corr_lanes, ys[2], qe, qo)), fs[2], t2),
            vfma(bfloat(_int4_pair(corr_lanes, ys[3], qe, qo)), fs[3], t3))


@jit_borrowing
def _dot4x4_int4(qi, corr, r, count, keys, runs, scores, k_scale, scale_runs):
    n = _layout.lanes(scores)
    chunk, row_bytes, sw = 4 * n, keys.shape[3], scores.shape[1]
    run_cols, starts, n_runs, step = runs
    scale_starts, scale_step = scale_runs
    q0, q1, q2, q3 = row_starts(r, count, qi.shape[1])
    o0, o1, o2, o3 = row_starts(r, count, corr.shape[1])
    lanes_a_group = INT4_GROUP // 8  # a lane holds eight numbers (four bytes)
    for i in range(n_runs):
        c, end, k, g = run_cols[i], run_cols[i + 1], starts[i], scale_starts[i]
        while c + 4 <= end:
            k0, k1, k2, k3 = k, k + step, k + 2 * step, k + 3 * step
            t00 = t01 = t02 = t03 = t10 = t11 = t12 = t13 = vzeros(scores)
            t20 = t21 = t22 = t23 = t30 = t31 = t32 = t33 = t00
            for x in range(0, row_bytes, chunk):
                valid = min(n, (row_bytes - x) // 4)
                e, h = x // chunk * n, 2 * x // INT4_GROUP  # the chunk's corr lanes, a group
                y0, y1 = bload(keys, k0 + x, valid), bload(keys, k1 + x, valid)
                y2, y3 = bload(keys, k2 + x, valid), bload(keys, k3 + x, valid)
                groups = valid // lanes_a_group
                f0 = vload_repeat4(k_scale, g + h, groups)
                f1 = vload_repeat4(k_scale, g + scale_step + h, groups)
                f2 = vload_repeat4(k_scale, g + 2 * scale_step + h, groups)
                f3 = vload_repeat4(k_scale, g + 3 * scale_step + h, groups)
                ys, fs = (y0, y1, y2, y3), (f0, f1, f2, f3)
                t00, t01, t02, t03 = _int4_row(qi, q0 + 2 * x, n, bload_i32(corr, o0 + e), ys,
                                               fs, t00, t01, t02, t03)
                if count > 1:
                    t10, t11, t12, t13 = _int4_row(qi, q1 + 2 * x, n, bload_i32(corr, o1 + e),
                                                   ys, fs, t10, t11, t12, t13)
                if count > 2:
                    t20, t21, t22, t23 = _int4_row(qi, q2 + 2 * x, n, bload_i32(corr, o2 + e),
                                                   ys, fs, t20, t21, t22, t23)
                if count > 3:
                    t30, t31, t32, t33 = _int4_row(qi, q3 + 2 * x, n, bload_i32(corr, o3 + e),
                                                   ys, fs, t30, t31, t32, t33)
            _layout.store_row_sums(scores, r * sw + c, sw, count,
                                   (t00, t01, t02, t03, t10, t11, t12, t13,
                                    t20, t21, t22, t23, t30, t31, t32, t33))
            c += 4
            k += 4 * step
            g += 4 * scale_step
        for c in range(c, end):  # the run's last keys, one at a time
            for j in range(count):
                total = vzeros(scores)
                for x in range(0, row_bytes, chunk):
                    valid = min(n, (row_bytes - x) // 4)
                    e, h = x // chunk * n, 2 * x // INT4_GROUP
                    at = (r + j) * qi.shape[1] + 2 * x
                    lanes_ = _int4_pair(bload_i32(corr, (r + j) * corr.shape[1] + e),
                                        bload(keys, k + x, valid), bload(qi, at, n),
                                        bload(qi, at + chunk, n))
                    total = vfma(bfloat(lanes_), vload_repeat4(k_scale, g + h,
                                                               valid // lanes_a_group), total)
                scores[r + j, c] = vhsum(total)
            k += step
            g += scale_step
