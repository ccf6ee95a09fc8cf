"""FlashAttention-1 (KV-outer), kept as a yardstick for the FA-2 kernel.

The loop order of the FA-1 paper: for every key/value block, every query block of the head is
loaded from the output in memory, rescaled to the new running max, divided by the new running
sum, and written back. Work can only be split over (batch, head), since all query blocks of a
head update their rows once per key block. Causal and scale only; float32 and float64.
"""

import math

import numpy as np
from numba import prange, types

from .._jit import Kernel, array
from . import _layout, _products, _steps


def _fa1_forward(q, k, v, out, lse, qk_scale, causal, block_q, block_k):
    batch, n_heads, n_q, d = q.shape
    n_k, dv = k.shape[2], v.shape[3]
    group = n_heads // k.shape[1]
    cdtype = lse.dtype
    shift = n_k - n_q
    right = 0 if causal else -1
    everything = (-_layout.UNBOUNDED, _layout.UNBOUNDED)  # FA-1 skips no panels
    for bh in prange(batch * n_heads):
        b, h = bh // n_heads, bh % n_heads
        hk = h // group
        q_tile, k_kept, v_kept, scores, acc = _layout.tile_buffers(block_q, block_k, d, dv, lse)
        k_panels, v_tile = k_kept[0], v_kept[0]
        tile_max = np.empty(block_q, dtype=cdtype)
        tile_sum = np.empty(block_q, dtype=cdtype)
        alpha = np.empty(block_q, dtype=cdtype)
        row_max = np.full(n_q, -np.inf, dtype=cdtype)  # per head, kept across key blocks
        row_sum = np.zeros(n_q, dtype=cdtype)
        out[b, h, :, :] = 0.0
        for kb in range(0, n_k, block_k):
            cols = min(block_k, n_k - kb)
            _products.pack_key_panels(k, b, hk, kb, cols, k_panels, 0)
            _products.pack_rows(v, b, hk, kb, cols, v_tile, 0)
            for q0 in range(0, n_q, block_q):
                rows = min(block_q, n_q - q0)
                if causal and kb > q0 + rows - 1 + shift:
                    continue  # the whole block is above the diagonal
                _products.pack_query_groups(q, b, h, q0, rows, q_tile, 0)
                _products.qk_tile(q_tile, k_panels, scores, rows, cols, qk_scale, *everything)
                if causal and kb + cols - 1 > q0 + shift:
                    _steps.band_mask_tile(scores, rows, cols, q0 + shift - kb, -1, right,
                                          *everything)
                # -- FA-1: load the normalized output rows and their statistics from memory,
                # update them with this key block, renormalize and store them again
                for r in range(rows):
                    tile_max[r] = row_max[q0 + r]
                    tile_sum[r] = row_sum[q0 + r]
                    for x in range(dv):
                        acc[r, x] = out[b, h, q0 + r, x] * tile_sum[r]
                _products.softmax_update(scores, tile_max, tile_sum, alpha, rows, cols, *everything)
                _products.pv_tile(scores, v_tile, acc, alpha, rows, cols, *everything)
                for r in range(rows):
                    norm = 1.0 / tile_sum[r] if tile_sum[r] != 0 else 0.0
                    for x in range(dv):
                        out[b, h, q0 + r, x] = acc[r, x] * norm
                    row_max[q0 + r] = tile_max[r]
                    row_sum[q0 + r] = tile_sum[r]
        for i in range(n_q):
            total = row_sum[i]
            lse[b, h, i] = row_max[i] + math.log(total) if total != 0 else -np.inf


def _signature(dtype):
    data = array(dtype, 4, readonly=True)
    return types.void(data, data, data, array(dtype, 4), array(dtype, 3), types.float64,
                      types.boolean, types.int64, types.int64)


fa1_forward = Kernel(_fa1_forward, _signature, "FlashAttention-1 reference")
