"""The FlashAttention-2 backward kernel.

Given the forward's log-sum-exp `lse` and ``delta = rowsum(dO * O)`` of each query row, the
probabilities of a tile are rebuilt from the scores alone, ``P = exp(S - lse)`` (no running max:
the LSE is final), and the gradients follow tile by tile:

    dV += P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   dQ += dS K,   dK += dS^T Q

(the scale, and the derivative of the score pipeline's steps through `_steps.score_tile`'s
chain factor, in their places). `delta` is computed first, in a pass of its own. Then one of two
schemes, each summing in a fixed order with no atomics:

* **split** (seven tile products): the **key pass** has one work item per key block of one
  (sequence, kv head); it owns the block's dK and dV and visits, for each query head of the kv
  head's group in turn, the query tiles that see some key of the block (a GQA group's sum stays
  inside one item). The **query pass** has one item per query tile of one (sequence, head), as
  in the forward; it owns the tile's dQ, visits the key blocks the tile sees and rebuilds S and
  dP there;
* **fused** (five products; `fused=True`): one key-pass item per (sequence, kv head) visits
  every key block in turn and adds dS K to the dQ rows of its group, in `dq_acc`; the query
  pass then has nothing to do. Fewer items, less work.

Both add each block's contribution to dQ in the same order (key blocks ascending, each summed
by the same micro-kernel), so the choice, which depends on the thread count, does not change the
bits, and neither does the thread count. Blocks that no row can see (causal, windows) are never
visited.

Non-finite values stay where the forward keeps them: a key row holding inf or NaN reaches
only the rows that see it, a query or output-gradient row only the keys it sees. A product sums
a group of rows (or keys) over every key (or row) some of them sees, with 0 for the others, and
0 * inf is NaN; so blocks where some row cannot see every key (a band edge crosses them, or a
bool mask applies) are checked with `x - x` over their operands, and one with a non-finite
operand is summed over what each row sees only (`_steps.tn_tile_exact`, `pv_tile_exact`): the
same terms in the same order less terms that are 0, so finite rows keep their bits.

The tiles are laid out as the forward's (`_steps`): rows are query rows in both passes, so the
score pipeline is the forward's steps in the forward's orientation, and the products that sum
over query rows (dV, dK) use `_products.tn_tile`, whose broadcasts read the tile transposed.

bfloat16 inputs where the dot products pay (`_simd.BF16_DOT`) or on AMX tiles (`_amx.TILES`):
the five products are bfloat16 dot products with float32 accumulation (`_pairs`, whose two
product steps are `_tiles`' on AMX), P and dS rounded to bfloat16 before
the products that take them (as flash-attn does on GPUs); dV and dK read P and dS transposed, so
that the pairs run along the query rows. The exact steps for non-finite operands stay float32.

Sequences and work items are described by the forward's tables (`_band.SEQ_*`,
`_band.ITEM_*`); in the key pass an item's ``ITEM_HEAD`` is a kv head and ``ITEM_Q0`` the
first key of its block (0 with `fused`).
"""

import numba
import numpy as np
from numba import prange, types

from .._jit import Kernel, array, jit, variant
from .._simd import vfma, vhsum, vload, vzeros
from . import _layout, _pairs, _pipeline, _products, _steps, _user

# True in `fa2_backward_plain`'s copies of the passes (`_jit.variant`), for calls with no
# modifier but a causal mask or a window: Numba then compiles none of the others' branches
PLAIN = False


