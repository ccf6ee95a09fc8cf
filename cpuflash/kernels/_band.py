"""Which keys a tile of query rows can see, and how the work is described to the kernels.

One home for the facts that the scheduler (numpy, on arrays of tiles) and the kernels (Numba,
on one tile) must agree on: plain functions of numpy operations, so they run on arrays as they
are and compile unchanged where a kernel calls them (`_steps.visible_keys`, `_steps.sees_all`).

Positions are bottom-right aligned: a tile's rows start at query row ``q0`` of a sequence of
``n_q`` queries and ``n_k`` keys, and row ``q0 + r`` sits over key column ``diag0 + r`` with
``diag0 = q0 + n_k - n_q``. It sees the keys ``diag0 + r - left .. diag0 + r + right`` (a
window side of -1 is unbounded; causal is ``right = 0``) that lie in its own chunk of `chunk`
positions (0 = no chunks): position ``x`` is in chunk ``(x + phase) // chunk``, `phase` 0 but
where the rows are keys and the "keys" query rows (the backward's view from the keys' side,
where the query row ``i`` is key position ``i + shift``: `phase` is the shift).
"""

import numpy as np

# -- the sequence table: one row per sequence of a call (batched, packed or cached). Sequence s
# reads q[batch_q, :, q_start:q_start + n_q] and k, v[batch_k, :, k_start:k_start + n_k].
SEQ_BATCH_Q, SEQ_Q_START, SEQ_N_Q, SEQ_BATCH_K, SEQ_K_START, SEQ_N_K = range(6)
SEQ_COLUMNS = 6
# -- the work items: one row per tile of query rows, (sequence, head, first row of the tile)
ITEM_SEQ, ITEM_HEAD, ITEM_Q0 = range(3)
ITEM_COLUMNS = 3


def visible_keys(diag0, rows, n_k, left, right, chunk, phase, align):
    """``(lo, hi)``: the keys ``lo .. hi - 1`` that some of `rows` rows from diagonal `diag0`
    sees, with `lo` rounded down to a multiple of `align`. The keys outside the rows' chunks
    are left out, so a tile never visits a block of another chunk.

    Rounding `lo` down makes the key blocks of every tile start at multiples of `align`, so a
    row meets the same key blocks, and rounds its sums the same way, whatever tile it falls in
    (and so whatever the thread count).
    """
    lo = np.maximum(0, diag0 - left) if left >= 0 else 0 * diag0
    hi = np.minimum(n_k, diag0 + rows + right) if right >= 0 else n_k + 0 * diag0
    if chunk > 0:
        # (the first position of the chunk of x is (x + phase) // chunk * chunk - phase)
        lo = np.maximum(lo, (diag0 + phase) // chunk * chunk - phase)
        hi = np.minimum(hi, (diag0 + rows - 1 + phase) // chunk * chunk - phase + chunk)
    return lo // align * align, hi


def sees_all(diag0, rows, first, cols, left, right, chunk):
    """Whether every one of `rows` rows from diagonal `diag0` sees all the keys
    ``first .. first + cols - 1`` (then no key of the block needs a mask)."""
    return ((left < 0 or first >= diag0 + rows - 1 - left)
            and (right < 0 or first + cols - 1 <= diag0 + right)
            and (chunk <= 0 or (diag0 // chunk == (diag0 + rows - 1) // chunk == first // chunk
                                == (first + cols - 1) // chunk)))
