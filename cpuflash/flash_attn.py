"""flash-attn 2.x's Python API on CPU tensors: flash-attn code runs by changing the import.

    from cpuflash.flash_attn import flash_attn_func, flash_attn_with_kvcache  # was: from flash_attn

The seven functions of ``flash_attn`` 2.x (2.8), with its names, argument names, defaults,
``(B, N, H, D)`` layout and return values, computed by cpuflash on CPU tensors and differentiable
through cpuflash's backward. ``causal`` is aligned bottom-right, as in flash-attn >= 2.1::

    Nq = 2, Nk = 5:  1 1 1 1 0      Nq = 5, Nk = 2:  0 0
                     1 1 1 1 1                       0 0
                                                     0 0
                                                     1 0
                                                     1 1     (a row with no key gives 0)

Batched calls use `cpuflash.torch`'s ``cpuflash::attention`` operator; this module registers two
more in the same style (`torch.library.custom_op` + ``register_fake`` + ``register_autograd``,
numpy views of torch's memory): ``cpuflash::attention_varlen`` (with its backward) and
``cpuflash::attention_with_kvcache``, which writes the new keys into the caches in place.
Eager calls run the operators' functions without their dispatch, as `cpuflash.torch` does.
What differs from flash-attn (no dropout, no attention probabilities, ...) is in
docs/flash_attn.md.
"""

import math

import numpy as np

from . import _keywords, api
from .torch import (_as_numpy, _as_tensor, _check_cpu, _eager, _eager_function, _save, _saved,
                    _score_keywords, _tensor_or_none, torch)
from .torch import attention as _attention

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"]

Tensor = torch.Tensor


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# -- packed sequences: cpuflash::attention_varlen and its backward

def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *score):
    """The varlen forward's work, shared by the operator and the eager path: (out, lse).
    `score`: the score keywords' slots (`_keywords`)."""
    out, lse = api.attention_varlen(
        _as_numpy(q), _as_numpy(k), _as_numpy(v), _as_numpy(cu_seqlens_q),
        _as_numpy(cu_seqlens_k), return_lse=True, **_score_keywords(score))
    return _as_tensor(out), _as_tensor(np.ascontiguousarray(lse))


_varlen_op = torch.library.custom_op(
    "cpuflash::attention_varlen", _varlen_forward, mutates_args=(), device_types="cpu",
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
           f"{_keywords.SCHEMA}) -> (Tensor, Tensor)")


@_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, *score):
    return (q.new_empty(q.shape[:-1] + v.shape[-1:]),
            q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q)))


def _varlen_gradients(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *score):
    """The varlen backward's work, shared by the operator and the eager path: (dq, dk, dv)."""
    grads = api.attention_varlen_backward(
        *map(_as_numpy, (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)),
        **_score_keywords(score))
    return tuple(_as_tensor(g) for g in grads)


_varlen_backward_op = torch.library.custom_op(
    "cpuflash::attention_varlen_backward", _varlen_gradients, mutates_args=(),
    device_types="cpu",
    schema=f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
           f"Tensor cu_seqlens_q, Tensor cu_seqlens_k, {_keywords.SCHEMA}) "
           f"-> (Tensor, Tensor, Tensor)")


@_varlen_backward_op.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *score):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *score = inputs
    out, lse = output
    _save(ctx, (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k), score)
    ctx.mark_non_differentiable(lse)


def _varlen_backward_through(gradients):
    """The varlen operator's autograd backward, its gradients from `gradients`: the backward
    operator, or on the eager path the function the operator runs."""
    def backward(ctx, dout, _dlse):
        (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k), score = _saved(ctx)
        dq, dk, dv = gradients(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *score)
        return (dq, dk, dv, None, None) + (None,) * len(score)
    return backward


_varlen_op.register_autograd(
    _varlen_backward_through(torch.ops.cpuflash.attention_varlen_backward),
    setup_context=_varlen_setup_context)

# the varlen operator's forward and gradients without its dispatch, for eager calls
_EagerVarlen = _eager_function("_EagerVarlen", _varlen_forward, _varlen_setup_context,
                               _varlen_backward_through(_varlen_gradients))