def _fa2_backward(q, k, v, out, dout, lse, delta, dq, dk, dv, dq_acc, seqs, q_items, q_chunks,
                  k_items, k_chunks, fused, block_q, block_k, half_kind, flat, score_args,
                  mask_args):
    d_v = v.shape[3]
    # (a parallel loop takes tuples one level deep: the pipeline comes in apart
    # (`_pipeline.kernel_args`) and is put together in the loops, as `mods`. The passes'
    # bodies are functions of their own: Numba types a parallel loop's body twice, and runs
    # its passes over it, where it is written)

    # ---- delta = rowsum(dO * O) of every query row, which both passes read
    for chunk in prange(q_chunks.shape[0] - 1):
        do_rows, o_rows = _rows_buffer(block_q, d_v, lse), _rows_buffer(block_q, d_v, lse)
        for item in range(q_chunks[chunk], q_chunks[chunk + 1]):
            seq, h, q0, batch_q, q_start, n_q, _, _, _ = _steps.work_item(q_items, item, seqs)
            _store_deltas(dout, out, batch_q, h, q_start + q0, min(block_q, n_q - q0), do_rows,
                          o_rows, delta, half_kind)

    # ---- the key pass: dK, dV of a key block, summed over the query tiles that see it; with
    # `fused`, an item is every key block of a (sequence, kv head) in turn, and dQ of the
    # group's rows is summed here too, in `dq_acc` (the query pass then has nothing to do)
    for chunk in prange(k_chunks.shape[0] - 1):
        mods = _pipeline.together(flat, score_args, mask_args)
        _key_pass(k_chunks[chunk], k_chunks[chunk + 1], q, k, v, dout, lse, delta, dq, dk, dv,
                  dq_acc, seqs, k_items, fused, block_q, block_k, half_kind, mods)

    # ---- the query pass: dQ of one query tile, summed over the key blocks it sees (in the
    # key pass's order: the sums, and so the bits, are those of the fused key pass)
    for chunk in prange(0 if fused else q_chunks.shape[0] - 1):
        mods = _pipeline.together(flat, score_args, mask_args)
        _query_pass(q_chunks[chunk], q_chunks[chunk + 1], q, k, v, dout, lse, delta, dq, dk, dv,
                    dq_acc, seqs, q_items, fused, block_q, block_k, half_kind, mods)


