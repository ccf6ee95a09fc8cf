"""The forward's tile steps for bfloat16 inputs on AVX512-BF16: ``Q K^T`` and ``P V`` as
bfloat16 dot products with float32 accumulation (`_simd.vdot_pairs`, one `vdpbf16ps` doing two
multiply-adds per float32 lane), the softmax in float32 between them, and P rounded to bfloat16
before ``P V`` (as flash-attn does on GPUs).

`vdpbf16ps` multiplies pairs of neighbours along the sum: the broadcast operand is one 32-bit
pair of a row (a query row, a row of P), row-major as it is; the vector operand has its pairs
interleaved. So the tiles are packed as uint16 bfloat16 bits (no widening), and ``D`` (for Q
K^T) or the keys (for P V) are zero-padded to a whole number of pairs:

* ``q_pairs (block_q, 2 * Dp)``: the tile's queries, ``Dp = ceil(D / 2)`` pairs per row;
* ``k_pairs (panels, Dp, 2 * W)``: ``k_pairs[c // W, x, 2 * (c % W) + t] = k[c, 2 * x + t]``,
  the key panels of `_steps` with each lane holding a pair of dims;
* ``v_pairs (keys / 2, 2 * Dvp)``: ``v_pairs[c // 2, 2 * x + c % 2] = v[c, x]``;
* ``p_pairs (block_q, keys)``: P rounded to bfloat16, laid out as the scores.

The float32 tiles of `_steps` hold the scores and the accumulator as before, so the score
modifiers, the softmax and the last step are shared. Each step here is a no-op for buffers that
are not uint16: the kernels are compiled for every dtype with these calls in a branch that only
bfloat16 on a CPU with AVX512-BF16 (or AMX tiles) takes (`pair_buffers` gives the other dtypes
empty float buffers, so nothing new is compiled for them). ``Q K^T`` on these layouts is
`_products.qk_tile` itself (`_micro`'s kernels take either layout). On AMX tiles, ``Q K^T`` and
``P V`` are `_tiles`' steps on these layouts.
"""

import math

import numpy as np
from numba import types
from numba.extending import overload

from .. import _amx, _simd
from .._jit import HELPER_OPTIONS, jit
from .._simd import vadd, vhsum, vload, vload_bf16, vload_bits, vload_rows, vload_rows_bits, \
    vmul, vsplat, vstore, vstore_bits, vstore_interleaved, vstore_pairs, vsub, vtranspose, vzeros
from . import _tiles
from ._convert import BFLOAT16, narrow, row_offset, vector_rows, widen
from ._layout import ROUNDS_P, ROWS, aligned_zeros, kept_count, round_up
from ._micro import pv_micro
# Whether bfloat16 tiles are packed as pairs: for `vdpbf16ps` where it pays, or for AMX tiles
# (`_tiles`), which read the same layouts, padded: the head dims to whole tiles (`DIMS` pairs),
# and the operands of `pv_tile_pairs` with room for a step past the last key (`PAST`).
TILED = _amx.TILES is not None
FORWARD_PAIRS = BACKWARD_PAIRS = ROUNDS_P
DIMS, PAST = (_tiles.T, _tiles.STEP) if TILED else (1, 0)


def _uses_pairs(buffer):
    return isinstance(buffer, types.Array) and buffer.dtype == types.uint16


def pair_buffers(block_q, block_k, d, dv, n_keys, key_align, q, like, half_kind):
    """``(q_pairs, k_pairs, v_pairs, p_pairs)`` of one thread: uint16 and zeroed for bfloat16
    inputs where `FORWARD_PAIRS`; else empty, in `like`'s dtype (the kernel then widens),
    padded for AMX tiles (`DIMS`, `PAST`). ``k_pairs[s]`` and ``v_pairs[s]`` are the packed
    keys and values of one block, as many as `_layout.kept_count` gives for `n_keys` keys."""