_ALIBI = _keywords.SLOT_NAMES.index("alibi_slopes")  # the score slot that is a tensor


def _run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *options):
    """``torch.ops.cpuflash.attention_varlen(...)``, or its eager path (`_eager`)."""
    if not _eager(q, k, v, cu_seqlens_q, cu_seqlens_k, options[_ALIBI]):
        return torch.ops.cpuflash.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                   *options)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, *options)
    return _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *options)


# -- decoding: cpuflash::attention_with_kvcache writes the new keys into the caches

def _kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, *options):
    """The decoding call's work, shared by the operator and the eager path: (out, lse).
    `options`: the score keywords' slots (`_keywords`), then `num_splits`."""
    if block_table is not None:  # here, on real lengths, so torch.compile traces no .max()
        _check_block_table_capacity(block_table, k_cache, k, cache_seqlens)
    out, lse = api.attention_with_kvcache(
        _as_numpy(q), _as_numpy(k_cache), _as_numpy(v_cache), k=_as_numpy(k), v=_as_numpy(v),
        cache_seqlens=_as_numpy(cache_seqlens), block_table=_as_numpy(block_table),
        layout="bshd", num_splits=options[-1], return_lse=True,
        **_score_keywords(options[:-1]))
    return _as_tensor(out), _as_tensor(np.ascontiguousarray(lse))


_kvcache_op = torch.library.custom_op(
    "cpuflash::attention_with_kvcache", _kvcache, mutates_args=("k_cache", "v_cache"),
    device_types="cpu",
    schema=f"(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
           f"Tensor? cache_seqlens, Tensor? block_table, {_keywords.SCHEMA}, int num_splits) "
           f"-> (Tensor, Tensor)")


def _run_kvcache(*args):
    """``torch.ops.cpuflash.attention_with_kvcache(*args)``, or, for an eager call that needs
    no gradient (`_eager`), its work without the dispatch, which was most of a short decoding
    call's time, 30 times a token in a 30-layer model (measured: docs/history.md, "Per-call
    cost", torch's operator dispatch).
    The caches' version counters move as the operator moves them, where keys are written."""
    q, k_cache, v_cache, k, v, cache_seqlens, block_table = args[:7]
    tensors = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, args[7 + _ALIBI])
    if not _eager(*tensors) or torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in tensors):
        return torch.ops.cpuflash.attention_with_kvcache(*args)
    result = _kvcache(*args)
    if k is not None:
        for cache in (k_cache, v_cache):
            torch.autograd.graph.increment_version(cache)
    return result


@_kvcache_op.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, block_table, *options):
    batch, n_q, heads = q.shape[:3]
    return (q.new_empty((batch, n_q, heads, v_cache.shape[-1])),
            q.new_empty((batch, heads, n_q), dtype=_lse_dtype(q)))


# -- argument handling shared by the functions

def _options(dropout_p, window_size, softcap):
    """flash-attn's `window_size` as (left, right); its `softcap`, which is off at <= 0."""
    if dropout_p != 0.0:
        raise ValueError(f"`dropout_p` must be 0 (cpuflash has no dropout), got {dropout_p}")
    left, right = _keywords.window_sides(window_size, "window_size")
    return left, right, float(softcap) if softcap > 0 else 0.0


def _scale(softmax_scale):
    return None if softmax_scale is None else float(softmax_scale)


def _unpack(packed, name, count, axis, expected):
    """The `count` tensors stacked along `axis` of a packed qkv / kv tensor, as views."""
    _check_cpu(**{name: packed})
    if packed.dim() <= axis or packed.shape[axis] != count:
        raise ValueError(f"`{name}` must be {expected}, got shape {tuple(packed.shape)}")
    return packed.unbind(axis)


def _result(out, lse, return_attn_probs):
    # flash-attn returns (out, softmax_lse, S_dmask); the probabilities are never formed here
    return (out, lse, None) if return_attn_probs else out


# -- the functions