@jit
def _key_pass(first_item, end_item, q, k, v, dout, lse, delta, dq, dk, dv, dq_acc, seqs,
              items, fused, block_q, block_k, half_kind, mods):
    """The key pass over work items first_item .. end_item - 1 of `items` (`_fa2_backward`)."""
    d, d_v, group, cdtype = q.shape[3], v.shape[3], q.shape[1] // k.shape[1], lse.dtype
    qk_scale, left, right = mods.scale, mods.left, mods.right
    has_chain = _steps.chains(mods)
    visible = None if PLAIN else mods  # what `_steps.key_visible` needs beside the band
    no_pre = np.empty((0, 0), dtype=cdtype)  # the scores before a score_mod: not needed here
    # -- thread-local tiles: Q and dO twice (for the scores, and as padded rows for the
    # products), K and V as panels (and K as rows for dQ), S/P, dP/dS, the chain factor,
    # dK and dV
    q_tile, do_tile, k_panels, v_panels, scores, dp, chain = _score_buffers(
        block_q, block_k, d, d_v, lse)
    q_rows, do_rows = _rows_buffer(block_q, d, lse), _rows_buffer(block_q, d_v, lse)
    dk_acc, dv_acc = _rows_buffer(block_k, d, lse), _rows_buffer(block_k, d_v, lse)
    k_rows = _rows_buffer(block_k if fused else 0, d, lse)
    # bfloat16 on AVX512-BF16: the products as bfloat16 dot products (`_pairs`), with the
    # widened tiles kept for the exact steps and the finiteness checks. Else empty.
    q_pairs, do_pairs, k_panel_pairs, v_panel_pairs, k_row_pairs, ds_pairs = \
        _pairs.backward_pair_buffers(block_q, block_k, d, d_v, q, lse, half_kind)
    q_row_pairs, do_row_pairs, transposed, transposed_pairs = \
        _pairs.transposed_pair_buffers(block_q, block_k, d, d_v, q, lse, half_kind)
    pairs = q_pairs.shape[0] > 0
    lse_rows = np.empty(block_q, dtype=cdtype)
    delta_rows = np.empty(block_q, dtype=cdtype)
    # `pv_tile`'s rescale factors: none here (for a tile's rows, or its keys with pairs)
    ones = np.ones(max(block_q, block_k), dtype=cdtype)

    for item in range(first_item, end_item):
        (seq, hk, k_first, batch_q, q_start, n_q,
         batch_k, k_start, n_k) = _steps.work_item(items, item, seqs)
        shift = n_k - n_q  # bottom-right alignment: query row i sits over key i + shift
        if fused:
            for h in range(hk * group, (hk + 1) * group):
                row0 = _acc_row(dq, batch_q, h, q_start)
                dq_acc[row0:row0 + n_q, :] = 0.0

        for k0 in range(k_first, n_k if fused else k_first + 1, block_k):
            cols = min(block_k, n_k - k0)
            # -- the query tiles that see a key of this block: `visible_keys` from the
            # keys' side (key j is seen by the rows j - shift - right .. j - shift +
            # left), tiles at multiples of block_q
            q_lo, q_hi = _steps.visible_keys(k0 - shift, cols, n_q, right, left, mods.chunk,
                                             shift, block_q)

            # -- this block's keys and values, once for every query head of the group
            _products.pack_key_panels(k, batch_k, hk, k_start + k0, cols, k_panels, half_kind)
            _products.pack_key_panels(v, batch_k, hk, k_start + k0, cols, v_panels, half_kind)
            if fused:
                _products.pack_rows(k, batch_k, hk, k_start + k0, cols, k_rows, half_kind)
            if pairs:
                _pairs.pack_panel_pairs(k, batch_k, hk, k_start + k0, cols, k_panel_pairs)
                _pairs.pack_panel_pairs(v, batch_k, hk, k_start + k0, cols, v_panel_pairs)
                if fused:
                    _pairs.pack_row_pairs(k, batch_k, hk, k_start + k0, cols, k_row_pairs)
            dk_acc[:cols, :] = 0.0
            dv_acc[:cols, :] = 0.0
            keys_finite = (_products.finite_panels(k_panels, cols)
                           and _products.finite_panels(v_panels, cols))

            for h in range(hk * group, (hk + 1) * group):
                for q0 in range(q_lo, q_hi, block_q):
                    rows = min(block_q, n_q - q0)
                    state = (_user.FULL if PLAIN
                             else _user.tile_state(mods, batch_q, h, q0, rows, k0, cols))
                    if state == _user.EMPTY:
                        continue
                    diag0 = q0 + shift
                    inside, lo_off, hi_off = _steps.block_band(diag0, rows, k0, cols, left,
                                                               right, mods.chunk)
                    band = (inside, lo_off, hi_off, left, right)
                    _load_query_tile(q, dout, lse, delta, batch_q, h, q_start + q0, rows,
                                     q_tile, do_tile, lse_rows, delta_rows, half_kind)
                    _copy_into(q_rows, q_tile, rows, d)
                    _copy_into(do_rows, do_tile, rows, d_v)

                    # -- S: the forward's score pipeline; dP = dO V^T
                    at = (seq, h, q0, k0, diag0, batch_q, state)
                    if pairs:
                        _pairs.pack_query_pairs(q, batch_q, h, q_start + q0, rows, q_pairs)
                        _pairs.pack_query_pairs(dout, batch_q, h, q_start + q0, rows,
                                                do_pairs)
                        _scores_and_dp(q_pairs, do_pairs, k_panel_pairs, v_panel_pairs,
                                       scores, dp, chain, rows, cols, at, band, mods, no_pre)
                    else:
                        _scores_and_dp(q_tile, do_tile, k_panels, v_panels, scores, dp, chain,
                                       rows, cols, at, band, mods, no_pre)

                    # -- P = exp(S - lse), dS = P (dP - delta)
                    _products.probs_and_grads(scores, dp, chain, lse_rows, delta_rows, rows,
                                           cols, lo_off, hi_off, has_chain, q)

                    # -- dV += P^T dO, dK += dS^T Q (and dQ += dS K); where some row
                    # cannot see every key and an operand is inf or NaN, over what each
                    # row sees only (0 * inf is NaN)
                    exact = (not inside or _steps.masks_keys(mods, state)) and not (
                        keys_finite and _finite_rows(q_tile, do_tile, lse_rows, delta_rows,
                                                     rows))
                    if exact:
                        _steps.tn_tile_exact(scores, do_rows, dv_acc, rows, cols, lo_off,
                                             hi_off, visible, at)
                        _steps.tn_tile_exact(dp, q_rows, dk_acc, rows, cols, lo_off, hi_off,
                                             visible, at)
                    elif pairs:  # P and dS rounded to bfloat16, as flash-attn does
                        _pairs.pack_row_pairs(q, batch_q, h, q_start + q0, rows,
                                              q_row_pairs)
                        _pairs.pack_row_pairs(dout, batch_q, h, q_start + q0, rows,
                                              do_row_pairs)
                        _pairs.tn_tile_pairs(scores, transposed, transposed_pairs,
                                             do_row_pairs, dv_acc, ones, rows, cols, lo_off,
                                             hi_off)
                        _pairs.tn_tile_pairs(dp, transposed, transposed_pairs, q_row_pairs,
                                             dk_acc, ones, rows, cols, lo_off, hi_off)
                    else:
                        _products.tn_tile(scores, do_rows, dv_acc, rows, cols, lo_off, hi_off)
                        _products.tn_tile(dp, q_rows, dk_acc, rows, cols, lo_off, hi_off)
                    if fused:
                        row0 = _acc_row(dq, batch_q, h, q_start + q0)
                        _add_ds_k(dp, k_rows, dq_acc[row0:row0 + rows], ones, rows, cols,
                                  lo_off, hi_off, exact, visible, at, pairs, ds_pairs,
                                  k_row_pairs)

            # -- each row of dK and dV written once
            _products.store_rows(dk_acc, cols, qk_scale, dk, batch_k, hk, k_start + k0,
                              half_kind)
            _products.store_rows(dv_acc, cols, 1.0, dv, batch_k, hk, k_start + k0, half_kind)

        if fused:
            for h in range(hk * group, (hk + 1) * group):
                row0 = _acc_row(dq, batch_q, h, q_start)
                _products.store_rows(dq_acc[row0:row0 + n_q], n_q, qk_scale, dq, batch_q, h,
                                  q_start, half_kind)


