"""Dense references that cpuflash is measured against.

`attention_reference` is the oracle of the test suite: a plain numpy implementation of every rule
of the score pipeline (scale, softcap, ALiBi, bias, causal, window, mask, sinks, GQA, LSE) that
builds the full ``Nq x Nk`` score matrix, in float64 unless asked otherwise. It is written to be
read, not to be fast.

`attention_fa1` is FlashAttention-1 (KV blocks outside, Q blocks inside) as a Numba kernel, kept so
the benchmarks can show what the FA-2 loop order buys.
"""

import numpy as np

__all__ = ["attention_reference", "probabilities", "scores", "attention_fa1", "naive_attention"]


def attention_reference(q, k, v, *, causal=False, scale=None, window=None, chunk_size=None,
                        softcap=0.0, alibi_slopes=None, bias=None, mask=None, sinks=None,
                        layout="bhsd", return_lse=False, dtype=np.float64):
    """Attention computed densely, rule by rule, in `dtype` (float64 by default).

    Takes the arguments of `cpuflash.attention` (see its docstring for shapes and conventions)
    and returns ``out`` (or ``(out, lse)``) in `dtype`. Inputs are trusted: no validation.
    Computing in float32 gives the "plain implementation in the same precision" that the
    accuracy rule of the tests compares against.
    """
    q, k, v = (np.asarray(x) for x in (q, k, v))
    dtype = np.dtype(dtype)
    if layout == "bshd":  # (B, N, H, D) -> (B, H, N, D)
        q, k, v = (np.swapaxes(x, 1, 2) for x in (q, k, v))
    s, visible = scores(q, k, causal=causal, scale=scale, window=window, chunk_size=chunk_size,
                        softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask,
                        dtype=dtype)
    v = v.astype(dtype)
    group = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    if group > 1:  # GQA / MQA: query head h reads kv head h // group
        v = np.repeat(v, group, axis=-3)
    p, row_sum, lse = _softmax(s, sinks, dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = _visible_sum(p, v, visible) / row_sum
    out = np.where(row_sum == 0, 0, out).astype(dtype)
    if layout == "bshd":
        out = np.swapaxes(out, 1, 2)
    return (out, lse.astype(dtype)) if return_lse else out


def probabilities(q, k, *, causal=False, scale=None, window=None, chunk_size=None, softcap=0.0,
                  alibi_slopes=None, bias=None, mask=None, sinks=None, layout="bhsd",
                  return_lse=False, dtype=np.float64):
    """The softmax that `attention_reference` multiplies V by: ``p`` of shape ``(..., Hq, Nq,
    Nk)`` in `dtype` (in either layout), 0 where a key is hidden and on rows that see none;
    ``(p, lse)`` with `return_lse`. These are the bits of `attention_reference` run on an
    identity matrix of values, without that matrix."""
    if layout == "bshd":  # (B, N, H, D) -> (B, H, N, D)
        q, k = (np.swapaxes(np.asarray(x), 1, 2) for x in (q, k))
    s, _ = scores(q, k, causal=causal, scale=scale, window=window, chunk_size=chunk_size,
                  softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask, dtype=dtype)
    p, row_sum, lse = _softmax(s, sinks, np.dtype(dtype))
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(row_sum == 0, 0, p / row_sum).astype(dtype)
    return (p, lse.astype(dtype)) if return_lse else p


def _softmax(s, sinks, dtype):
    """Step 6 on the scores `s`: the unnormalized probabilities, their row sums (sinks
    included) and the log-sum-exp. A row with no visible key sums to 0 (lse -inf), as
    flash-attn has it."""
    n_k = s.shape[-1]
    row_max = s.max(axis=-1, keepdims=True) if n_k else np.full(s.shape[:-1] + (1,), -np.inf)
    if sinks is not None:
        sink = np.asarray(sinks, dtype=dtype)[:, None, None]
        row_max = np.maximum(row_max, sink)
    shift = np.where(row_max == -np.inf, 0, row_max)
    p = np.exp(s - shift)
    row_sum = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        row_sum = row_sum + np.exp(sink - shift)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = (shift + np.log(row_sum))[..., 0]
    return p, row_sum, lse


def scores(q, k, *, causal=False, scale=None, window=None, chunk_size=None, softcap=0.0,
           alibi_slopes=None, bias=None, mask=None, dtype=np.float64):
    """Steps 1-5 of the score pipeline, densely: ``(s, visible)``.

    `q` is ``(..., Hq, Nq, D)`` and `k` ``(..., Hk, Nk, D)`` (``layout="bhsd"``); the other
    arguments are those of `cpuflash.attention`. `s` is ``(..., Hq, Nq, Nk)`` in `dtype`, with
    ``-inf`` where the key is not visible; `visible` is a bool array broadcastable to it. The
    softmax of `attention_reference` and the bias gradient of `cpuflash.jax` start from here.
    """
    dtype = np.dtype(dtype)
    q, k = np.asarray(q).astype(dtype), np.asarray(k).astype(dtype)
    n_q, d = q.shape[-2:]
    n_k = k.shape[-2]
    group = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    if group > 1:  # GQA / MQA: query head h reads kv head h // group
        k = np.repeat(k, group, axis=-3)
    scale = 1.0 / np.sqrt(d) if scale is None else scale

    # 1. scaled dot products
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * dtype.type(scale)
    # 2. softcap
    if softcap > 0:
        s = dtype.type(softcap) * np.tanh(s / dtype.type(softcap))
    # 3. ALiBi, on the bottom-right aligned distance between query i and key j
    rows = np.arange(n_q)[:, None] + (n_k - n_q)
    cols = np.arange(n_k)[None, :]
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=dtype)[..., None, None]
        s = s - slopes * np.abs(rows - cols).astype(dtype)
    # 4. additive bias
    if bias is not None:
        s = s + np.asarray(bias).astype(dtype)
    # 5. visibility
    visible = np.ones((n_q, n_k), dtype=bool)
    if causal:
        visible &= cols <= rows
    if window is not None:
        left, right = window
        if causal:
            right = 0
        if left >= 0:
            visible &= cols >= rows - left
        if right >= 0:
            visible &= cols <= rows + right
    if chunk_size is not None:
        visible &= rows // chunk_size == cols // chunk_size
    if mask is not None:
        visible = visible & np.asarray(mask, dtype=bool)
    s = np.where(visible, s, -np.inf)
    return s, visible


