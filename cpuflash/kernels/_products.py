"""The products and the softmax of a tile: packing, the micro-kernels of Q K^T, P V and the
backward's transposed products, the online softmax and the finished rows.

Shapes (compute dtype, C order, owned by one thread):

* ``q_tile (groups, D, ROWS)``: the tile's queries in groups of ``ROWS`` rows, row ``r`` at
  ``q_tile[r // ROWS, :, r % ROWS]``, so the ``ROWS`` elements a micro-kernel broadcasts for one
  dimension lie side by side (`_micro.rows_at`); the backward's tiles are plain ``(rows, D)``;
* ``k_panels (panels, D, W)``: the key block packed into panels of ``W = 2 * lanes`` keys (two
  SIMD vectors), so the Q K^T micro-kernel reads each panel as one contiguous stream;
* ``v_tile (panels * W, Dvp)``: the value block, row-major, ``Dvp`` = Dv rounded up to ``W``;
* ``scores (block_q, panels * W)``: S, then P in place;
* ``acc (block_q, Dvp)``: the unnormalized output; ``row_max``, ``row_sum``, ``alpha`` per row.

Only the first `rows` x `cols` entries of a tile are meaningful. Padding columns of `v_tile` and
`acc` are zero (they are allocated zeroed and never written), so whole vectors can be used.

The three hot steps (Q K^T, the softmax update, P V) are written with the explicit SIMD values
of `cpuflash._simd`. The products run on register-blocked micro-kernels (`_micro`) of `ROWS`
query rows x two vectors (12 accumulators, for the 16 registers of AVX2), or x four vectors where
the CPU has the 32 of AVX-512 (`WIDE`: 24 accumulators), whose accumulators stay in registers for
a whole panel.
"""

import math

import numpy as np
from numba import types
from numba.extending import overload

from .. import _amx
from .._jit import HELPER_OPTIONS, jit
from .._simd import vadd, vexp2, vexp2_half, vhmax, vhsum, vload, vmax, vmul, vsplat, vstore, \
    vsub, vtranspose, vzeros
from ._convert import like_dtype, load_block, load_widened, narrow, row_offset, store_narrowed, \
    vector_rows, widen
from ._layout import ROUNDS_P, ROWS, WIDE, _sees, lanes, round_up, row_span
from ._micro import per_term, pv_micro, qk_micro, tn_micro
from ._tiles import qk_tiles

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E)
LN2 = 0.6931471805599453


@jit
def pack_rows(src, b, h, start, rows, dst, half_kind):
    """dst[r, :D] = src[b, h, start + r, :], widened to the compute dtype."""
    n = lanes(dst)
    if vector_rows(src, n):  # whole vectors
        base, stride = row_offset(src, b, h, start), src.strides[2] // src.itemsize
        for r in range(rows):
            for x in range(0, src.shape[3], n):
                row = load_widened(src, base + r * stride + x, half_kind)
                vstore(dst, r * dst.shape[1] + x, row)
        return
    for r in range(rows):
        for x in range(src.shape[3]):
            dst[r, x] = widen(src[b, h, start + r, x], half_kind)


@jit
def pack_query_groups(src, b, h, start, rows, q_tile, half_kind):
    """q_tile[r // ROWS, :, r % ROWS] = src[b, h, start + r, :], widened to the compute dtype:
    the row groups of `_micro.rows_at`. Once per query tile, so element by element."""
    for r in range(rows):
        g, i = r // ROWS, r % ROWS
        for x in range(src.shape[3]):
            q_tile[g, x, i] = widen(src[b, h, start + r, x], half_kind)


