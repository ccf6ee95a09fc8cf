"""Work items and their distribution over threads (numpy only, no Numba).

A work item is one tile of `block_q` query rows of one (sequence, head) (`work_items`); the
backward's key pass has one per block of `block_k` keys of one (sequence, kv head)
(`key_items`), or one per (sequence, kv head) (`whole_sequences`). Items differ in cost
(causal and windowed tiles see different numbers of keys, varlen sequences differ in length), and
Numba's `prange` hands each thread one contiguous range of iterations, so the kernels loop over
*chunks* of items prepared here: one chunk per thread, balanced by estimated cost. Which thread
computes an item never changes how it is computed, so results are bitwise identical for any
thread count.
"""

import numpy as np

from .kernels._band import (ITEM_COLUMNS, ITEM_HEAD, ITEM_Q0, ITEM_SEQ, SEQ_BATCH_K, SEQ_BATCH_Q,
                            SEQ_COLUMNS, SEQ_K_START, SEQ_N_K, SEQ_N_Q, SEQ_Q_START,
                            visible_keys)

# Fixed cost of an item (packing, finishing rows), in units of query-key pairs.
ITEM_OVERHEAD = 4096


def sequence_table(n_q, n_k, batch):
    """The kernel's sequence table for `batch` sequences of the same lengths (no varlen)."""
    seqs = np.zeros((batch, SEQ_COLUMNS), dtype=np.int64)
    seqs[:, SEQ_BATCH_Q] = seqs[:, SEQ_BATCH_K] = np.arange(batch)
    seqs[:, SEQ_N_Q] = n_q
    seqs[:, SEQ_N_K] = n_k
    return seqs


def varlen_table(cu_q, cu_k):
    """The kernel's sequence table for packed sequences given by cumulative lengths."""
    batch = len(cu_q) - 1
    seqs = np.zeros((batch, SEQ_COLUMNS), dtype=np.int64)
    seqs[:, SEQ_Q_START] = cu_q[:-1]
    seqs[:, SEQ_N_Q] = np.diff(cu_q)
    seqs[:, SEQ_K_START] = cu_k[:-1]
    seqs[:, SEQ_N_K] = np.diff(cu_k)
    return seqs


