"""The decoding kernel: few query rows against a long (paged) KV cache, split across cores.

With one or a few query rows the work is memory-bound: every key and value row is read once
and used for a handful of dot products. So the kernel packs nothing: it reads the rows of each
key block in place from their pages (float16/bfloat16 bits widened as they are loaded, so half
the bytes), and serves every query head of a GQA group (``Hq // Hk`` heads x ``Nq`` rows) from
that one read, four query rows at a time in register-blocked micro-kernels. Rows that are not
whole SIMD vectors (a head dim that is no multiple of the vector width, or strided rows) go
through a widened copy of the block instead.

One work item is one (batch, kv head, split): split-KV (flash-decoding) cuts each sequence's
keys into `n_splits` ranges so that a single sequence with a single KV head still keeps every
core busy. Each item writes its normalized partial output and its log-sum-exp; the partial
results are then merged exactly (`cpuflash.merge_states`). For a given split count the result
does not depend on the thread count.

A cache is addressed through a page table: key position ``p`` of batch ``b`` is row
``p % page_size`` of page ``block_table[b, p // page_size]``. An unpaged cache is the case of
one page per batch entry.
"""

import numpy as np
from numba import prange, types

from .._jit import Kernel, array, jit
from .._simd import prefetch, vbroadcast, vfma, vhsum, vload, vstore_hsums, vzeros
from . import _steps
from ._convert import load_widened, row_offset, vector_rows, widen