@jit
def pack_key_panels(k, b, h, start, cols, k_panels, half_kind):
    """Key rows start..start+cols into panels: k_panels[c // W, :, c % W].

    A transpose: where the rows are whole vectors, `lanes` keys x `lanes` dims at a time, in
    registers (`vtranspose`); element by element for the rest.
    """
    w, d, n = k_panels.shape[2], k.shape[3], lanes(k_panels)
    c = 0
    if vector_rows(k, n):
        base, stride = row_offset(k, b, h, start), k.strides[2] // k.itemsize
        while c + n <= cols:
            out = c // w * d * w + c % w  # k_panels[c // w, 0, c % w]
            for x in range(0, d, n):
                block = vtranspose(load_block(k, base + c * stride + x, stride, half_kind))
                for j in range(n):  # dim x + j of keys c .. c + n
                    vstore(k_panels, out + (x + j) * w, block[j])
            c += n
    for c in range(c, cols):
        panel, lane = c // w, c % w
        for x in range(d):
            k_panels[panel, x, lane] = widen(k[b, h, start + c, x], half_kind)
    # zero the tail of a partial last panel: in each dim's row of it, the lanes past the keys
    last = (cols - 1) // w
    tail = cols - last * w
    if tail < w:
        whole = round_up(tail, n)  # whole vectors from here on
        zeros = vzeros(k_panels)
        for x in range(d):
            for lane in range(tail, whole):
                k_panels[last, x, lane] = 0.0
            for lane in range(whole, w, n):
                vstore(k_panels, (last * d + x) * w + lane, zeros)


@jit
def qk_tile(q_tile, k_panels, scores, rows, cols, mult, lo_off, hi_off):
    """scores[:rows, :cols] = mult * (q_tile[:rows] @ keys^T), panel by panel, ROWS rows at a
    time (two panels at a time where the CPU has 32 vector registers). The scale is applied
    to each finished sum in registers, as it is stored: scaling Q first would round every query
    element (and float64 then misses the accuracy rule on large logits), and a pass of its own
    over the scores would cost a trip through the cache.

    Row r sees tile columns r + lo_off .. r + hi_off (a window band; +-UNBOUNDED when it sees
    them all): panels that no row of a row group can see are skipped (on a band's edge, one of a
    pair of panels is computed alone), and their scores are left for the band mask to
    overwrite.

    Float tiles, or bfloat16 pairs (uint16: `_pairs`' ``q_pairs`` and ``k_pairs``), which run
    where the CPU has AVX512-BF16, so two panels at a time.
    """
    qk_columns(q_tile, k_panels, scores, rows, cols, mult, lo_off, hi_off, 0, cols)


