"""What each step of the kernels costs, timed one step at a time on cache-resident data.

perf on the test VM sees no JIT symbols, so this is how to see where a kernel's time goes: each
step of `cpuflash.kernels` is called on its own, many times over the same buffers, by a small
jitted driver (one thread, so no other thread's work is counted).

* **forward**: one query tile of 384 rows with a sliding window (256, 0), its band block of keys
  (masked edges, whole panels skipped where no row of a row group sees them), next to a fully
  visible 384 x 256 tile, the kind that long causal rows are made of. In ns per query row of 257
  visible pairs (the dense tile's figures scaled from 256 to 257 keys).
* **decode**: Q K^T, the softmax and P V of the decoding kernel for a GQA group of four query
  rows over a cache of 768 keys in 256-key blocks (held in L2), in ns per key row.

Each step's figure is net of the driver's own cost (its buffers, its loop), timed as a step that
does nothing.
The steps run on data already in L1/L2, so these are compute costs; the real kernels also wait
for memory (decoding, and the window's key and value rows, which no other tile has read yet).
``--memory`` adds what reading from memory costs the forward kernel, on every thread: the
window (256, 0) and causal attention at N=16384 (H=8, ``out=`` reused), with their query, key and
value rows read from memory, then aliased to one row (strides of 0: the same arithmetic with
nothing to read). For decoding, `bench/stream_shapes.py` compares the kernel with loops that
read the same cache. (Timing Q K^T or P V alone over half of a decode cache misleads: 64 MiB
partly stays in the 32 MiB L3 between calls, so the halves read faster than the whole: plain
reads of the keys and of the values took 0.92 and 0.80 ms, of both 2.0 ms.)

    python bench/step_costs.py [--repeats 20] [--memory]
"""

import argparse
import time

import numba
import numpy as np

import cpuflash
from cpuflash import benchmark as runner
from cpuflash import tiling
from cpuflash.kernels import _steps
from cpuflash.kernels import decode as _decode

HEAD_DIM = 128
BLOCK_Q, DENSE_BLOCK_K, WINDOW = 384, 256, (256, 0)
FORWARD_STEPS = ("loop", "Q pack, state init", "K/V pack", "Q K^T", "band mask", "softmax", "P V",
                 "finish rows")
DECODE_ROWS, DECODE_KEYS, DECODE_BLOCK = 4, 768, 256
MEMORY_N, HEADS = 16384, 8
DECODE_STEPS = ("loop", "Q K^T", "scale, softmax", "P V")
EVERYTHING = _steps.UNBOUNDED


