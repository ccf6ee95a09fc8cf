"""The decoding kernel: few query rows against a long (paged) KV cache, split across cores.

With one or a few query rows the work is memory-bound: every key and value row is read once
and used for a handful of dot products. So the kernel packs nothing: it reads the rows of each
key block in place from their pages (float16/bfloat16 bits widened as they are loaded, so half
the bytes), and serves every query head of a GQA group (``Hq // Hk`` heads x ``Nq`` rows) from
that one read, in register-blocked micro-kernels. Streaming from memory goes fastest when each
row is read once, front to back (docs/history.md, "What caps decoding"), so for up to four rows
and a head dim of eight vectors (128 float32 lanes with AVX-512) in a float cache, Q K^T takes
all the rows in one pass over the keys, prefetching the key rows ahead, and P V two rows at a
time (four rows' accumulators would need all 32 vector registers); otherwise four query rows at
a time, prefetching the other stream.
Rows that are not whole SIMD vectors (a head dim that is no multiple of the vector width, or
strided rows) go through a widened copy of the block instead.

One work item is one (batch, kv head, split): split-KV (flash-decoding) cuts each sequence's
keys into `n_splits` ranges so that a single sequence with a single KV head still keeps every
core busy. Each item writes its normalized partial output and its log-sum-exp; the partial
results are then merged exactly (`cpuflash.merge_states`). For a given split count the result
does not depend on the thread count. The items are dealt to the threads in equal chunks of
consecutive items, each chunk with its buffers allocated once; a call with little work runs
them all on the calling thread (`SERIAL_WORK`): at 64 cached keys the launch of the threads
would cost more than the work, and a decoding step calls the kernel once per layer.

A quantized cache (`cpuflash.quantize_kv`: int8, or float8_e4m3fn read as uint8 bits, with a
float32 scale per (token, head)) goes through the same code: its rows are widened in registers
as they are loaded, unscaled, and the scales multiply the scores (keys) and the probabilities
before ``P V`` (values); see `_decode_items`. The queries are then float32, and the four-row
micro-kernels serve every head dim. An int4 cache (two numbers a byte, a scale per group of a
row) goes through `decode_int4`, which reads its rows in place too, each byte's nibbles split
in registers (`_int4`), where a group is whole units of two vectors; other group sizes turn
each block's rows into float32 ones first (`_int4_rows`, into the buffers of widened copies).
With `integer_dot` on a CPU with AVX512-VNNI, `decode_idot` (int8) and `decode_int4_idot` take
Q K^T in integers instead, each query row quantized to int8 (`_idot`); P V is the same.

A cache is addressed through a page table: key position ``p`` of batch ``b`` is row
``p % page_size`` of page ``block_table[b, p // page_size]``. An unpaged cache is the case of
one page per batch entry. The micro-kernels walk a block as runs of consecutive rows, one per
page it touches, so they compute each row's address instead of loading it from a table.
"""

import numpy as np
from numba import prange, types
from numba.extending import overload
from numba.np.numpy_support import as_dtype

from .. import _jit
from .._jit import STRICT_OPTIONS, Kernel, array, jit, variant
from .._simd import (prefetch, vadd, vbroadcast, vfma, vhsum, vload, vload_i4, vload_i4_scaled,
                     vmul, vsplat, vstore, vstore_hsums, vsub, vzeros)
from . import _idot, _int4, _layout, _pipeline, _products, _steps, _user
from ._convert import contiguous_rows, load_widened, row_offset, unit, vector_rows, widen
from ._layout import CACHE_LINE, fma4 as _fma4, row_starts as _row_starts


jit_borrowing = _jit.jit_borrowing_any_constants

# how many key rows ahead `_stream_dot4` and `_stream_dot2` prefetch (16 rows of 128 float32:
# 8 KiB; further ahead, or to L2 only, read slower: docs/history.md, "Decoding variants
# measured and dropped")
AHEAD = 16
NOTHING_NEXT = -1  # no next key block (see `_dot_rows`)
# What a parallel launch costs, in the kernel's work of one core: keys x query rows
# x (D + Dv) multiply-adds. The items run on the calling thread alone unless the threads would
# save more than that (the work of all but the largest chunk's items; chosen by measurement on
# 2 threads: docs/history.md, "Per-call cost", decoding on the Xeon). Each
# item's arithmetic is the same either way, so the results do not depend on it.
SERIAL_WORK = 1 << 17

# The helpers below only read and write arrays that their caller holds, so they are compiled
# without reference counting (`jit_borrowing`): with it, the atomic counts of the arrays passed
# from call to call took half the time of a short item (64 keys). `_finish_rows` is
# `_products.finish_rows` compiled so, `_modify_rows` `_steps.modify_tile` and `_band_rows`
# `_steps.band_mask_tile` (the same code; their own cache entries would collide with the counted
# ones, and they are compiled into the cached kernel anyway).
_finish_rows = jit_borrowing(_products.finish_rows.py_func, cache=False)
_modify_rows = jit_borrowing(_steps.modify_tile.py_func, cache=False)
_band_rows = jit_borrowing(_steps.band_mask_tile.py_func, cache=False)

# True in `decode_plain`'s copy of `_decode_items` (`_jit.variant`), for calls with no modifier
# but a causal mask or a window: Numba then compiles none of the others' branches
PLAIN = False
# True in `decode_int4`'s copies: the caches are int4 pairs (uint8) with a scale per group,
# (pages, Hk, page rows, groups), read in place (`_int4`) or through float32 copies of each
# block's rows
INT4 = False
# True in `decode_idot`'s and `decode_int4_idot`'s copies: Q K^T in integers where the key rows
# allow it (`_idot`, `attention_with_kvcache(..., integer_dot=True)`)
IDOT = False


def line_elements(arr):
    """Elements of `arr`'s dtype in one cache line (a compile-time constant in kernels: as a
    loop step computed at run time, it made `_stream_dot4`'s prefetch cost as much as its
    arithmetic)."""
    return CACHE_LINE // arr.itemsize


@overload(line_elements, jit_options=STRICT_OPTIONS)
def _line_elements(arr):
    n = CACHE_LINE // as_dtype(arr.dtype).itemsize
    return lambda arr: n


