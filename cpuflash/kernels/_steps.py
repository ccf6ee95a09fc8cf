"""The score pipeline's tile steps (`_pipeline.STEPS`, in its order): the scale, softcap,
ALiBi, bias and visibility steps on a tile of scores, `modify_tile` running them, `score_tile`
computing a tile's scores through them, the derivative factors the backward chains, and the
products that sum only what each row sees (`pv_tile_exact`, `tn_tile_exact`).

The tiles' shapes are `_products`'. Each step works on each row's band of a tile (columns
``r + lo_off .. r + hi_off``, `_layout.row_span`) with whole vectors.
"""

import math

import numpy as np
from numba import types
from numba.extending import overload

from .._jit import HELPER_OPTIONS, jit
from .._simd import vabs, vadd, vbroadcast, vfill_outside, vfma, viota, vload, vmul, vsplat, \
    vstore, vsub, vtanh, vzeros
from . import _band, _pipeline, _user
from ._convert import contiguous_rows, row_offset
from ._layout import UNBOUNDED, lanes, rescale_add, round_up, row_span
from ._products import any_qk_tile

# the keys a tile's rows see (shared with the scheduler, see `_band`)
visible_keys = jit(_band.visible_keys)
sees_all = jit(_band.sees_all)


@jit
def work_item(items, item, seqs):
    """Row `item` of a work table and its sequence's row of `seqs` (`_band`'s columns):
    ``(seq, head, first, batch_q, q_start, n_q, batch_k, k_start, n_k)``, where `first` is the
    first query row of the item's tile (the first key of its block in the backward's key pass)."""
    seq = items[item, _band.ITEM_SEQ]
    return (seq, items[item, _band.ITEM_HEAD], items[item, _band.ITEM_Q0],
            seqs[seq, _band.SEQ_BATCH_Q], seqs[seq, _band.SEQ_Q_START], seqs[seq, _band.SEQ_N_Q],
            seqs[seq, _band.SEQ_BATCH_K], seqs[seq, _band.SEQ_K_START], seqs[seq, _band.SEQ_N_K])


@jit
def longest_keys(seqs):
    """The most keys a sequence of `seqs` (`_band`'s columns) has."""
    longest = 0
    for s in range(seqs.shape[0]):
        longest = max(longest, seqs[s, _band.SEQ_N_K])
    return longest


@jit
def scale_tile(scores, rows, cols, mult, lo_off, hi_off):
    """s *= mult, whole vectors of each row's span (the padding past `cols` is never read)."""
    n = lanes(scores)
    mult_v = vsplat(mult, scores)
    for r in range(rows):
        base = r * scores.shape[1]
        first, end = row_span(r, cols, lo_off, hi_off, n)
        for c in range(first, end, n):
            vstore(scores, base + c, vmul(mult_v, vload(scores, base + c)))


def softcap_tile(scores, rows, cols, cap, lo_off, hi_off):
    """s = cap * tanh(s) over each row's span, on scores already divided by the softcap."""


@overload(softcap_tile, jit_options=HELPER_OPTIONS)
def _softcap_tile(scores, rows, cols, cap, lo_off, hi_off):
    if scores.dtype == types.float32:  # vectorized tanh; the padding past `cols` is harmless
        def vector_softcap(scores, rows, cols, cap, lo_off, hi_off):
            n = lanes(scores)
            cap_v = vsplat(cap, scores)
            for r in range(rows):
                base = r * scores.shape[1]
                first, end = row_span(r, cols, lo_off, hi_off, n)
                for c in range(first, end, n):
                    vstore(scores, base + c, vmul(cap_v, vtanh(vload(scores, base + c))))
        return vector_softcap

    def scalar_softcap(scores, rows, cols, cap, lo_off, hi_off):
        n = lanes(scores)
        for r in range(rows):
            first, end = row_span(r, cols, lo_off, hi_off, n)
            for c in range(first, min(end, cols)):
                scores[r, c] = cap * math.tanh(scores[r, c])
    return scalar_softcap


@jit
def alibi_tile(scores, rows, cols, slope, offset, lo_off, hi_off):
    """s -= slope * |i - j| with i - j = r + offset - c (bottom-right aligned distance), over
    the whole vectors of each row's span (the padding past `cols` is never read)."""
    n = lanes(scores)
    lane_v, minus_slope = viota(scores), vsplat(-slope, scores)  # distance: r + offset - c - lane
    for r in range(rows):
        base = r * scores.shape[1]
        first, end = row_span(r, cols, lo_off, hi_off, n)
        for c in range(first, end, n):
            distance = vabs(vsub(vsplat(r + offset - c, scores), lane_v))
            vstore(scores, base + c, vfma(minus_slope, distance, vload(scores, base + c)))


