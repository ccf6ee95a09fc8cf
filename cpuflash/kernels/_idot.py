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
cache bytes as the bytes of its even numbers, then of its odd ones. An int4 group of 32 numbers
is four lanes: four keys' lanes are summed group by group in integers, exactly, into one
vector, which the groups' scales multiply as floats (`_dot_keys_int4`), so the float work of
a (row, key) pair is a quarter of a vector a chunk, not four vectors and their sum; an int8
row's one scale multiplies the sum, as in the exact route.
"""

import numpy as np

from .. import _jit
from .._simd import vfma, vhsum, vzeros
from .._simd_bytes import (bdot, bflip, bfloat, bgroup_sums, bload, bload_all, bload_i32,
                           bnibbles_high, bnibbles_low, vload_groups4, vstore_key_sums)
from . import _layout
from ._convert import contiguous_rows
from ._layout import row_starts

jit_borrowing = _jit.jit_borrowing_any_constants

INT4_GROUP = 32  # the int4 group size the route reads (four lanes of a chunk's)
LANES_A_GROUP = INT4_GROUP // 8  # a lane holds eight numbers (four bytes)


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
        count = min(4, rows - r)
        if count == 4:  # (a constant: the rows' steps without a test a chunk)
            _dot_keys_int4(qi, corr, r, 4, keys, runs, scores, k_scale, scale_runs)
        else:
            _dot_keys_int4(qi, corr, r, count, keys, runs, scores, k_scale, scale_runs)
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


@_jit.jit_borrowing
def _dot_keys_int4(qi, corr, r, count, keys, runs, scores, k_scale, scale_runs):
    """Rows r .. r + count - 1 (count <= 4) against the key rows four at a time (the last of
    a run repeated where fewer are left), a chunk at a time: each (row, key) pair's lanes in
    integers, their groups' sums exact (`bgroup_sums`), times the groups' scales as floats,
    added over the chunks lane by lane and over a chunk's groups by `vstore_key_sums`. A
    key's bits do not depend on the keys beside it."""
    n = _layout.lanes(scores)
    chunk, row_bytes, sw = 4 * n, keys.shape[3], scores.shape[1]
    whole = row_bytes // chunk * chunk  # the bytes of whole chunks
    run_cols, starts, n_runs, step = runs
    scale_starts, scale_step = scale_runs
    rows = row_starts(r, count, qi.shape[1]), row_starts(r, count, corr.shape[1])
    for i in range(n_runs):
        c, end, k, g = run_cols[i], run_cols[i + 1], starts[i], scale_starts[i]
        while c < end:
            more = min(4, end - c) - 1  # the keys after the first, repeating the last
            at = (k, k + min(1, more) * step, k + min(2, more) * step, k + more * step)
            groups = (g, g + min(1, more) * scale_step, g + min(2, more) * scale_step,
                      g + more * scale_step)
            zero = vzeros(scores)
            t = (zero, zero, zero, zero)
            for x in range(0, whole, chunk):
                ys = (bload_all(keys, at[0] + x), bload_all(keys, at[1] + x),
                      bload_all(keys, at[2] + x), bload_all(keys, at[3] + x))
                t = _chunk_int4(qi, corr, rows, count, ys, k_scale, groups, x, n, t)
            if whole < row_bytes:
                valid = (row_bytes - whole) // 4
                ys = (bload(keys, at[0] + whole, valid), bload(keys, at[1] + whole, valid),
                      bload(keys, at[2] + whole, valid), bload(keys, at[3] + whole, valid))
                t = _chunk_int4(qi, corr, rows, count, ys, k_scale, groups, whole, valid, t)
            vstore_key_sums(scores, r * sw + c, sw, t, count, more + 1)
            c += more + 1
            k += (more + 1) * step
            g += (more + 1) * scale_step


@jit_borrowing
def _chunk_int4(qi, corr, rows, count, ys, k_scale, groups, x, valid, t):
    """The chunk at byte x of four key rows `ys` (`valid` lanes; their scales from `groups`
    in `k_scale`) against `count` query rows (`rows`: their flat starts in `qi` and `corr`),
    added to t (a vector a row, lane 4g + k: key k's group g)."""
    n = _layout.lanes(k_scale)
    e, h = x // (4 * n) * n, 2 * x // INT4_GROUP  # the chunk's corr lanes, its first group
    nibbles = ((bnibbles_low(ys[0]), bnibbles_low(ys[1]), bnibbles_low(ys[2]),
                bnibbles_low(ys[3])),
               (bnibbles_high(ys[0]), bnibbles_high(ys[1]), bnibbles_high(ys[2]),
                bnibbles_high(ys[3])))
    scales = vload_groups4(k_scale, groups[0] + h, groups[1] + h, groups[2] + h,
                           groups[3] + h, valid // LANES_A_GROUP)
    (q0, q1, q2, q3), (o0, o1, o2, o3) = rows
    t0 = _row_chunk(qi, q0 + 2 * x, 4 * n, bload_i32(corr, o0 + e), nibbles, scales, t[0])
    t1, t2, t3 = t[1], t[2], t[3]
    if count > 1:
        t1 = _row_chunk(qi, q1 + 2 * x, 4 * n, bload_i32(corr, o1 + e), nibbles, scales, t1)
    if count > 2:
        t2 = _row_chunk(qi, q2 + 2 * x, 4 * n, bload_i32(corr, o2 + e), nibbles, scales, t2)
    if count > 3:
        t3 = _row_chunk(qi, q3 + 2 * x, 4 * n, bload_i32(corr, o3 + e), nibbles, scales, t3)
    return t0, t1, t2, t3


@jit_borrowing
def _row_chunk(qi, at, chunk, corr_lanes, nibbles, scales, total):
    """A query row's chunk (its even numbers' bytes at `at` of `qi`, its odd ones' a `chunk`
    on) against four keys' (low, high) nibbles: the groups' exact sums as floats, times their
    scales, added to `total`."""
    qe, qo = bload_all(qi, at), bload_all(qi, at + chunk)
    lows, highs = nibbles
    return vfma(bfloat(bgroup_sums(bdot(bdot(corr_lanes, lows[0], qe), highs[0], qo),
                                   bdot(bdot(corr_lanes, lows[1], qe), highs[1], qo),
                                   bdot(bdot(corr_lanes, lows[2], qe), highs[2], qo),
                                   bdot(bdot(corr_lanes, lows[3], qe), highs[3], qo))),
                scales, total)