@jit
def _query_pass(first_item, end_item, q, k, v, dout, lse, delta, dq, dk, dv, dq_acc, seqs,
                items, fused, block_q, block_k, half_kind, mods):
    """The query pass over work items first_item .. end_item - 1 of `items` (`_fa2_backward`)."""
    d, d_v, group, cdtype = q.shape[3], v.shape[3], q.shape[1] // k.shape[1], lse.dtype
    qk_scale, left, right = mods.scale, mods.left, mods.right
    has_chain = _steps.chains(mods)
    visible = None if PLAIN else mods  # what `_steps.key_visible` needs beside the band
    no_pre = np.empty((0, 0), dtype=cdtype)  # the scores before a score_mod: not needed here
    q_tile, do_tile, k_panels, v_panels, scores, dp, chain = _score_buffers(
        block_q, block_k, d, d_v, lse)
    k_rows, dq_rows = _rows_buffer(block_k, d, lse), _rows_buffer(block_q, d, lse)
    q_pairs, do_pairs, k_panel_pairs, v_panel_pairs, k_row_pairs, ds_pairs = \
        _pairs.backward_pair_buffers(block_q, block_k, d, d_v, q, lse, half_kind)
    pairs = q_pairs.shape[0] > 0
    lse_rows = np.empty(block_q, dtype=cdtype)
    delta_rows = np.empty(block_q, dtype=cdtype)
    ones = np.ones(block_q, dtype=cdtype)

    for item in range(first_item, end_item):
        (seq, h, q0, batch_q, q_start, n_q,
         batch_k, k_start, n_k) = _steps.work_item(items, item, seqs)
        hk = h // group
        rows = min(block_q, n_q - q0)
        diag0 = q0 + n_k - n_q

        # -- the keys some row of this tile sees, in blocks at multiples of block_k
        k_lo, k_hi = _steps.visible_keys(diag0, rows, n_k, left, right, mods.chunk, 0,
                                             block_k)

        _load_query_tile(q, dout, lse, delta, batch_q, h, q_start + q0, rows, q_tile,
                         do_tile, lse_rows, delta_rows, half_kind)
        if pairs:
            _pairs.pack_query_pairs(q, batch_q, h, q_start + q0, rows, q_pairs)
            _pairs.pack_query_pairs(dout, batch_q, h, q_start + q0, rows, do_pairs)
        dq_rows[:rows, :] = 0.0
        rows_finite = _finite_rows(q_tile, do_tile, lse_rows, delta_rows, rows)

        for kb in range(k_lo, k_hi, block_k):
            cols = min(block_k, k_hi - kb)
            state = (_user.FULL if PLAIN
                     else _user.tile_state(mods, batch_q, h, q0, rows, kb, cols))
            if state == _user.EMPTY:
                continue
            inside, lo_off, hi_off = _steps.block_band(diag0, rows, kb, cols, left, right,
                                                       mods.chunk)
            band = (inside, lo_off, hi_off, left, right)

            # -- the block's keys (as panels and as rows) and values
            _products.pack_key_panels(k, batch_k, hk, k_start + kb, cols, k_panels, half_kind)
            _products.pack_rows(k, batch_k, hk, k_start + kb, cols, k_rows, half_kind)
            _products.pack_key_panels(v, batch_k, hk, k_start + kb, cols, v_panels, half_kind)

            # -- S and dP, as in the key pass
            at = (seq, h, q0, kb, diag0, batch_q, state)
            if pairs:
                _pairs.pack_panel_pairs(k, batch_k, hk, k_start + kb, cols, k_panel_pairs)
                _pairs.pack_panel_pairs(v, batch_k, hk, k_start + kb, cols, v_panel_pairs)
                _pairs.pack_row_pairs(k, batch_k, hk, k_start + kb, cols, k_row_pairs)
                _scores_and_dp(q_pairs, do_pairs, k_panel_pairs, v_panel_pairs, scores, dp,
                               chain, rows, cols, at, band, mods, no_pre)
            else:
                _scores_and_dp(q_tile, do_tile, k_panels, v_panels, scores, dp, chain, rows,
                               cols, at, band, mods, no_pre)

            # -- P and dS
            _products.probs_and_grads(scores, dp, chain, lse_rows, delta_rows, rows, cols,
                                   lo_off, hi_off, has_chain, q)

            # -- dQ += dS K (over what each row sees only, as in the key pass)
            exact = (not inside or _steps.masks_keys(mods, state)) and not (
                rows_finite and _products.finite_panels(k_panels, cols)
                and _products.finite_panels(v_panels, cols))
            _add_ds_k(dp, k_rows, dq_rows, ones, rows, cols, lo_off, hi_off, exact, visible,
                      at, pairs, ds_pairs, k_row_pairs)

        _products.store_rows(dq_rows, rows, qk_scale, dq, batch_q, h, q_start + q0, half_kind)


