"""Products on AMX tiles (`_amx`), for bfloat16 inputs: ``Q K^T`` and ``P V`` on the pair
layouts of `_pairs`, which are a tile's as they are. The backward's five products take the same
two steps (`_pairs.tn_tile_pairs` turns ``P^T dO`` and ``dS^T Q`` into ``P V``'s form).

A ``tdpbf16ps`` multiplies an A tile, 16 rows of 32 bfloat16 numbers read row-major, by a B
tile of 16 rows of 16 bfloat16 pairs, into a C tile of 16 x 16 float32. So:

* ``Q K^T``: A is 16 rows of `q_pairs` and 32 of its head dims, B is 16 keys of a `k_pairs`
  panel over 16 pairs of dims (rows ``w2`` elements apart), C a 16 x 16 block of the scores;
  ``D`` is zero-padded to a multiple of 32 (`pair_buffers`).
* ``P V``: A is 16 rows of `p_pairs` (P rounded to bfloat16) over 32 keys, B is 16 pairs of
  `v_pairs` rows over 16 of the value's columns, C a 16 x 16 block of the accumulator, loaded,
  added to and stored back.

Each step covers 32 query rows by 32 columns in four C tiles (two A tiles and two B tiles per 32
terms of the sum, the 2 x 2 blocking of AMX GEMMs), fewer at a tile's edge. A step's scores are
scaled as soon as its tiles are stored (in float32, as `_products.qk_tile` scales its finished
sums), and the accumulator is rescaled by alpha before ``P V`` adds to it. The float32 sums run over the
whole head dim (or the block's keys) in one accumulator, not in chunks: bfloat16's rounding of the
output, 2^-9, is far above what that costs.

Past the keys of a block, the P columns a tile reads are 0 and the value pairs too (zeroed as
they are packed: `_pairs._pack_values`), so stale numbers, inf or NaN, never meet a product.
"""

from .. import _simd
from .._amx import tile_config, tile_dot, tile_file, tile_load, tile_release, tile_store, \
    tile_zero
from .._jit import jit
from .._simd import vload, vmul, vsplat, vstore, vstore_pairs, vzeros
from ._layout import _sees, round_up, row_span

T = 16  # rows and columns of a tile
STEP = 2 * T  # rows and columns a step covers, and terms of the sum an A tile holds


@jit
def qk_tiles(q_pairs, k_pairs, scores, rows, cols, mult, lo_off, hi_off):
    """scores[:rows, :cols] = mult * (Q @ K^T); blocks of 32 x 32 that no row sees are
    skipped, their scores left for the band mask (as `_products.qk_tile`). A `mult` of 1 (Q came
    scaled: `_pairs.folded_scale`) takes a build without the scaling: its mere presence, not
    taken, slowed the forward measurably (docs/history.md, "bfloat16", AMX tiles on the
    Xeon)."""
    if mult == 1.0:
        _qk_unscaled(q_pairs, k_pairs, scores, rows, cols, mult, lo_off, hi_off)
    else:
        _qk_scaled(q_pairs, k_pairs, scores, rows, cols, mult, lo_off, hi_off)