@jit
def add_tile(scores, bias, bb, h, q0, kb, rows, cols, mult, lo_off, hi_off):
    """s += mult * bias[bb, h, q0 + r, kb + c] over each row's span, read through the bias's
    broadcast strides."""
    n = lanes(scores)
    rows_of_vectors = contiguous_rows(bias)
    mult_v = vsplat(mult, scores)
    for r in range(rows):
        first, end = row_span(r, cols, lo_off, hi_off, n)
        end = min(end, cols)
        c = first
        if rows_of_vectors:  # whole vectors that end inside the row
            row = row_offset(bias, bb, h, q0 + r) + kb
            base = r * scores.shape[1]
            while c + n <= end:
                vstore(scores, base + c, vfma(mult_v, vload(bias, row + c),
                                              vload(scores, base + c)))
                c += n
        for c in range(c, end):
            scores[r, c] += mult * bias[bb, h, q0 + r, kb + c]


@jit
def band_mask_tile(scores, rows, cols, offset, left, right, lo_off, hi_off):
    """Hide keys outside the band left/right of the diagonal (causal is right = 0): per row,
    -inf before and after the visible columns, in the whole vectors of the row's span that hold
    hidden columns (with exact spans, just its first and last vector)."""
    n = lanes(scores)
    for r in range(rows):
        diag = r + offset  # the tile column under row r's diagonal
        first = min(cols, max(0, diag - left)) if left >= 0 else 0
        end = min(cols, max(0, diag + right + 1)) if right >= 0 else cols
        _keep_columns(scores, r, cols, first, end, lo_off, hi_off, n)


@jit
def chunk_mask_tile(scores, rows, cols, diag0, kb, chunk, lo_off, hi_off):
    """Hide the keys outside each row's chunk of `chunk` positions (row r sits at key position
    diag0 + r; the tile's columns are keys kb ..), as `band_mask_tile` hides the band's."""
    n = lanes(scores)
    for r in range(rows):
        start = (diag0 + r) // chunk * chunk - kb  # the tile column the row's chunk starts at
        first, end = min(cols, max(0, start)), min(cols, max(0, start + chunk))
        _keep_columns(scores, r, cols, first, end, lo_off, hi_off, n)