def _score_arg_grads(q, k, v, dout, lse, delta, seqs, items, slot_ptr, block_q, block_k,
                     half_kind, flat, score_args, mask_args, grad_fns, grads):
    """The gradients of the float arrays among a score_mod's arguments, by the user's
    ``score_mod_grad`` (`_user.score_grad_tile`), after the backward has found `delta`.

    Each slot owns a fixed run of the query pass's work items (`slot_ptr`, the same for any
    thread count) and adds into its own part of each gradient, ``grads[i][slot]``, summing its
    tiles in order; the caller sums the slots in order, so the bits do not depend on the
    threads. A tile's scores are rebuilt as in the backward: P from S and the lse, and
    ``dS = P (dO V^T - delta)``, the gradient of the loss by the score after the mod.
    """
    d = q.shape[3]
    d_v = v.shape[3]
    group = q.shape[1] // k.shape[1]
    cdtype = lse.dtype
    # (taken apart and put together again in the loop, as in `_fa2_backward`)
    for slot in prange(slot_ptr.shape[0] - 1):
        mods = _pipeline.together(flat, score_args, mask_args)
        left, right = mods.left, mods.right
        q_tile, do_tile, k_panels, v_panels, scores, dp, pre = _score_buffers(
            block_q, block_k, d, d_v, lse)
        no_chain = scores[:0]
        lse_rows = np.empty(block_q, dtype=cdtype)
        delta_rows = np.empty(block_q, dtype=cdtype)
        slot_grads = _user.slot_views(grads, slot)
        for item in range(slot_ptr[slot], slot_ptr[slot + 1]):
            (seq, h, q0, batch_q, q_start, n_q,
             batch_k, k_start, n_k) = _steps.work_item(items, item, seqs)
            hk = h // group
            rows = min(block_q, n_q - q0)
            diag0 = q0 + n_k - n_q
            k_lo, k_hi = _steps.visible_keys(diag0, rows, n_k, left, right, mods.chunk, 0,
                                             block_k)
            _load_query_tile(q, dout, lse, delta, batch_q, h, q_start + q0, rows, q_tile,
                             do_tile, lse_rows, delta_rows, half_kind)
            for kb in range(k_lo, k_hi, block_k):
                cols = min(block_k, k_hi - kb)
                state = _user.tile_state(mods, batch_q, h, q0, rows, kb, cols)
                if state == _user.EMPTY:
                    continue
                inside, lo_off, hi_off = _steps.block_band(diag0, rows, kb, cols, left,
                                                           right, mods.chunk)
                _products.pack_key_panels(k, batch_k, hk, k_start + kb, cols, k_panels, half_kind)
                _products.pack_key_panels(v, batch_k, hk, k_start + kb, cols, v_panels, half_kind)
                at = (seq, h, q0, kb, diag0, batch_q, state)
                _steps.score_tile(q_tile, k_panels, scores, no_chain, rows, cols, at,
                                  (inside, lo_off, hi_off, left, right), mods, pre)
                _products.qk_tile(do_tile, v_panels, dp, rows, cols, 1.0, lo_off, hi_off)
                _products.probs_and_grads(scores, dp, no_chain, lse_rows, delta_rows, rows, cols,
                                       lo_off, hi_off, False)
                _user.score_grad_tile(grad_fns, dp, pre, rows, cols, (lo_off, hi_off),
                                      (batch_q, h, _user.query_index(mods, q0, diag0), kb),
                                      mods.score_args, slot_grads)


