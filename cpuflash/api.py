"""Public entry points: argument handling and docstrings, no math."""

import numba
import numpy as np

from . import _schedule, _validate, tiling
from .kernels.forward import fa2_forward


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None,
              bias=None, mask=None, sinks=None, layout="bhsd", return_lse=False, out=None,
              tiles=None):
    """Exact attention ``softmax(scale * Q K^T + modifiers) V``, tiled, never forming ``Nq x Nk``.

    Parameters
    ----------
    q : (..., Hq, Nq, D) array, or (B, Nq, Hq, D) with ``layout="bshd"``
        Queries. A 2-D ``(Nq, D)`` array is one head. Any strides; never modified.
    k : (..., Hk, Nk, D) array, or (B, Nk, Hk, D)
        Keys; the leading axes equal those of `q`. ``Hq % Hk == 0`` (GQA/MQA): query head ``h``
        reads key/value head ``h // (Hq // Hk)``.
    v : (..., Hk, Nk, Dv) array, or (B, Nk, Hk, Dv)
        Values. ``Dv`` may differ from ``D``.
    causal : bool
        Key ``j`` is visible to query ``i`` when ``j <= i + Nk - Nq``: the diagonal is aligned to
        the bottom-right corner, as in flash-attn (torch's ``is_causal`` aligns it top-left).
        For ``Nq = 3``, ``Nk = 5`` (``x`` = visible)::

            x x x . .
            x x x x .
            x x x x x

    scale : float, optional
        Multiplies ``Q K^T``; default ``1 / sqrt(D)``.
    window : (left, right), optional
        Key ``j`` is visible to query ``i`` when
        ``i + Nk - Nq - left <= j <= i + Nk - Nq + right``; ``-1`` leaves a side unbounded.
        With `causal`, ``right`` is 0.
    softcap : float
        When ``> 0``, scores become ``softcap * tanh(score / softcap)`` (Gemma-2 style).
    alibi_slopes : (Hq,) or (..., Hq) float array, optional
        ALiBi: ``score -= slope[h] * |i + Nk - Nq - j|``.
    bias : float array broadcastable to (..., Hq, Nq, Nk), optional
        Added to the scores; read tile by tile through its broadcast strides (never expanded).
    mask : bool array broadcastable to (..., Hq, Nq, Nk), optional
        ``True`` means the key takes part (torch's convention).
    sinks : (Hq,) float array, optional
        Attention sinks (gpt-oss): ``exp(sinks[h])`` joins every softmax denominator.
    layout : {"bhsd", "bshd"}
        ``"bshd"`` is flash-attn's ``(batch, seqlen, heads, dim)``; the output follows it.
    return_lse : bool
        Also return the log-sum-exp of each row's visible scores (natural log).
    out : array, optional
        Where to write the result (shape and dtype of the result); returned.
    tiles : TileConfig or (block_q, block_k), optional
        Override the tile sizes `choose_tiles` picks from this machine's caches.

    Returns
    -------
    out : (..., Hq, Nq, Dv) array (``(B, Nq, Hq, Dv)`` with ``"bshd"``), the dtype of `q`
    lse : (..., Hq, Nq) array (``(B, Hq, Nq)`` with ``"bshd"``), only with ``return_lse=True``
        float32 (float64 for float64 inputs).

    Notes
    -----
    float32 and float64 are computed natively; float16 and bfloat16 (``ml_dtypes.bfloat16``) are
    widened tile by tile and accumulated in float32. A query row that sees no key gets output 0
    and lse ``-inf`` (with `sinks`: lse ``sinks[h]``), as in flash-attn; torch returns NaN there.
    Results do not depend on the number of threads (``numba.set_num_threads``).
    """
    call = _validate.attention_args(
        q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks, layout=layout,
        return_lse=return_lse, out=out, tiles=tiles)
    if call.n_q and call.batch and call.n_heads:
        _run_forward(call, _schedule.sequence_table(call.n_q, call.n_k, call.batch))
    return call.result(return_lse)


def _run_forward(call, seqs):
    """Choose tiles, deal the work items to threads and run the FA-2 kernel."""
    n_threads = numba.get_num_threads()
    tiles = call.tiles
    if tiles is None:
        tiles = tiling.choose_tiles(call.head_dim, call.compute_dtype, head_dim_v=call.head_dim_v)
        tiles = tiling.split_for_threads(tiles, int(seqs[:, 2].max()),
                                         len(seqs) * call.n_heads, n_threads)
    items, cost = _schedule.work_items(seqs, call.n_heads, tiles.block_q, call.window)
    items, chunk_ptr = _schedule.balance(items, cost, n_threads)
    kernel = fa2_forward.specialize((call.q.dtype, call.compute_dtype))
    left, right = call.window
    kernel(call.q, call.k, call.v, call.out_kernel, call.lse, seqs, items, chunk_ptr,
           tiles.block_q, tiles.block_k, call.qk_scale, call.softcap, left, right,
           call.half_kind, call.alibi, call.bias, call.bias_map, call.mask, call.mask_map,
           call.sinks)
