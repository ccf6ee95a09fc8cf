"""Work items and their deal over threads (`cpuflash._schedule`), without running a kernel."""

import numpy as np
import pytest

from cpuflash import _schedule


def deal(costs, n_threads):
    items = np.stack([np.zeros(len(costs), np.int64), np.zeros(len(costs), np.int64),
                      np.arange(len(costs), dtype=np.int64)], axis=1)
    costs = np.asarray(costs, dtype=np.int64)
    dealt, chunk_ptr = _schedule.balance(items, costs, n_threads)
    chunks = [dealt[chunk_ptr[c]:chunk_ptr[c + 1], 2] for c in range(len(chunk_ptr) - 1)]
    return chunks, [int(costs[chunk].sum()) for chunk in chunks]


@pytest.mark.parametrize("n_threads", [1, 2, 3, 7, 100])
@pytest.mark.parametrize("seed", range(5))
def test_every_item_once_in_order_within_a_chunk(n_threads, seed):
    costs = np.random.default_rng(seed).integers(1, 1000, size=15)
    chunks, loads = deal(costs, n_threads)
    assert len(chunks) == min(n_threads, len(costs))
    assert sorted(np.concatenate(chunks).tolist()) == list(range(len(costs)))
    assert all((np.diff(chunk) > 0).all() for chunk in chunks)
    assert max(loads) <= costs.sum() / len(chunks) + costs.max()


def test_equal_costs_are_cut_into_runs():
    chunks, loads = deal([5] * 12, 3)
    assert [chunk.tolist() for chunk in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_causal_costs_are_dealt_heaviest_first():
    # one head's causal tiles: runs would give 1+..+5 = 15 against 6+7+8 = 21
    chunks, loads = deal([1, 2, 3, 4, 5, 6, 7, 8], 2)
    assert loads == [18, 18]


def test_a_tie_goes_to_the_deal_that_leaves_no_thread_idle():
    chunks, loads = deal([100, 1, 1], 3)
    assert all(len(chunk) == 1 for chunk in chunks)


def test_no_items():
    items = np.zeros((0, 3), dtype=np.int64)
    dealt, chunk_ptr = _schedule.balance(items, np.zeros(0, dtype=np.int64), 4)
    assert dealt.shape == (0, 3) and chunk_ptr.tolist() == [0, 0]


@pytest.mark.parametrize("window, key_align, pairs", [
    ((-1, -1), 256, [100 * 300, 100 * 300, 100 * 300]),
    ((-1, 0), 256, [100 * 100, 100 * 200, 100 * 300]),       # keys up to the tile's last row
    ((20, 0), 256, [100 * 100, 100 * 200, 100 * 300]),       # every tile from block 0
    ((20, 0), 32, [100 * 100, 100 * 136, 100 * 140]),        # from key 64, then from key 160
])
def test_work_item_pairs_follow_the_kernel_key_range(window, key_align, pairs):
    seqs = _schedule.sequence_table(300, 300, 1)
    items, cost = _schedule.work_items(seqs, 1, 100, window, 0, key_align)
    assert items[:, 2].tolist() == [0, 100, 200]
    assert (cost - _schedule.ITEM_OVERHEAD).tolist() == pairs


@pytest.mark.parametrize("window, pairs", [
    ((-1, -1), [100 * 300, 100 * 300, 100 * 300]),
    ((-1, 0), [100 * 300, 100 * 200, 100 * 100]),     # key j is seen from row j on
    ((20, 0), [100 * 120, 100 * 120, 100 * 100]),     # ... up to row j + 20, in whole tiles
])
def test_key_item_pairs_follow_the_kernel_query_range(window, pairs):
    """The backward's key items: one per block of 100 keys and kv head, costed over the rows
    of the query tiles (20 rows, from multiples of 20) that see a key of it, for each query
    head of the group."""
    seqs = _schedule.sequence_table(300, 300, 1)
    items, cost = _schedule.key_items(seqs, 1, 1, 100, 20, window, 0)
    assert items[:, 2].tolist() == [0, 100, 200]
    assert (cost - _schedule.ITEM_OVERHEAD).tolist() == pairs
    items, cost2 = _schedule.key_items(seqs, 2, 3, 100, 20, window, 0)
    assert items[:, 1].tolist() == [0, 1] * 3
    assert (cost2 - _schedule.ITEM_OVERHEAD).tolist() == [3 * p for p in pairs for _ in "ab"]


def test_whole_sequences_sum_their_key_items():
    seqs = _schedule.varlen_table(np.array([0, 50, 50, 250]), np.array([0, 0, 100, 400]))
    items, cost = _schedule.key_items(seqs, 2, 1, 64, 24, (-1, -1), 0)
    whole, total = _schedule.whole_sequences(seqs, 2, items, cost)
    assert whole.tolist() == [[s, h, 0] for s in range(3) for h in range(2)]
    # no keys: no key items, the overhead alone (its dQ is still written); no queries: two
    # blocks of keys that no row sees; 200 x 300 pairs in five blocks
    assert total.tolist() == [_schedule.ITEM_OVERHEAD] * 2 + [2 * _schedule.ITEM_OVERHEAD] * 2 \
        + [5 * _schedule.ITEM_OVERHEAD + 200 * 300] * 2