@jit
def _copy_into(dst, src, rows, cols):
    """dst[:rows, :cols] = src[:rows, :cols], element by element: a slice assignment would
    compile Numba's shape-mismatch message (seconds of string formatting) into the kernel."""
    for r in range(rows):
        for c in range(cols):
            dst[r, c] = src[r, c]


@jit
def _finite_rows(q_tile, do_tile, lse_rows, delta_rows, rows):
    """Whether a query tile's rows hold only finite queries, output gradients, deltas and
    log-sum-exps (-inf allowed: a row that sees no key)."""
    return (_products.finite_lse(lse_rows, delta_rows, rows)
            and _products.finite_tile(q_tile, rows, q_tile.shape[1])
            and _products.finite_tile(do_tile, rows, do_tile.shape[1]))


@jit
def _add_ds_k(ds, k_rows, dq_rows, ones, rows, cols, lo_off, hi_off, exact, mods, at, pairs,
              ds_pairs, k_row_pairs):
    """dQ += dS K: `pv_tile`, or with `exact`, `pv_tile_exact` (over the keys each row sees;
    the same bits for finite rows); with `pairs`, `_pairs.pv_tile_pairs` (dS rounded to
    bfloat16, as flash-attn does) unless `exact`."""
    if exact:
        _steps.pv_tile_exact(ds, k_rows, dq_rows, ones, rows, cols, lo_off, hi_off, mods, at)
    elif pairs:
        _pairs.pv_tile_pairs(ds, ds_pairs, k_row_pairs, dq_rows, ones, rows, cols, lo_off,
                             hi_off)
    else:
        _products.pv_tile(ds, k_rows, dq_rows, ones, rows, cols, lo_off, hi_off)


@jit
def _scores_and_dp(q_tile, do_tile, k_panels, v_panels, scores, dp, chain, rows, cols, at, band,
                   mods, pre):
    """S (the score pipeline: `_steps.score_tile`) and dP = dO V^T of a query tile, as floats
    or as bfloat16 dot products (`_pairs`)."""
    _steps.score_tile(q_tile, k_panels, scores, chain, rows, cols, at, band, mods, pre)
    _products.any_qk_tile(do_tile, v_panels, dp, rows, cols, 1.0, band[1], band[2])


@jit
def _band_scores_and_dp(q_tile, do_tile, k_panels, v_panels, scores, dp, chain, rows, cols, at,
                        band, mods, pre):
    """`_scores_and_dp` of a call with no modifier but its band (`fa2_backward_plain`)."""
    _steps.band_scores(q_tile, k_panels, scores, rows, cols, mods.scale, at[4] - at[3], band)
    _products.any_qk_tile(do_tile, v_panels, dp, rows, cols, 1.0, band[1], band[2])


@jit
def _acc_row(dq, b, h, row):
    """The row of the fused pass's dQ accumulator, ``(batch * Hq * Nq, Dp)``, that holds dQ's
    row ``dq[b, h, row]``."""
    return (b * dq.shape[1] + h) * dq.shape[2] + row