def _visible_sum(p, v, visible):
    """``sum_j p_ij v_j`` over the keys j that row i sees: a value row it cannot see adds
    nothing, even inf or NaN (``p @ v`` would add 0 * inf = NaN)."""
    finite = np.isfinite(v)
    out = np.matmul(p, np.where(finite, v, 0))
    if finite.all():
        return out
    seen = np.broadcast_to(visible, p.shape)
    not_finite = np.where(finite, 0, v)
    leading = tuple(range(v.ndim - 2)) + (v.ndim - 1,)
    for j in np.flatnonzero(~finite.all(axis=leading)):  # the keys with an inf or NaN value
        term = p[..., :, j, None] * not_finite[..., None, j, :]
        out = out + np.where(seen[..., :, j, None], term, 0)
    return out


def naive_attention(q, k, v, *, causal=False, scale=None):
    """The textbook three steps in numpy, in the input precision: ``softmax(Q K^T) V``.

    Materializes the ``Nq x Nk`` matrix. This is the "naive numpy" line of the benchmarks (and
    what most people write first); masks beyond `causal` are left to `attention_reference`.
    Shapes as `cpuflash.attention` with ``layout="bhsd"`` and ``Hq == Hk``.
    """
    d = q.shape[-1]
    n_q, n_k = q.shape[-2], k.shape[-2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    s = np.matmul(q, np.swapaxes(k, -1, -2))
    s *= q.dtype.type(scale)
    if causal:
        hidden = np.arange(n_k)[None, :] > np.arange(n_q)[:, None] + (n_k - n_q)
        s[..., hidden] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, v)


def attention_fa1(q, k, v, *, causal=False, scale=None, tiles=None):
    """FlashAttention-1: the KV loop outside, the Q loop inside, parallel over (batch, head).

    For every KV block the whole output of a head is read, rescaled by the change of the running
    max, divided by the running sum and written back: the extra traffic and the coarse
    parallelism that FA-2 removes. Same arguments, shapes and result as `cpuflash.attention`
    (``layout="bhsd"``, float32/float64); kept for the benchmarks, not for use.
    """
    from . import _call, _validate
    from .kernels.fa1 import fa1_forward
    from .tiling import choose_tiles

    call = _validate.attention_args(q, k, v, causal=causal, scale=scale, tiles=tiles)
    if call.half_kind != _call.NATIVE:
        raise TypeError(f"attention_fa1 takes float32 or float64, got {call.dtype}")
    tiles = call.tiles or choose_tiles(call.head_dim, call.compute_dtype)
    if call.n_q and call.n_k == 0:
        call.out_kernel[...] = 0
        return call.result(return_lse=False)
    kernel = fa1_forward.specialize(call.compute_dtype)
    kernel(call.q, call.k, call.v, call.out_kernel, call.lse, call.qk_scale, call.causal,
           tiles.block_q, tiles.block_k)
    return call.result(return_lse=False)