@numba.njit
def _forward_steps(step, repeats, q, k, v, out, lse, block_k, left):
    """`repeats` calls of forward step `step` (an index into FORWARD_STEPS) for the tile at
    query row 1536 of head 0; `left` < 0 for a fully visible tile of `block_k` keys."""
    buffers = _steps.tile_buffers(BLOCK_Q, block_k, HEAD_DIM, HEAD_DIM, lse)
    q_tile, k_panels, v_tile, scores, acc = buffers
    row_max = np.full(BLOCK_Q, -np.inf, dtype=np.float32)
    row_sum = np.zeros(BLOCK_Q, dtype=np.float32)
    alpha = np.ones(BLOCK_Q, dtype=np.float32)
    q0 = 1536
    if left >= 0:  # as the kernel sets up a band tile (right = 0)
        kb = (q0 - left) // tiling.KEY_PANEL * tiling.KEY_PANEL
        cols = min(block_k, q0 + BLOCK_Q - kb)
        lo, hi = q0 - kb - left, q0 - kb
    else:
        kb, cols, lo, hi = 0, block_k, -EVERYTHING, EVERYTHING
    w = k_panels.shape[2]
    first, end = max(0, lo) // w * w, min(cols, BLOCK_Q + hi)
    # every buffer filled once, so any step can run on its own
    _steps.pack_rows(q, 0, 0, q0, BLOCK_Q, q_tile, 0)
    _steps.pack_key_panels(k, 0, 0, kb + first, end - first, k_panels[first // w:], 0)
    _steps.pack_rows(v, 0, 0, kb + first, end - first, v_tile[first:], 0)
    _steps.qk_tile(q_tile, k_panels, scores, BLOCK_Q, cols, 0.1, lo, hi)
    for _ in range(repeats):
        if step == 1:
            _steps.pack_rows(q, 0, 0, q0, BLOCK_Q, q_tile, 0)
            row_max[:] = -np.inf
            row_sum[:] = 0.0
            acc[:, :] = 0.0
        elif step == 2:
            _steps.pack_key_panels(k, 0, 0, kb + first, end - first, k_panels[first // w:], 0)
            _steps.pack_rows(v, 0, 0, kb + first, end - first, v_tile[first:], 0)
        elif step == 3:
            _steps.qk_tile(q_tile, k_panels, scores, BLOCK_Q, cols, 0.1, lo, hi)
        elif step == 4 and left >= 0:
            _steps.band_mask_tile(scores, BLOCK_Q, cols, q0 - kb, left, 0, lo, hi)
        elif step == 5:
            row_max[:] = -np.inf  # the same first-block update each time
            row_sum[:] = 0.0
            _steps.softmax_update(scores, row_max, row_sum, alpha, BLOCK_Q, cols, lo, hi)
        elif step == 6:
            _steps.pv_tile(scores, v_tile, acc, alpha, BLOCK_Q, cols, lo, hi)
        elif step == 7:
            _steps.finish_rows(acc, row_max, row_sum, BLOCK_Q, -np.inf, out, lse, 0, 0, q0, 0)


@numba.njit
def _decode_steps(step, repeats, q_rows, k_cache, v_cache):
    """`repeats` passes of decode step `step` (an index into DECODE_STEPS) over the key blocks
    of the (unpaged, single-head) cache, as the kernel makes them (the one-pass Q K^T
    prefetching on into the next block, P V the next block's key rows)."""
    rows, d, n_keys = q_rows.shape[0], q_rows.shape[1], k_cache.shape[2]
    block_table = np.zeros((1, 1), dtype=np.int64)
    run_cols, next_cols = np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.int64)
    k_starts, v_starts = np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64)
    next_starts = np.zeros(3, dtype=np.int64)
    k_step = k_cache.strides[2] // k_cache.itemsize
    v_step = v_cache.strides[2] // v_cache.itemsize
    scores = np.zeros((4, DECODE_BLOCK), dtype=np.float32)
    acc = np.zeros((rows, d), dtype=np.float32)
    row_max, row_sum = np.full(rows, -np.inf, dtype=np.float32), np.zeros(rows, np.float32)
    alpha = np.ones(rows, dtype=np.float32)
    for _ in range(repeats):
        for kb in range(0, n_keys, DECODE_BLOCK):
            n_runs = _decode._block_runs(k_cache, block_table, 0, 0, kb, DECODE_BLOCK, n_keys,
                                         run_cols, k_starts)
            _decode._block_runs(v_cache, block_table, 0, 0, kb, DECODE_BLOCK, n_keys, run_cols,
                                v_starts)
            n_next = _decode._block_runs(k_cache, block_table, 0, 0, kb + DECODE_BLOCK,
                                         min(DECODE_BLOCK, n_keys - kb - DECODE_BLOCK), n_keys,
                                         next_cols, next_starts)
            if step == 1:
                _decode._dot_rows(q_rows, k_cache, run_cols, k_starts, n_runs, k_step, scores,
                                  rows, 0, v_cache, v_starts, v_step, True,
                                  next_starts[0] if n_next else _decode.NOTHING_NEXT)
            elif step == 2:
                _steps.scale_tile(scores, rows, DECODE_BLOCK, 0.1, -EVERYTHING, EVERYTHING)
                _steps.softmax_update(scores, row_max, row_sum, alpha, rows, DECODE_BLOCK,
                                      -EVERYTHING, EVERYTHING)
            elif step == 3:
                _decode._pv_rows(scores, v_cache, run_cols, v_starts, n_runs, v_step, d, acc,
                                 alpha, rows, 0, k_cache, next_cols, next_starts, n_next, k_step)


def _best(call, n_steps, repeats, settle=False):
    """Best seconds of call(step) for each step, the steps interleaved in each round; with
    `settle`, each call first waits for the threads of the call before to go quiet."""
    for step in range(n_steps):
        call(step)  # compile, and warm the buffers
    best = [float("inf")] * n_steps
    for _ in range(repeats):
        for step in range(n_steps):
            if settle:
                runner.settle(lambda: call(step))
            start = time.perf_counter()
            call(step)
            best[step] = min(best[step], time.perf_counter() - start)
    return best


def _print(title, names, costs, unit):
    """The steps' costs less the driver's own (the "loop" step), and their sum."""
    print(title)
    steps = [cost - costs[0] for cost in costs[1:]]
    for name, cost in zip(names[1:], steps):
        print(f"  {name:20} {cost:7.1f} {unit}")
    print(f"  {'all steps':20} {sum(steps):7.1f} {unit}")


def _memory(args, rng):
    """The --memory report: forward calls with their rows read from memory or aliased to one
    row of it."""
    n = MEMORY_N
    real = [rng.standard_normal((1, HEADS, n, HEAD_DIM), dtype=np.float32) for _ in range(3)]
    aliased = [np.lib.stride_tricks.as_strided(x[:, :, :1], shape=x.shape,
                                               strides=(x.strides[0], x.strides[1], 0, 4))
               for x in real]
    out = np.empty_like(real[0])
    cases = [(name, rows, options) for name, options in (("window (256, 0)", dict(window=WINDOW)),
                                                         ("causal", dict(causal=True)))
             for rows in ("read", "aliased")]
    seconds = _best(lambda i: cpuflash.attention(*(real if cases[i][1] == "read" else aliased),
                                                 **cases[i][2], out=out),
                    len(cases), max(1, args.repeats // 5), settle=True)
    print(f"forward, N={n}, H={HEADS}, D={HEAD_DIM}, out= reused: ns per visible pair")
    for (name, rows, options), t in zip(cases, seconds):
        pairs = HEADS * runner.visible_pairs(n, n, options.get("causal", False),
                                             options.get("window"))
        print(f"  {name:16} rows {rows:8} {t / pairs * 1e9:7.3f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--memory", action="store_true",
                        help="also time forward calls reading from memory and not")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)

    q, k, v = (rng.standard_normal((1, 1, 4096, HEAD_DIM), dtype=np.float32) for _ in range(3))
    out, lse = np.zeros_like(q), np.zeros((1, 1, 4096), dtype=np.float32)
    band = tiling.band_tiles(tiling.TileConfig(BLOCK_Q, DENSE_BLOCK_K), WINDOW)[0].block_k
    calls = 50
    per_row = 1e9 / (calls * BLOCK_Q)
    window = _best(lambda s: _forward_steps(s, calls, q, k, v, out, lse, band, WINDOW[0]),
                   len(FORWARD_STEPS), args.repeats)
    dense = _best(lambda s: _forward_steps(s, calls, q, k, v, out, lse, DENSE_BLOCK_K, -1),
                  len(FORWARD_STEPS), args.repeats)
    _print(f"forward, window {WINDOW}: a {BLOCK_Q} x {band} band block", FORWARD_STEPS,
           [t * per_row for t in window], "ns per query row")
    _print(f"forward, fully visible {BLOCK_Q} x {DENSE_BLOCK_K} tile", FORWARD_STEPS,
           [t * per_row * 257 / DENSE_BLOCK_K for t in dense], "ns per 257 pairs")

    q_rows = rng.standard_normal((DECODE_ROWS, HEAD_DIM), dtype=np.float32)
    k_cache, v_cache = (rng.standard_normal((1, 1, DECODE_KEYS, HEAD_DIM), dtype=np.float32)
                        for _ in range(2))
    calls = 200
    steps = _best(lambda s: _decode_steps(s, calls, q_rows, k_cache, v_cache), len(DECODE_STEPS),
                  args.repeats)
    _print(f"decode, {DECODE_ROWS} query rows, {DECODE_KEYS} keys in L2 (one thread)",
           DECODE_STEPS, [t * 1e9 / (calls * DECODE_KEYS) for t in steps], "ns per key row")
    if args.memory:
        _memory(args, rng)


if __name__ == "__main__":
    main()
