"""The int4 cache read in place: the decoding kernel's Q K^T and P V on nibbles in registers.

An int4 row (`cpuflash.quantize_kv`) holds element 2m in the low nibble of byte m and 2m + 1 in
its high one, with a float32 scale per group of `size` numbers. Splitting a byte's nibbles is
cheap (`_simd.vload_i4_scaled`: with 16 lanes, a table lookup of each nibble's product with its
group's scale); interleaving them back into the row's order would add a shuffle to every vector
of every key and value row, once per four query rows. So the kernel never interleaves: a *unit* of
``2 * lanes`` numbers (``lanes`` bytes) is read as its even numbers, then its odd ones, and the
query rows and the output accumulator hold their columns in that order too (`permute_rows`,
`unpermute`). A dot product does not care in which order it adds, and P V writes each column
into the accumulator column of the same place, so nothing else changes: this is the float
computation on the dequantized cache (each number times its group's scale, the bits of
`cpuflash.dequantize_kv`), its sums in another order. A unit must lie in one group (``size`` a
multiple of ``2 * lanes``) and rows must be whole units; `fused` says whether a call's caches
are so. Reading a row in place this way took an int4 call from 2.4x int8's time to int8's
(docs/history.md, "Four-bit caches read in place").
"""

from .. import _jit
from .._simd import (prefetch, vadd, vbroadcast, vfma, vhsum, vload, vload_i4_scaled, vsub,
                     vzeros)
from . import _layout
from ._convert import contiguous_rows
from ._layout import CACHE_LINE, WIDE, fma4, row_starts

jit_borrowing = _jit.jit_borrowing_any_constants