@jit
def _keep_columns(scores, r, cols, first, end, lo_off, hi_off, n):
    """-inf in row r's columns outside first .. end - 1, in the whole vectors of its span that
    hold such columns (with exact spans, just its first and last vector)."""
    span0, span1 = row_span(r, cols, lo_off, hi_off, n)
    base = r * scores.shape[1]
    before = min(span1, round_up(first, n))  # vectors holding a column left of the band
    for c in range(span0, before, n):
        _hide_outside(scores, base + c, first - c, end - c)
    for c in range(max(before, end // n * n), span1, n):  # ... right of it
        _hide_outside(scores, base + c, first - c, end - c)


@jit
def _hide_outside(scores, o, first, end):
    """-inf in the lanes of the vector at `o` outside lanes first .. end - 1."""
    vstore(scores, o, vfill_outside(vload(scores, o), first, end, -np.inf))


@jit
def bool_mask_tile(scores, mask, bb, h, q0, kb, rows, cols, lo_off, hi_off):
    """Hide keys whose mask entry is False, over each row's span."""
    n = lanes(scores)
    for r in range(rows):
        first, end = row_span(r, cols, lo_off, hi_off, n)
        for c in range(first, min(end, cols)):
            if not mask[bb, h, q0 + r, kb + c]:
                scores[r, c] = -np.inf


@jit
def pv_tile_exact(scores, v_tile, acc, alpha, rows, cols, lo_off, hi_off, mods, at):
    """`pv_tile` row by row over only the keys each row sees: its band, and of those the ones
    `key_visible` lets it see (``at``: the tile, as `score_tile` takes it).

    For a key block where a value row that some row cannot see is inf or NaN: `pv_tile` would
    give that row 0 * inf = NaN. With finite values the sums are `pv_tile`'s (the same terms in
    the same order, less terms of probability 0), so the bits are the same.
    """
    n = lanes(acc)
    dvp, sw = acc.shape[1], scores.shape[1]
    for r in range(rows):
        key0, key1 = max(0, r + lo_off), min(cols, r + 1 + hi_off)
        for x in range(0, dvp, n):
            total = vzeros(acc)
            for c in range(key0, key1):
                if key_visible(mods, at, r, c):
                    total = vfma(vbroadcast(scores, r * sw + c), vload(v_tile, c * dvp + x),
                                 total)
            rescale_add(acc, r * dvp + x, alpha[r], total)


# -- the backward's steps (`kernels/backward.py`): the score pipeline as one step, the
#    probabilities and score gradients from the saved LSE, and the products with a transposed
#    tile

@jit
def block_band(diag0, rows, kb, cols, left, right, chunk):
    """``(inside, lo_off, hi_off)`` of the key block ``kb .. kb + cols - 1`` for `rows` query
    rows from diagonal `diag0`: whether every row sees every key of it (its window and chunk),
    and the window's band of tile columns row r sees, ``r + lo_off .. r + hi_off``
    (+-UNBOUNDED inside; see `qk_tile`)."""
    inside = sees_all(diag0, rows, kb, cols, left, right, chunk)
    lo_off = diag0 - kb - left if left >= 0 and not inside else -UNBOUNDED
    hi_off = diag0 - kb + right if right >= 0 and not inside else UNBOUNDED
    return inside, lo_off, hi_off


@jit
def score_tile(q_tile, k_panels, scores, chain, rows, cols, at, band, mods, pre):
    """The score pipeline of one tile: ``scores = S`` of the queries of `q_tile` against the
    key panels, every modifier in its place, -inf where a key is hidden.

    ``at = (seq, h, q0, kb, diag0, b, state)`` places the tile (`b`: the batch entry the
    user's functions see; `state`: `_user.tile_state`'s), ``band = (inside, lo_off, hi_off,
    left, right)`` is `block_band`'s and the window's, and `mods` the call's score pipeline
    (`_pipeline.Pipeline`).

    `chain` receives the derivative of the final score by ``scale * q . k`` where it is not 1
    (with a softcap or a user's score_mod), so a gradient step needs no knowledge of the
    modifiers: a modifier with a gradient records its factor here, one place. The forward
    passes an empty `chain`. `pre`, unless empty, receives the scores a user's score_mod
    takes (for the gradients of its arguments).
    """
    # -- S = scale * Q K^T (divided by the softcap, which tanh takes first)
    any_qk_tile(q_tile, k_panels, scores, rows, cols, _pipeline.product_scale(mods), band[1],
                band[2])
    modify_tile(scores, chain, rows, cols, at, band, mods, pre)


@jit
def band_scores(q_tile, k_panels, scores, rows, cols, mult, offset, band):
    """`score_tile` of a call with no modifier but its band (a causal mask or a window; `mult`
    its scale, `offset` the tile's ``diag0 - kb``): the same steps, without the others'."""
    inside, lo_off, hi_off, left, right = band
    any_qk_tile(q_tile, k_panels, scores, rows, cols, mult, lo_off, hi_off)
    if not inside:
        band_mask_tile(scores, rows, cols, offset, left, right, lo_off, hi_off)


@jit
def modifies(mods):
    """Whether `modify_tile` changes a tile that lies inside its band: a softcap, ALiBi, a
    bias, a mask or a user's function."""
    fns = mods.functions
    return (mods.softcap > 0 or mods.alibi.shape[1] > 0 or mods.bias.shape[0] > 0
            or mods.mask.shape[0] > 0 or _user.has_score_mod(fns) or _user.has_mask_mod(fns))


@jit
def chains(mods):
    """Whether `modify_tile` writes a factor into the backward's chain (the derivative of the
    steps after the product): a softcap's, a score_mod's."""
    return mods.softcap > 0 or _user.has_score_mod(mods.functions)


@jit
def modify_tile(scores, chain, rows, cols, at, band, mods, pre):
    """The score pipeline after the product: `scores` holds ``product_scale(mods) * Q K^T``
    over each row's band (`score_tile`'s arguments), and gets every modifier in its place,
    -inf where a key is hidden. The forward, the backward and the decode kernels all go
    through here."""
    seq, h, q0, kb, diag0, b, state = at
    inside, lo_off, hi_off, left, right = band
    softcap, alibi, bias, mask, fns = mods.softcap, mods.alibi, mods.bias, mods.mask, \
        mods.functions
    uq0 = _user.query_index(mods, q0, diag0)
    # -- modifiers, in the order of the score pipeline
    if softcap > 0:
        softcap_tile(scores, rows, cols, softcap, lo_off, hi_off)
        if chain.shape[0] > 0:
            softcap_chain_tile(scores, chain, rows, cols, softcap, lo_off, hi_off)
    elif chain.shape[0] > 0 and _user.has_score_mod(fns):
        ones_tile(chain, rows, cols, lo_off, hi_off)
    if alibi.shape[1] > 0:
        alibi_tile(scores, rows, cols, alibi[seq, h], diag0 - kb, lo_off, hi_off)
    if bias.shape[0] > 0:
        add_tile(scores, bias, mods.bias_map[seq], h, q0, kb, rows, cols, 1.0, lo_off, hi_off)
    if pre.shape[0] > 0:
        copy_rows(scores, pre, rows)
    _user.score_mod_tile(fns, scores, chain, rows, cols, (lo_off, hi_off), (b, h, uq0, kb),
                         mods.score_args)
    # -- visibility
    if not inside:
        band_mask_tile(scores, rows, cols, diag0 - kb, left, right, lo_off, hi_off)
        if mods.chunk > 0:
            chunk_mask_tile(scores, rows, cols, diag0, kb, mods.chunk, lo_off, hi_off)
    if mask.shape[0] > 0:
        bool_mask_tile(scores, mask, mods.mask_map[seq], h, q0, kb, rows, cols, lo_off, hi_off)
    if state == _user.PARTIAL:
        _user.mask_mod_tile(fns, scores, rows, cols, (lo_off, hi_off), (b, h, uq0, kb),
                            mods.mask_args)


@jit
def hide_unseen(scores, seen, rows, cols, lo_off, hi_off):
    """-inf where ``seen[r, c]`` is False, over each row's span (`seen`: a tile's `mask_mod`
    answers, `_user.mask_mod_fill`)."""
    for r in range(rows):
        row, answers = scores[r], seen[r]
        first = max(0, r + lo_off)
        for i in range(min(cols, r + hi_off + 1) - first):
            c = first + i
            if not answers[c]:
                row[c] = -np.inf


@jit
def copy_rows(src, dst, rows):
    """dst[:rows] = src[:rows], vector by vector (two tiles of the same shape). A slice
    assignment would compile Numba's shape-mismatch message, seconds of string formatting in
    a cold compile (docs/history.md, "Compile time")."""
    n = lanes(src)
    for o in range(0, rows * src.shape[1], n):
        vstore(dst, o, vload(src, o))


@jit
def masks_keys(mods, state):
    """Whether keys of a tile may be hidden inside its band: a bool mask, or a `mask_mod`
    that the block mask does not say is met by the whole tile."""
    return mods.mask.shape[0] > 0 or state == _user.PARTIAL


@jit
def key_visible(mods, at, r, c):
    """Whether the chunks, the bool mask and the user's `mask_mod` let row r of a tile see its
    column c (``at`` as `score_tile` takes it; the window's band is checked by the caller)."""
    if mods is None:  # a call with no modifier but its band (`kernels.forward.PLAIN`)
        return True
    mask = mods.mask
    seq, h, q0, kb, diag0, b, state = at
    if mods.chunk > 0 and (diag0 + r) // mods.chunk != (kb + c) // mods.chunk:
        return False
    if mask.shape[0] > 0 and not mask[mods.mask_map[seq], h, q0 + r, kb + c]:
        return False
    if state == _user.PARTIAL:
        return _user.mask_mod_sees(mods.functions, b, h,
                                   _user.query_index(mods, q0, diag0) + r, kb + c,
                                   mods.mask_args)
    return True


@jit
def ones_tile(chain, rows, cols, lo_off, hi_off):
    """chain = 1 over each row's span: the factor of a score pipeline with no softcap, which
    a user's score_mod then multiplies."""
    n = lanes(chain)
    one = vsplat(1.0, chain)
    for r in range(rows):
        base = r * chain.shape[1]
        first, end = row_span(r, cols, lo_off, hi_off, n)
        for c in range(first, end, n):
            vstore(chain, base + c, one)


@jit
def softcap_chain_tile(scores, chain, rows, cols, cap, lo_off, hi_off):
    """chain = 1 - (s / cap)^2 from the capped scores s = cap * tanh(x / cap): the derivative
    of s by x, over each row's span."""
    n = lanes(scores)
    inverse, one = vsplat(1.0 / cap, scores), vsplat(1.0, scores)
    minus_one = vsplat(-1.0, scores)
    for r in range(rows):
        base = r * scores.shape[1]
        first, end = row_span(r, cols, lo_off, hi_off, n)
        for c in range(first, end, n):
            t = vmul(vload(scores, base + c), inverse)
            vstore(chain, base + c, vfma(vmul(minus_one, t), t, one))


@jit
def tn_tile_exact(a, b_rows, acc, rows, cols, lo_off, hi_off, mods, at):
    """`tn_tile` column by column over only the rows that see each key: its band, and of those
    the ones `key_visible` lets see it (``at``: the tile, as `score_tile` takes it).

    For a tile where a row that cannot see some key has an inf or NaN in `b_rows` (0 * inf is
    NaN). With finite rows the sums are `tn_tile`'s (the same terms in the same order, less
    terms that are 0), so the bits are the same.
    """
    n = lanes(acc)
    bw, aw = acc.shape[1], a.shape[1]
    for c in range(cols):
        row0, row1 = max(0, c - hi_off), min(rows, c + 1 - lo_off)
        for x in range(0, bw, n):
            total = vzeros(acc)
            for r in range(row0, row1):
                if key_visible(mods, at, r, c):
                    total = vfma(vbroadcast(a, r * aw + c), vload(b_rows, r * bw + x), total)
            vstore(acc, c * bw + x, vadd(vload(acc, c * bw + x), total))


