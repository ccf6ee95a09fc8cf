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
from .._simd import vfma, vhsum, vload, vstore, vzeros
from . import _steps
from ._convert import widen

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _decode(q, k_cache, v_cache, block_table, page_size, n_keys, split_len, block_k, qk_scale,
            softcap, left, right, half, alibi, part_out, part_lse):
    batch, n_heads, n_q, d = q.shape
    n_kv, dv = k_cache.shape[1], v_cache.shape[3]
    group = n_heads // n_kv
    rows = group * n_q  # row r is query row r % n_q of head hk * group + r // n_q
    n_splits = part_out.shape[0]
    has_alibi = alibi.shape[1] > 0
    q_mult = qk_scale / softcap if softcap > 0 else qk_scale * LOG2E
    cap = softcap * LOG2E

    for item in prange(batch * n_kv * n_splits):
        b, hk, split = item // (n_kv * n_splits), item // n_splits % n_kv, item % n_splits
        n_k = n_keys[b]
        shift = n_k - n_q  # bottom-right alignment, per batch entry
        # -- this split's keys, narrowed to what some row of the group can see
        k_lo = split * split_len
        k_hi = min(n_k, k_lo + split_len)
        if left >= 0:
            k_lo = max(k_lo, shift - left)
        if right >= 0:
            k_hi = min(k_hi, n_q + shift + right)

        q_rows, k_rows, v_tile, scores, acc = _buffers(rows, block_k, d, dv, part_lse)
        row_max = np.full(rows, -np.inf, dtype=part_lse.dtype)
        row_sum = np.zeros(rows, dtype=part_lse.dtype)
        alpha = np.empty(rows, dtype=part_lse.dtype)
        for r in range(rows):
            for x in range(d):
                q_rows[r, x] = widen(q[b, hk * group + r // n_q, r % n_q, x], half) * q_mult

        for kb in range(k_lo, k_hi, block_k):
            cols = min(block_k, k_hi - kb)
            # -- stream the block's key and value rows out of their pages
            for c in range(cols):
                page = block_table[b, (kb + c) // page_size]
                row = (kb + c) % page_size
                _copy_row(k_cache, page, hk, row, k_rows, c, half)
                _copy_row(v_cache, page, hk, row, v_tile, c, half)

            # -- S = Q K^T, one dot product along D per (row, key)
            _dot_rows(q_rows, k_rows, scores, rows, cols)

            # -- score modifiers and visibility, per row of the group
            if softcap > 0:
                _steps.softcap_tile(scores, rows, cols, cap)
            for r in range(rows):
                diag = r % n_q + shift - kb  # block column under row r's diagonal
                slope = alibi[b, hk * group + r // n_q] * LOG2E if has_alibi else 0.0
                for c in range(cols):
                    if (left >= 0 and c < diag - left) or (right >= 0 and c > diag + right):
                        scores[r, c] = -np.inf
                    elif has_alibi:
                        scores[r, c] -= slope * abs(diag - c)

            # -- online softmax and acc = alpha * acc + P V, as in the forward kernel
            _steps.softmax_update(scores, row_max, row_sum, alpha, rows, cols)
            _steps.pv_tile(scores, v_tile, acc, alpha, rows, cols)

        # -- this split's normalized rows and their log-sum-exp
        for g in range(group):
            first = g * n_q
            _steps.finish_rows(acc[first:], row_max[first:], row_sum[first:], n_q, -np.inf,
                               part_out[split], part_lse[split], b, hk * group + g, 0, LN2, 0)


@jit
def _buffers(rows, block_k, d, dv, like):
    """q_rows, k_rows (padded to whole vectors), v_tile, scores and acc of one work item."""
    dtype = like.dtype
    n = _steps.lanes(like)
    dp = (d + n - 1) // n * n
    _, _, v_tile, scores, acc = _steps.tile_buffers(rows, block_k, 1, dv, like)
    return (np.zeros((rows, dp), dtype=dtype), np.zeros((block_k, dp), dtype=dtype),
            v_tile, scores, acc)


def _copy_row(src, page, h, row, dst, c, half):
    """dst[c, :n] = src[page, h, row, :], widened; vector copies where the row is contiguous."""


@overload(_copy_row, jit_options=OPTIONS)
def _copy_row_impl(src, page, h, row, dst, c, half):
    if not isinstance(src.dtype, types.Float):  # half-precision bits: widen one by one
        def widen_row(src, page, h, row, dst, c, half):
            for x in range(src.shape[3]):
                dst[c, x] = widen(src[page, h, row, x], half)
        return widen_row

    def copy_row(src, page, h, row, dst, c, half):
        n = src.shape[3]
        if src.strides[3] != src.itemsize:
            for x in range(n):
                dst[c, x] = src[page, h, row, x]
            return
        lanes = _steps.lanes(dst)
        start = (page * src.strides[0] + h * src.strides[1] + row * src.strides[2]) \
            // src.itemsize
        whole = n - n % lanes
        to = c * dst.shape[1]
        for x in range(0, whole, lanes):
            vstore(dst, to + x, vload(src, start + x))
        for x in range(whole, n):
            dst[c, x] = src[page, h, row, x]
    return copy_row


@jit
def _dot_rows(q_rows, k_rows, scores, rows, cols):
    """scores[r, c] = q_rows[r] . k_rows[c]; rows are zero-padded to whole vectors."""
    n = _steps.lanes(q_rows)
    dp = q_rows.shape[1]
    for c in range(cols):
        for r in range(rows):
            total = vzeros(q_rows)
            for x in range(0, dp, n):
                total = vfma(vload(q_rows, r * dp + x), vload(k_rows, c * dp + x), total)
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