def _qk_steps(scales):
    def qk(q_pairs, k_pairs, scores, rows, cols, mult, lo_off, hi_off):
        tiles = tile_file()
        dp, w2, qw, sw = k_pairs.shape[1], k_pairs.shape[2], q_pairs.shape[1], scores.shape[1]
        w = w2 // 2
        key_tiles = (cols + T - 1) // T
        for r in range(0, rows, STEP):
            m0, m1 = min(T, rows - r), min(T, max(0, rows - r - T))
            tile_config(tiles, m0, m1)
            for j in range(0, key_tiles, 2):
                if not _sees(j // 2, STEP, r, m0 + m1, lo_off, hi_off):
                    continue
                two = j + 1 < key_tiles
                b0 = (T * j) // w * dp * w2 + (T * j) % w * 2  # key tile j: its panel and lane
                b1 = (T * j + T) // w * dp * w2 + (T * j + T) % w * 2
                _zero_block(tiles, m1, two)
                for x in range(0, dp, T):
                    _dot_step(tiles, q_pairs, r * qw + 2 * x, qw, k_pairs, b0 + x * w2,
                              b1 + x * w2, w2, m1, two)
                o = r * sw + T * j
                _store_block(tiles, scores, o, sw, m1, two)
                if scales:
                    _scale_block(scores, o, m0 + m1, T * 2 if two else T, mult)
        tile_release(tiles)
    return jit(qk)


_qk_scaled, _qk_unscaled = _qk_steps(True), _qk_steps(False)


@jit
def _scale_block(scores, o, n_rows, width, mult):
    """scores[r, c] *= mult for the `n_rows` x `width` block at flat offset `o`, while the tiles
    just stored are in L1 (a pass of its own over the scores, after the products, reads them
    back from L2; measured: docs/history.md, "bfloat16", AMX tiles written on a Zen 4). Columns
    no row sees are scaled too: the band mask or the softmax overwrites them."""
    n = _simd.LANES_F32
    sw = scores.shape[1]
    m = vsplat(mult, scores)
    for r in range(n_rows):
        for c in range(0, width, n):
            vstore(scores, o + r * sw + c, vmul(m, vload(scores, o + r * sw + c)))


@jit
def pv_tiles(scores, p_pairs, v_pairs, acc, alpha, rows, cols, lo_off, hi_off):
    """acc[r] = alpha[r] * acc[r] + sum_c P[r, c] * v[c], P (float32, from `softmax_update`)
    rounded to bfloat16 over the keys each 32-row step reads (from an even key: a pair)."""
    tiles = tile_file()
    dvp, vw, pw = acc.shape[1], v_pairs.shape[1], p_pairs.shape[1]
    for r in range(0, rows, STEP):
        m0, m1 = min(T, rows - r), min(T, max(0, rows - r - T))
        _rescale_rows(acc, alpha, r, r + m0 + m1)
        key0, key1 = max(0, r + lo_off), min(cols, r + m0 + m1 + hi_off)
        if key1 <= key0:
            continue
        c0 = key0 - key0 % 2
        c1 = c0 + round_up(key1 - c0, STEP)
        _round_probs(scores, p_pairs, r, r + m0 + m1, c0, c1, cols, lo_off, hi_off)
        tile_config(tiles, m0, m1)
        for x in range(0, dvp, STEP):
            two = x + T < dvp
            o = r * dvp + x
            _load_block(tiles, acc, o, dvp, m1, two)
            for c in range(c0, c1, STEP):
                _dot_step(tiles, p_pairs, r * pw + c, pw, v_pairs, c // 2 * vw + 2 * x,
                          c // 2 * vw + 2 * (x + T), vw, m1, two)
            _store_block(tiles, acc, o, dvp, m1, two)
    tile_release(tiles)


# -- a step's four C tiles (rows 0..15 and 16..31 of the step as m0 and m1 rows; columns
# 0..15, and 16..31 where `two`)

@jit
def _zero_block(tiles, m1, two):
    tile_zero(tiles, 0)
    if two:
        tile_zero(tiles, 1)
    if m1:
        tile_zero(tiles, 2)
        if two:
            tile_zero(tiles, 3)


@jit
def _load_block(tiles, arr, o, stride, m1, two):
    tile_load(tiles, 0, arr, o, stride)
    if two:
        tile_load(tiles, 1, arr, o + T, stride)
    if m1:
        tile_load(tiles, 2, arr, o + T * stride, stride)
        if two:
            tile_load(tiles, 3, arr, o + T * stride + T, stride)


@jit
def _store_block(tiles, arr, o, stride, m1, two):
    tile_store(tiles, 0, arr, o, stride)
    if two:
        tile_store(tiles, 1, arr, o + T, stride)
    if m1:
        tile_store(tiles, 2, arr, o + T * stride, stride)
        if two:
            tile_store(tiles, 3, arr, o + T * stride + T, stride)


@jit
def _dot_step(tiles, a, a0, aw, b, b0, b1, bw, m1, two):
    """32 terms of the sums into the C tiles: A tiles of rows from a[a0] and a[a0 + 16 aw]
    (`aw` apart), B tiles from b[b0] and b[b1] (`bw` apart)."""
    tile_load(tiles, 4, a, a0, aw)
    tile_load(tiles, 6, b, b0, bw)
    tile_dot(tiles, 0, 4, 6)
    if two:
        tile_load(tiles, 7, b, b1, bw)
        tile_dot(tiles, 1, 4, 7)
    if m1:
        tile_load(tiles, 5, a, a0 + T * aw, aw)
        tile_dot(tiles, 2, 5, 6)
        if two:
            tile_dot(tiles, 3, 5, 7)


@jit
def _rescale_rows(acc, alpha, r0, r1):
    """acc[r] *= alpha[r] for rows r0 .. r1 - 1 (whole vectors: acc's width is), but not by 1
    (the running max did not move: most key blocks after the first; a NaN alpha is not 1)."""
    n = _simd.LANES_F32
    dvp = acc.shape[1]
    for r in range(r0, r1):
        if alpha[r] == 1.0:
            continue
        a = vsplat(alpha[r], acc)
        for x in range(0, dvp, n):
            vstore(acc, r * dvp + x, vmul(a, vload(acc, r * dvp + x)))


@jit
def _round_probs(scores, p_pairs, r0, r1, c0, c1, cols, lo_off, hi_off):
    """p_pairs[r, c0:c1] = P rounded to bfloat16 on row r's span (`row_span`, where
    `softmax_update` left P) and 0 elsewhere, for rows r0 .. r1 - 1, two vectors at a time
    (one `vcvtne2ps2bf16` with AVX512-BF16) from the pair of vectors that holds c0."""
    n = _simd.LANES_F32
    sw, pw = scores.shape[1], p_pairs.shape[1]
    zeros = vzeros(scores)
    for r in range(r0, r1):
        first, end = row_span(r, cols, lo_off, hi_off, n)
        for c in range(c0 // (2 * n) * (2 * n), round_up(c1, 2 * n), 2 * n):
            lo = vload(scores, r * sw + c) if first <= c < end else zeros
            hi = vload(scores, r * sw + c + n) if first <= c + n < end else zeros
            vstore_pairs(p_pairs, r * pw + c, lo, hi)