@overload(pair_buffers, jit_options=HELPER_OPTIONS)
def _pair_buffers(block_q, block_k, d, dv, n_keys, key_align, q, like, half_kind):
    if not (FORWARD_PAIRS and q.dtype == types.uint16):
        # q_pairs shaped as the forward's q_tile (row groups), so that the untaken pairs branch
        # calls the tile steps with the float branch's types: one specialization, not two
        def empty(block_q, block_k, d, dv, n_keys, key_align, q, like, half_kind):
            return (np.zeros((0, 0, 0), like.dtype), np.zeros((1, 0, 0, 0), like.dtype),
                    np.zeros((1, 0, 0), like.dtype), np.zeros((0, 0), like.dtype))
        return empty
    width = 2 * _simd.LANES_F32

    def pairs(block_q, block_k, d, dv, n_keys, key_align, q, like, half_kind):
        if half_kind != BFLOAT16:
            block_q = block_k = d = dv = 0
        keys, dvp, dp = round_up(block_k, width), round_up(dv, width), (d + 1) // 2
        dp = round_up(dp, DIMS)
        kept = kept_count(n_keys, key_align, 2 * (keys * 2 * dp + (keys + PAST) * dvp))
        return (aligned_zeros((block_q, 2 * dp), np.uint16),
                aligned_zeros((kept, keys // width, dp, 2 * width), np.uint16),
                aligned_zeros((kept, (keys + PAST) // 2, 2 * dvp), np.uint16),
                aligned_zeros((block_q, keys + PAST), np.uint16))
    return pairs


def backward_pair_buffers(block_q, block_k, d, d_v, q, like, half_kind):
    """The backward's ``(q_pairs, do_pairs, k_panel_pairs, v_panel_pairs, k_row_pairs,
    ds_pairs)`` of one thread: Q and dO rows (for S and dP), K^T and V^T panels, K as pairs of
    rows (for dQ += dS K) and dS rounded; uint16 and zeroed for bfloat16 inputs where
    `BACKWARD_PAIRS`, else empty in `like`'s dtype (as `pair_buffers`)."""


@overload(backward_pair_buffers, jit_options=HELPER_OPTIONS)
def _backward_pair_buffers(block_q, block_k, d, d_v, q, like, half_kind):
    if not (BACKWARD_PAIRS and q.dtype == types.uint16):
        def empty(block_q, block_k, d, d_v, q, like, half_kind):
            return (np.zeros((0, 0), like.dtype), np.zeros((0, 0), like.dtype),
                    np.zeros((0, 0, 0), like.dtype), np.zeros((0, 0, 0), like.dtype),
                    np.zeros((0, 0), like.dtype), np.zeros((0, 0), like.dtype))
        return empty
    width = 2 * _simd.LANES_F32

    def pairs(block_q, block_k, d, d_v, q, like, half_kind):
        if half_kind != BFLOAT16:
            block_q = block_k = d = d_v = 0
        keys = round_up(block_k, width)
        dp, dvp = round_up((d + 1) // 2, DIMS), round_up((d_v + 1) // 2, DIMS)
        u2 = np.uint16
        return (aligned_zeros((block_q, 2 * dp), u2), aligned_zeros((block_q, 2 * dvp), u2),
                aligned_zeros((keys // width, dp, 2 * width), u2),
                aligned_zeros((keys // width, dvp, 2 * width), u2),
                aligned_zeros(((keys + PAST) // 2, 2 * round_up(d, width)), u2),
                aligned_zeros((block_q, keys + PAST), u2))
    return pairs


def transposed_pair_buffers(block_q, block_k, d, d_v, q, like, half_kind):
    """The backward's ``(q_row_pairs, do_row_pairs, transposed, transposed_pairs)`` for dK +=
    dS^T Q and dV += P^T dO: Q and dO as pairs of query rows, and a float32 tile with its
    bfloat16 copy for P^T or dS^T, ``(keys, block_q rounded up to two vectors)``; uint16 (the
    copy) and zeroed for bfloat16 where `BACKWARD_PAIRS`, else empty in `like`'s dtype."""


@overload(transposed_pair_buffers, jit_options=HELPER_OPTIONS)
def _transposed_pair_buffers(block_q, block_k, d, d_v, q, like, half_kind):
    if not (BACKWARD_PAIRS and q.dtype == types.uint16):
        def empty(block_q, block_k, d, d_v, q, like, half_kind):
            return (np.zeros((0, 0), like.dtype), np.zeros((0, 0), like.dtype),
                    np.zeros((0, 0), like.dtype), np.zeros((0, 0), like.dtype))
        return empty
    width = 2 * _simd.LANES_F32

    def pairs(block_q, block_k, d, d_v, q, like, half_kind):
        if half_kind != BFLOAT16:
            block_q = block_k = d = d_v = 0
        keys, rows = round_up(block_k, width), round_up(block_q, width)
        return (aligned_zeros(((rows + PAST) // 2, 2 * round_up(d, width)), np.uint16),
                aligned_zeros(((rows + PAST) // 2, 2 * round_up(d_v, width)), np.uint16),
                aligned_zeros((keys, rows), np.float32),
                aligned_zeros((keys, rows + PAST), np.uint16))
    return pairs


def tn_tile_pairs(a, transposed, transposed_pairs, b_pairs, acc, ones, rows, cols, lo_off,
                  hi_off):
    """`_products.tn_tile` on pairs: acc[c] += sum_r a[r, c] * b[r] for the tile's columns c <
    cols, with `a` (P or dS) transposed into `transposed`, rounded to bfloat16, and `b` (dO or
    Q) as pairs of rows: `pv_tile_pairs` of the transposed tile, whose rows are keys (column c
    is seen by the rows c - hi_off .. c - lo_off). `ones` (rescale factors of 1) has at least
    `cols` entries. A no-op for buffers that are not uint16."""


@overload(tn_tile_pairs, jit_options=HELPER_OPTIONS)
def _tn_tile_pairs(a, transposed, transposed_pairs, b_pairs, acc, ones, rows, cols, lo_off,
                   hi_off):
    if not _uses_pairs(b_pairs):
        return lambda a, transposed, transposed_pairs, b_pairs, acc, ones, rows, cols, lo_off, \
            hi_off: None

    def tn(a, transposed, transposed_pairs, b_pairs, acc, ones, rows, cols, lo_off, hi_off):
        _transpose(a, transposed, rows, cols)
        pv_tile_pairs(transposed, transposed_pairs, b_pairs, acc, ones, cols, rows, -hi_off,
                      -lo_off)
    return tn


@jit
def _transpose(a, transposed, rows, cols):
    """transposed[c, r] = a[r, c] for r < rows, c < cols (and some of the padding around),
    `lanes` x `lanes` blocks in registers; element by element where a block would pass the
    last row of `a`."""
    n = _simd.LANES_F32
    aw, tw = a.shape[1], transposed.shape[1]
    for r0 in range(0, rows, n):
        for c0 in range(0, cols, n):
            if r0 + n <= a.shape[0]:
                block = vtranspose(vload_rows(a, r0 * aw + c0, aw))
                for j in range(n):
                    vstore(transposed, (c0 + j) * tw + r0, block[j])
            else:
                for r in range(r0, rows):
                    for c in range(c0, min(c0 + n, cols)):
                        transposed[c, r] = a[r, c]


def pack_panel_pairs(k, b, h, start, cols, k_pairs):
    """Rows start .. start + cols of `k` as panels of pairs (K^T, or V^T for dP = dO V^T), the
    lanes past `cols` 0 (a no-op for buffers that are not uint16)."""


@overload(pack_panel_pairs, jit_options=HELPER_OPTIONS)
def _pack_panel_pairs(k, b, h, start, cols, k_pairs):
    if not _uses_pairs(k_pairs):
        return lambda k, b, h, start, cols, k_pairs: None
    return lambda k, b, h, start, cols, k_pairs: _pack_keys(k, b, h, start, cols, k_pairs)


def pack_row_pairs(v, b, h, start, cols, v_pairs):
    """Rows start .. start + cols of `v` as pairs of rows (V for P V, or K for dS K), the odd
    row of the last pair 0 (a no-op for buffers that are not uint16)."""


@overload(pack_row_pairs, jit_options=HELPER_OPTIONS)
def _pack_row_pairs(v, b, h, start, cols, v_pairs):
    if not _uses_pairs(v_pairs):
        return lambda v, b, h, start, cols, v_pairs: None
    return lambda v, b, h, start, cols, v_pairs: _pack_values(v, b, h, start, cols, v_pairs)


@jit
def folded_scale(scale):
    """What `pack_query_pairs` multiplies Q by on AMX tiles: `scale` where it is a power of two
    up to 1 (1/8 at D = 64, 1/16 at D = 256), so that ``Q K^T`` needs no scaling pass of its
    own (`_tiles.qk_tiles`; measured: docs/history.md, "bfloat16", AMX tiles on the Xeon);
    else 1."""
    if TILED and 0 < scale <= 1 and math.frexp(scale)[0] == 0.5:
        return scale
    return 1.0


def pack_query_pairs(q, b, h, start, rows, q_pairs, mult=1.0):
    """q_pairs[r, :D] = the bits of mult * q[b, h, start + r, :] (the pad of an odd D stays 0).
    `mult` is a power of two (or 1): the products are exact, so ``(mult * Q) K^T`` is ``mult *
    (Q K^T)`` to the bit but for subnormal results (`vstore_pairs` flushes them)."""


@overload(pack_query_pairs, jit_options=HELPER_OPTIONS)
def _pack_query_pairs(q, b, h, start, rows, q_pairs, mult=1.0):
    if not _uses_pairs(q_pairs):
        return lambda q, b, h, start, rows, q_pairs, mult=1.0: None

    def pack(q, b, h, start, rows, q_pairs, mult=1.0):
        n = 2 * _simd.LANES_F32
        if vector_rows(q, n):  # whole vectors
            base, stride = row_offset(q, b, h, start), q.strides[2] // q.itemsize
            qw = q_pairs.shape[1]
            for r in range(rows):
                for x in range(0, q.shape[3], n):
                    at = base + r * stride + x
                    if mult == 1.0:
                        vstore_bits(q_pairs, r * qw + x, vload_bits(q, at))
                    else:
                        lo, hi = vload_bf16(q, at), vload_bf16(q, at + n // 2)
                        m = vsplat(np.float32(mult), lo)
                        vstore_pairs(q_pairs, r * qw + x, vmul(m, lo), vmul(m, hi))
            return
        for r in range(rows):
            for x in range(q.shape[3]):
                value = q[b, h, start + r, x]
                if mult != 1.0:
                    value = narrow(np.float32(mult) * widen(value, BFLOAT16), q_pairs.dtype,
                                   BFLOAT16)
                q_pairs[r, x] = value
    return pack


def pack_key_value_pairs(k, v, b, h, start, cols, k_pairs, v_pairs):
    """Key and value rows start .. start + cols into `k_pairs` and `v_pairs` (their first
    panel and pair: the caller slices them), with the lanes past `cols` of the last panel and
    the odd key of the last value pair 0."""


@overload(pack_key_value_pairs, jit_options=HELPER_OPTIONS)
def _pack_key_value_pairs(k, v, b, h, start, cols, k_pairs, v_pairs):
    if not _uses_pairs(k_pairs):
        return lambda k, v, b, h, start, cols, k_pairs, v_pairs: None

    def pack(k, v, b, h, start, cols, k_pairs, v_pairs):
        _pack_keys(k, b, h, start, cols, k_pairs)
        _pack_values(v, b, h, start, cols, v_pairs)
    return pack


@jit
def _pack_keys(k, b, h, start, cols, k_pairs):
    """K^T in panels of pairs: a transpose of 32-bit pairs, `lanes` keys x `lanes` pairs at a
    time in registers where the rows are whole vectors of pairs, element by element else."""
    w2, dp, d = k_pairs.shape[2], k_pairs.shape[1], k.shape[3]
    w, n = w2 // 2, _simd.LANES_F32
    c = 0
    if vector_rows(k, 2 * n):
        base, stride = row_offset(k, b, h, start), k.strides[2] // k.itemsize
        while c + n <= cols:
            out = c // w * dp * w2 + c % w * 2  # k_pairs[c // w, 0, 2 * (c % w)]
            for x in range(0, d // 2, n):  # (`dp` may be padded past the row's pairs)
                block = vtranspose(vload_rows_bits(k, base + c * stride + 2 * x, stride))
                for j in range(n):  # pair x + j of keys c .. c + n
                    vstore_bits(k_pairs, out + (x + j) * w2, block[j])
            c += n
    for c in range(c, cols):
        panel, lane = c // w, 2 * (c % w)
        for x in range(d):
            k_pairs[panel, x // 2, lane + x % 2] = k[b, h, start + c, x]
    last = (cols - 1) // w
    for lane in range(cols - last * w, w):  # zero the tail of a partial last panel
        for x in range(dp):
            k_pairs[last, x, 2 * lane] = 0
            k_pairs[last, x, 2 * lane + 1] = 0


@jit
def _pack_values(v, b, h, start, cols, v_pairs):
    """Value rows into pairs of rows: two rows interleaved at a time where the rows are whole
    vectors, element by element else. For AMX tiles, the `PAST` // 2 pairs after them are
    zeroed (the last step of `_tiles.pv_tiles` reads them, and P's 0 times a stale inf or NaN
    is NaN)."""
    dv, n = v.shape[3], _simd.LANES_F32
    vw = v_pairs.shape[1]
    c = 0
    if vector_rows(v, n):
        base, stride = row_offset(v, b, h, start), v.strides[2] // v.itemsize
        while c + 2 <= cols:
            row = base + c * stride
            for x in range(0, dv, n):
                vstore_interleaved(v_pairs, c // 2 * vw + 2 * x, v, row + x, row + stride + x)
            c += 2
    for c in range(c, cols):
        for x in range(dv):
            v_pairs[c // 2, 2 * x + c % 2] = v[b, h, start + c, x]
    if cols % 2:  # the pair's second key is past the block
        for x in range(dv):
            v_pairs[cols // 2, 2 * x + 1] = 0
    for c in range((cols + 1) // 2, min(v_pairs.shape[0], (cols + PAST + 1) // 2)):
        v_pairs[c, :] = 0


def finite_pairs(v_pairs, first, end, like):
    """Whether value pairs first .. end - 1 hold only finite numbers: x - x is 0 for those and
    NaN for inf and NaN (True for buffers that are not uint16; `like` is a float32 array)."""


@overload(finite_pairs, jit_options=HELPER_OPTIONS)
def _finite_pairs(v_pairs, first, end, like):
    if not _uses_pairs(v_pairs):
        return lambda v_pairs, first, end, like: True

    def finite(v_pairs, first, end, like):
        total = vzeros(like)
        for o in range(first * v_pairs.shape[1], end * v_pairs.shape[1], _simd.LANES_F32):
            x = vload_bf16(v_pairs, o)
            total = vadd(total, vsub(x, x))
        return vhsum(total) == 0
    return finite


# -- P V

def pv_tile_pairs(scores, p_pairs, v_pairs, acc, alpha, rows, cols, lo_off, hi_off):
    """`_products.pv_tile` on pairs: P (float32, from `softmax_update`) rounded to bfloat16 over
    the keys each row group reads, then acc[r] = alpha[r] * acc[r] + sum_c P[r, c] * v[c] with
    the same row groups, column slices and key ranges (a no-op for buffers that are not
    uint16)."""


@overload(pv_tile_pairs, jit_options=HELPER_OPTIONS)
def _pv_tile_pairs(scores, p_pairs, v_pairs, acc, alpha, rows, cols, lo_off, hi_off):
    if not _uses_pairs(v_pairs):
        return lambda scores, p_pairs, v_pairs, acc, alpha, rows, cols, lo_off, hi_off: None
    if TILED:
        return lambda scores, p_pairs, v_pairs, acc, alpha, rows, cols, lo_off, hi_off: \
            _tiles.pv_tiles(scores, p_pairs, v_pairs, acc, alpha, rows, cols, lo_off, hi_off)

    def pv(scores, p_pairs, v_pairs, acc, alpha, rows, cols, lo_off, hi_off):
        full = rows - rows % ROWS
        for r in range(0, full, ROWS):
            _round_probs(scores, p_pairs, r, ROWS, max(0, r + lo_off),
                         min(cols, r + ROWS + hi_off))
        for r in range(full, rows):
            _round_probs(scores, p_pairs, r, 1, max(0, r + lo_off), min(cols, r + 1 + hi_off))
        w = 2 * _simd.LANES_F32
        for x0 in range(0, acc.shape[1], 2 * w):
            wide = x0 + w < acc.shape[1]
            for r in range(0, full, ROWS):
                pair0, pair1 = _pair_range(max(0, r + lo_off), min(cols, r + ROWS + hi_off))
                if wide:
                    pv_micro(p_pairs, r, v_pairs, x0, acc, alpha, pair0, pair1, ROWS, 2)
                else:
                    pv_micro(p_pairs, r, v_pairs, x0, acc, alpha, pair0, pair1, ROWS, 1)
            for r in range(full, rows):
                pair0, pair1 = _pair_range(max(0, r + lo_off), min(cols, r + 1 + hi_off))
                pv_micro(p_pairs, r, v_pairs, x0, acc, alpha, pair0, pair1, 1, 1)
                if wide:
                    pv_micro(p_pairs, r, v_pairs, x0 + w, acc, alpha, pair0, pair1, 1, 1)
    return pv


@jit
def _pair_range(key0, key1):
    """The pairs of keys that cover keys key0 .. key1 - 1 (none when that is empty)."""
    if key1 <= key0:
        return 0, 0
    return key0 // 2, (key1 + 1) // 2


@jit
def _round_probs(scores, p_pairs, r, n_rows, key0, key1):
    """p_pairs = P rounded to bfloat16 for rows r .. r + n_rows - 1 over keys key0 .. key1 - 1
    (which `softmax_update` leaves as P or 0 for every row of the group), and 0 for the key
    beside them that shares a pair with one of them. Whole vectors: the other columns
    converted are never read."""
    if key1 <= key0:
        return
    n = _simd.LANES_F32
    sw = scores.shape[1]
    c0, c1 = key0 // (2 * n) * (2 * n), round_up(key1, 2 * n)
    for row in range(r, r + n_rows):
        base = row * sw
        for c in range(c0, c1, 2 * n):
            vstore_pairs(p_pairs, base + c, vload(scores, base + c), vload(scores, base + c + n))
        if key0 % 2:
            p_pairs[row, key0 - 1] = 0
        if key1 % 2:
            p_pairs[row, key1] = 0
