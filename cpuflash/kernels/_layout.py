"""What every tile step shares: the micro-tiles' sizes, a tile's buffers, the columns a row
sees, and how a block's sum joins the running sum.

`_micro` (the micro-kernels), `_products` (float tiles), `_pairs` (bfloat16 pairs) and `_tiles`
(AMX) build on these; none of them is imported here, so they import this module, `_pairs` and
`_products` import `_micro`, and `_products` imports `_pairs` and `_tiles` (`_steps`, the score
pipeline's steps, imports `_products`).
"""

import numpy as np
from numba.extending import overload
from numba.np.numpy_support import as_dtype

from .. import _amx, _simd, tiling
from .._jit import STRICT_OPTIONS, jit
from .._simd import vfma, vload, vsplat, vstore, vstore_hsums

CACHE_LINE = 64  # bytes
ROWS = 6  # query rows per micro-tile
UNBOUNDED = 1 << 40  # a band edge that no tile reaches
DOT_CHUNK = 64  # terms of a dot product summed in registers before joining the stored sum
# 32 vector registers (AVX-512): room for the 24 accumulators of the wide micro-kernels
WIDE = _simd.LANES_F32 == 16

# `tiling` sizes tiles on these facts, and the same bits for any thread count rest on them: a
# query block is whole row groups, so a row falls in the same micro-tile group (and rounds the
# same way) whatever block it is in; key blocks start on panel borders, so no panel of a
# block straddles two blocks.
assert tiling.BLOCK_Q_MULTIPLE % ROWS == 0, "query blocks must be whole micro-tile row groups"
assert tiling.KEY_PANEL % (2 * _simd.LANES_F32) == 0, "key blocks must start on panel borders"

# whether the kernels take bfloat16 inputs as pairs and round P to bfloat16 (`_pairs`'
# FORWARD_PAIRS and BACKWARD_PAIRS are this): the AVX512-BF16 dot products or AMX tiles.
# Elsewhere they widen those inputs and compute the float32 kernel's bits
# (`test_bf16.test_target_without_bf16_widens`)
ROUNDS_P = _simd.BF16_DOT or _amx.TILES is not None


def lanes(arr):
    """Elements of `arr`'s dtype in one SIMD vector (a compile-time constant in kernels)."""
    return _simd.lanes_for(arr.dtype)


@overload(lanes, jit_options=STRICT_OPTIONS)
def _lanes(arr):
    n = _simd.lanes_for(as_dtype(arr.dtype))
    return lambda arr: n


@jit
def round_up(x, multiple):
    """The least multiple of `multiple` that is >= x (x >= 0)."""
    return (x + multiple - 1) // multiple * multiple


# the bytes of packed key and value blocks one thread keeps for its next query tiles
KEPT_BYTES = 1 << 22