def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """flash-attn's `flash_attn_func` on CPU tensors: attention over batched sequences.

    Parameters
    ----------
    q : (batch_size, seqlen_q, nheads, headdim) tensor
    k : (batch_size, seqlen_k, nheads_k, headdim) tensor
        ``nheads % nheads_k == 0`` (MQA/GQA: query head ``h`` reads kv head
        ``h // (nheads // nheads_k)``).
    v : (batch_size, seqlen_k, nheads_k, headdim_v) tensor
    dropout_p : float
        Must be 0 (a ValueError otherwise): cpuflash has no dropout.
    softmax_scale : float, optional
        Default ``1 / sqrt(headdim)``.
    causal : bool
        Bottom-right aligned (see the module docstring).
    window_size : (left, right)
        Query ``i`` sees keys ``i + seqlen_k - seqlen_q - left ..= i + seqlen_k - seqlen_q +
        right``; -1 is unbounded.
    softcap : float
        ``> 0`` caps the scores at ``softcap * tanh(s / softcap)``; ``<= 0`` is off.
    alibi_slopes : (nheads,) or (batch_size, nheads) float32 tensor, optional
        Adds ``-slope * |i + seqlen_k - seqlen_q - j|`` to the scores.
    deterministic : bool
        Accepted; cpuflash's backward is always deterministic.
    return_attn_probs : bool
        Also return ``softmax_lse`` and ``None`` (the probabilities are not formed).

    Returns
    -------
    out : (batch_size, seqlen_q, nheads, headdim_v) tensor, differentiable in q, k, v
    softmax_lse : (batch_size, nheads, seqlen_q) float32 tensor (float64 for float64 inputs),
        only with ``return_attn_probs=True``; no gradient
    None : only with ``return_attn_probs=True``
    """
    left, right, softcap = _options(dropout_p, window_size, softcap)
    out, lse = _attention(q, k, v, causal=causal, scale=_scale(softmax_scale),
                          window=(left, right), softcap=softcap, alibi_slopes=alibi_slopes,
                          layout="bshd", return_lse=True)
    return _result(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """`flash_attn_func` with ``qkv`` of shape (batch_size, seqlen, 3, nheads, headdim)."""
    q, k, v = _unpack(qkv, "qkv", 3, 2, "(batch_size, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """`flash_attn_func` with ``kv`` of shape (batch_size, seqlen_k, 2, nheads_k, headdim)."""
    k, v = _unpack(kv, "kv", 2, 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """flash-attn's `flash_attn_varlen_func` on CPU tensors: packed sequences of any lengths.

    Parameters
    ----------
    q : (total_q, nheads, headdim) tensor
        The queries of every sequence, one sequence after the other.
    k : (total_k, nheads_k, headdim) tensor
        Or, with `block_table`, a paged cache (num_blocks, page_block_size, nheads_k, headdim).
    v : (total_k, nheads_k, headdim_v) tensor, or paged like `k`
    cu_seqlens_q, cu_seqlens_k : (batch_size + 1,) int32 tensors
        Sequence ``b`` is rows ``cu[b]:cu[b+1]``.
    max_seqlen_q, max_seqlen_k : int
        Accepted and not needed (flash-attn sizes its GPU grid with them).
    block_table : (batch_size, max_num_blocks_per_seq) int32 tensor, optional
        Paged keys and values: position ``p`` of sequence ``b`` is row ``p % page_block_size``
        of block ``block_table[b, p // page_block_size]``.
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
    return_attn_probs
        As in `flash_attn_func`, per sequence (``causal`` bottom-right in each sequence).

    Returns
    -------
    out : (total_q, nheads, headdim_v) tensor, differentiable in q, k, v
    softmax_lse : (nheads, total_q) tensor, only with ``return_attn_probs=True``
    None : only with ``return_attn_probs=True``
    """
    left, right, softcap = _options(dropout_p, window_size, softcap)
    cu_seqlens_q, cu_seqlens_k, alibi_slopes = map(
        _tensor_or_none, (cu_seqlens_q, cu_seqlens_k, alibi_slopes))
    _check_cpu(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
               alibi_slopes=alibi_slopes, block_table=block_table)
    if block_table is not None:
        k, v = _gather_pages(k, v, cu_seqlens_k, block_table)
    score = _keywords.pack(causal=causal, scale=softmax_scale, window=(left, right),
                           softcap=softcap, alibi_slopes=alibi_slopes)
    out, lse = _run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *score)
    return _result(out, lse, return_attn_probs)


def _gather_pages(k_pages, v_pages, cu_seqlens_k, block_table):
    """The packed (total_k, nheads_k, headdim) keys and values that `block_table` points at
    (a differentiable gather)."""
    lengths = cu_seqlens_k.long().diff()
    page_rows = k_pages.shape[1] if k_pages.dim() == 4 else 0
    if (k_pages.dim() != 4 or block_table.dim() != 2 or block_table.shape[0] != len(lengths)
            or (len(lengths) and block_table.shape[1] * page_rows < int(lengths.max()))):
        raise ValueError(
            f"with `block_table`, `k` must be paged (num_blocks, page_block_size, nheads_k, "
            f"headdim) and `block_table` (batch_size={len(lengths)}, max_num_blocks_per_seq) "
            f"with room for the longest sequence ({int(lengths.max()) if len(lengths) else 0} "
            f"keys), got `k` {tuple(k_pages.shape)} and `block_table` "
            f"{tuple(block_table.shape)}")
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    pos = torch.arange(len(seq)) - cu_seqlens_k.long()[seq]
    pages = block_table.long()[seq, pos // page_rows]
    if len(pages) and not 0 <= int(pages.min()) <= int(pages.max()) < k_pages.shape[0]:
        raise ValueError(f"`block_table` entries for the keys in use must lie in "
                         f"[0, {k_pages.shape[0]}) (the number of blocks), got "
                         f"{int(pages.min())}..{int(pages.max())}")
    rows = pos % page_rows
    return k_pages[pages, rows], v_pages[pages, rows]


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """`flash_attn_varlen_func` with ``qkv`` of shape (total, 3, nheads, headdim)."""
    q, k, v = _unpack(qkv, "qkv", 3, 1, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """`flash_attn_varlen_func` with ``kv`` of shape (total_k, 2, nheads_k, headdim)."""
    k, v = _unpack(kv, "kv", 2, 1, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """flash-attn's `flash_attn_with_kvcache` on CPU tensors: decoding against a KV cache.

    New keys/values `k`, `v` (rotated first when `rotary_cos`/`rotary_sin` are given) are
    written into the caches in place at positions ``cache_seqlens[b]:cache_seqlens[b]+seqlen_new``,
    then `q` attends to the cache. ``cache_seqlens`` itself is not changed. No gradient.

    Parameters
    ----------
    q : (batch_size, seqlen_q, nheads, headdim) tensor
    k_cache, v_cache : (batch_size_cache, seqlen_cache, nheads_k, headdim) tensors
        Or, with `block_table`, (num_blocks, page_block_size, nheads_k, headdim).
    k, v : (batch_size, seqlen_new, nheads_k, headdim) tensors, optional
    rotary_cos, rotary_sin : (seqlen_ro, rotary_dim / 2) tensors, optional
        Rotary embedding of the first ``rotary_dim`` dims of `q` and `k` (needs `k`): `k` at
        positions ``cache_seqlens[b] + i``; `q` at the same positions when causal or local,
        otherwise every query at ``cache_seqlens[b]``.
    cache_seqlens : int or (batch_size,) int32 tensor, optional
        Filled length of each cache entry (counted from row 0, `cache_leftpad` included);
        None means full. Needed with `k`.
    cache_batch_idx : (batch_size,) int32 tensor, optional
        Batch entry ``b`` uses cache entry ``cache_batch_idx[b]``.
    cache_leftpad : (batch_size,) int32 tensor, optional
        Entry ``b``'s keys start at row ``cache_leftpad[b]`` (rows before it are not keys).
    block_table : (batch_size, max_num_blocks_per_seq) int32 tensor, optional
        Paged cache; not together with `cache_batch_idx` or `cache_leftpad` (as in flash-attn).
        Keys past its ``max_num_blocks_per_seq * page_block_size`` rows (``cache_seqlens``
        plus the new keys) raise, as flash-attn raises, an error that is a RuntimeError and a
        ValueError.
    rotary_interleaved : bool
        True rotates dims (0, 1), (2, 3), ...; False rotates (i, i + rotary_dim / 2) (GPT-NeoX).
    softmax_scale, causal, window_size, softcap, alibi_slopes
        As in `flash_attn_func`, the keys of entry ``b`` being its rows ``cache_leftpad[b]`` to
        ``cache_seqlens[b] + seqlen_new``. ``causal=False`` by default, as in flash-attn.
    num_splits : int
        0 chooses; ``n > 1`` splits the keys across cores and merges the parts exactly.
    return_softmax_lse : bool

    Returns
    -------
    out : (batch_size, seqlen_q, nheads, headdim_v) tensor
    softmax_lse : (batch_size, nheads, seqlen_q) tensor, only with ``return_softmax_lse=True``
    """
    left, right, softcap = _options(0.0, window_size, softcap)
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32)
    alibi_slopes = _tensor_or_none(alibi_slopes)
    _check_cpu(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos,
               rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
               cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
               block_table=block_table, alibi_slopes=alibi_slopes)
    if k is not None and cache_seqlens is None:
        raise ValueError("`cache_seqlens` must be given with new keys `k` (where to write "
                         "them), got None")
    if rotary_cos is not None or rotary_sin is not None:
        seqlen_k = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
        local = causal or 0 <= left < seqlen_k or 0 <= right < seqlen_k  # flash-attn's test
        q, k = _rotate(q, k, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved, local)
    if cache_batch_idx is not None or cache_leftpad is not None:
        if block_table is not None:
            raise ValueError("`block_table` (a paged cache) cannot be combined with "
                             "`cache_batch_idx` or `cache_leftpad` (nor can it in flash-attn)")
        k_cache, v_cache, block_table, cache_seqlens = _entry_pages(
            k_cache, v_cache, q.shape[0], cache_seqlens, cache_batch_idx, cache_leftpad,
            0 if k is None else k.shape[1])
    score = _keywords.pack(causal=causal, scale=softmax_scale, window=(left, right),
                           softcap=softcap, alibi_slopes=alibi_slopes)
    out, lse = _run_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, *score,
                            int(num_splits))
    return (out, lse) if return_softmax_lse else out


class _BlockTableCapacityError(RuntimeError, ValueError):
    """Keys past what `block_table` can address. flash-attn raises RuntimeError there (a
    host-side check in ``mha_fwd_kvcache``) and code written for it catches that; cpuflash
    raises ValueError for bad arguments, so this is both."""


def _check_block_table_capacity(block_table, k_cache, k, cache_seqlens):
    """flash-attn's check that every sequence's keys (``cache_seqlens[b]`` plus the new ones)
    fit in the pages its row of `block_table` has room for. Tables and lengths of the wrong
    shape are left to cpuflash's own checks, which name them."""
    if block_table.dim() != 2 or k_cache.dim() != 4 or cache_seqlens is None or \
            cache_seqlens.dim() != 1 or cache_seqlens.numel() == 0:
        return
    n_new = 0 if k is None or k.dim() != 4 else k.shape[1]
    blocks, page_rows = block_table.shape[1], k_cache.shape[1]
    longest = int(cache_seqlens.max()) + n_new
    if longest > blocks * page_rows:
        raise _BlockTableCapacityError(
            f"`block_table` has room for {blocks * page_rows} keys a sequence "
            f"(max_num_blocks_per_seq {blocks} x page_block_size {page_rows}), but "
            f"`cache_seqlens` plus {n_new} new keys reaches {longest}: give `block_table` "
            f"more columns")


def _rotate(q, k, cos, sin, cache_seqlens, interleaved, per_query):
    """`q` and the new `k` turned by flash-attn's rotary embedding at their cache positions."""
    if cos is None or sin is None or k is None:
        raise ValueError("`rotary_cos` and `rotary_sin` must be given together, with new keys "
                         f"`k`: got `rotary_cos` {'None' if cos is None else 'a tensor'}, "
                         f"`rotary_sin` {'None' if sin is None else 'a tensor'}, `k` "
                         f"{'None' if k is None else 'a tensor'}")
    head_dim = q.shape[-1]
    if cos.dim() != 2 or sin.shape != cos.shape or 2 * cos.shape[1] > head_dim:
        raise ValueError(f"`rotary_cos` and `rotary_sin` must both be (seqlen_ro, rotary_dim / 2)"
                         f" with rotary_dim <= headdim ({head_dim}), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    start = cache_seqlens.long()[:, None]
    q_steps = torch.arange(q.shape[1]) * per_query  # all at cache_seqlens unless per query
    q_pos, k_pos = start + q_steps, start + torch.arange(k.shape[1])
    used = torch.cat((q_pos.flatten(), k_pos.flatten()))
    last = int(used.max()) if used.numel() else -1
    if last >= cos.shape[0]:
        raise ValueError(f"`rotary_cos` and `rotary_sin` have {cos.shape[0]} positions, but "
                         f"position {last} is rotated (cache_seqlens + the new tokens)")
    return (_rotary(q, cos, sin, q_pos, interleaved), _rotary(k, cos, sin, k_pos, interleaved))


def _rotary(x, cos, sin, positions, interleaved):
    """flash-attn's `apply_rotary_emb` on x (B, N, H, D) at integer `positions` (B, N):
    ``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim`` dims, the rest unchanged;
    computed in float32 (float64 for float64) and rounded once, as flash-attn's kernel does."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    dim = 2 * cos.shape[1]
    c, s = (t[positions].to(compute).unsqueeze(2) for t in (cos, sin))  # (B, N, 1, dim / 2)
    part = x[..., :dim].to(compute)
    if interleaved:  # pairs (0, 1), (2, 3), ...
        x1, x2 = part[..., 0::2], part[..., 1::2]
        turned = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:  # pairs (i, i + dim / 2), GPT-NeoX style
        x1, x2 = part.chunk(2, dim=-1)
        turned = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., dim:]), dim=-1)


def _entry_pages(k_cache, v_cache, batch, cache_seqlens, cache_batch_idx, cache_leftpad, n_new):
    """flash-attn's `cache_batch_idx` and `cache_leftpad` as a block table over the caches'
    own memory (no copy): batch entry ``b`` reads cache entry ``cache_batch_idx[b]`` from row
    ``cache_leftpad[b]`` on, through pages of ``rows`` rows, a divisor of the cache length and
    of every left pad. Returns the paged views, the table and the lengths counted from the pad.
    """
    entries, n_max = k_cache.shape[0], k_cache.shape[1]
    index = torch.arange(batch) if cache_batch_idx is None else cache_batch_idx.long()
    pad = torch.zeros(batch, dtype=torch.long) if cache_leftpad is None else cache_leftpad.long()
    filled = (torch.full((batch,), n_max) if cache_seqlens is None
              else cache_seqlens.long())
    if index.shape != (batch,) or not bool(((index >= 0) & (index < entries)).all()):
        raise ValueError(f"`cache_batch_idx` must be (batch_size={batch},) with entries in "
                         f"[0, {entries}) (the cache's batch size), got {index.tolist()}")
    if pad.shape != (batch,) or filled.shape != (batch,) or not bool(
            ((pad >= 0) & (pad <= filled) & (filled + n_new <= n_max)).all()):
        raise ValueError(f"`cache_leftpad` and `cache_seqlens` must be (batch_size={batch},) "
                         f"with 0 <= cache_leftpad <= cache_seqlens <= {n_max - n_new} (cache "
                         f"length {n_max} minus {n_new} new keys), got {pad.tolist()} and "
                         f"{filled.tolist()}")
    rows = math.gcd(n_max, *pad.tolist()) or 1
    try:
        k_pages, v_pages = (cache.view(entries * n_max // rows, rows, *cache.shape[2:])
                            for cache in (k_cache, v_cache))
    except RuntimeError:
        raise ValueError(f"`cache_leftpad` needs caches whose batch and sequence axes can be "
                         f"viewed as one (e.g. contiguous caches), got `k_cache` strides "
                         f"{k_cache.stride()} and `v_cache` strides {v_cache.stride()}") from None
    per_entry = n_max // rows
    first = (index * n_max + pad) // rows
    table = torch.minimum(first[:, None] + torch.arange(per_entry),
                          (index[:, None] + 1) * per_entry - 1)  # unused tail: stay in the entry
    return k_pages, v_pages, table.to(torch.int32), (filled - pad).to(torch.int32)
