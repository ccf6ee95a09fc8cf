"""The tile steps of the forward kernel, one small function each.

Shapes (compute dtype, C order, owned by one thread):

* ``q_tile (block_q, D)``: the tile's queries, already multiplied by the score scale;
* ``k_panels (panels, D, PANEL)``: the key block packed into panels of `PANEL` keys, so the
  Q K^T step reads each panel as one contiguous stream;
* ``v_tile (panels * PANEL, Dv)``: the value block, row-major;
* ``scores (block_q, panels * PANEL)``: S, then P in place;
* ``acc (block_q, Dv)``: the unnormalized output; ``row_max``, ``row_sum``, ``alpha`` per row.

Only the first `rows` x `cols` entries of a tile are meaningful; padding is never read.
"""

import math

import numpy as np

from .._jit import jit
from ._convert import narrow, widen

PANEL = 32  # keys per packed panel (tiling.KEY_PANEL)


@jit
def pack_rows(src, b, h, start, rows, dst, mult, half):
    """dst[r, :] = mult * src[b, h, start + r, :], widened to the compute dtype."""
    for r in range(rows):
        for x in range(src.shape[3]):
            dst[r, x] = widen(src[b, h, start + r, x], half) * mult


@jit
def pack_key_panels(k, b, h, start, cols, k_panels, half):
    """Key rows start..start+cols into panels: k_panels[c // PANEL, :, c % PANEL]."""
    for c in range(cols):
        panel, lane = c // PANEL, c % PANEL
        for x in range(k.shape[3]):
            k_panels[panel, x, lane] = widen(k[b, h, start + c, x], half)
    last = (cols - 1) // PANEL
    for lane in range(cols - last * PANEL, PANEL):  # zero the tail of a partial last panel
        for x in range(k.shape[3]):
            k_panels[last, x, lane] = 0.0


@jit
def qk_tile(q_tile, k_panels, scores, rows, cols):
    """scores[:rows, :cols] = q_tile[:rows] @ keys^T, one panel of keys at a time."""
    d = q_tile.shape[1]
    for panel in range((cols + PANEL - 1) // PANEL):
        c0 = panel * PANEL
        for r in range(rows):
            for lane in range(PANEL):
                scores[r, c0 + lane] = 0.0
            for x in range(d):
                qx = q_tile[r, x]
                for lane in range(PANEL):
                    scores[r, c0 + lane] += qx * k_panels[panel, x, lane]


@jit
def softcap_tile(scores, rows, cols, cap):
    """s = cap * tanh(s), on scores already divided by the softcap."""
    for r in range(rows):
        for c in range(cols):
            scores[r, c] = cap * math.tanh(scores[r, c])


@jit
def alibi_tile(scores, rows, cols, slope, offset):
    """s -= slope * |i - j| with i - j = r + offset - c (bottom-right aligned distance)."""
    for r in range(rows):
        for c in range(cols):
            scores[r, c] -= slope * abs(r + offset - c)


@jit
def add_tile(scores, bias, bb, h, q0, kb, rows, cols, mult):
    """s += mult * bias[bb, h, q0 + r, kb + c], read through the bias's broadcast strides."""
    for r in range(rows):
        for c in range(cols):
            scores[r, c] += mult * bias[bb, h, q0 + r, kb + c]


@jit
def band_mask_tile(scores, rows, cols, offset, left, right):
    """Hide keys outside the band left/right of the diagonal (causal is right = 0)."""
    for r in range(rows):
        diag = r + offset  # the tile column under row r's diagonal
        for c in range(cols):
            if (left >= 0 and c < diag - left) or (right >= 0 and c > diag + right):
                scores[r, c] = -np.inf


@jit
def bool_mask_tile(scores, mask, bb, h, q0, kb, rows, cols):
    """Hide keys whose mask entry is False."""
    for r in range(rows):
        for c in range(cols):
            if not mask[bb, h, q0 + r, kb + c]:
                scores[r, c] = -np.inf


@jit
def softmax_update(scores, row_max, row_sum, alpha, rows, cols):
    """Online softmax over one key block: scores become P = exp2(s - new max).

    alpha[r] = exp2(old max - new max) is the factor that rescales what row r accumulated so
    far. A row whose every score so far is -inf keeps max -inf and uses 0 as its shift, so it
    produces zeros rather than NaN; a NaN score is never taken as the max and reaches the output
    through exp2(NaN).
    """
    for r in range(rows):
        block_max = -np.inf
        for c in range(cols):
            if scores[r, c] > block_max:
                block_max = scores[r, c]
        new_max = max(row_max[r], block_max)
        shift = new_max if new_max != -np.inf else 0.0
        alpha[r] = math.exp2(row_max[r] - shift)
        total = 0.0
        for c in range(cols):
            p = math.exp2(scores[r, c] - shift)
            scores[r, c] = p
            total += p
        row_sum[r] = row_sum[r] * alpha[r] + total
        row_max[r] = new_max


@jit
def pv_tile(scores, v_tile, acc, alpha, rows, cols):
    """acc[r] = alpha[r] * acc[r] + sum_c P[r, c] * v[c]."""
    dv = acc.shape[1]
    for r in range(rows):
        a = alpha[r]
        for x in range(dv):
            acc[r, x] *= a
        for c in range(cols):
            p = scores[r, c]
            for x in range(dv):
                acc[r, x] += p * v_tile[c, x]


@jit
def finish_rows(acc, row_max, row_sum, rows, sink, out, lse, b, h, start, ln2, half):
    """out = acc / row_sum and lse = max + log2(sum) in natural log, written once per row.

    `sink` (base 2, -inf when absent) joins the denominator only. A row with nothing visible
    writes zeros and lse -inf (the sink's value when there is one).
    """
    for r in range(rows):
        m, total = row_max[r], row_sum[r]
        if sink != -np.inf:
            top = max(m, sink)
            total = total * math.exp2(m - top) + math.exp2(sink - top)
            norm = math.exp2(m - top) / total
            m = top
        else:
            norm = 1.0 / total if total != 0 else 0.0  # NaN stays NaN
        for x in range(acc.shape[1]):
            out[b, h, start + r, x] = narrow(acc[r, x] * norm, out.dtype, half)
        lse[b, h, start + r] = (m + math.log2(total)) * ln2 if total != 0 else -np.inf