@jit
def tile_buffers(block_q, block_k, d, dv, like, n_keys=0, key_align=1):
    """Zeroed q_tile (in row groups), k_panels and v_tile, scores and acc of one thread, in
    `like`'s dtype. ``k_panels[s]`` and ``v_tile[s]`` are the packed keys and values of one
    block, as many as `kept_count` gives for `n_keys` keys (one for 0)."""
    dtype = like.dtype
    width = 2 * lanes(like)
    keys, dvp = round_up(block_k, width), round_up(dv, width)
    kept = kept_count(n_keys, key_align, (keys * d + keys * dvp) * like.itemsize)
    return (aligned_zeros(((block_q + ROWS - 1) // ROWS, d, ROWS), dtype),
            aligned_zeros((kept, keys // width, d, width), dtype),
            aligned_zeros((kept, keys, dvp), dtype), aligned_zeros((block_q, keys), dtype),
            aligned_zeros((block_q, dvp), dtype))


@jit
def per_head(buffer, heads):
    """`heads` zeroed buffers shaped as `buffer` (a thread's tile state), as one array: ``[j]``
    for head j of a work item; for one head, `buffer` itself."""
    if heads == 1:
        return buffer.reshape((1,) + buffer.shape)
    return aligned_zeros((heads,) + buffer.shape, buffer.dtype)


@jit
def kept_count(n_keys, key_align, block_bytes):
    """How many packed key blocks a thread keeps: one per block of `n_keys` keys from
    multiples of `key_align`, up to `KEPT_BYTES` (at least one)."""
    return max(1, min((n_keys + key_align - 1) // key_align, KEPT_BYTES // max(1, block_bytes)))


@jit
def kept_block(slots, head, row, first, end, key_align):
    """(s, held): the kept block (`tile_buffers`) for keys from `row` of `head` (b * heads +
    h), and whether it holds keys row + first .. row + end packed already; if not, `slots` marks
    it as holding them, and the caller packs them. The query tiles of one head, which a thread
    runs in turn, read the same key blocks: packing them once instead of once per tile made the
    forward faster, the bfloat16 one on AMX tiles most (measured: docs/history.md, "bfloat16",
    AMX tiles on the Xeon). One block per block start (`key_align`) in turn; ``slots[s]`` is
    (head, row, first, end) of what block s holds."""
    s = (row // key_align) % slots.shape[0]
    held = (slots[s, 0] == head and slots[s, 1] == row and slots[s, 2] <= first
            and end <= slots[s, 3])
    if not held:
        slots[s, 0], slots[s, 1], slots[s, 2], slots[s, 3] = head, row, first, end
    return s, held


@jit
def aligned_zeros(shape, dtype):
    """np.zeros(shape, dtype) from a 64-byte boundary: a cache line, an AVX-512 vector, an AMX
    tile row. Numba aligns arrays to 32 bytes, and half the time a row of 64 bytes then spans
    two lines: AMX tile loads of such rows ran far slower (measured: docs/history.md,
    "bfloat16", AMX tiles on the Xeon)."""
    n = 1
    for s in shape:
        n *= s
    flat = np.zeros(n + 64, dtype)
    skip = (-flat.ctypes.data % 64) // flat.itemsize
    return flat[skip:skip + n].reshape(shape)


@jit
def _sees(panel, w, r, n_rows, lo_off, hi_off):
    """Whether some row of r .. r + n_rows sees a column of `panel` (see `qk_tile`)."""
    return (panel + 1) * w - 1 >= r + lo_off and panel * w <= r + n_rows - 1 + hi_off


@jit
def row_span(r, cols, lo_off, hi_off, n):
    """(first, end): the columns of the whole `n`-vectors that cover row r's visible columns
    r + lo_off .. r + hi_off of a block of `cols` columns (see `qk_tile`); empty when it sees
    none. The score steps after Q K^T work on these columns only, and `softmax_update` reads
    only these."""
    first = max(0, r + lo_off) // n * n
    end = min(round_up(cols, n), round_up(max(0, r + hi_off + 1), n))
    return first, end


@jit
def row_starts(r, count, stride):
    """Flat starts of rows r .. r + 3 of a buffer, rows past r + count - 1 repeating it."""
    last = r + count - 1
    return (r * stride, min(r + 1, last) * stride, min(r + 2, last) * stride,
            min(r + 3, last) * stride)


@jit
def fma4(a, bs, c0, c1, c2, c3):
    """(a * bs[0] + c0, ..., a * bs[3] + c3), each one FMA: a row of a micro-kernel's block of
    accumulators."""
    return vfma(a, bs[0], c0), vfma(a, bs[1], c1), vfma(a, bs[2], c2), vfma(a, bs[3], c3)


@jit
def store_row_sums(scores, at, stride, count, sums):
    """The sums of `count` (1 to 4) rows x four columns of accumulators into `scores` from flat
    `at`, rows `stride` apart: `sums` holds four rows' 16 vectors, row by row (those past the
    count are not read), each stored as its lanes' sum (`_simd.vstore_hsums`)."""
    if count == 4:
        vstore_hsums(scores, at, stride, sums)
    elif count == 3:
        vstore_hsums(scores, at, stride, sums[:12])
    elif count == 2:
        vstore_hsums(scores, at, stride, sums[:8])
    else:
        vstore_hsums(scores, at, stride, sums[:4])


@jit
def rescale_add(acc, o, alpha, total):
    """acc[o : o + lanes] = alpha * acc[...] + total: a block's sum joins the running sum.

    The block's sum starts from zero and joins the running sum once: a two-level sum, whose
    rounding error grows with block_k + number of blocks instead of with the sequence length.
    """
    vstore(acc, o, vfma(vsplat(alpha, acc), vload(acc, o), total))
