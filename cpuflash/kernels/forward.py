"""The FlashAttention-2 forward kernel.

One work item is one tile of `block_q` query rows of one (sequence, head). Items are spread
over the threads by `prange`, and each item runs the whole key loop on its own: its running row
max, running row sum and unnormalized accumulator live in buffers of the thread that owns it, and
its output rows are written once, after the last key block (FA-2's Q-outer loop and lazy
rescaling). The tile steps are small functions in `_steps` so the loop below reads like the
algorithm.

The softmax runs on the vectorized `exp2` of the SIMD layer: `exp(s - max)` is computed as
`exp2((s - max) * log2(e))`.

Sequences are described by a table so that batched input, packed (varlen) input and KV caches
share this kernel: row ``s`` of `seqs` is ``(batch_q, q_start, n_q, batch_k, k_start, n_k)``
(the columns `_band.SEQ_*`; the work items' are `_band.ITEM_*`) and
sequence ``s`` reads ``q[batch_q, :, q_start:q_start+n_q]`` and
``k[batch_k, :, k_start:k_start+n_k]``.
Per-sequence operands (ALiBi slopes, the rows of bias and mask) are indexed by ``s``.
"""

import numpy as np
from numba import prange, types

from .._jit import Kernel, array, jit, variant
from . import _layout, _pairs, _pipeline, _products, _steps, _user

# True in `fa2_forward_plain`'s copies of the functions below (`_jit.variant`), for calls with
# no modifier but a causal mask or a window: Numba then compiles none of the others' branches
PLAIN = False


def _fa2_forward(q, k, v, out, lse, seqs, items, chunk_ptr, block_q, block_k, key_align,
                 heads, half_kind, flat, score_args, mask_args):
    # (a parallel loop takes tuples one level deep: the pipeline comes in apart
    # (`_pipeline.kernel_args`) and is put together in the loop, as `mods`. The loop's body is
    # a function of its own: Numba types a parallel loop's body twice, and runs its passes
    # over it, where it is written)

    for chunk in prange(chunk_ptr.shape[0] - 1):
        mods = _pipeline.together(flat, score_args, mask_args)
        _forward_items(chunk_ptr[chunk], chunk_ptr[chunk + 1], q, k, v, out, lse, seqs, items,
                       block_q, block_k, key_align, heads, half_kind, mods)