@jit
def qk_columns(q_tile, k_panels, scores, rows, cols, mult, lo_off, hi_off, c_lo, c_hi):
    """`qk_tile` on the panels that hold columns c_lo .. c_hi - 1 only (the others' scores are
    left for a mask to overwrite: no row sees them)."""
    w = k_panels.shape[2] // per_term(k_panels)  # columns of a panel
    panels = (c_hi + w - 1) // w
    full = rows - rows % ROWS
    # (loops over ranges: a counter that starts as the constant 0 would first be typed as that
    # constant, and every helper it is passed to compiled twice)
    for panel in range(c_lo // w, panels, 2 if WIDE else 1):
        pair = WIDE and panel + 1 < panels
        for r in range(0, full, ROWS):
            first = _sees(panel, w, r, ROWS, lo_off, hi_off)
            second = pair and _sees(panel + 1, w, r, ROWS, lo_off, hi_off)
            if first and second:
                qk_micro(q_tile, r, k_panels, panel, scores, mult, ROWS, 2)
            elif first or second:
                qk_micro(q_tile, r, k_panels, panel if first else panel + 1, scores, mult,
                         ROWS, 1)
        for r in range(full, rows):
            for p in range(panel, panel + 2 if pair else panel + 1):
                if _sees(p, w, r, 1, lo_off, hi_off):
                    qk_micro(q_tile, r, k_panels, p, scores, mult, 1, 1)


def any_qk_tile(q_tile, k_panels, scores, rows, cols, mult, lo_off, hi_off):
    """`qk_tile` (of float tiles or bfloat16 pairs), or for pairs on AMX tiles
    `_tiles.qk_tiles`."""


@overload(any_qk_tile, jit_options=HELPER_OPTIONS)
def _any_qk_tile(q_tile, k_panels, scores, rows, cols, mult, lo_off, hi_off):
    if k_panels.dtype == types.uint16 and _amx.TILES is not None:
        def tiles(q_tile, k_panels, scores, rows, cols, mult, lo_off, hi_off):
            qk_tiles(q_tile, k_panels, scores, rows, cols, mult, lo_off, hi_off)
        return tiles

    def products(q_tile, k_panels, scores, rows, cols, mult, lo_off, hi_off):
        qk_columns(q_tile, k_panels, scores, rows, cols, mult, lo_off, hi_off, 0, cols)
    return products


@jit
def softmax_update(scores, row_max, row_sum, alpha, rows, cols, lo_off, hi_off, inputs=None):
    """Online softmax over one key block: scores become P = exp(s - new max).

    alpha[r] = exp(old max - new max) is the factor that rescales what row r accumulated so
    far. The exponentials are exp2((s - max) * log2(e)): the difference first, so it is exact
    for the scores that matter and large logits lose nothing to the change of base. A row whose
    every score so far is -inf keeps max -inf and uses 0 as its shift, so it produces zeros
    rather than NaN; a NaN score makes its row max NaN and so its output NaN. Scores past
    `cols` in the last vector are set to -inf first, so whole vectors can be used.

    Row r sees columns r + lo_off .. r + hi_off (see `qk_tile`): only the vectors covering them
    are exponentiated; P is set to 0 on the rest of the columns that `pv_tile` reads for the
    row's group (the others' exponentials would be exactly 0, so the sums are unchanged).
    `inputs` (q, or None) chooses the exponential (`exp_for`).
    """
    n = lanes(scores)
    sw = scores.shape[1]
    width = round_up(cols, n)
    full_groups = rows - rows % ROWS
    # Three loops over the rows: block maxes (into alpha), new maxes and alpha, then P and
    # the sums. Each row's work is a chain of dependent steps (the maxes' shuffle tree, the
    # exponential, the sum's tree); in short loops the core runs several rows' chains at once
    # (measured faster at 16-128 keys: docs/history.md, "Per-call cost", small calls)
    for r in range(rows):
        for c in range(cols, width):
            scores[r, c] = -np.inf
        first, end = row_span(r, cols, lo_off, hi_off, n)  # the vectors covering its band
        alpha[r] = _max_span(scores, r * sw + first, r * sw + end)
    for r in range(rows):
        first, end = row_span(r, cols, lo_off, hi_off, n)
        m = row_max[r]
        if first >= end:  # sees nothing here: the max stays, alpha as the general case has it
            alpha[r] = 0.0 if m == -np.inf else m - m + 1.0  # 1, or NaN for a NaN/inf max
        else:
            block_max = alpha[r]
            new_max = block_max if block_max > m or block_max != block_max else m
            alpha[r] = math.exp2((m - (new_max if new_max != -np.inf else 0.0)) * LOG2E)
            row_max[r] = new_max
    for r in range(rows):
        base = r * sw
        first, end = row_span(r, cols, lo_off, hi_off, n)
        if first >= end:
            row_sum[r] = row_sum[r] * alpha[r]
        else:
            m = row_max[r]
            row_sum[r] = row_sum[r] * alpha[r] + _exp_span(scores, base + first, base + end,
                                                           m if m != -np.inf else 0.0, inputs)
        # zeros where the row's group reads keys this row cannot see (pv_tile's key range), in
        # whole vectors: `first` and `end` are multiples of n, and past the group's range no
        # one reads this row's scores
        group = r - r % ROWS if r < full_groups else r
        span = ROWS if r < full_groups else 1
        zeros = vzeros(scores)
        for c in range(max(0, group + lo_off) // n * n, min(first, cols), n):
            vstore(scores, base + c, zeros)
        for c in range(end, min(cols, group + span + hi_off), n):
            vstore(scores, base + c, zeros)


@jit
def _max_span(scores, start, end):
    """The largest of scores[start:end] (whole vectors); -inf for none, NaN if one is NaN.

    Four running maxes: `vmax` is three dependent instructions (it keeps NaN), and one running
    max over a row leaves the core waiting on that chain (measured on the AVX2 build at
    D = 64: docs/history.md, "Forward", the AVX2 build on Zen 4). A maximum is exact
    whatever the order, so the value is the same as one running max's (only the sign of a zero
    maximum may differ).
    """
    n = lanes(scores)
    t0 = t1 = t2 = t3 = vsplat(-np.inf, scores)
    c = start
    while c + 4 * n <= end:
        t0 = vmax(t0, vload(scores, c))
        t1 = vmax(t1, vload(scores, c + n))
        t2 = vmax(t2, vload(scores, c + 2 * n))
        t3 = vmax(t3, vload(scores, c + 3 * n))
        c += 4 * n
    while c < end:
        t0 = vmax(t0, vload(scores, c))
        c += n
    return vhmax(vmax(vmax(t0, t1), vmax(t2, t3)))


def exp_for(x, inputs):
    """`vexp2(x)`, or `vexp2_half(x)` where `inputs` are 16-bit floats (a uint16 array) and
    `ROUNDS_P`: P is rounded to bfloat16 next, or a float16 output to 2^-11."""


@overload(exp_for, jit_options=HELPER_OPTIONS)
def _exp_for(x, inputs):
    if ROUNDS_P and isinstance(inputs, types.Array) and inputs.dtype == types.uint16:
        return lambda x, inputs: vexp2_half(x)
    return lambda x, inputs: vexp2(x)


@jit
def _exp_span(scores, start, end, shift, inputs):
    """scores[start:end] = exp2((s - shift) * log2(e)) in place, whole vectors, and their sum.

    Four vectors at a time: the exponential is a chain of a dozen dependent instructions, and
    four independent chains keep the FMA pipes busy where one leaves them waiting (measured on
    AVX2: docs/history.md, "The forward on AVX2 (AMD EPYC Zen 3)"). The sum is kept in two
    partial sums, in an order fixed by `start` and `end` alone (a row's columns, whatever tile
    the row is in).
    """
    n = lanes(scores)
    shift_v, log2e = vsplat(shift, scores), vsplat(LOG2E, scores)
    t0 = t1 = vzeros(scores)
    c = start
    while c + 4 * n <= end:
        p0 = exp_for(vmul(vsub(vload(scores, c), shift_v), log2e), inputs)
        p1 = exp_for(vmul(vsub(vload(scores, c + n), shift_v), log2e), inputs)
        p2 = exp_for(vmul(vsub(vload(scores, c + 2 * n), shift_v), log2e), inputs)
        p3 = exp_for(vmul(vsub(vload(scores, c + 3 * n), shift_v), log2e), inputs)
        vstore(scores, c, p0)
        vstore(scores, c + n, p1)
        vstore(scores, c + 2 * n, p2)
        vstore(scores, c + 3 * n, p3)
        t0 = vadd(t0, vadd(p0, p2))
        t1 = vadd(t1, vadd(p1, p3))
        c += 4 * n
    while c < end:
        p0 = exp_for(vmul(vsub(vload(scores, c), shift_v), log2e), inputs)
        vstore(scores, c, p0)
        t0 = vadd(t0, p0)
        c += n
    return vhsum(vadd(t0, t1))


@jit
def pv_tile(scores, v_tile, acc, alpha, rows, cols, lo_off, hi_off):
    """acc[r] = alpha[r] * acc[r] + sum_c P[r, c] * v[c], ROWS rows x two vectors at a time
    (four where the CPU has 32 vector registers).

    Row r sees columns r + lo_off .. r + hi_off (see `qk_tile`): a row group sums only over the
    keys some of its rows can see. P is exactly 0 elsewhere, so the sums are unchanged, unless
    a value there is inf or NaN (0 * inf is NaN): such blocks go to `pv_tile_exact`.
    """
    pv_columns(scores, v_tile, acc, alpha, rows, cols, lo_off, hi_off, 0, cols)


@jit
def pv_columns(scores, v_tile, acc, alpha, rows, cols, lo_off, hi_off, c_lo, c_hi):
    """`pv_tile` over keys c_lo .. c_hi - 1 only (P is 0 for the others: their terms would add
    exact zeros; `pv_tile`'s rule on inf and NaN values holds)."""
    w = 2 * lanes(acc)
    full = rows - rows % ROWS
    for x0 in range(0, acc.shape[1], 2 * w if WIDE else w):  # (ranges: see `qk_tile`)
        wide = WIDE and x0 + w < acc.shape[1]
        for r in range(0, full, ROWS):
            key0, key1 = max(c_lo, r + lo_off), min(c_hi, r + ROWS + hi_off)
            if wide:
                pv_micro(scores, r, v_tile, x0, acc, alpha, key0, key1, ROWS, 2)
            else:
                pv_micro(scores, r, v_tile, x0, acc, alpha, key0, key1, ROWS, 1)
        for r in range(full, rows):
            key0, key1 = max(c_lo, r + lo_off), min(c_hi, r + 1 + hi_off)
            pv_micro(scores, r, v_tile, x0, acc, alpha, key0, key1, 1, 1)
            if wide:
                pv_micro(scores, r, v_tile, x0 + w, acc, alpha, key0, key1, 1, 1)


@jit
def finite_rows(tile, first, end):
    """Whether rows first .. end - 1 of `tile` (whole vectors) hold only finite numbers."""
    return finite_span(tile, first * tile.shape[1], end * tile.shape[1])


@jit
def finite_span(arr, start, end):
    """Whether the elements start .. end - 1 of `arr` (flat, whole vectors) are all finite:
    x - x is 0 for those and NaN for inf and NaN."""
    total = vzeros(arr)
    for o in range(start, end, lanes(arr)):
        x = vload(arr, o)
        total = vadd(total, vsub(x, x))
    return vhsum(total) == 0


@jit
def finish_rows(acc, row_max, row_sum, rows, sink, out, lse, b, h, start, half_kind):
    """out = acc / row_sum and lse = max + log(sum), written once per row.

    `sink` (-inf when absent) joins the denominator only. A row with nothing visible (or whose
    visible scores are all -inf) writes zeros and lse -inf (the sink's value when there is
    one).
    """
    n = lanes(acc)
    whole_vectors = vector_rows(out, n)
    for r in range(rows):
        m, total = np.float64(row_max[r]), np.float64(row_sum[r])  # (the sinks need float64)
        if sink != -np.inf:
            top = max(m, sink)
            total = total * math.exp2((m - top) * LOG2E) + math.exp2((sink - top) * LOG2E)
            norm = math.exp2((m - top) * LOG2E) / total
            m = top
        elif total == 0:  # nothing visible, or only scores of -inf: zeros, whatever acc holds
            # (a value row of probability 0 leaves 0 * inf = NaN there)
            for x in range(out.shape[3]):
                out[b, h, start + r, x] = narrow(0.0, out.dtype, half_kind)
            lse[b, h, start + r] = -np.inf
            continue
        else:
            norm = 1.0 / total  # NaN stays NaN
        rounded = like_dtype(norm, acc)  # one rounding, whichever way the row is written
        if whole_vectors:  # (rounded to a half-precision output as it is stored)
            o = row_offset(out, b, h, start + r)
            scale = vsplat(rounded, acc)
            for x in range(0, out.shape[3], n):
                store_narrowed(out, o + x, vmul(scale, vload(acc, r * acc.shape[1] + x)),
                               half_kind)
        else:
            for x in range(out.shape[3]):
                out[b, h, start + r, x] = narrow(acc[r, x] * rounded, out.dtype, half_kind)
        lse[b, h, start + r] = m + math.log2(total) * LN2 if total != 0 else -np.inf


@jit
def probs_and_grads(scores, dp, chain, lse, delta, rows, cols, lo_off, hi_off, has_chain,
                    inputs=None):
    """From S and dP = dO V^T to P and dS, in place, with each row's saved log-sum-exp:

        P = exp(S - lse) = exp2((S - lse) * log2(e)),   dS = P * (dP - delta)  (* chain)

    with ``delta = rowsum(dO * O)``. The difference first, as the forward's softmax takes it.
    Both tiles are 0 in every column of a row outside its span (see `row_span`) and past
    `cols`, and everywhere in a row that sees no key at all (lse -inf), so the products that
    follow may read any column of any row (`pv_tile`, `tn_tile`). `inputs` (q, or None)
    chooses the exponential (`exp_for`).
    """
    n = lanes(scores)
    sw = scores.shape[1]
    width = round_up(cols, n)
    log2e, zeros = vsplat(LOG2E, scores), vzeros(scores)
    for r in range(rows):
        base = r * sw
        first, end = row_span(r, cols, lo_off, hi_off, n)
        if first >= end or lse[r] == -np.inf:  # sees no key here, or none at all (no sink)
            first = end = 0
        for c in range(0, first, n):
            vstore(scores, base + c, zeros)
            vstore(dp, base + c, zeros)
        for c in range(end, width, n):
            vstore(scores, base + c, zeros)
            vstore(dp, base + c, zeros)
        row_lse, row_delta = vsplat(lse[r], scores), vsplat(delta[r], scores)
        for c in range(first, end, n):
            p = exp_for(vmul(vsub(vload(scores, base + c), row_lse), log2e), inputs)
            ds = vmul(p, vsub(vload(dp, base + c), row_delta))
            if has_chain:
                ds = vmul(ds, vload(chain, base + c))
            vstore(scores, base + c, p)
            vstore(dp, base + c, ds)
        for c in range(max(first, cols), end):  # the padding past the block
            scores[r, c] = 0.0
            dp[r, c] = 0.0


@jit
def finite_tile(tile, rows, cols):
    """Whether ``tile[:rows, :cols]`` holds only finite numbers (x - x is 0 for those, NaN for
    inf and NaN); `finite_rows` for tiles whose rows are not whole vectors."""
    total = 0.0
    for r in range(rows):
        for c in range(cols):
            total += tile[r, c] - tile[r, c]
    return total == 0


@jit
def finite_panels(panels, cols):
    """Whether the key panels of a block of `cols` keys (`pack_key_panels`, whose lanes past
    `cols` are 0) hold only finite numbers."""
    w = panels.shape[2]
    return finite_span(panels, 0, (cols + w - 1) // w * panels.shape[1] * w)


@jit
def finite_lse(lse, delta, rows):
    """Whether the rows' log-sum-exps (-inf allowed: a row that sees no key) and deltas are
    finite."""
    total = 0.0
    for r in range(rows):
        total += (delta[r] - delta[r]) + (0.0 if lse[r] == -np.inf else lse[r] - lse[r])
    return total == 0


@jit
def tn_tile(a, b_rows, acc, rows, cols, lo_off, hi_off):
    """acc[c] += sum_r a[r, c] * b_rows[r] for the tile's columns c < cols: ``A^T B`` (dV += P^T
    dO, dK += dS^T Q), ROWS columns x two vectors at a time (four with 32 vector registers).

    The pv micro-kernels with the roles of rows and columns of `a` swapped: the broadcasts
    read ROWS neighbours of one row of `a`. Column c is seen by the rows ``c - hi_off ..
    c - lo_off`` (see `qk_tile`); a group of columns sums over the rows that see one of them,
    `a` being 0 elsewhere (`probs_and_grads`). `b_rows` is as wide as `acc`.
    """
    w = 2 * lanes(acc)
    full = cols - cols % ROWS
    for x0 in range(0, acc.shape[1], 2 * w if WIDE else w):  # (ranges: see `qk_tile`)
        wide = WIDE and x0 + w < acc.shape[1]
        for c in range(0, full, ROWS):
            row0, row1 = max(0, c - hi_off), min(rows, c + ROWS - lo_off)
            if wide:
                tn_micro(a, c, b_rows, x0, acc, row0, row1, ROWS, 2)
            else:
                tn_micro(a, c, b_rows, x0, acc, row0, row1, ROWS, 1)
        for c in range(full, cols):
            row0, row1 = max(0, c - hi_off), min(rows, c + 1 - lo_off)
            tn_micro(a, c, b_rows, x0, acc, row0, row1, 1, 1)
            if wide:
                tn_micro(a, c, b_rows, x0 + w, acc, row0, row1, 1, 1)


@jit
def store_rows(acc, rows, mult, dst, b, h, start, half_kind):
    """dst[b, h, start + r, :] = mult * acc[r, :D] for r < rows, rounded once to dst's dtype
    (whole vectors where `dst`'s rows allow, the same bits either way)."""
    n = lanes(acc)
    rounded = like_dtype(mult, acc)
    if vector_rows(dst, n):
        scale = vsplat(rounded, acc)
        for r in range(rows):
            o = row_offset(dst, b, h, start + r)
            for x in range(0, dst.shape[3], n):
                store_narrowed(dst, o + x, vmul(scale, vload(acc, r * acc.shape[1] + x)),
                               half_kind)
        return
    for r in range(rows):
        for x in range(dst.shape[3]):
            dst[b, h, start + r, x] = narrow(acc[r, x] * rounded, dst.dtype, half_kind)