@jit_borrowing
def fused(k_cache, v_cache, k_scale, v_scale, n):
    """Whether int4 caches (uint8 pairs, their scales an axis of groups) are read in place with
    vectors of `n` lanes: rows contiguous and whole units of ``2 * n`` numbers, each unit inside
    one group."""
    unit = 2 * n
    d, dv = 2 * k_cache.shape[3], 2 * v_cache.shape[3]
    return (contiguous_rows(k_cache) and contiguous_rows(v_cache) and d % unit == 0
            and dv % unit == 0 and d // k_scale.shape[3] % unit == 0
            and dv // v_scale.shape[3] % unit == 0)


@jit_borrowing
def permute_rows(rows_, count, d, scratch):
    """Rows 0 .. count - 1 of `rows_`, their first `d` columns, into unit order: in each unit of
    ``2 * lanes`` numbers, the even numbers, then the odd ones (`scratch`: d numbers)."""
    n = _layout.lanes(rows_)
    for r in range(count):
        for x in range(d):
            scratch[x] = rows_[r, x]
        for x in range(d):
            rows_[r, _unit_position(x, n)] = scratch[x]


@jit_borrowing
def unpermute(acc, rows, width, scratch):
    """Rows 0 .. rows - 1 of `acc`, their first `width` columns, from unit order back to the
    row's order (`scratch`: at least ``2 * lanes`` numbers)."""
    n = _layout.lanes(acc)
    for r in range(rows):
        for start in range(0, width, 2 * n):
            for x in range(2 * n):
                scratch[x] = acc[r, start + x]
            for x in range(2 * n):
                acc[r, start + x] = scratch[_unit_position(x, n)]


@jit_borrowing
def _unit_position(x, n):
    """Where number x of a row lies in unit order (units of ``2 * n``: their even numbers,
    then their odd ones)."""
    at = x % (2 * n)
    return x - at + at % 2 * n + at // 2


@jit_borrowing
def _unit(data, o, scale, s):
    """The unit at byte o of `data` as its even and its odd numbers, times the scale at flat s of
    `scale` (two float32 vectors)."""
    return vload_i4_scaled(data, o, vbroadcast(scale, s))


@jit_borrowing
def _fma_unit(qs, ys, acc):
    """acc + qs[0] * ys[0] + qs[1] * ys[1]: one unit of a dot product."""
    return vfma(qs[1], ys[1], vfma(qs[0], ys[0], acc))


@jit_borrowing
def _row_units(q_rows, o, ys, a0, a1, a2, a3):
    """A query row's unit at flat o of `q_rows` times four keys' units `ys`, added to their
    accumulators a0 .. a3."""
    qs = (vload(q_rows, o), vload(q_rows, o + _layout.lanes(q_rows)))
    return (_fma_unit(qs, ys[0], a0), _fma_unit(qs, ys[1], a1), _fma_unit(qs, ys[2], a2),
            _fma_unit(qs, ys[3], a3))


@jit_borrowing
def dot_rows(q_rows, data, scale, runs, scale_runs, scores, rows, later):
    """scores[r, c] = q_rows[r] . (key row of block column c), for rows 0 .. rows - 1, the key
    rows int4 in place: `runs` = (run_cols, starts, n_runs, step) as `decode._block_runs`
    gives them for `data` (byte offsets), `scale_runs` = (starts, step, group step, group size)
    for `scale`. `q_rows` hold their columns in unit order (`permute_rows`). Four rows x four
    keys at a time, as `decode._dot4x4`: 16 FMA chains, each key unit loaded and scaled once for
    the rows; each score one chain along D in unit order, so its bits do not depend on the
    grouping.

    `later` = (values, starts, step, scales, scale starts, scale step): the block's value rows
    and their scales, as `runs` and `scale_runs` give the keys', which the first four rows'
    pass prefetches as it goes, a cache line at a time (the kernel reads two arrays in turns,
    and the hardware prefetcher would start each turn cold)."""
    for r in range(0, rows, 4):
        count = min(4, rows - r)
        if count == 4 and WIDE:  # (a constant: the rows' steps without a test a key)
            _dot_keys(q_rows, r, 4, data, scale, runs, scale_runs, scores, later)
        else:
            _dot_keys(q_rows, r, count, data, scale, runs, scale_runs, scores, later)


@_jit.jit_borrowing
def _dot_keys(q_rows, r, count, data, scale, runs, scale_runs, scores, later):
    """`dot_rows` for rows r .. r + count - 1 (count <= 4)."""
    n, dp, sw = _layout.lanes(q_rows), q_rows.shape[1], scores.shape[1]
    run_cols, starts, n_runs, step = runs
    s_starts, s_step, g_step, size = scale_runs
    values, v_starts, v_step, v_scale, vs_starts, vs_step = later
    v_bytes = values.shape[3]
    q0, q1, q2, q3 = row_starts(r, count, dp)
    for i in range(n_runs):
        c, end, k, s = run_cols[i], run_cols[i + 1], starts[i], s_starts[i]
        lv, ls = v_starts[i], vs_starts[i]
        while c + 4 <= end:
            if r == 0:
                for j in range(4):
                    for e in range(0, v_bytes, CACHE_LINE):
                        prefetch(values, lv + j * v_step + e)
                prefetch(v_scale, ls)
                prefetch(v_scale, ls + 3 * vs_step)
                lv += 4 * v_step
                ls += 4 * vs_step
            s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = vzeros(q_rows)
            s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = s00
            g, left = s, size  # the units' group, and its numbers from this unit on
            for x in range(0, dp, 2 * n):
                y0 = _unit(data, k + x // 2, scale, g)
                y1 = _unit(data, k + step + x // 2, scale, g + s_step)
                y2 = _unit(data, k + 2 * step + x // 2, scale, g + 2 * s_step)
                y3 = _unit(data, k + 3 * step + x // 2, scale, g + 3 * s_step)
                ys = (y0, y1, y2, y3)
                s00, s01, s02, s03 = _row_units(q_rows, q0 + x, ys, s00, s01, s02, s03)
                if count > 1:
                    s10, s11, s12, s13 = _row_units(q_rows, q1 + x, ys, s10, s11, s12, s13)
                if count > 2:
                    s20, s21, s22, s23 = _row_units(q_rows, q2 + x, ys, s20, s21, s22, s23)
                if count > 3:
                    s30, s31, s32, s33 = _row_units(q_rows, q3 + x, ys, s30, s31, s32, s33)
                left -= 2 * n
                if left == 0:
                    g, left = g + g_step, size
            _layout.store_row_sums(scores, r * sw + c, sw, count,
                                   (s00, s01, s02, s03, s10, s11, s12, s13,
                                    s20, s21, s22, s23, s30, s31, s32, s33))
            c += 4
            k += 4 * step
            s += 4 * s_step
        for c in range(c, end):  # the run's last keys, one at a time
            for j in range(count):
                total = vzeros(q_rows)
                o = (r + j) * dp
                for x in range(0, dp, 2 * n):
                    qs = (vload(q_rows, o + x), vload(q_rows, o + x + n))
                    total = _fma_unit(qs, _unit(data, k + x // 2, scale, s + x // size
                                                * g_step), total)
                scores[r + j, c] = vhsum(total)
            k += step
            s += s_step


@jit_borrowing
def finite_scales(scale, scale_runs, runs, groups, like):
    """Whether the first `groups` scales of the block's rows are finite (x - x is 0 for those,
    NaN for inf and NaN): an int4 row's numbers are finite exactly where its scales are."""
    s_starts, s_step, g_step, _ = scale_runs
    run_cols, n_runs = runs[0], runs[2]
    total = vzeros(like)
    for i in range(n_runs):
        s = s_starts[i]
        for _ in range(run_cols[i], run_cols[i + 1]):
            for g in range(groups):
                x = vbroadcast(scale, s + g * g_step)
                total = vadd(total, vsub(x, x))
            s += s_step
    return vhsum(total) == 0


@jit_borrowing
def pv_rows(scores, data, scale, runs, scale_runs, width, acc, alpha, rows, later):
    """acc = alpha * acc + P V over the int4 value rows given as `runs` and `scale_runs` (see
    `dot_rows`), their first `width` numbers (whole units), `acc` in unit order. Four rows x two
    units at a time (16 accumulators), then four rows x one: each row's block sum starts from
    zero, adds the value rows in order and joins `acc` once (`_layout.rescale_add`), as
    `decode._pv_rows` does.

    `later` = (keys, (run_cols, starts, n_runs, step)): the next block's key rows, as runs,
    which the first pass prefetches, a row for each value row it reads (`dot_rows`' reason)."""
    n = _layout.lanes(acc)
    keys, key_runs = later
    none = (key_runs[0], key_runs[1], 0, key_runs[3])
    for r in range(0, rows, 4):
        count = min(4, rows - r)
        x = 0
        while x + 4 * n <= width:
            ahead = key_runs if r + x == 0 else none
            if count == 4 and WIDE:  # (a constant: the rows' steps without a test a key)
                _pv_units(scores, r, 4, data, scale, runs, scale_runs, x, 2, acc, alpha, keys,
                          ahead)
            else:
                _pv_units(scores, r, count, data, scale, runs, scale_runs, x, 2, acc, alpha,
                          keys, ahead)
            x += 4 * n
        if x < width:
            _pv_units(scores, r, count, data, scale, runs, scale_runs, x, 1, acc, alpha, keys,
                      key_runs if r + x == 0 else none)


@_jit.jit_borrowing
def _pv_units(scores, r, count, data, scale, runs, scale_runs, x, units, acc, alpha, keys,
              key_runs):
    """Rows r .. r + count - 1 (count <= 4) x `units` (1 or 2) units from column x, prefetching
    the key rows given as `key_runs` (see `pv_rows`), one for each value row."""
    n, sw = _layout.lanes(acc), scores.shape[1]
    run_cols, starts, n_runs, step = runs
    s_starts, s_step, g_step, size = scale_runs
    k_cols, k_starts, k_runs, k_step = key_runs
    j, ko = 0, k_starts[0]  # the next key row to prefetch: run j, at byte ko
    p0, p1, p2, p3 = row_starts(r, count, sw)
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = vzeros(acc)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = a00
    g0 = x // size * g_step
    g1 = (x + 2 * n) // size * g_step
    for i in range(n_runs):
        o, s = starts[i] + x // 2, s_starts[i]
        for c in range(run_cols[i], run_cols[i + 1]):
            v0, v1 = _unit(data, o, scale, s + g0)
            v2, v3 = _unit(data, o + n, scale, s + g1) if units > 1 else (v0, v1)
            if j < k_runs:
                for e in range(0, keys.shape[3], CACHE_LINE):
                    prefetch(keys, ko + e)
                ko += k_step
                if c + 1 >= k_cols[j + 1]:
                    j += 1
                    ko = k_starts[j]
            vs = (v0, v1, v2, v3)
            a00, a01, a02, a03 = fma4(vbroadcast(scores, p0 + c), vs, a00, a01, a02, a03)
            if count > 1:
                a10, a11, a12, a13 = fma4(vbroadcast(scores, p1 + c), vs, a10, a11, a12, a13)
            if count > 2:
                a20, a21, a22, a23 = fma4(vbroadcast(scores, p2 + c), vs, a20, a21, a22, a23)
            if count > 3:
                a30, a31, a32, a33 = fma4(vbroadcast(scores, p3 + c), vs, a30, a31, a32, a33)
            o += step
            s += s_step
    for j, row in enumerate(((a00, a01, a02, a03), (a10, a11, a12, a13), (a20, a21, a22, a23),
                             (a30, a31, a32, a33))):
        if j < count:
            o = (r + j) * acc.shape[1] + x
            _layout.rescale_add(acc, o, alpha[r + j], row[0])
            _layout.rescale_add(acc, o + n, alpha[r + j], row[1])
            if units > 1:
                _layout.rescale_add(acc, o + 2 * n, alpha[r + j], row[2])
                _layout.rescale_add(acc, o + 3 * n, alpha[r + j], row[3])