def _decode(q, k_cache, v_cache, k_scale, v_scale, block_table, page_size, n_keys, split_len,
            block_k, half_kind, flat, score_args, mask_args, part_out, part_lse, n_threads):
    # (`n_threads` is numba's thread count at the call: read in here, it would keep the kernel
    # out of the on-disk cache; `k_scale`, `v_scale`: see `_decode_items`; `flat`,
    # `score_args`, `mask_args`: the score pipeline, apart (`_pipeline.kernel_args`), put
    # together in the parallel loop, which takes tuples one level deep)
    scales = (k_scale, v_scale)
    n_items = q.shape[0] * k_cache.shape[1] * part_out.shape[0]
    n_chunks = min(n_items, n_threads)
    rows = q.shape[1] // k_cache.shape[1] * q.shape[2]
    largest = -(-n_items // max(n_chunks, 1))  # items of the largest chunk
    if n_chunks <= 1 or _work(q, v_cache, n_keys) * (n_items - largest) <= SERIAL_WORK * n_items:
        buffers = _item_buffers(k_cache, v_cache, rows, block_k, page_size, q.shape[3], part_lse)
        _decode_items(0, n_items, buffers, q, k_cache, v_cache, scales, block_table, page_size,
                      n_keys, split_len, block_k, half_kind,
                      _pipeline.together(flat, score_args, mask_args), part_out, part_lse)
    else:
        for chunk in prange(n_chunks):
            mods = _pipeline.together(flat, score_args, mask_args)
            buffers = _item_buffers(k_cache, v_cache, rows, block_k, page_size, q.shape[3],
                                    part_lse)
            _decode_items(chunk * n_items // n_chunks, (chunk + 1) * n_items // n_chunks,
                          buffers, q, k_cache, v_cache, scales, block_table, page_size, n_keys,
                          split_len, block_k, half_kind, mods, part_out, part_lse)


@jit_borrowing
def _work(q, v_cache, n_keys):
    """The call's work in the units of `SERIAL_WORK`."""
    keys = 0
    for b in range(n_keys.shape[0]):
        keys += n_keys[b]
    dv = 2 * v_cache.shape[3] if INT4 else v_cache.shape[3]
    return keys * q.shape[1] * q.shape[2] * (q.shape[3] + dv)


@jit
def _item_buffers(k_cache, v_cache, rows, block_k, page_size, d, like):
    """The buffers of one thread's chunk of items: `_buffers`, the row states and the tables of
    a block's key runs (`_block_runs`): its runs' block columns, key and value starts, and the
    next block's columns and key starts."""
    n = _layout.lanes(like)
    direct = vector_rows(k_cache, n) and vector_rows(v_cache, n)  # rows read in place
    dv = v_cache.shape[3]
    if INT4:  # float32 copies of the rows
        direct, dv = False, 2 * dv
    q_rows, k_rows, v_tile, scores, acc = _buffers(rows, block_k, 0 if direct else block_k,
                                                   d, dv, like)
    row_max = np.empty(rows, dtype=like.dtype)
    row_sum = np.empty(rows, dtype=like.dtype)
    alpha = np.empty(rows, dtype=like.dtype)
    max_runs = block_k // page_size + 2
    runs = np.zeros((7, max_runs + 1), dtype=np.int64)  # (5, 6: an int4 cache's scale starts)
    if IDOT:  # the quantized query rows, their scales and lane corrections (`_idot`)
        q_shape, corr_shape = _idot.buffer_shapes(rows, k_cache.shape[3], INT4, like)
        integer = (np.zeros(q_shape, dtype=np.int8), np.zeros(rows, dtype=np.float32),
                   np.zeros(corr_shape, dtype=np.int32))
        return (q_rows, k_rows, v_tile, scores, acc, row_max, row_sum, alpha, runs, integer)
    return (q_rows, k_rows, v_tile, scores, acc, row_max, row_sum, alpha, runs)


@jit_borrowing
def _decode_items(first, last, buffers, q, k_cache, v_cache, scales, block_table, page_size,
                  n_keys, split_len, block_k, half_kind, mods, part_out, part_lse):
    """Work items first .. last - 1, with the buffers of `_item_buffers`. Each item starts
    from the same state whatever ran before it (so its bits do not depend on the chunks): the
    row states and acc are reset, q_rows rewritten (its padding stays zero), and scores and the
    widened copies are written before they are read, as from one key block to the next.

    `scales` = (k_scale, v_scale): for a quantized cache (int8, or float8_e4m3fn bits as uint8)
    the float32 scale of each cached row, (pages, Hk, page rows), else empty. The rows are read
    as they are stored and widened unscaled in registers; a key's scale multiplies its dot
    products (the scores), a value row's its probabilities before ``P V``: one multiply per
    (row, key) instead of one per element, and no dequantized copy anywhere.

    `mods` is the call's score pipeline (`_pipeline.Pipeline`), applied by
    `_steps.modify_tile` to each query head's rows of a block, as the forward applies it."""
    batch, n_heads, n_q, d = q.shape
    n_kv, dv = k_cache.shape[1], v_cache.shape[3]
    group = n_heads // n_kv
    rows = group * n_q  # row r is query row r % n_q of head hk * group + r // n_q
    n_splits = part_out.shape[0]
    left, right = mods.left, mods.right
    s_mult = _pipeline.product_scale(mods)
    modified = _steps.modifies(mods)  # else only the window's edges change a block
    masked = mods.mask.shape[0] > 0 or _user.has_mask_mod(mods.functions)  # keys may be hidden
    visible = None if PLAIN else mods  # what `_steps.key_visible` needs beside the window

    q_rows, k_rows, v_tile, scores, acc, row_max, row_sum, alpha, runs = buffers[:9]
    no_chain = scores[:0]  # decoding needs no score derivatives
    k_scale, v_scale = scales
    quantized = k_scale.shape[0] > 0
    direct = k_rows.shape[0] == 0
    everything = (-_layout.UNBOUNDED, _layout.UNBOUNDED)  # the rows' band offsets differ
    # a block's rows as runs of consecutive cache rows (split where a page ends): run i is
    # block columns run_cols[i] .. run_cols[i + 1], its first key row at element k_starts[i]
    # of k_cache (v_starts[i] of v_cache), the next rows one row stride further each
    run_cols, k_starts, v_starts, next_cols, next_starts = runs[0], runs[1], runs[2], runs[3], \
        runs[4]
    k_step = k_cache.strides[2] // k_cache.itemsize
    v_step = v_cache.strides[2] // v_cache.itemsize
    if not direct:  # a widened copy is one run of rows in its buffer
        k_step, v_step = k_rows.shape[1], v_tile.shape[1]
    # an int4 cache read in place keeps q's columns and acc's in `_int4`'s unit order
    fused = _int4.fused(k_cache, v_cache, k_scale, v_scale, _layout.lanes(acc)) if INT4 else False
    integer = False  # Q K^T in integers (`_idot`)
    if IDOT:
        integer = _idot.applies_int4(k_cache, k_scale) if INT4 else _idot.applies_int8(k_cache)
        q_bytes, q_scale, corr = buffers[9]

    for item in range(first, last):
        b, hk, split = item // (n_kv * n_splits), item // n_splits % n_kv, item % n_splits
        n_k = n_keys[b]
        shift = n_k - n_q  # bottom-right alignment, per batch entry
        seen_lo, seen_hi = _steps.visible_keys(shift, n_q, n_k, left, right, mods.chunk, 0,
                                                block_k)
        k_lo = max(split * split_len, seen_lo)
        k_hi = min(split * split_len + split_len, seen_hi)

        row_max[:] = -np.inf
        row_sum[:] = 0.0
        acc[:, :] = 0.0
        for r in range(rows):
            for x in range(d):
                q_rows[r, x] = widen(q[b, hk * group + r // n_q, r % n_q, x], half_kind)
        if IDOT:
            if integer:
                _idot.quantize_rows(q_rows, rows, d, INT4, q_bytes, q_scale, corr)
        if INT4:
            if fused:
                _int4.permute_rows(q_rows, rows, d, k_rows[0])

        for kb in range(k_lo, k_hi, block_k):
            cols = min(block_k, k_hi - kb)
            # -- S = Q K^T, one dot product along D per (row, key), each key row read from the
            # cache where the rows are whole vectors (the four-row micro-kernels prefetching the
            # block's value rows meanwhile, the one-pass ones their own key rows ahead, on into
            # the next block's), else from a widened copy
            scored = False
            if IDOT:
                if integer:  # (the runs the P V below reads too)
                    if INT4:
                        n_runs = _int4_runs(k_cache, v_cache, scales, block_table, b, hk, kb,
                                            cols, page_size, runs)
                    else:
                        n_runs = _pair_runs(k_cache, v_cache, block_table, b, hk, kb, cols,
                                            page_size, runs)
                        n_next = _next_runs(k_cache, block_table, b, hk, kb, k_hi, block_k,
                                            page_size, runs)
                    key_runs = (run_cols, k_starts, n_runs, k_cache.strides[2])
                    if INT4:
                        _idot.dot_rows_int4(q_bytes, q_scale, corr, k_cache, k_scale, key_runs,
                                            (runs[5], _row_step(k_scale)), scores, rows)
                    else:
                        _idot.dot_rows_int8(q_bytes, q_scale, corr, k_cache, key_runs, scores,
                                            rows)
                    scored = True
            if scored:
                pass
            elif direct:
                n_runs = _pair_runs(k_cache, v_cache, block_table, b, hk, kb, cols, page_size,
                                    runs)
                n_next = _next_runs(k_cache, block_table, b, hk, kb, k_hi, block_k, page_size,
                                    runs)
                _dot_rows(q_rows, k_cache, (run_cols, k_starts, n_runs, k_step), scores, rows,
                          half_kind, v_cache, (run_cols, v_starts, n_runs, v_step), True,
                          next_starts[0] if n_next else NOTHING_NEXT)
            elif INT4:
                n_runs = _int4_scores(q_rows, k_cache, v_cache, scales, block_table, b, hk, kb,
                                      cols, page_size, runs, k_rows, scores, rows, fused)
            else:
                n_runs = _one_run(cols, run_cols, k_starts, v_starts)
                _widen_rows(k_cache, block_table, b, hk, kb, cols, page_size, k_rows, half_kind)
                _dot_rows(q_rows, k_rows, (run_cols, k_starts, n_runs, k_step), scores, rows,
                          half_kind, v_cache, (run_cols, v_starts, n_runs, v_step), False,
                          NOTHING_NEXT)
            if INT4:
                pass  # (the scales are in the copies)
            elif quantized:  # -- S *= the keys' scales
                _scale_columns(scores, rows, cols, k_scale, unit(k_cache), block_table, b, hk, kb,
                               page_size, False)
            _steps.scale_tile(scores, rows, cols, s_mult, *everything)

            # -- score modifiers and visibility, the rows of one query head at a time (they
            # share its modifiers; row r's diagonal is r + shift)
            inside = _steps.sees_all(shift, n_q, kb, cols, left, right, mods.chunk)
            band = (inside, -_layout.UNBOUNDED, _layout.UNBOUNDED, left, right)
            # (no KV-cache call has a block mask: the state is every head's)
            state = _user.PARTIAL if _user.has_mask_mod(mods.functions) else _user.FULL
            for g in range(group if modified or not inside else 0):
                at = (b, hk * group + g, 0, kb, shift, b, state)
                if PLAIN:  # (what `_modify_rows` does for such a call)
                    _band_rows(scores[g * n_q:], n_q, cols, shift - kb, left, right,
                               *everything)
                else:
                    _modify_rows(scores[g * n_q:], no_chain, n_q, cols, at, band, mods,
                                 no_chain)

            # -- online softmax and acc = alpha * acc + P V (the four-row micro-kernels
            # prefetching the next block's key rows meanwhile)
            _products.softmax_update(scores, row_max, row_sum, alpha, rows, cols, *everything)
            if INT4:
                pass
            elif quantized:  # -- P *= the value rows' scales (row_sum has the true P)
                _scale_columns(scores, rows, cols, v_scale, unit(v_cache), block_table, b, hk, kb,
                               page_size, True)
            seen = (not inside or masked, n_q, shift - kb, (left, right), visible,
                    (b, hk * group, 0, kb, shift, b, state))
            if direct:
                _pv_rows(scores, v_cache, (run_cols, v_starts, n_runs, v_step), dv, acc, alpha,
                         rows, half_kind, k_cache, (next_cols, next_starts, n_next, k_step), seen)
            elif INT4:
                n_next = _next_runs(k_cache, block_table, b, hk, kb, k_hi, block_k, page_size,
                                    runs) if fused else 0
                _int4_values(scores, v_cache, v_scale, block_table, b, hk, kb, cols, page_size,
                             runs, n_runs, v_tile, acc, alpha, rows, seen, fused,
                             (k_cache, (next_cols, next_starts, n_next, k_cache.strides[2])))
            else:
                n_runs = _one_run(cols, run_cols, k_starts, v_starts)
                _widen_rows(v_cache, block_table, b, hk, kb, cols, page_size, v_tile, half_kind)
                _pv_rows(scores, v_tile, (run_cols, v_starts, n_runs, v_step), v_tile.shape[1],
                         acc, alpha, rows, half_kind, k_cache, (next_cols, next_starts, 0, k_step),
                         seen)

        # -- this split's normalized rows and their log-sum-exp
        if INT4:
            if fused:
                _int4.unpermute(acc, rows, acc.shape[1], k_rows[0])
        for g in range(group):
            top = g * n_q
            _finish_rows(acc[top:], row_max[top:], row_sum[top:], n_q, -np.inf, part_out[split],
                         part_lse[split], b, hk * group + g, 0, 0)


@jit_borrowing
def _scale_columns(scores, rows, cols, scale, unit_scale, block_table, b, h, start, page_size,
                   keep_zeros):
    """scores[r, c] *= `unit_scale` (`_convert.unit`: a power of two, exact) and the scale of
    key position start + c (batch b, head h), for rows 0 .. rows - 1. With `keep_zeros`
    (probabilities), zeros stay zero: a hidden key's probability times a NaN scale (that of a
    non-finite row) must not reach a row that cannot see it. Scores keep the product: a NaN
    scale makes the key's score NaN, as its dequantized row would (hidden keys are masked to
    -inf afterwards)."""
    # by runs of keys in one page, each row's run in whole vectors where a page's scales lie
    # side by side (the scales' array has any strides, so LLVM's own loop stayed scalar: a
    # seventh of an int8 decoding call), then a key at a time; with `keep_zeros` the vectors
    # only where the run's scales are finite (then a zero times one is zero)
    n, sw = _layout.lanes(scale), scores.shape[1]
    side_by_side = scale.strides[2] == scale.itemsize
    index, row, c = start // page_size, start % page_size, 0
    while c < cols:
        page = block_table[b, index]
        run = min(cols - c, page_size - row)
        at = (page * scale.strides[0] + h * scale.strides[1]) // scale.itemsize + row
        whole = run // n * n if side_by_side else 0
        if keep_zeros and whole > 0 and not _products.finite_span(scale, at, at + whole):
            whole = 0
        factors = scale[page, h, row:row + run]
        for r in range(rows):
            done = _scale_vectors(scores, r * sw + c, scale, at, whole, unit_scale)
            line = scores[r, c:c + run]
            if keep_zeros:
                for i in range(done, run):
                    value = line[i]
                    line[i] = value * unit_scale * factors[i] if value != 0 else value
            else:
                for i in range(done, run):
                    line[i] = line[i] * unit_scale * factors[i]
        c += run
        index, row = index + 1, 0


def _scale_vectors(scores, o, scale, at, count, unit_scale):
    """scores[o + i] = scores[o + i] * unit_scale * scale[at + i] (flat), i < count (whole
    vectors), a vector at a time; returns how many it scaled: `count`, or 0 where their dtypes
    differ (no quantized cache has float64 scores)."""


@overload(_scale_vectors, jit_options=STRICT_OPTIONS)
def _scale_vectors_impl(scores, o, scale, at, count, unit_scale):
    if scores.dtype != scale.dtype:
        return lambda scores, o, scale, at, count, unit_scale: 0

    def impl(scores, o, scale, at, count, unit_scale):
        unit_vec = vsplat(unit_scale, scores)
        for i in range(0, count, _layout.lanes(scores)):
            vstore(scores, o + i, vmul(vmul(vload(scores, o + i), unit_vec),
                                       vload(scale, at + i)))
        return count
    return impl


@jit
def _buffers(rows, block_k, copied, d, dv, like):
    """q_rows, scores and acc of one thread's work items, and k_rows and v_tile for widened
    copies of `copied` key and value rows (zero when the rows are read in place). D and Dv are
    padded to whole vectors (to two for scores and acc, as `_layout.tile_buffers` pads them),
    and the rows of scores to a multiple of four (`_dot_rows` stores two or four rows at a
    time)."""
    dtype = like.dtype
    n = _layout.lanes(like)
    dp, dvp = _layout.round_up(d, n), _layout.round_up(dv, 2 * n)
    keys, score_rows = _layout.round_up(block_k, 2 * n), _layout.round_up(rows, 4)
    return (np.zeros((rows, dp), dtype=dtype), np.zeros((copied, dp), dtype=dtype),
            np.zeros((copied, dvp), dtype=dtype), np.zeros((score_rows, keys), dtype=dtype),
            np.zeros((rows, dvp), dtype=dtype))


@jit_borrowing
def _block_runs(cache, block_table, b, h, start, cols, page_size, run_cols, starts):
    """Cut the cache rows of positions start .. start + cols (batch b, head h) into runs of
    consecutive rows, one per page they lie in: fills `run_cols` (the block column where each
    run starts, then `cols`) and `starts` (the flat element offset of each run's first row);
    returns the number of runs (none, and nothing read, for ``cols <= 0``)."""
    n_runs, c = 0, 0
    while c < cols:
        index, row = (start + c) // page_size, (start + c) % page_size
        run_cols[n_runs] = c
        starts[n_runs] = row_offset(cache, block_table[b, index], h, row)
        c += min(page_size - row, cols - c)
        n_runs += 1
    run_cols[n_runs] = cols
    return n_runs


@jit_borrowing
def _pair_runs(k_cache, v_cache, block_table, b, h, start, cols, page_size, runs):
    """`_block_runs` of a block's key and value rows, both read in place: their block columns,
    key and value starts in `runs` rows 0, 1 and 2 (`_item_buffers`); returns their number."""
    n_runs = _block_runs(k_cache, block_table, b, h, start, cols, page_size, runs[0], runs[1])
    _block_runs(v_cache, block_table, b, h, start, cols, page_size, runs[0], runs[2])
    return n_runs


@jit_borrowing
def _next_runs(k_cache, block_table, b, h, start, end, block_k, page_size, runs):
    """`_block_runs` of the key rows of the block after the one at `start` (keys up to `end`),
    into `runs` rows 3 and 4: what the P V of this block prefetches; returns their number."""
    return _block_runs(k_cache, block_table, b, h, start + block_k,
                       min(block_k, end - start - block_k), page_size, runs[3], runs[4])


@jit_borrowing
def _int4_runs(k_cache, v_cache, scales, block_table, b, h, start, cols, page_size, runs):
    """`_pair_runs` of int4 caches, and the starts of the rows' scales in `runs` rows 5 and 6."""
    n_runs = _pair_runs(k_cache, v_cache, block_table, b, h, start, cols, page_size, runs)
    _block_runs(scales[0], block_table, b, h, start, cols, page_size, runs[0], runs[5])
    _block_runs(scales[1], block_table, b, h, start, cols, page_size, runs[0], runs[6])
    return n_runs


@jit_borrowing
def _one_run(cols, run_cols, k_starts, v_starts):
    """The runs of a widened copy: all `cols` rows, from the start of the buffers."""
    run_cols[0], run_cols[1] = 0, cols
    k_starts[0] = v_starts[0] = 0
    return 1


@jit_borrowing
def _widen_rows(cache, block_table, b, h, start, cols, page_size, dst, half_kind):
    """The general gather: element by element, any strides, half-precision bits widened."""
    for c in range(cols):
        page = block_table[b, (start + c) // page_size]
        for x in range(cache.shape[3]):
            dst[c, x] = widen(cache[page, h, (start + c) % page_size, x], half_kind)


@jit_borrowing
def _int4_rows(cache, scale, block_table, b, h, start, cols, page_size, dst, unit_order):
    """Rows start .. start + cols of an int4 cache (batch b, head h) into the float32 rows of
    `dst`: each number times its group's scale, the bits of `_quantize.dequantize_rows`, in the
    row's order, or in `_int4`'s unit order with `unit_order`. A vector of numbers at a time
    where a group is whole vectors, else number by number."""
    n_groups = scale.shape[3]
    d = 2 * cache.shape[3]
    size = d // n_groups
    n = _layout.lanes(dst)
    vectors = size % n == 0 and contiguous_rows(cache)
    stride = dst.shape[1]
    index, row = start // page_size, start % page_size  # (a division a row cost a tenth)
    for c in range(cols):
        if c and row == page_size - 1:
            index, row = index + 1, 0
        elif c:
            row += 1
        page = block_table[b, index]
        if vectors:
            o = row_offset(cache, page, h, row)
            for g in range(n_groups):
                factor = vsplat(scale[page, h, row, g], dst)
                if unit_order:  # (whole units in each group: `_int4.fused`)
                    for x in range(g * size, (g + 1) * size, 2 * n):
                        even, odd = vload_i4_scaled(cache, o + x // 2, factor)
                        vstore(dst, c * stride + x, even)
                        vstore(dst, c * stride + x + n, odd)
                else:
                    for x in range(g * size, (g + 1) * size, n):
                        vstore(dst, c * stride + x, vmul(vload_i4(cache, o + x // 2), factor))
        else:
            for x in range(d):
                pair = np.int32(cache[page, h, row, x // 2])
                number = pair >> 4 if x & 1 else pair & 15
                if number > 7:  # the nibble's sign bit
                    number -= 16
                dst[c, x] = np.float32(number) * scale[page, h, row, x // size]


@jit_borrowing
def _int4_scores(q_rows, k_cache, v_cache, scales, block_table, b, h, start, cols, page_size,
                 runs, k_rows, scores, rows, fused):
    """S = Q K^T over a block of an int4 cache: read in place where `fused` (`_int4.dot_rows`;
    q_rows in unit order, the block's value rows prefetched meanwhile), else through float32
    copies of its rows in `k_rows`. Returns the block's number of runs, `runs` rows 1 and 5
    (2 and 6) filled with the starts of the key (value) rows and of their scales where
    `fused`."""
    k_scale, v_scale = scales
    run_cols, starts = runs[0], runs[1]
    if fused:
        n_runs = _int4_runs(k_cache, v_cache, scales, block_table, b, h, start, cols, page_size,
                            runs)
        size = 2 * k_cache.shape[3] // k_scale.shape[3]
        _int4.dot_rows(q_rows, k_cache, k_scale, (run_cols, starts, n_runs, k_cache.strides[2]),
                       (runs[5], _row_step(k_scale), _group_step(k_scale), size), scores, rows,
                       (v_cache, runs[2], v_cache.strides[2], v_scale, runs[6],
                        _row_step(v_scale)))
        return n_runs
    n_runs = _one_run(cols, run_cols, starts, runs[2])
    _int4_rows(k_cache, k_scale, block_table, b, h, start, cols, page_size, k_rows, False)
    own = (run_cols, starts, n_runs, k_rows.shape[1])
    _dot_rows(q_rows, k_rows, own, scores, rows, 0, k_rows, own, False, NOTHING_NEXT)
    return n_runs


@jit_borrowing
def _row_step(scale):
    """Elements from one row's scales to the next row's in an int4 cache's scales."""
    return scale.strides[2] // scale.itemsize


@jit_borrowing
def _group_step(scale):
    """Elements from one group's scale to the next one's in an int4 cache's scales."""
    return scale.strides[3] // scale.itemsize


@jit_borrowing
def _int4_values(scores, v_cache, v_scale, block_table, b, h, start, cols, page_size, runs,
                 n_runs, v_tile, acc, alpha, rows, seen, fused, later):
    """acc = alpha * acc + P V over a block of an int4 cache: read in place where `fused`
    (`_int4.pv_rows`; acc in unit order; `runs` as `_int4_scores` left them) unless some row
    may not see some key and a value row is not finite (`_pv_rows`' careful route), else
    through float32 copies of its rows in `v_tile` (in unit order where `fused`). `later`:
    the next block's key rows (`_int4.pv_rows`)."""
    run_cols, starts = runs[0], runs[2]
    if fused:
        size = 2 * v_cache.shape[3] // v_scale.shape[3]
        value_runs = (run_cols, starts, n_runs, v_cache.strides[2])
        scale_runs = (runs[6], _row_step(v_scale), _group_step(v_scale), size)
        if not seen[0] or _int4.finite_scales(v_scale, scale_runs, value_runs,
                                              v_scale.shape[3], acc):
            _int4.pv_rows(scores, v_cache, v_scale, value_runs, scale_runs, 2 * v_cache.shape[3],
                          acc, alpha, rows, later)
            return
    n_runs = _one_run(cols, run_cols, runs[1], starts)
    _int4_rows(v_cache, v_scale, block_table, b, h, start, cols, page_size, v_tile, fused)
    own = (run_cols, starts, n_runs, v_tile.shape[1])
    _pv_rows(scores, v_tile, own, v_tile.shape[1], acc, alpha, rows, 0, v_tile,
             (run_cols, starts, 0, v_tile.shape[1]), seen)


@jit_borrowing
def _dot_rows(q_rows, keys, runs, scores, rows, half_kind, later, later_runs, ahead,
              next_start):
    """scores[r, c] = q_rows[r] . (key row of block column c), the key rows given as `runs`
    = (run_cols, starts, n_runs, step) (`_block_runs`: block column run_cols[i] is the row at
    flat element starts[i] of `keys`, the run's next rows `step` elements apart). q_rows are
    zero-padded to whole vectors and so must the key rows be, or D a multiple of them.

    Each dot product is one chain of FMAs along D, summed by `vstore_hsums` (bit for bit
    `vhsum`), so a score's bits do not depend on how the keys are grouped. `scores` has rows up
    to a multiple of four; the micro-kernels may write sums of repeated rows into those past
    `rows`, which nothing reads.

    With `ahead`, the four-row micro-kernel of the first four rows also prefetches the rows of
    the same block columns in `later` (`later_runs`, the same columns: the block's value rows),
    one cache line per vector: the kernel reads two arrays in turns, and the
    hardware prefetcher would start each turn cold. The one-pass kernels for eight vectors
    (`_stream_dot4`, `_stream_dot2`) prefetch their own key rows ahead instead, past the block's
    end into the next block, whose first row is at flat `next_start` of `keys` (`NOTHING_NEXT`:
    no next block).
    """
    if _one_pass(q_rows.shape[1], rows, half_kind, q_rows):
        if rows > 2:
            _stream_dot4(q_rows, rows, keys, runs, scores, half_kind, next_start)
        else:
            _stream_dot2(q_rows, rows, keys, runs, scores, half_kind, next_start)
        return
    for r in range(0, rows, 4):
        _dot4x4(q_rows, r, min(4, rows - r), keys, runs, scores, half_kind, later, later_runs,
                ahead and r == 0)


@jit_borrowing
def _one_pass(width, rows, half_kind, like):
    """Whether a block goes through the one-pass kernels (`_stream_dot4`, `_stream_dot2`,
    `_stream_pv2`): up to four query rows of a head dim of eight vectors, in a float cache. Half
    caches keep the four-row shapes: the one-pass Q K^T, widening as it loads, measured 2x
    slower on a float16 cache."""
    return width == 8 * _layout.lanes(like) and rows <= 4 and half_kind == 0


@jit_borrowing
def _stream_dot2(q_rows, count, keys, runs, scores, half_kind, next_start):
    """`_dot_rows` for rows 0 .. count - 1 (count <= 2) of a head dim of eight vectors: both
    rows' query vectors are held in registers and every key row is read front to back, four
    keys at a time, prefetching the key rows `AHEAD` columns on as `_stream_dot4` does. A
    missing second row repeats the first, its sums landing in the padding rows of `scores`."""
    dp, sw = q_rows.shape[1], scores.shape[1]
    run_cols, starts, n_runs, step = runs
    qs = _pair_vectors(q_rows, 0, (count - 1) * dp)
    for i in range(n_runs):
        c, end, k = run_cols[i], run_cols[i + 1], starts[i]
        ahead = AHEAD * step  # the prefetched rows: in this run, then in the next one
        beyond = ahead + _run_jump(runs, i, next_start)
        while c + 4 <= end:
            _prefetch_rows(keys, k + (ahead if c + AHEAD + 4 <= end else beyond), 4, step, dp)
            a0, b0 = _dot2(keys, k, half_kind, qs)
            a1, b1 = _dot2(keys, k + step, half_kind, qs)
            a2, b2 = _dot2(keys, k + 2 * step, half_kind, qs)
            a3, b3 = _dot2(keys, k + 3 * step, half_kind, qs)
            vstore_hsums(scores, c, sw, (a0, a1, a2, a3, b0, b1, b2, b3))
            c += 4
            k += 4 * step
        for c in range(c, end):  # the run's last keys, one at a time
            _prefetch_rows(keys, k + beyond, 1, step, dp)
            a, b_ = _dot2(keys, k, half_kind, qs)
            scores[0, c] = vhsum(a)
            scores[1, c] = vhsum(b_)
            k += step


@jit_borrowing
def _stream_dot4(q_rows, count, keys, runs, scores, half_kind, next_start):
    """`_dot_rows` for rows 0 .. count - 1 (count of 3 or 4) of a head dim of eight vectors,
    in one pass over the keys: a second pass over a block, even one served from L2, costs the
    stream far more than its arithmetic (docs/history.md, "What caps decoding"). Rows 0 and 1
    keep their query vectors in registers and rows 2 and 3 load theirs from L1, two keys at a
    time: 8 FMA chains in 27 registers. Each step prefetches the key rows `AHEAD` columns on:
    this loop issues more instructions per cache line than the hardware prefetcher keeps ahead
    of (measured there). The
    prefetched rows are found from the current one, one stride per row, and on a run's last
    rows in the next run (`_run_jump`): no bookkeeping in the loop, which with the block in L2
    took as long as the arithmetic. A missing fourth row repeats the third, its sums landing in
    the padding row of `scores`."""
    dp, sw = q_rows.shape[1], scores.shape[1]
    run_cols, starts, n_runs, step = runs
    qs = _pair_vectors(q_rows, 0, dp)
    o2, o3 = 2 * dp, (count - 1) * dp
    for i in range(n_runs):
        c, end, k = run_cols[i], run_cols[i + 1], starts[i]
        ahead = AHEAD * step  # the prefetched rows: in this run, then in the next one
        beyond = ahead + _run_jump(runs, i, next_start)
        while c + 2 <= end:
            _prefetch_rows(keys, k + (ahead if c + AHEAD + 2 <= end else beyond), 2, step, dp)
            a0, a1, b0, b1, e0, e1, f0, f1 = _dot4x2(keys, k, k + step, half_kind, qs, q_rows,
                                                     o2, o3)
            vstore_hsums(scores, c, sw, ((a0, a1), (b0, b1), (e0, e1), (f0, f1)))
            c += 2
            k += 2 * step
        if c < end:  # the run's last key
            _prefetch_rows(keys, k + beyond, 1, step, dp)
            a0, a1, b0, b1, e0, e1, f0, f1 = _dot4x2(keys, k, k, half_kind, qs, q_rows, o2, o3)
            scores[0, c], scores[1, c] = vhsum(a0), vhsum(b0)
            scores[2, c], scores[3, c] = vhsum(e0), vhsum(f0)


@jit_borrowing
def _run_jump(runs, i, next_start):
    """How far the row after run i's last lies from where it would be in the same run, in
    elements: the prefetches of `_stream_dot4` and `_stream_dot2` add it past a run's end. The row
    after the block's last run is the next block's first, at flat `next_start`; with none
    (`NOTHING_NEXT`), the prefetches fall back on the run's own rows, already read."""
    run_cols, starts, n_runs, step = runs
    if i + 1 < n_runs:
        after = starts[i + 1]
    elif next_start != NOTHING_NEXT:
        after = next_start
    else:
        return -AHEAD * step
    return after - starts[i] - (run_cols[i + 1] - run_cols[i]) * step


@jit_borrowing
def _prefetch_rows(arr, o, rows, step, width):
    """Prefetch the cache lines of `width` elements of `rows` rows from flat o, `step` apart."""
    for r in range(rows):
        for x in range(0, width, line_elements(arr)):
            prefetch(arr, o + r * step + x)


@jit_borrowing
def _run_position(runs, c):
    """(run, flat offset of its row) of block column c of a block given as runs; (n_runs, 0)
    past the block's end."""
    run_cols, starts, n_runs, step = runs
    j = 0
    while j < n_runs and run_cols[j + 1] <= c:
        j += 1
    return j, (starts[j] + (c - run_cols[j]) * step if j < n_runs else 0)


@jit_borrowing
def _next_position(runs, c, j, o):
    """`_run_position` of column c + 1 from that of column c, (j, o)."""
    run_cols, starts, n_runs, step = runs
    if j >= n_runs:
        return j, o
    if c + 1 < run_cols[j + 1]:
        return j, o + step
    return j + 1, (starts[j + 1] if j + 1 < n_runs else 0)


@jit_borrowing
def _dot4x2(keys, k0, k1, half_kind, qs, q_rows, o2, o3):
    """The eight dot products of the key rows at flat k0 and k1 with four query rows: those
    whose vectors are `qs` (as in `_dot2`), then those at flat o2 and o3 of `q_rows`. Returns
    (row 0 x k0, row 0 x k1, row 1 x k0, ..., row 3 x k1), each one FMA chain along D, bit for
    bit `_dot2`'s."""
    n = _layout.lanes(qs[0])
    z = vzeros(qs[0])
    acc = (z, z, z, z, z, z, z, z)
    acc = _quad_step(keys, k0, k1, 0, half_kind, qs[0], qs[8], q_rows, o2, o3, acc)
    acc = _quad_step(keys, k0, k1, n, half_kind, qs[1], qs[9], q_rows, o2, o3, acc)
    acc = _quad_step(keys, k0, k1, 2 * n, half_kind, qs[2], qs[10], q_rows, o2, o3, acc)
    acc = _quad_step(keys, k0, k1, 3 * n, half_kind, qs[3], qs[11], q_rows, o2, o3, acc)
    acc = _quad_step(keys, k0, k1, 4 * n, half_kind, qs[4], qs[12], q_rows, o2, o3, acc)
    acc = _quad_step(keys, k0, k1, 5 * n, half_kind, qs[5], qs[13], q_rows, o2, o3, acc)
    acc = _quad_step(keys, k0, k1, 6 * n, half_kind, qs[6], qs[14], q_rows, o2, o3, acc)
    return _quad_step(keys, k0, k1, 7 * n, half_kind, qs[7], qs[15], q_rows, o2, o3, acc)


@jit_borrowing
def _quad_step(keys, k0, k1, x, half_kind, qa, qb, q_rows, o2, o3, acc):
    """Elements x .. x + lanes of `_dot4x2`'s eight chains."""
    y0, y1 = load_widened(keys, k0 + x, half_kind), load_widened(keys, k1 + x, half_kind)
    a0, a1, b0, b1, e0, e1, f0, f1 = acc
    q = vload(q_rows, o2 + x)
    e0, e1 = vfma(q, y0, e0), vfma(q, y1, e1)
    q = vload(q_rows, o3 + x)
    f0, f1 = vfma(q, y0, f0), vfma(q, y1, f1)
    return (vfma(qa, y0, a0), vfma(qa, y1, a1), vfma(qb, y0, b0), vfma(qb, y1, b1), e0, e1, f0,
            f1)


@jit_borrowing
def _pair_vectors(q_rows, o, p):
    """The eight vectors of the query row at flat o, then the eight of the one at flat p."""
    n = _layout.lanes(q_rows)
    return (vload(q_rows, o), vload(q_rows, o + n), vload(q_rows, o + 2 * n),
            vload(q_rows, o + 3 * n), vload(q_rows, o + 4 * n), vload(q_rows, o + 5 * n),
            vload(q_rows, o + 6 * n), vload(q_rows, o + 7 * n),
            vload(q_rows, p), vload(q_rows, p + n), vload(q_rows, p + 2 * n),
            vload(q_rows, p + 3 * n), vload(q_rows, p + 4 * n), vload(q_rows, p + 5 * n),
            vload(q_rows, p + 6 * n), vload(q_rows, p + 7 * n))


@jit_borrowing
def _dot2(keys, k, half_kind, qs):
    """The two dot products of the key row at flat `k` with the query rows whose eight
    vectors each are `qs` (the first row's, then the second's): two FMA chains along D."""
    n = _layout.lanes(qs[0])
    y = load_widened(keys, k, half_kind)
    a, b = vfma(qs[0], y, vzeros(y)), vfma(qs[8], y, vzeros(y))
    y = load_widened(keys, k + n, half_kind)
    a, b = vfma(qs[1], y, a), vfma(qs[9], y, b)
    y = load_widened(keys, k + 2 * n, half_kind)
    a, b = vfma(qs[2], y, a), vfma(qs[10], y, b)
    y = load_widened(keys, k + 3 * n, half_kind)
    a, b = vfma(qs[3], y, a), vfma(qs[11], y, b)
    y = load_widened(keys, k + 4 * n, half_kind)
    a, b = vfma(qs[4], y, a), vfma(qs[12], y, b)
    y = load_widened(keys, k + 5 * n, half_kind)
    a, b = vfma(qs[5], y, a), vfma(qs[13], y, b)
    y = load_widened(keys, k + 6 * n, half_kind)
    a, b = vfma(qs[6], y, a), vfma(qs[14], y, b)
    y = load_widened(keys, k + 7 * n, half_kind)
    a, b = vfma(qs[7], y, a), vfma(qs[15], y, b)
    return a, b


@jit_borrowing
def _dot4x4(q_rows, r, count, keys, runs, scores, half_kind, later, later_runs, ahead):
    """`_dot_rows` for rows r .. r + count - 1 (count <= 4), any head dim: the rows x four keys
    at a time, up to 16 independent FMA chains, each key vector loaded once for the rows and
    each query vector once for four keys, and one shared reduction tree for the sums. Rows past
    the count are skipped, not repeated (the branches are the same each step, and predicted):
    a multi-head model's group of one row did four times the arithmetic it needs, which held
    an int8 cache far above the time its bytes take (measured: docs/history.md, "Decoding",
    8-bit caches on Zen 4)."""
    n, dp, sw = _layout.lanes(q_rows), q_rows.shape[1], scores.shape[1]
    run_cols, starts, n_runs, step = runs
    later_starts, later_step = later_runs[1], later_runs[3]
    q0, q1, q2, q3 = _row_starts(r, count, dp)
    for i in range(n_runs):
        c, end, k, lk = run_cols[i], run_cols[i + 1], starts[i], later_starts[i]
        while c + 4 <= end:
            k0, k1, k2, k3 = k, k + step, k + 2 * step, k + 3 * step
            s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = vzeros(q_rows)
            s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = s00
            for x in range(0, dp, n):
                y0 = load_widened(keys, k0 + x, half_kind)
                y1 = load_widened(keys, k1 + x, half_kind)
                y2 = load_widened(keys, k2 + x, half_kind)
                y3 = load_widened(keys, k3 + x, half_kind)
                # the same columns of four later rows, once per cache line (an 8-bit row has
                # four vectors to a line)
                if ahead and x % line_elements(later) == 0:
                    prefetch(later, lk + x)
                    prefetch(later, lk + later_step + x)
                    prefetch(later, lk + 2 * later_step + x)
                    prefetch(later, lk + 3 * later_step + x)
                ys = (y0, y1, y2, y3)
                s00, s01, s02, s03 = _fma4(vload(q_rows, q0 + x), ys, s00, s01, s02, s03)
                if count > 1:
                    s10, s11, s12, s13 = _fma4(vload(q_rows, q1 + x), ys, s10, s11, s12, s13)
                if count > 2:
                    s20, s21, s22, s23 = _fma4(vload(q_rows, q2 + x), ys, s20, s21, s22, s23)
                if count > 3:
                    s30, s31, s32, s33 = _fma4(vload(q_rows, q3 + x), ys, s30, s31, s32, s33)
            _layout.store_row_sums(scores, r * sw + c, sw, count,
                                   (s00, s01, s02, s03, s10, s11, s12, s13,
                                    s20, s21, s22, s23, s30, s31, s32, s33))
            c += 4
            k += 4 * step
            lk += 4 * later_step
        for c in range(c, end):  # the run's last keys, one at a time
            for j in range(count):
                total = vzeros(q_rows)
                for x in range(0, dp, n):
                    total = vfma(vload(q_rows, (r + j) * dp + x),
                                 load_widened(keys, k + x, half_kind), total)
                scores[r + j, c] = vhsum(total)
            k += step


@jit_borrowing
def _pv_rows(scores, values, runs, width, acc, alpha, rows, half_kind, later, later_runs, seen):
    """acc = alpha * acc + P V over the value rows given as `runs` (see `_dot_rows`), their
    first `width` elements, a whole number of vectors; the rest of `acc` is left as it is.

    `seen` = (hidden, n_q, offset, window, mods, at): `hidden` when some row may not see some
    key of the block (the window ``(left, right)``, or a mask of `mods`, which is None where
    there is none); row r's diagonal is block column r % n_q + offset, and `at` places the
    block as `_steps.modify_tile` takes it, for the group's first head (row r's is
    ``at[1] + r // n_q``). Where a row cannot see
    every key and a value row is inf or NaN, the rows go one by one over what each sees: the
    group sums would give that row 0 * inf = NaN.

    Each query row's block sum starts from zero in registers, adds the value rows in order and
    joins `acc` once (`_layout.rescale_add`), as in `_products.pv_tile`, so the bits do not depend
    on the grouping below. A head dim of eight vectors in a float cache takes two query rows x
    whole value rows at a time (every value row read front to back, nothing else loaded but
    P); others take four rows x four vectors, then four rows x one, the four-vector passes of
    the first four rows prefetching meanwhile the same columns of the rows in `later` given as
    `later_runs` (the next block's key rows).
    """
    n = _layout.lanes(acc)
    if seen[0] and not _finite_runs(values, runs, width, half_kind, acc):
        _pv_rows_seen(scores, values, runs, width, acc, alpha, rows, half_kind, seen)
        return
    if _one_pass(width, rows, half_kind, acc):
        for r in range(0, rows, 2):
            _stream_pv2(scores, r, min(2, rows - r), values, runs, acc, alpha, half_kind)
        return
    no_later = (later_runs[0], later_runs[1], 0, later_runs[3])  # rows past the first four
    for r in range(0, rows, 4):
        count = min(4, rows - r)
        x = 0
        while x + 4 * n <= width:
            _pv_micro4x4(scores, r, count, values, runs, x, acc, alpha, half_kind, later,
                         later_runs if r == 0 else no_later)
            x += 4 * n
        for x in range(x, width, n):
            _pv_micro4x1(scores, r, count, values, runs, x, acc, alpha, half_kind)


@jit_borrowing
def _finite_runs(values, runs, width, half_kind, like):
    """Whether the value rows given as runs hold only finite numbers in their first `width`
    elements (x - x is 0 for those, NaN for inf and NaN)."""
    run_cols, starts, n_runs, step = runs
    total = vzeros(like)
    for i in range(n_runs):
        o = starts[i]
        for c in range(run_cols[i], run_cols[i + 1]):
            for x in range(0, width, _layout.lanes(like)):
                v = load_widened(values, o + x, half_kind)
                total = vadd(total, vsub(v, v))
            o += step
    return vhsum(total) == 0


@jit_borrowing
def _pv_rows_seen(scores, values, runs, width, acc, alpha, rows, half_kind, seen):
    """`_pv_rows` row by row, each over only the keys it sees (see `_pv_rows`): the same sums
    in the same order for finite values, less the terms of the keys it cannot see."""
    n, sw = _layout.lanes(acc), scores.shape[1]
    run_cols, starts, n_runs, step = runs
    _, n_q, offset, (left, right), mods, at = seen
    seq, h0, q0, kb, diag0, b, state = at
    for r in range(rows):
        diag = r % n_q + offset
        first = diag - left if left >= 0 else -_layout.UNBOUNDED
        last = diag + right if right >= 0 else _layout.UNBOUNDED
        row_at = (seq, h0 + r // n_q, q0, kb, diag0, b, state)
        for x in range(0, width, n):
            total = vzeros(acc)
            for i in range(n_runs):
                o = starts[i] + x
                for c in range(run_cols[i], run_cols[i + 1]):
                    if first <= c <= last and _steps.key_visible(mods, row_at, r % n_q, c):
                        total = vfma(vbroadcast(scores, r * sw + c),
                                     load_widened(values, o, half_kind), total)
                    o += step
            _layout.rescale_add(acc, r * acc.shape[1] + x, alpha[r], total)


@jit_borrowing
def _stream_pv2(scores, r, count, values, runs, acc, alpha, half_kind):
    """Rows r, r + count - 1 (count <= 2) x eight vectors: 16 accumulators in registers over
    the whole block. A missing second row repeats the first and is not stored."""
    n, sw = _layout.lanes(acc), scores.shape[1]
    run_cols, starts, n_runs, step = runs
    p0, p1 = r * sw, (r + count - 1) * sw
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzeros(acc)
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = a0
    for i in range(n_runs):
        o = starts[i]
        for c in range(run_cols[i], run_cols[i + 1]):
            v0, v1 = load_widened(values, o, half_kind), load_widened(values, o + n, half_kind)
            v2 = load_widened(values, o + 2 * n, half_kind)
            v3 = load_widened(values, o + 3 * n, half_kind)
            v4 = load_widened(values, o + 4 * n, half_kind)
            v5 = load_widened(values, o + 5 * n, half_kind)
            v6 = load_widened(values, o + 6 * n, half_kind)
            v7 = load_widened(values, o + 7 * n, half_kind)
            p = vbroadcast(scores, p0 + c)
            a0, a1, a2, a3 = vfma(p, v0, a0), vfma(p, v1, a1), vfma(p, v2, a2), vfma(p, v3, a3)
            a4, a5, a6, a7 = vfma(p, v4, a4), vfma(p, v5, a5), vfma(p, v6, a6), vfma(p, v7, a7)
            p = vbroadcast(scores, p1 + c)
            b0, b1, b2, b3 = vfma(p, v0, b0), vfma(p, v1, b1), vfma(p, v2, b2), vfma(p, v3, b3)
            b4, b5, b6, b7 = vfma(p, v4, b4), vfma(p, v5, b5), vfma(p, v6, b6), vfma(p, v7, b7)
            o += step
    _join4(acc, r, 0, alpha, a0, a1, a2, a3)
    _join4(acc, r, 4 * n, alpha, a4, a5, a6, a7)
    if count > 1:
        _join4(acc, r + 1, 0, alpha, b0, b1, b2, b3)
        _join4(acc, r + 1, 4 * n, alpha, b4, b5, b6, b7)


@jit_borrowing
def _pv_micro4x4(scores, r, count, values, runs, x, acc, alpha, half_kind, later, later_runs):
    """Rows r .. r + count - 1 (count <= 4) x four vectors from column x: up to 16
    accumulators held in registers over the whole block; rows past the count are skipped (as
    in `_dot4x4`)."""
    n, sw = _layout.lanes(acc), scores.shape[1]
    run_cols, starts, n_runs, step = runs
    n_later = later_runs[2]
    p0, p1, p2, p3 = _row_starts(r, count, sw)
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = vzeros(acc)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = a00
    j, lo = _run_position(later_runs, 0)  # the later row
    for i in range(n_runs):
        o = starts[i] + x
        for c in range(run_cols[i], run_cols[i + 1]):
            v0, v1 = load_widened(values, o, half_kind), load_widened(values, o + n, half_kind)
            v2 = load_widened(values, o + 2 * n, half_kind)
            v3 = load_widened(values, o + 3 * n, half_kind)
            if j < n_later:  # the same columns of a later row, each cache line once
                for e in range(0, 4 * n, line_elements(later)):
                    prefetch(later, lo + x + e)
                j, lo = _next_position(later_runs, c, j, lo)
            vs = (v0, v1, v2, v3)
            a00, a01, a02, a03 = _fma4(vbroadcast(scores, p0 + c), vs, a00, a01, a02, a03)
            if count > 1:
                a10, a11, a12, a13 = _fma4(vbroadcast(scores, p1 + c), vs, a10, a11, a12, a13)
            if count > 2:
                a20, a21, a22, a23 = _fma4(vbroadcast(scores, p2 + c), vs, a20, a21, a22, a23)
            if count > 3:
                a30, a31, a32, a33 = _fma4(vbroadcast(scores, p3 + c), vs, a30, a31, a32, a33)
            o += step
    _join4(acc, r, x, alpha, a00, a01, a02, a03)
    if count > 1:
        _join4(acc, r + 1, x, alpha, a10, a11, a12, a13)
    if count > 2:
        _join4(acc, r + 2, x, alpha, a20, a21, a22, a23)
    if count > 3:
        _join4(acc, r + 3, x, alpha, a30, a31, a32, a33)


@jit_borrowing
def _pv_micro4x1(scores, r, count, values, runs, x, acc, alpha, half_kind):
    """`_pv_micro4x4` for one vector of columns (the last vectors of a narrow head)."""
    sw = scores.shape[1]
    run_cols, starts, n_runs, step = runs
    p0, p1, p2, p3 = _row_starts(r, count, sw)
    a0 = a1 = a2 = a3 = vzeros(acc)
    for i in range(n_runs):
        o = starts[i] + x
        for c in range(run_cols[i], run_cols[i + 1]):
            v = load_widened(values, o, half_kind)
            a0 = vfma(vbroadcast(scores, p0 + c), v, a0)
            if count > 1:
                a1 = vfma(vbroadcast(scores, p1 + c), v, a1)
            if count > 2:
                a2 = vfma(vbroadcast(scores, p2 + c), v, a2)
            if count > 3:
                a3 = vfma(vbroadcast(scores, p3 + c), v, a3)
            o += step
    for j, total in enumerate((a0, a1, a2, a3)):
        if j < count:
            _layout.rescale_add(acc, (r + j) * acc.shape[1] + x, alpha[r + j], total)


@jit_borrowing
def _join4(acc, r, x, alpha, a0, a1, a2, a3):
    """acc[r, x : x + 4 vectors] = alpha[r] * acc[r, ...] + (a0, a1, a2, a3)
    (`_layout.rescale_add`)."""
    o = r * acc.shape[1] + x
    for i, total in enumerate((a0, a1, a2, a3)):
        _layout.rescale_add(acc, o + i * _layout.lanes(acc), alpha[r], total)


def _signature(key, scale_axes=3):
    """(cache dtype, compute dtype, query dtype, the Numba types of the user's functions and
    their argument tuples): the same dtype thrice for a float cache; an 8-bit cache (int8, or
    uint8 float8 bits) with float32 queries."""
    cache, compute, query, user_types = key
    data = array(cache, 4, readonly=True)
    scale = array(np.float32, scale_axes, readonly=True)
    i8 = types.int64
    return types.void(
        array(query, 4, readonly=True), data, data, scale, scale,
        array(np.int64, 2, readonly=True), i8, array(np.int64, 1, readonly=True), i8, i8, i8,
        *_pipeline.kernel_types(compute, *user_types), array(compute, 5), array(compute, 4), i8)


def _signature_int4(key):
    """`_signature` of an int4 cache (uint8 pairs): its scales have an axis of groups."""
    return _signature(key, scale_axes=4)


decode = Kernel(_decode, _signature, "KV-cache decoding")
decode_plain = Kernel(
    variant(_decode, "_plain",
            _decode_items=jit_borrowing(variant(_decode_items.py_func, "_plain", PLAIN=True))),
    _signature, "KV-cache decoding")
decode_int4 = Kernel(
    variant(_decode, "_int4",
            _decode_items=jit_borrowing(variant(_decode_items.py_func, "_int4", INT4=True)),
            _item_buffers=_jit.jit(variant(_item_buffers.py_func, "_int4", INT4=True)),
            _work=jit_borrowing(variant(_work.py_func, "_int4", INT4=True))),
    _signature_int4, "KV-cache decoding (int4)")
decode_idot = Kernel(
    variant(_decode, "_idot",
            _decode_items=jit_borrowing(variant(_decode_items.py_func, "_idot", IDOT=True)),
            _item_buffers=_jit.jit(variant(_item_buffers.py_func, "_idot", IDOT=True))),
    _signature, "KV-cache decoding (integer Q K^T)")
decode_int4_idot = Kernel(
    variant(_decode, "_int4_idot",
            _decode_items=jit_borrowing(variant(_decode_items.py_func, "_int4_idot", INT4=True,
                                                IDOT=True)),
            _item_buffers=_jit.jit(variant(_item_buffers.py_func, "_int4_idot", INT4=True,
                                           IDOT=True)),
            _work=jit_borrowing(variant(_work.py_func, "_int4_idot", INT4=True))),
    _signature_int4, "KV-cache decoding (int4, integer Q K^T)")
