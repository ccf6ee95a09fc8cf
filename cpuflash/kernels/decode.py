"""The decoding kernel: few query rows against a long (paged) KV cache, split across cores.

With one or a few query rows the work is memory-bound: every key and value row is read once
and used for a handful of dot products. So the kernel packs nothing: it streams the rows of
each key block from their pages into a small row-major buffer, and serves every query head of
a GQA group (``Hq // Hk`` heads x ``Nq`` rows) from that one read.

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

from numba.extending import overload

from .._jit import OPTIONS, Kernel, array, jit
from .._simd import vbroadcast, vfma, vhsum, vload, vsplat, vstore, vstore_hsum4, vzeros
from . import _steps
from ._convert import widen



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

        q_rows, k_rows, v_tile, scores, acc = _buffers(rows, block_k, d, dv, part_lse)
        row_max = np.full(rows, -np.inf, dtype=part_lse.dtype)
        row_sum = np.zeros(rows, dtype=part_lse.dtype)
        alpha = np.empty(rows, dtype=part_lse.dtype)
        offsets = np.empty(block_k, dtype=np.int64)
        for r in range(rows):
            for x in range(d):
                q_rows[r, x] = widen(q[b, hk * group + r // n_q, r % n_q, x], half)

        for kb in range(k_lo, k_hi, block_k):
            cols = min(block_k, k_hi - kb)
            # -- S = Q K^T, one dot product along D per (row, key), each key row read once
            # from its page (software prefetching of the next block measured 30% slower here:
            # the hardware prefetcher follows the rows, an extra burst only competes with it)
            _qk_block(q_rows, k_cache, block_table, b, hk, kb, cols, page_size, offsets, k_rows,
                      scores, rows, half)
            _steps.scale_tile(scores, rows, cols, s_mult)

            # -- score modifiers and visibility, per row of the group
            if softcap > 0:
                _steps.softcap_tile(scores, rows, cols, softcap)
            inside = ((left < 0 or kb >= n_q - 1 + shift - left)
                      and (right < 0 or kb + cols - 1 <= shift + right))
            if has_alibi or not inside:
                for r in range(rows):
                    diag = r % n_q + shift - kb  # block column under row r's diagonal
                    if has_alibi:
                        slope = alibi[b, hk * group + r // n_q]
                        _steps.alibi_tile(scores[r:], 1, cols, slope, diag)
                    if not inside:
                        _steps.band_mask_tile(scores[r:], 1, cols, diag, left, right)

            # -- online softmax and acc = alpha * acc + P V, as in the forward kernel
            _steps.softmax_update(scores, row_max, row_sum, alpha, rows, cols,
                                  -_steps.UNBOUNDED, _steps.UNBOUNDED)
            _pv_block(scores, v_cache, block_table, b, hk, kb, cols, page_size, offsets, v_tile,
                      acc, alpha, rows, half)

        # -- this split's normalized rows and their log-sum-exp
        for g in range(group):
            first = g * n_q
            _steps.finish_rows(acc[first:], row_max[first:], row_sum[first:], n_q, -np.inf,
                               part_out[split], part_lse[split], b, hk * group + g, 0, 0)


@jit
def _buffers(rows, block_k, d, dv, like):
    """q_rows, k_rows (padded to whole vectors), v_tile, scores and acc of one work item."""
    dtype = like.dtype
    n = _steps.lanes(like)
    dp = (d + n - 1) // n * n
    _, _, v_tile, scores, acc = _steps.tile_buffers(rows, block_k, 1, dv, like)
    return (np.zeros((rows, dp), dtype=dtype), np.zeros((block_k, dp), dtype=dtype),
            v_tile, scores, acc)


@jit
def _row_offsets(cache, block_table, b, h, start, cols, page_size, offsets):
    """offsets[c] = flat element offset of the cache row of position start + c (batch b,
    head h), walking the pages without a division per row."""
    page_stride = cache.strides[0] // cache.itemsize
    row_stride = cache.strides[2] // cache.itemsize
    head_offset = h * (cache.strides[1] // cache.itemsize)
    index, row = start // page_size, start % page_size
    offset = block_table[b, index] * page_stride + head_offset + row * row_stride
    for c in range(cols):
        offsets[c] = offset
        row += 1
        offset += row_stride
        if row == page_size and c + 1 < cols:
            index, row = index + 1, 0
            offset = block_table[b, index] * page_stride + head_offset


@jit
def _widen_rows(cache, block_table, b, h, start, cols, page_size, dst, half):
    """The general gather: element by element, any strides, half-precision bits widened."""
    for c in range(cols):
        page = block_table[b, (start + c) // page_size]
        for x in range(cache.shape[3]):
            dst[c, x] = widen(cache[page, h, (start + c) % page_size, x], half)


def _gather_rows(cache, block_table, b, h, start, cols, page_size, offsets, dst, half):
    """dst[c, :D] = the cache rows of positions start..start+cols of batch b, head h."""


@overload(_gather_rows, jit_options=OPTIONS)
def _gather_rows_impl(cache, block_table, b, h, start, cols, page_size, offsets, dst, half):
    if not isinstance(cache.dtype, types.Float):  # half-precision bits
        def widen_rows(cache, block_table, b, h, start, cols, page_size, offsets, dst, half):
            _widen_rows(cache, block_table, b, h, start, cols, page_size, dst, half)
        return widen_rows

    def copy_rows(cache, block_table, b, h, start, cols, page_size, offsets, dst, half):
        n = _steps.lanes(dst)
        if cache.strides[3] != cache.itemsize or cache.shape[3] % n:
            _widen_rows(cache, block_table, b, h, start, cols, page_size, dst, half)
            return
        _row_offsets(cache, block_table, b, h, start, cols, page_size, offsets)
        for c in range(cols):  # whole vectors straight from the contiguous rows
            for x in range(0, cache.shape[3], n):
                vstore(dst, c * dst.shape[1] + x, vload(cache, offsets[c] + x))
    return copy_rows


@jit
def _direct(cache, like):
    """Whether the kernel reads the (float) `cache` rows in place: contiguous, whole vectors."""
    return cache.strides[3] == cache.itemsize and cache.shape[3] % _steps.lanes(like) == 0


def _qk_block(q_rows, k_cache, block_table, b, h, start, cols, page_size, offsets, k_rows,
              scores, rows, half):
    """scores[:rows, :cols] = q_rows . keys of positions start..start+cols."""


@jit
def _qk_from_copy(q_rows, k_cache, block_table, b, h, start, cols, page_size, offsets, k_rows,
                  scores, rows, half):
    _gather_rows(k_cache, block_table, b, h, start, cols, page_size, offsets, k_rows, half)
    _dot_rows(q_rows, k_rows, _steps.padded_rows(cols, k_rows), scores, rows, cols)


@overload(_qk_block, jit_options=OPTIONS)
def _qk_block_impl(q_rows, k_cache, block_table, b, h, start, cols, page_size, offsets, k_rows,
                   scores, rows, half):
    if not isinstance(k_cache.dtype, types.Float):  # half-precision bits: widened copies
        return _qk_from_copy.py_func

    def qk_block(q_rows, k_cache, block_table, b, h, start, cols, page_size, offsets, k_rows,
                 scores, rows, half):
        if _direct(k_cache, q_rows):  # straight from the cache: no copy, one read of each row
            _row_offsets(k_cache, block_table, b, h, start, cols, page_size, offsets)
            _dot_rows(q_rows, k_cache, offsets, scores, rows, cols)
        else:
            _qk_from_copy(q_rows, k_cache, block_table, b, h, start, cols, page_size, offsets,
                          k_rows, scores, rows, half)
    return qk_block


def _pv_block(scores, v_cache, block_table, b, h, start, cols, page_size, offsets, v_tile, acc,
              alpha, rows, half):
    """acc = alpha * acc + P V over the values of positions start..start+cols."""


@jit
def _pv_from_copy(scores, v_cache, block_table, b, h, start, cols, page_size, offsets, v_tile,
                  acc, alpha, rows, half):
    _gather_rows(v_cache, block_table, b, h, start, cols, page_size, offsets, v_tile, half)
    _steps.pv_tile(scores, v_tile, acc, alpha, rows, cols, -_steps.UNBOUNDED, _steps.UNBOUNDED)


@overload(_pv_block, jit_options=OPTIONS)
def _pv_block_impl(scores, v_cache, block_table, b, h, start, cols, page_size, offsets, v_tile,
                   acc, alpha, rows, half):
    if not isinstance(v_cache.dtype, types.Float):  # half-precision bits: widened copies
        return _pv_from_copy.py_func

    def pv_block(scores, v_cache, block_table, b, h, start, cols, page_size, offsets, v_tile,
                 acc, alpha, rows, half):
        if _direct(v_cache, acc):  # v_tile (block_k >= rows rows) holds the block's sum
            _row_offsets(v_cache, block_table, b, h, start, cols, page_size, offsets)
            _pv_rows(scores, v_cache, offsets, v_tile, acc, alpha, rows, cols)
        else:
            _pv_from_copy(scores, v_cache, block_table, b, h, start, cols, page_size, offsets,
                          v_tile, acc, alpha, rows, half)
    return pv_block


@jit
def _pv_rows(scores, v_cache, offsets, block_acc, acc, alpha, rows, cols):
    """acc = alpha * acc + P V with the value rows read in place at `offsets`.

    Each value vector is loaded once and used by every query row; the block's sum starts from
    zero in `block_acc` and joins `acc` once (the same arithmetic as `_steps.pv_tile`).
    """
    n = _steps.lanes(acc)
    dv, dvp, sw = v_cache.shape[3], acc.shape[1], scores.shape[1]
    block_acc[:rows, :] = 0.0
    for c in range(cols):
        for x in range(0, dv, n):
            value = vload(v_cache, offsets[c] + x)
            for r in range(rows):
                o = r * dvp + x
                vstore(block_acc, o, vfma(vbroadcast(scores, r * sw + c), value,
                                          vload(block_acc, o)))
    for r in range(rows):
        scale = vsplat(alpha[r], acc)
        for x in range(0, dvp, n):
            o = r * dvp + x
            vstore(acc, o, vfma(scale, vload(acc, o), vload(block_acc, o)))


@jit
def _dot_rows(q_rows, keys, offsets, scores, rows, cols):
    """scores[r, c] = q_rows[r] . keys[offsets[c] : offsets[c] + D] (flat element offsets; q_rows
    are zero-padded to whole vectors and so must the key rows be, or D a multiple of them).

    Four keys at a time: four independent FMA chains per query row, one load of each query
    vector for all four, and one shared reduction tree for the four sums.
    """
    n = _steps.lanes(q_rows)
    dp = q_rows.shape[1]
    c = 0
    while c + 4 <= cols:
        k0, k1, k2, k3 = offsets[c], offsets[c + 1], offsets[c + 2], offsets[c + 3]
        for r in range(rows):
            s0 = s1 = s2 = s3 = vzeros(q_rows)
            for x in range(0, dp, n):
                qx = vload(q_rows, r * dp + x)
                s0 = vfma(qx, vload(keys, k0 + x), s0)
                s1 = vfma(qx, vload(keys, k1 + x), s1)
                s2 = vfma(qx, vload(keys, k2 + x), s2)
                s3 = vfma(qx, vload(keys, k3 + x), s3)
            vstore_hsum4(scores, r * scores.shape[1] + c, s0, s1, s2, s3)
        c += 4
    for c in range(c, cols):
        for r in range(rows):
            total = vzeros(q_rows)
            for x in range(0, dp, n):
                total = vfma(vload(q_rows, r * dp + x), vload(keys, offsets[c] + x), total)
            scores[r, c] = vhsum(total)


def _signature(key):
    dtype, compute = key
    data = array(dtype, 4, readonly=True)
    i8, f8 = types.int64, types.float64
    return types.void(
        data, data, data, array(np.int64, 2, readonly=True), i8, array(np.int64, 1, readonly=True),
        i8, i8, f8, f8, i8, i8, i8, array(compute, 2, readonly=True), array(compute, 5),
        array(compute, 4))


decode = Kernel(_decode, _signature)