def _decode(q, k_cache, v_cache, block_table, page_size, n_keys, split_len, block_k, qk_scale,
            softcap, left, right, half, alibi, part_out, part_lse):
    batch, n_heads, n_q, d = q.shape
    n_kv, dv = k_cache.shape[1], v_cache.shape[3]
    group = n_heads // n_kv
    rows = group * n_q  # row r is query row r % n_q of head hk * group + r // n_q
    n_splits = part_out.shape[0]
    has_alibi = alibi.shape[1] > 0
    s_mult = qk_scale / softcap if softcap > 0 else qk_scale

    for item in prange(batch * n_kv * n_splits):
        b, hk, split = item // (n_kv * n_splits), item // n_splits % n_kv, item % n_splits
        n_k = n_keys[b]
        shift = n_k - n_q  # bottom-right alignment, per batch entry
        # -- this split's keys, narrowed to what some row of the group can see
        k_lo = split * split_len
        k_hi = min(n_k, k_lo + split_len)
        if left >= 0:  # aligned down, so the key blocks are the same for any split of rows
            k_lo = max(k_lo, (shift - left) // block_k * block_k)
        if right >= 0:
            k_hi = min(k_hi, n_q + shift + right)

        n = _steps.lanes(part_lse)
        direct = vector_rows(k_cache, n) and vector_rows(v_cache, n)  # rows read in place
        q_rows, k_rows, v_tile, scores, acc = _buffers(rows, block_k, 0 if direct else block_k,
                                                       d, dv, part_lse)
        row_max = np.full(rows, -np.inf, dtype=part_lse.dtype)
        row_sum = np.zeros(rows, dtype=part_lse.dtype)
        alpha = np.empty(rows, dtype=part_lse.dtype)
        everything = (-_steps.UNBOUNDED, _steps.UNBOUNDED)  # the rows' band offsets differ
        k_offsets = np.empty(block_k, dtype=np.int64)
        v_offsets = np.empty(block_k, dtype=np.int64)
        for r in range(rows):
            for x in range(d):
                q_rows[r, x] = widen(q[b, hk * group + r // n_q, r % n_q, x], half)
        if direct:  # the first block's key rows; each block then finds the next one's
            _row_offsets(k_cache, block_table, b, hk, k_lo, min(block_k, k_hi - k_lo), page_size,
                         k_offsets)

        for kb in range(k_lo, k_hi, block_k):
            cols = min(block_k, k_hi - kb)
            # -- S = Q K^T, one dot product along D per (row, key), each key row read once: in
            # place where the rows are whole vectors, prefetching the block's value rows
            # meanwhile; else through a widened copy
            if direct:
                _row_offsets(v_cache, block_table, b, hk, kb, cols, page_size, v_offsets)
                _dot_rows(q_rows, k_cache, k_offsets, scores, rows, cols, v_cache, v_offsets,
                          cols, half)
            else:
                _widen_rows(k_cache, block_table, b, hk, kb, cols, page_size, k_rows, half)
                _dot_rows(q_rows, k_rows, _steps.padded_rows(cols, k_rows), scores, rows, cols,
                          k_rows, k_offsets, 0, half)
            _steps.scale_tile(scores, rows, cols, s_mult, *everything)

            # -- score modifiers and visibility, per row of the group
            if softcap > 0:
                _steps.softcap_tile(scores, rows, cols, softcap, *everything)
            inside = ((left < 0 or kb >= n_q - 1 + shift - left)
                      and (right < 0 or kb + cols - 1 <= shift + right))
            if has_alibi or not inside:
                for r in range(rows):
                    diag = r % n_q + shift - kb  # block column under row r's diagonal
                    if has_alibi:
                        slope = alibi[b, hk * group + r // n_q]
                        _steps.alibi_tile(scores[r:], 1, cols, slope, diag, *everything)
                    if not inside:
                        _steps.band_mask_tile(scores[r:], 1, cols, diag, left, right,
                                              *everything)

            # -- online softmax and acc = alpha * acc + P V, prefetching the next key block (whose
            # row offsets the next Q K^T then uses)
            _steps.softmax_update(scores, row_max, row_sum, alpha, rows, cols, *everything)
            if direct:
                following = min(block_k, k_hi - kb - block_k)
                _row_offsets(k_cache, block_table, b, hk, kb + block_k, following, page_size,
                             k_offsets)
                _pv_rows(scores, v_cache, v_offsets, dv, acc, alpha, rows, cols, k_cache,
                         k_offsets, following, half)
            else:
                _widen_rows(v_cache, block_table, b, hk, kb, cols, page_size, v_tile, half)
                _pv_rows(scores, v_tile, _steps.padded_rows(cols, v_tile), v_tile.shape[1], acc,
                         alpha, rows, cols, v_tile, v_offsets, 0, half)

        # -- this split's normalized rows and their log-sum-exp
        for g in range(group):
            first = g * n_q
            _steps.finish_rows(acc[first:], row_max[first:], row_sum[first:], n_q, -np.inf,
                               part_out[split], part_lse[split], b, hk * group + g, 0, 0)


@jit
def _buffers(rows, block_k, copied, d, dv, like):
    """q_rows, scores and acc of one work item, and k_rows and v_tile for widened copies of
    `copied` key and value rows (zero when the rows are read in place). D and Dv are padded to
    whole vectors (to two for scores and acc, as `_steps.tile_buffers` pads them), and the rows
    of scores to a multiple of four (`_dot_rows` stores four rows at a time)."""
    dtype = like.dtype
    n = _steps.lanes(like)
    dp, dvp = _steps.round_up(d, n), _steps.round_up(dv, 2 * n)
    keys, score_rows = _steps.round_up(block_k, 2 * n), _steps.round_up(rows, 4)
    return (np.zeros((rows, dp), dtype=dtype), np.zeros((copied, dp), dtype=dtype),
            np.zeros((copied, dvp), dtype=dtype), np.zeros((score_rows, keys), dtype=dtype),
            np.zeros((rows, dvp), dtype=dtype))


@jit
def _row_offsets(cache, block_table, b, h, start, cols, page_size, offsets):
    """offsets[c] = flat element offset of the cache row of position start + c (batch b,
    head h), walking the pages without a division per row. Nothing is read for no rows (the
    page of `start` may then lie past the table)."""
    if cols <= 0:
        return
    row_stride = cache.strides[2] // cache.itemsize
    index, row = start // page_size, start % page_size
    offset = row_offset(cache, block_table[b, index], h, row)
    for c in range(cols):
        offsets[c] = offset
        row += 1
        offset += row_stride
        if row == page_size and c + 1 < cols:
            index, row = index + 1, 0
            offset = row_offset(cache, block_table[b, index], h, 0)


@jit
def _widen_rows(cache, block_table, b, h, start, cols, page_size, dst, half):
    """The general gather: element by element, any strides, half-precision bits widened."""
    for c in range(cols):
        page = block_table[b, (start + c) // page_size]
        for x in range(cache.shape[3]):
            dst[c, x] = widen(cache[page, h, (start + c) % page_size, x], half)


@jit
def _pv_rows(scores, values, offsets, width, acc, alpha, rows, cols, later, later_offsets,
             later_cols, half):
    """acc = alpha * acc + P V over the value rows at flat `offsets` of `values` (their first
    `width` elements, a whole number of vectors; the rest of `acc` is left as it is).

    Four query rows at a time share every load of a value vector; each block's sum starts from
    zero in registers and joins `acc` once, as in `_steps.pv_tile`. Meanwhile the first
    `later_cols` rows at `later_offsets` of `later` are prefetched (see `_dot_rows`).
    """
    n = _steps.lanes(acc)
    for r in range(0, rows, 4):
        count = min(4, rows - r)
        x = 0
        while x + 4 * n <= width:
            _pv_micro4x4(scores, r, count, values, offsets, x, acc, alpha, cols, later,
                         later_offsets, later_cols if r == 0 else 0, half)
            x += 4 * n
        for x in range(x, width, n):
            _pv_micro4x1(scores, r, count, values, offsets, x, acc, alpha, cols, half)


@jit
def _pv_micro4x4(scores, r, count, values, offsets, x, acc, alpha, cols, later, later_offsets,
                 later_cols, half):
    """Rows r .. r + count (count <= 4) x four vectors from column x: 16 accumulators held
    in registers over the whole block. Missing rows repeat the last one and are not stored."""
    n, sw = _steps.lanes(acc), scores.shape[1]
    p0, p1, p2, p3 = _row_starts(r, count, sw)
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = vzeros(acc)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = a00
    for c in range(cols):
        o = offsets[c] + x
        v0, v1 = load_widened(values, o, half), load_widened(values, o + n, half)
        v2, v3 = load_widened(values, o + 2 * n, half), load_widened(values, o + 3 * n, half)
        if c < later_cols:  # the same columns of a later row, one cache line per vector
            o = later_offsets[c] + x
            prefetch(later, o)
            prefetch(later, o + n)
            prefetch(later, o + 2 * n)
            prefetch(later, o + 3 * n)
        p = vbroadcast(scores, p0 + c)
        a00, a01, a02, a03 = vfma(p, v0, a00), vfma(p, v1, a01), vfma(p, v2, a02), vfma(p, v3, a03)
        p = vbroadcast(scores, p1 + c)
        a10, a11, a12, a13 = vfma(p, v0, a10), vfma(p, v1, a11), vfma(p, v2, a12), vfma(p, v3, a13)
        p = vbroadcast(scores, p2 + c)
        a20, a21, a22, a23 = vfma(p, v0, a20), vfma(p, v1, a21), vfma(p, v2, a22), vfma(p, v3, a23)
        p = vbroadcast(scores, p3 + c)
        a30, a31, a32, a33 = vfma(p, v0, a30), vfma(p, v1, a31), vfma(p, v2, a32), vfma(p, v3, a33)
    _join4(acc, r, x, alpha, a00, a01, a02, a03)
    if count > 1:
        _join4(acc, r + 1, x, alpha, a10, a11, a12, a13)
    if count > 2:
        _join4(acc, r + 2, x, alpha, a20, a21, a22, a23)
    if count > 3:
        _join4(acc, r + 3, x, alpha, a30, a31, a32, a33)


@jit
def _pv_micro4x1(scores, r, count, values, offsets, x, acc, alpha, cols, half):
    """`_pv_micro4x4` for one vector of columns (the last vectors of a narrow head)."""
    sw = scores.shape[1]
    p0, p1, p2, p3 = _row_starts(r, count, sw)
    a0 = a1 = a2 = a3 = vzeros(acc)
    for c in range(cols):
        v = load_widened(values, offsets[c] + x, half)
        a0, a1 = vfma(vbroadcast(scores, p0 + c), v, a0), vfma(vbroadcast(scores, p1 + c), v, a1)
        a2, a3 = vfma(vbroadcast(scores, p2 + c), v, a2), vfma(vbroadcast(scores, p3 + c), v, a3)
    for i, total in enumerate((a0, a1, a2, a3)):
        if i < count:
            _steps.rescale_add(acc, (r + i) * acc.shape[1] + x, alpha[r + i], total)


@jit
def _join4(acc, r, x, alpha, a0, a1, a2, a3):
    """acc[r, x : x + 4 vectors] = alpha[r] * acc[r, ...] + (a0, a1, a2, a3)
    (`_steps.rescale_add`)."""
    o = r * acc.shape[1] + x
    for i, total in enumerate((a0, a1, a2, a3)):
        _steps.rescale_add(acc, o + i * _steps.lanes(acc), alpha[r], total)


@jit
def _row_starts(r, count, stride):
    """Flat starts of rows r .. r + 3 of a buffer, rows past r + count - 1 repeating it."""
    last = r + count - 1
    return (r * stride, min(r + 1, last) * stride, min(r + 2, last) * stride,
            min(r + 3, last) * stride)


@jit
def _dot_rows(q_rows, keys, offsets, scores, rows, cols, later, later_offsets, later_cols,
              half):
    """scores[r, c] = q_rows[r] . keys[offsets[c] : offsets[c] + D] (flat element offsets; q_rows
    are zero-padded to whole vectors and so must the key rows be, or D a multiple of them).

    Four rows x four keys at a time: 16 independent FMA chains, each key vector loaded once for
    four rows and each query vector once for four keys, and one shared reduction tree for each
    16 sums (`vstore_hsums`; `scores` has rows up to a multiple of four, those past `rows`
    taking the sums of the repeated last row).

    Meanwhile the same columns of the first `later_cols` rows at `later_offsets` of `later` are
    prefetched, one cache line per vector: the kernel streams two arrays in turns (a block of
    key rows, then its value rows), and the hardware prefetcher, which follows one stream at a
    time, would start each turn cold.
    """
    n, dp, sw = _steps.lanes(q_rows), q_rows.shape[1], scores.shape[1]
    for r in range(0, rows, 4):
        count = min(4, rows - r)
        q0, q1, q2, q3 = _row_starts(r, count, dp)
        prefetched = later_cols if r == 0 else 0
        c = 0
        while c + 4 <= cols:
            k0, k1, k2, k3 = offsets[c], offsets[c + 1], offsets[c + 2], offsets[c + 3]
            s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = vzeros(q_rows)
            s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = s00
            for x in range(0, dp, n):
                y0, y1 = load_widened(keys, k0 + x, half), load_widened(keys, k1 + x, half)
                y2, y3 = load_widened(keys, k2 + x, half), load_widened(keys, k3 + x, half)
                if c + 4 <= prefetched:  # the same columns of four later rows
                    prefetch(later, later_offsets[c] + x)
                    prefetch(later, later_offsets[c + 1] + x)
                    prefetch(later, later_offsets[c + 2] + x)
                    prefetch(later, later_offsets[c + 3] + x)
                q = vload(q_rows, q0 + x)
                s00, s01, s02, s03 = vfma(q, y0, s00), vfma(q, y1, s01), vfma(q, y2, s02), \
                    vfma(q, y3, s03)
                q = vload(q_rows, q1 + x)
                s10, s11, s12, s13 = vfma(q, y0, s10), vfma(q, y1, s11), vfma(q, y2, s12), \
                    vfma(q, y3, s13)
                q = vload(q_rows, q2 + x)
                s20, s21, s22, s23 = vfma(q, y0, s20), vfma(q, y1, s21), vfma(q, y2, s22), \
                    vfma(q, y3, s23)
                q = vload(q_rows, q3 + x)
                s30, s31, s32, s33 = vfma(q, y0, s30), vfma(q, y1, s31), vfma(q, y2, s32), \
                    vfma(q, y3, s33)
            vstore_hsums(scores, r * sw + c, sw, (s00, s01, s02, s03, s10, s11, s12, s13,
                                                  s20, s21, s22, s23, s30, s31, s32, s33))
            c += 4
        for c in range(c, cols):  # the last keys, one at a time
            for i in range(count):
                total = vzeros(q_rows)
                for x in range(0, dp, n):
                    total = vfma(vload(q_rows, (r + i) * dp + x),
                                 load_widened(keys, offsets[c] + x, half), total)
                scores[r + i, c] = vhsum(total)


def _signature(key):
    dtype, compute = key
    data = array(dtype, 4, readonly=True)
    i8, f8 = types.int64, types.float64
    return types.void(
        data, data, data, array(np.int64, 2, readonly=True), i8, array(np.int64, 1, readonly=True),
        i8, i8, f8, f8, i8, i8, i8, array(compute, 2, readonly=True), array(compute, 5),
        array(compute, 4))


decode = Kernel(_decode, _signature)