@jit
def _score_buffers(block_q, block_k, d, d_v, like):
    """Zeroed tiles of one thread for the scores and dP, in `like`'s dtype: q_tile, do_tile
    (block_q rows), k_panels, v_panels (block_k keys), and three (block_q, keys) tiles: S/P,
    dP/dS and the chain factor."""
    dtype = like.dtype
    width = 2 * _layout.lanes(like)
    keys = _layout.round_up(block_k, width)
    return (_layout.aligned_zeros((block_q, d), dtype),
            _layout.aligned_zeros((block_q, d_v), dtype),
            _layout.aligned_zeros((keys // width, d, width), dtype),
            _layout.aligned_zeros((keys // width, d_v, width), dtype),
            _layout.aligned_zeros((block_q, keys), dtype),
            _layout.aligned_zeros((block_q, keys), dtype),
            _layout.aligned_zeros((block_q, keys), dtype))


@jit
def _rows_buffer(n_rows, dim, like):
    """A zeroed (rows rounded up to a key panel, dim rounded up to two vectors) tile: rows of
    an operand or an accumulator of the products (`pv_tile`, `tn_tile`), whose padding
    columns stay 0."""
    width = 2 * _layout.lanes(like)
    return _layout.aligned_zeros((_layout.round_up(n_rows, width), _layout.round_up(dim, width)),
                                like.dtype)


@jit
def _store_deltas(dout, out, b, h, start, rows, do_rows, o_rows, delta, half_kind):
    """delta[b, h, start + r] = dout[b, h, start + r] . out[b, h, start + r] for r < rows, in
    the compute dtype, summed in the same order whatever the strides of dout and out."""
    _products.pack_rows(dout, b, h, start, rows, do_rows, half_kind)
    _products.pack_rows(out, b, h, start, rows, o_rows, half_kind)
    n, width = _layout.lanes(do_rows), do_rows.shape[1]
    for r in range(rows):
        total = vzeros(do_rows)
        for x in range(r * width, (r + 1) * width, n):
            total = vfma(vload(do_rows, x), vload(o_rows, x), total)
        delta[b, h, start + r] = vhsum(total)


@jit
def _load_query_tile(q, dout, lse, delta, b, h, start, rows, q_tile, do_tile, lse_rows,
                     delta_rows, half_kind):
    """The rows start .. start + rows - 1 of query head h: its queries, output gradients,
    log-sum-exps and deltas, widened to the compute dtype."""
    _products.pack_rows(q, b, h, start, rows, q_tile, half_kind)
    _products.pack_rows(dout, b, h, start, rows, do_tile, half_kind)
    for r in range(rows):
        lse_rows[r] = lse[b, h, start + r]
        delta_rows[r] = delta[b, h, start + r]


def _signature(key):
    dtype, compute, user_types = key
    data = array(dtype, 4, readonly=True)
    grad = array(dtype, 4)
    per_row = array(compute, 3, readonly=True)
    delta = array(compute, 3)
    rows2 = types.Array(numba.from_dtype(compute), 2, "C")  # whose row slices are "C" too
    index2 = array(np.int64, 2, readonly=True)
    index1 = array(np.int64, 1, readonly=True)
    i8 = types.int64
    return types.void(
        data, data, data, data, data, per_row, delta, grad, grad, grad, rows2,
        index2, index2, index1, index2, index1, types.boolean, i8, i8, i8,
        *_pipeline.kernel_types(compute, *user_types))


fa2_backward = Kernel(_fa2_backward, _signature, "attention backward")
fa2_backward_plain = Kernel(
    variant(_fa2_backward, "_plain", **{
        name: jit(variant(step.py_func, "_plain", PLAIN=True,
                          _scores_and_dp=_band_scores_and_dp))
        for name, step in (("_key_pass", _key_pass), ("_query_pass", _query_pass))}),
    _signature, "attention backward")


def _grads_signature(key):
    dtype, compute, user_types, grad_fns, grads = key
    data = array(dtype, 4, readonly=True)
    per_row = array(compute, 3, readonly=True)
    index2 = array(np.int64, 2, readonly=True)
    index1 = array(np.int64, 1, readonly=True)
    i8 = types.int64
    return types.void(data, data, data, data, per_row, per_row, index2, index2, index1, i8, i8,
                      i8, *_pipeline.kernel_types(compute, *user_types), grad_fns, grads)


score_arg_grads = Kernel(_score_arg_grads, _grads_signature, "score_mod gradients")