@jit
def _forward_items(first_item, end_item, q, k, v, out, lse, seqs, items, block_q, block_k,
                   key_align, heads, half_kind, mods):
    """Work items first_item .. end_item - 1 of one thread: the tiles of `_fa2_forward`. An item
    is a query tile of `heads` heads of one kv head from its head on: each key block is packed
    once and then serves the heads' tiles in turn, each with its own state (the same steps, so
    the same results, as an item a head)."""
    d = q.shape[3]
    dv = v.shape[3]
    group = q.shape[1] // k.shape[1]
    cdtype = lse.dtype
    qk_scale, left, right, sinks = mods.scale, mods.left, mods.right, mods.sinks
    has_sinks = sinks.shape[0] > 0
    no_chain = np.empty((0, 0), dtype=cdtype)  # the forward needs no score derivatives
    # -- thread-local tile state, allocated once per chunk of work items, with packed key
    # blocks for the longest sequence's keys (not the array's: a cache's rows past its
    # length, or the keys a part of a call leaves to another, are never read; zeroing blocks
    # for them cost a folded call's causal part 20x its work)
    n_keys = _steps.longest_keys(seqs)
    # bfloat16 on AVX512-BF16: the tiles as bfloat16 pairs (`_pairs`); else empty
    q_pairs, k_kept_pairs, v_kept_pairs, p_pairs = _pairs.pair_buffers(
        block_q, block_k, d, dv, n_keys, key_align, q, lse, half_kind)
    pairs = q_pairs.shape[0] > 0
    q_tile, k_kept, v_kept, scores, acc = _layout.tile_buffers(
        block_q, block_k, d, dv, lse, 0 if pairs else n_keys, key_align)
    # each head's queries and state (``[j]`` for the item's head j)
    head_q_pairs, head_q_tiles = _layout.per_head(q_pairs, heads), _layout.per_head(q_tile, heads)
    head_accs = _layout.per_head(acc, heads)
    head_row_max = np.empty((heads, block_q), dtype=cdtype)
    head_row_sum = np.empty((heads, block_q), dtype=cdtype)
    alpha = np.empty(block_q, dtype=cdtype)
    # the packed key blocks kept for the next query tiles (`_layout.kept_block`)
    slots = np.full((k_kept_pairs.shape[0] if pairs else k_kept.shape[0], 4), -1, np.int64)
    k_panels, v_tile, k_pairs, v_pairs = k_kept[0], v_kept[0], k_kept_pairs[0], v_kept_pairs[0]
    # the part of the scale that Q takes as it is packed (`_pairs.folded_scale`)
    q_scale = _pairs.folded_scale(qk_scale) if PLAIN and pairs else 1.0
    # a partial tile's `mask_mod` answers (`_user.mask_mod_fill`)
    seen = np.empty((block_q, block_k) if _user.has_mask_mod(mods.functions) else (0, 0),
                    np.bool_)

    for item in range(first_item, end_item):
        (seq, h0, q0, batch_q, q_start, n_q,
         batch_k, k_start, n_k) = _steps.work_item(items, item, seqs)
        hk = h0 // group
        rows = min(block_q, n_q - q0)
        # bottom-right alignment: query row i sits over key column i + shift
        shift = n_k - n_q
        diag0 = q0 + shift  # key column under the tile's first row

        # -- the keys any row of this tile can see; blocks outside are never visited. Blocks
        # start at multiples of block_k whatever the tile (key_align = block_k); or, for a
        # narrow window (`tiling.band_tiles`), the tile's whole band is one block from a
        # multiple of key_align, which holds each row's whole band.
        k_lo, k_hi = _steps.visible_keys(diag0, rows, n_k, left, right, mods.chunk, 0,
                                         key_align)

        for j in range(heads):
            if pairs:
                _pairs.pack_query_pairs(q, batch_q, h0 + j, q_start + q0, rows, head_q_pairs[j],
                                        q_scale)
            else:
                _products.pack_query_groups(q, batch_q, h0 + j, q_start + q0, rows,
                                            head_q_tiles[j], half_kind)
            head_row_max[j, :rows] = -np.inf
            head_row_sum[j, :rows] = 0.0
            head_accs[j, :rows, :] = 0.0

        for kb in range(k_lo, k_hi, block_k):
            cols = min(block_k, k_hi - kb)
            for h in range(h0, h0 + heads):  # (see `_run._heads_an_item`)
                j = h - h0
                q_pairs, q_tile, acc = head_q_pairs[j], head_q_tiles[j], head_accs[j]
                row_max, row_sum = head_row_max[j], head_row_sum[j]
                # -- a block mask's empty tiles are never visited
                state = _user.FULL if PLAIN else _user.tile_state(mods, batch_q, h, q0, rows,
                                                                  kb, cols)
                if state == _user.EMPTY:
                    continue
                # -- the band of this block each row sees (tile columns r + lo_off ..
                # r + hi_off); blocks inside it need no element masks, and on its edges whole
                # panels are skipped
                inside, lo_off, hi_off = _steps.block_band(diag0, rows, kb, cols, left, right,
                                                           mods.chunk)
                # -- a partial tile of a `mask_mod`: its answers first, then only the box that
                # holds every visible pair: the rows below it keep their state (as they would
                # with every score -inf), the products and P V leave out the key panels beside
                # it, and a tile no row sees is skipped
                tile_rows, c_lo, c_hi = rows, 0, cols
                if not PLAIN and state == _user.PARTIAL and not pairs:
                    tile_rows, c_lo, c_hi = _user.mask_mod_fill(
                        mods.functions, seen, rows, cols, (lo_off, hi_off),
                        (batch_q, h, _user.query_index(mods, q0, diag0), kb), mods.mask_args)
                    if tile_rows == 0:
                        continue

                # -- pack the keys and values some row sees (from a whole panel), unless the
                # thread kept them from the item's previous head or the head's previous tile
                w = k_panels.shape[2]
                first = max(0, lo_off, c_lo) // w * w
                end = min(cols, tile_rows + hi_off, c_hi)
                if end > first:
                    s, held = _layout.kept_block(slots, batch_k * k.shape[1] + hk,
                                                 k_start + kb, first, end, key_align)
                    if pairs:
                        k_pairs, v_pairs = k_kept_pairs[s], v_kept_pairs[s]
                        if not held:
                            _pairs.pack_key_value_pairs(
                                k, v, batch_k, hk, k_start + kb + first, end - first,
                                k_pairs[first // w:], v_pairs[first // 2:])
                    else:
                        k_panels, v_tile = k_kept[s], v_kept[s]
                        if not held:
                            _products.pack_key_panels(k, batch_k, hk, k_start + kb + first,
                                                      end - first, k_panels[first // w:],
                                                      half_kind)
                            _products.pack_rows(v, batch_k, hk, k_start + kb + first,
                                                end - first, v_tile[first:], half_kind)

                # -- S = scale * Q K^T and the score modifiers, in the order of the score
                # pipeline, on each row's band; -inf where a key is hidden (element masks only
                # in blocks that cross a band edge)
                at = (seq, h, q0, kb, diag0, batch_q, state)
                band = (inside, lo_off, hi_off, left, right)
                if PLAIN and pairs:
                    _steps.band_scores(q_pairs, k_pairs, scores, rows, cols,
                                       qk_scale / q_scale, diag0 - kb, band)
                elif PLAIN:
                    _steps.band_scores(q_tile, k_panels, scores, rows, cols, qk_scale,
                                       diag0 - kb, band)
                elif pairs:
                    _steps.score_tile(q_pairs, k_pairs, scores, no_chain, rows, cols, at, band,
                                      mods, no_chain)
                elif state == _user.PARTIAL:  # (the mask_mod's answers are in `seen`)
                    _products.qk_columns(q_tile, k_panels, scores, tile_rows, cols,
                                         _pipeline.product_scale(mods), lo_off, hi_off, c_lo,
                                         c_hi)
                    _steps.modify_tile(scores, no_chain, tile_rows, cols,
                                       (seq, h, q0, kb, diag0, batch_q, _user.FULL), band, mods,
                                       no_chain)
                    _steps.hide_unseen(scores, seen, tile_rows, cols, lo_off, hi_off)
                else:
                    _steps.score_tile(q_tile, k_panels, scores, no_chain, rows, cols, at, band,
                                      mods, no_chain)

                # -- online softmax: new row max, rescale factor alpha, P = exp(S - max)
                _products.softmax_update(scores, row_max, row_sum, alpha, tile_rows, cols,
                                         lo_off, hi_off, q)

                # -- acc = alpha * acc + P V; where some row cannot see every key and a value
                # row is inf or NaN, row by row over what each row sees (0 * NaN is NaN)
                simple = (inside and not _steps.masks_keys(mods, state)) or end <= first
                if pairs and (simple or _pairs.finite_pairs(v_pairs, first // 2,
                                                            (end + 1) // 2, scores)):
                    _pairs.pv_tile_pairs(scores, p_pairs, v_pairs, acc, alpha, rows, cols,
                                         lo_off, hi_off)
                elif not pairs and (simple or _products.finite_rows(v_tile, first, end)):
                    _products.pv_columns(scores, v_tile, acc, alpha, tile_rows, cols, lo_off,
                                         hi_off, c_lo, c_hi)
                else:
                    if pairs:  # rare (an inf or NaN value): the exact path on widened values
                        _products.pack_rows(v, batch_k, hk, k_start + kb + first,
                                            end - first, v_tile[first:], half_kind)
                    _steps.pv_tile_exact(scores, v_tile, acc, alpha, tile_rows, cols, lo_off,
                                         hi_off, None if PLAIN else mods, at)

        # -- normalize once, write each output row once
        for h in range(h0, h0 + heads):
            sink = sinks[h] if has_sinks else -np.inf
            _products.finish_rows(head_accs[h - h0], head_row_max[h - h0], head_row_sum[h - h0],
                                  rows, sink, out, lse, batch_q, h, q_start + q0, half_kind)


def _signature(key):
    """(dtype, compute dtype, user types[, out dtype]): `out` has the inputs' dtype unless the
    key names another (the compute dtype: a part of a result to merge, never rounded)."""
    dtype, compute, user_types = key[:3]
    out = key[3] if len(key) > 3 else dtype
    data = array(dtype, 4, readonly=True)
    index2 = array(np.int64, 2, readonly=True)
    index1 = array(np.int64, 1, readonly=True)
    i8 = types.int64
    return types.void(data, data, data, array(out, 4), array(compute, 3), index2, index2,
                      index1, i8, i8, i8, i8, i8, *_pipeline.kernel_types(compute, *user_types))


fa2_forward = Kernel(_fa2_forward, _signature, "attention")
fa2_forward_plain = Kernel(
    variant(_fa2_forward, "_plain",
            _forward_items=jit(variant(_forward_items.py_func, "_plain", PLAIN=True))),
    _signature, "attention")
