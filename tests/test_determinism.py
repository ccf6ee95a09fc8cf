"""Bitwise the same results on every run, for every thread count and every query block the
tile chooser may pick (API.md: attention, attention_varlen, and attention_with_kvcache with a
given `num_splits`)."""

import os

import numba
import numpy as np
import pytest

import cpuflash

from helpers import (TESTS_DIR, assert_same_bits, digest, explain, last_json_line, random_qkv,
                     run_python, visible)
from workloads import determinism_cases

DETERMINISM_CASES = determinism_cases()


@pytest.fixture
def restore_num_threads():
    before = numba.get_num_threads()
    yield
    numba.set_num_threads(before)


@pytest.mark.parametrize("name", list(DETERMINISM_CASES))
def test_bits_do_not_depend_on_runs_or_thread_count(name, restore_num_threads):
    call = DETERMINISM_CASES[name]
    counts = sorted({1, 2, numba.config.NUMBA_NUM_THREADS} & set(
        range(1, numba.config.NUMBA_NUM_THREADS + 1)))
    numba.set_num_threads(counts[0])
    expected = call()
    for n in counts:
        numba.set_num_threads(n)
        for run in range(2):
            assert_same_bits(call(), expected, f"{name} threads={n} run={run}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("options", [dict(window=(5, 0)), dict(window=(40, 7)),
                                     dict(causal=True, window=(30, -1)), dict(causal=True),
                                     dict(window=(-1, 3))])
def test_bits_do_not_depend_on_the_query_block(monkeypatch, dtype, options):
    """Every `block_q` that the tile chooser picks for some thread count gives the same bits,
    with narrow windows (one band block per tile) and wide ones, and with a value row holding
    inf."""
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, (1, 2, 230, 40), (1, 1, 250, 40), d_v=24, dtype=dtype)
    v[0, 0, 120, 5] = np.inf
    split = cpuflash.tiling.split_for_threads
    start = cpuflash.choose_tiles(40, dtype)
    block_qs = sorted({split(start, 230, 2, threads).block_q for threads in (1, 2, 3, 5, 16, 64)})
    assert len(block_qs) >= 3, block_qs
    results = []
    for block_q in block_qs:  # each thread count's choice, on whatever threads this machine has
        monkeypatch.setattr(cpuflash.tiling, "split_for_threads",
                            lambda tiles, *args, block_q=block_q: cpuflash.TileConfig(
                                block_q, tiles.block_k))
        results.append(cpuflash.attention(q, k, v, return_lse=True, **options))
    for block_q, result in zip(block_qs[1:], results[1:]):
        assert_same_bits(result, results[0], f"block_q={block_q} vs {block_qs[0]}")
    # the inf reached the rows that see key 120 (which others it reaches: test_hidden_nonfinite)
    out = results[0][0]
    sees = visible(230, 250, options.get("causal", False), options.get("window"))[:, 120]
    assert sees.any() and not np.isfinite(out[0][:, sees, 5]).any()
    assert np.isfinite(np.delete(out, 5, axis=-1)).all()  # and no other value column


@pytest.mark.slow
def test_more_threads_than_cores_give_the_same_bits(restore_num_threads):
    """A fresh interpreter with a pool of 16 Numba threads (more than this machine may have),
    run with 3, 5 and 16 of them: `block_q` shrinks down to 24 rows."""
    numba.set_num_threads(1)
    expected = {name: digest(call()) for name, call in DETERMINISM_CASES.items()}
    result = run_python("""
        import json, sys
        sys.path.insert(0, sys.argv[1])
        import numba
        from helpers import digest
        from workloads import determinism_cases
        cases = determinism_cases()
        digests = {}
        for n in (3, 5, 16):
            numba.set_num_threads(n)
            digests[n] = {name: digest(call()) for name, call in cases.items()}
        print(json.dumps(digests))
    """, TESTS_DIR, env=dict(os.environ, NUMBA_NUM_THREADS="16"))
    assert result.returncode == 0, explain(result)
    differ = {n: [name for name in expected if digests[name] != expected[name]]
              for n, digests in last_json_line(result).items()}
    assert not any(differ.values()), f"bits that differ from 1 thread's, by thread count: {differ}"