def work_items(seqs, n_heads, block_q, window, chunk, key_align, heads=1):
    """All (sequence, head, first row) items and the number of query-key pairs each may see
    (a tile's first key block starts at a multiple of `key_align`, as in the kernel); with
    `heads`, an item runs that many heads from its own (which `heads` divides)."""
    n_q, n_k = seqs[:, SEQ_N_Q], seqs[:, SEQ_N_K]
    seq, q0 = _blocks(n_q, block_q)
    rows = np.minimum(block_q, n_q[seq] - q0)
    # the same key range the kernel computes for the tile
    left, right = window
    diag0 = q0 + n_k[seq] - n_q[seq]
    k_lo, k_hi = visible_keys(diag0, rows, n_k[seq], left, right, chunk, 0, key_align)
    items, cost = _per_head(seq, q0, rows * np.maximum(0, k_hi - k_lo) * heads,
                            n_heads // heads)
    items[:, ITEM_HEAD] *= heads
    return items, cost


def key_items(seqs, n_kv_heads, group, block_k, block_q, window, chunk):
    """The backward's key items: (sequence, kv head, first key of a block of `block_k`), and the
    number of query-key pairs each may see over the `group` query heads it visits (query tiles
    start at multiples of `block_q`, as in the kernel)."""
    n_q, n_k = seqs[:, SEQ_N_Q], seqs[:, SEQ_N_K]
    seq, k0 = _blocks(n_k, block_k)
    cols = np.minimum(block_k, n_k[seq] - k0)
    # the query rows that see a key of the block: `visible_keys` from the keys' side (key j is
    # seen by rows j - shift - right .. j - shift + left)
    left, right = window
    shift = n_k[seq] - n_q[seq]
    q_lo, q_hi = visible_keys(k0 - shift, cols, n_q[seq], right, left, chunk, shift, block_q)
    return _per_head(seq, k0, cols * np.maximum(0, q_hi - q_lo) * group, n_kv_heads)


def whole_sequences(seqs, n_kv_heads, items, cost):
    """The backward's fused items: one per (sequence, kv head), first key 0, costing the sum of
    the `key_items` `items` for it; a sequence without keys too (its dQ is written as 0)."""
    n_items = len(seqs) * n_kv_heads
    which = items[:, ITEM_SEQ] * n_kv_heads + items[:, ITEM_HEAD]
    whole = np.zeros((n_items, ITEM_COLUMNS), dtype=np.int64)
    whole[:, ITEM_SEQ] = np.repeat(np.arange(len(seqs)), n_kv_heads)
    whole[:, ITEM_HEAD] = np.tile(np.arange(n_kv_heads), len(seqs))
    total = np.bincount(which, weights=cost, minlength=n_items).astype(np.int64)
    return whole, np.maximum(total, ITEM_OVERHEAD)


def _blocks(lengths, block):
    """``(seq, first)``: every block of `block` positions of each sequence of `lengths`, as the
    sequence and the first position of the block, sequence by sequence."""
    blocks = -(-lengths // block)
    seq = np.repeat(np.arange(len(lengths)), blocks)
    first = np.arange(blocks.sum()) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    return seq, first * block


def _per_head(seq, first, pairs, n_heads):
    """The items of blocks ``(seq, first)`` for each of `n_heads` heads, and their costs."""
    items = np.empty((len(seq) * n_heads, ITEM_COLUMNS), dtype=np.int64)
    items[:, ITEM_SEQ] = np.repeat(seq, n_heads)
    items[:, ITEM_HEAD] = np.tile(np.arange(n_heads), len(seq))
    items[:, ITEM_Q0] = np.repeat(first, n_heads)
    return items, np.repeat(pairs, n_heads) + ITEM_OVERHEAD


def balance(items, cost, n_threads):
    """Reorder `items` into `n_threads` chunks of similar total cost.

    Returns ``(items, chunk_ptr)``: chunk `c` is ``items[chunk_ptr[c]:chunk_ptr[c+1]]``. Within
    a chunk the items run by sequence, head and first row, so that consecutive tiles of one head
    follow each other and the key and value rows they share are still in the core's caches. Of
    two deals, the one whose heaviest chunk is lighter is kept; on a tie, the one that leaves
    fewer chunks empty, then the first:

    * **runs**: the items in that order, cut into consecutive runs of about equal cost (best for
      the caches; balanced to within one item);
    * **snake**: heaviest first, in a snake order (0, 1, .., n-1, n-1, .., 1, 0, 0, 1, ..), so each
      round of dealing gives back to the chunks that the previous round served last (balances
      causal tiles of very different costs).
    """
    n_chunks = max(1, min(n_threads, len(items)))
    in_order = np.lexsort((items[:, ITEM_Q0], items[:, ITEM_HEAD], items[:, ITEM_SEQ]))
    # runs: chunk c takes the items whose cost midpoint falls in the c-th equal share
    total = np.cumsum(cost[in_order])
    midpoint = total - cost[in_order] / 2
    runs = np.empty(len(items), dtype=np.int64)
    runs[in_order] = np.minimum(n_chunks - 1, midpoint * n_chunks // max(1, cost.sum()))
    # snake
    order = np.argsort(-cost, kind="stable")
    rank = np.arange(len(items))
    seat = rank % n_chunks
    snake = np.empty(len(items), dtype=np.int64)
    snake[order] = np.where((rank // n_chunks) % 2 == 0, seat, n_chunks - 1 - seat)

    def badness(owner):  # (heaviest chunk, empty chunks): smaller is better
        loads = np.bincount(owner, weights=cost, minlength=n_chunks)
        empty = np.bincount(owner, minlength=n_chunks) == 0
        return loads.max(initial=0), int(empty.sum())

    owner = runs if badness(runs) <= badness(snake) else snake
    by_chunk = np.lexsort((items[:, ITEM_Q0], items[:, ITEM_HEAD], items[:, ITEM_SEQ], owner))
    chunk_ptr = np.zeros(n_chunks + 1, dtype=np.int64)
    chunk_ptr[1:] = np.cumsum(np.bincount(owner, minlength=n_chunks))
    return np.ascontiguousarray(items[by_chunk]), chunk_ptr
