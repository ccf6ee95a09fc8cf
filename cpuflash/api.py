"""Public entry points: argument handling and docstrings; `_run` runs the validated calls."""

import numpy as np

from . import (_backward, _combine, _plans, _public, _quantize, _run, _schedule, _sparse,
               _user_functions, _validate)


@_public.public(_validate.attention_args)
def attention(q, k, v, *, causal=False, scale=None, window=None, chunk_size=None, softcap=0.0,
              alibi_slopes=None, bias=None, mask=None, sinks=None, layout="bhsd",
              return_lse=False, out=None, tiles=None, key_indices=None):
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
    chunk_size : int, optional
        Chunked local attention (Llama 4): query ``i`` sees only the keys of its own chunk of
        `chunk_size` positions, ``(i + Nk - Nq) // chunk_size == j // chunk_size``, AND the
        other rules. Key blocks outside a query tile's chunks are never visited.
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
    key_indices : (B, Nq, topk) or (B, Hk, Nq, topk) int array, optional
        Sparse attention's top-k (DeepSeek V3.2): query row ``i`` of entry ``b`` sees only the
        listed key positions (``-1``: an unused slot; listed positions distinct), AND causal,
        `window` and `chunk_size`. The work grows with ``topk``, not with ``Nk``. Not with
        `alibi_slopes`, `bias`, `mask` or `tiles`.
    tiles : TileConfig or (block_q, block_k), optional
        Override the tile sizes `choose_tiles` picks from this machine's caches. Key blocks
        then start at multiples of `block_k` for every window (the band blocks of narrow
        windows, `tiling.band_tiles`, come with the automatic choice only).

    Returns
    -------
    out : (..., Hq, Nq, Dv) array (``(B, Nq, Hq, Dv)`` with ``"bshd"``), the dtype of `q`
    lse : (..., Hq, Nq) array (``(B, Hq, Nq)`` with ``"bshd"``), only with ``return_lse=True``
        float32 (float64 for float64 inputs).

    Notes
    -----
    float32 and float64 are computed natively; float16 and bfloat16 (``ml_dtypes.bfloat16``) are
    widened tile by tile and accumulated in float32. A query row that sees no key gets output 0
    and lse ``-inf`` (with `sinks`: lse ``sinks[h]``), as in flash-attn (torch 2.13 gives 0 too).
    Results do not depend on the number of threads (``numba.set_num_threads``). A call with one
    query row (a decoding step; no `bias`, `mask` or `tiles`) runs the streaming kernel of
    `attention_with_kvcache`. A repeated call with the shapes, dtypes and options of an earlier
    one (and no `alibi_slopes`, `bias`, `mask`, `sinks` or `tiles`) skips the argument checks
    that cannot fail for them.

    torch CPU tensors are read in place. This numpy-level call has no autograd (use
    `cpuflash.torch` for that): a tensor that requires grad is a TypeError while grad mode is on
    (no gradient is dropped silently); under ``torch.no_grad()`` or ``torch.inference_mode()``
    it is read like any other.
    """
    key = None
    if (alibi_slopes is None and bias is None and mask is None and sinks is None
            and tiles is None and key_indices is None):
        q, k, v = _validate.as_array("q", q), _validate.as_array("k", k), _validate.as_array("v", v)
        key = _run.plan_key("attention", q, k, v, None, causal, scale, window, chunk_size,
                            softcap, layout, 0, return_lse)
        result = _run.attention_again(key, q, k, v, out, return_lse)
        if result is not None:
            return result
        if q.ndim != 4:
            key = None  # (only 4-D calls keep a plan)
    call = _validate.attention_args(
        q, k, v, causal=causal, scale=scale, window=window, chunk_size=chunk_size,
        softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks,
        layout=layout, return_lse=return_lse, out=out, tiles=tiles)
    if key_indices is not None:
        listed = _validate.key_indices_value(
            key_indices, call, np.full(call.batch, call.n_k),
            dict(alibi_slopes=alibi_slopes, bias=bias, mask=mask, tiles=tiles))
        _sparse.attention(call, listed)
        return call.result(return_lse)
    return _run.attention(call, layout, key, out is not None, return_lse)


@_public.public()
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None,
                     window=None, chunk_size=None, softcap=0.0, alibi_slopes=None,
                     return_lse=False):
    """Attention over a batch of packed sequences of different lengths (flash-attn's "thd").

    Parameters
    ----------
    q : (total_q, Hq, D) array
        The queries of all sequences, one after the other.
    k : (total_k, Hk, D) array
    v : (total_k, Hk, Dv) array
    cu_seqlens_q, cu_seqlens_k : (B + 1,) int arrays
        Cumulative lengths: sequence ``b`` is rows ``cu[b]:cu[b+1]``; start at 0, never
        decrease, end at ``total``. Empty sequences are allowed.
    causal, scale, window, chunk_size, softcap : as in `attention`, aligned per sequence
        (bottom-right: query ``i`` of sequence ``b`` sits over key ``i + Nk_b - Nq_b``; chunks
        start at each sequence's first key).
    alibi_slopes : (Hq,) or (B, Hq) float array, optional
    return_lse : bool

    Returns
    -------
    out : (total_q, Hq, Dv) array, the dtype of `q`
    lse : (Hq, total_q) array, only with ``return_lse=True``

    Work items are (sequence, head, query block): no work is spent on padding.
    """
    call = _validate.varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal,
                                 scale=scale, window=window, chunk_size=chunk_size,
                                 softcap=softcap, alibi_slopes=alibi_slopes,
                                 return_lse=return_lse)
    seqs = _schedule.varlen_table(call.cu_q, call.cu_k)
    if call.n_q and call.batch:
        _run.forward(call, seqs)
    return call.result(return_lse)


@_public.public(_validate.kvcache_args)
def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None,
                           causal=True, scale=None, window=None, chunk_size=None,
                           softcap=0.0, alibi_slopes=None, sinks=None, block_table=None,
                           layout="bhsd", num_splits=0, return_lse=False, score_mod=None,
                           score_args=(), mask_mod=None, mask_args=(), value_dim=None,
                           key_indices=None, integer_dot=False):
    """Decoding (or chunked prefill) against a KV cache, with split-KV over the cores.

    Parameters
    ----------
    q : (B, Hq, Nq, D) array, or (B, Nq, Hq, D) with ``layout="bshd"``
        The new queries; ``Nq`` is 1 when decoding one token.
    k_cache, v_cache : (B, Hk, Nmax, D) and (B, Hk, Nmax, Dv) arrays
        (``(B, Nmax, Hk, D)`` with ``"bshd"``). With `block_table`: a paged cache
        ``(num_pages, Hk, page_size, D)`` (``(num_pages, page_size, Hk, D)`` with ``"bshd"``).
    k, v : (B, Hk, Nnew, D) and (B, Hk, Nnew, Dv) arrays, optional
        New keys and values, written into the cache in place at positions
        ``cache_seqlens[b] : cache_seqlens[b] + Nnew`` (after every check has passed), then
        attended to.
    cache_seqlens : (B,) int array or int, optional
        How many positions of each cache entry are filled; None means all ``Nmax``. Not changed:
        the caller advances it. Batch ``b`` attends to its first ``cache_seqlens[b] + Nnew`` keys.
    causal : bool
        Bottom-right aligned per batch entry: query ``i`` sees keys
        ``j <= i + cache_seqlens[b] + Nnew - Nq``. True by default, as decoding needs
        (flash-attn's `flash_attn_with_kvcache` defaults to False).
    scale, window, softcap, alibi_slopes, sinks, layout : as in `attention`.
    chunk_size : int, optional
        As in `attention`, over cache positions: query ``i`` (at position
        ``cache_seqlens[b] + Nnew - Nq + i``) sees the keys of its own chunk.
    block_table : (B, max_pages) int array, optional
        Paged cache: position ``p`` of batch ``b`` is row ``p % page_size`` of page
        ``block_table[b, p // page_size]``.
    num_splits : int
        0 chooses from the work and the thread count; ``n > 1`` splits each sequence's keys into
        n ranges processed in parallel and merged exactly. Results for a given `num_splits` do
        not depend on the thread count.
    return_lse : bool
    score_mod, score_args, mask_mod, mask_args
        Your own functions, as `cpuflash.flex_attention` takes them, except that `q_idx` is a
        query's position in its sequence (bottom-right aligned: the last query sits at the last
        key) and `kv_idx` a key's, so that a mask written for training works unchanged when
        decoding. They are compiled into the split-KV decoding kernel as into the forward's.
    value_dim : int, optional
        Values inside the keys (DeepSeek MLA's latent cache): with ``v_cache=None`` the values
        are the first `value_dim` columns of the key cache (float, paged or quantized, where they
        take the keys' scales), new ones come inside `k` (``v=None``), and the output has
        `value_dim` columns. With numpy caches, ``v_cache=k_cache[..., :Dv]`` is the same.
    key_indices : (B, Nq, topk) or (B, Hk, Nq, topk) int array, optional
        As in `attention`, in cache positions after the write (``0 .. cache_seqlens[b] + Nnew
        - 1``): only the listed keys are read, from contiguous or paged, float or quantized
        caches. With a `mask_mod`, a row sees the listed keys its mask keeps (evaluated for
        the listed keys only; where the heads of a group keep different keys, they run one
        head of each group at a time); a `score_mod` gets each listed key's position as
        `kv_idx`. ALiBi is refused with it.
    integer_dot : bool
        Opt-in, int8 and int4 caches only: the decoding kernel computes ``Q K^T`` in integers,
        each query row quantized to int8 (``s = amax / 127`` of the row, numbers
        ``rint(q * (1 / s))``), as llama.cpp does. The result is the float computation with q
        replaced by ``rint(q * (1 / s)) * s``: no longer within the accuracy rule on the dequantized
        cache (docs/quantized_kv.md, "Integer Q K^T", has the measured error and agreement).
        Only on CPUs with AVX512-VNNI (`vpdpbusd`): elsewhere (where it would be slower), and
        with `key_indices` or int4 groups other than 32, the call computes exactly as without
        it.

    Returns
    -------
    out : (B, Hq, Nq, Dv) array (``(B, Nq, Hq, Dv)`` with ``"bshd"``), the dtype of `q`
    lse : (B, Hq, Nq) array, only with ``return_lse=True``

    Notes
    -----
    A decoding step calls this once per layer with the same shapes. A call with the shapes,
    dtypes and options of an earlier valid one (and no `block_table`, `alibi_slopes` or `sinks`)
    checks only what can fail for them (`cache_seqlens`, a writable cache) and goes on to the
    kernel with what the earlier call worked out (`cpuflash._plans`).
    """
    key = None
    scales = _run.quantized_scales(k_cache, v_cache, cache_seqlens)
    own = not (score_mod is None and mask_mod is None and _nothing(score_args)
               and _nothing(mask_args))
    if (block_table is None and alibi_slopes is None and sinks is None and not own
            and value_dim is None and key_indices is None and (k is None) == (v is None)
            and scales is not False and (integer_dot is False
                                         or (integer_dot is True and scales is not None))):
        # (in the order of the full checks, so that a non-array fails with the same message)
        q = _validate.as_array("q", q)
        if scales is None:
            k_data = k_cache = _validate.as_array("k_cache", k_cache)
            v_data = v_cache = _validate.as_array("v_cache", v_cache)
            kind = "kvcache"
        else:  # a quantized cache: its scales' shapes and dtypes join the key
            k_data, v_data = k_cache.data, v_cache.data
            kind = ("kvcache", scales[0].shape, scales[0].dtype, scales[1].shape,
                    scales[1].dtype, bool(k_cache.rotated), integer_dot)
        if k is not None:
            k, v = _validate.as_array("k", k), _validate.as_array("v", v)
        key = _run.plan_key(kind, q, k_data, v_data, cache_seqlens, causal, scale, window,
                            chunk_size, softcap, layout, num_splits, return_lse, k, v)
        setup = _plans.get(key)
        if setup is not None:
            result = _run.decode_again(setup, q, k_data, v_data, cache_seqlens, return_lse, k,
                                       v, scales)
            if result is not None:
                return result
    call = _validate.kvcache_args(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, causal=causal, scale=scale,
        window=window, chunk_size=chunk_size, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, block_table=block_table, layout=layout, num_splits=num_splits,
        return_lse=return_lse, value_dim=value_dim, integer_dot=integer_dot)
    if key_indices is not None:
        listed = _validate.key_indices_value(key_indices, call, call.n_keys,
                                             dict(alibi_slopes=alibi_slopes))
        score, mask = _user_functions.listed_functions(score_mod, score_args, mask_mod,
                                                       mask_args, call.compute_dtype)
        _sparse.kvcache(call, listed, mask, score)
        return call.result(return_lse)
    if own:
        call = _user_functions.with_user_functions(call, score_mod, score_args, mask_mod,
                                                   mask_args, None, positions=True)
    return _run.kvcache(call, layout, key, return_lse)


def _nothing(args):
    return isinstance(args, (tuple, list)) and not args


@_public.public()
def merge_states(outs, lses):
    """Exact merge of partial attention results over disjoint sets of keys.

    Parameters
    ----------
    outs : (S, ..., Dv) array, or a sequence of S arrays (..., Dv)
        Normalized partial outputs, each over its own keys (float32 or float64).
    lses : (S, ...) array, or a sequence of S arrays
        Their log-sum-exps; ``-inf`` marks a part that saw no key (its output is ignored).

    Returns
    -------
    out : (..., Dv) array
        ``sum_s exp(lse_s - lse) * out_s``: the attention output over the union of the keys.
    lse : (...) array
        ``log(sum_s exp(lse_s))``; ``-inf`` (and output 0) where no part saw a key.
    """
    return _combine.merge(*_validate.merge_args(outs, lses))


QuantizedKV = _quantize.QuantizedKV


@_public.public()
def quantize_kv(x, dtype="int8", *, group_size=32, rotate=False):
    """Quantize keys or values for a compressed KV cache: int8 or float8_e4m3 with one
    symmetric scale per row, or int4 with one per group of a row.

    Parameters
    ----------
    x : (..., Hk, N, D) float array
        Keys or values (any float dtype; read as float32). Each row of D numbers (one token of
        one head) is quantized on its own.
    dtype : {"int8", "float8_e4m3", "int4"}
        The format: int8, ``ml_dtypes.float8_e4m3fn`` (needs ml_dtypes), or 4-bit integers
        in [-7, 7], two a byte.
    group_size : int
        int4 only: how many consecutive numbers of a row share a scale (D a multiple of it, D
        even). The 8-bit formats have one scale a row (a `group_size` other than the default
        is a ValueError there).
    rotate : bool
        Turn each row by the orthonormal Walsh-Hadamard matrix ``H`` (D a power of two) before
        quantizing: it spreads a row's outliers over all of its numbers, so they share a scale
        with less loss. `attention_with_kvcache` turns q and the output itself (a rotated key
        cache needs a rotated value cache); `dequantize_kv` turns rows back.

    Returns
    -------
    QuantizedKV(data, scale, rotated)
        int8 / float8_e4m3: ``data`` (..., Hk, N, D) int8 or float8_e4m3fn, ``x / scale``
        rounded to nearest (ties to even); ``scale`` (..., Hk, N) float32, the float32 division
        ``amax / 127`` (``/ 448`` for float8_e4m3) of the row's largest magnitude.
        int4: ``data`` (..., Hk, N, D // 2) uint8, element ``2m`` of a row in the low nibble
        and ``2m + 1`` in the high one (two's complement); ``scale`` (..., Hk, N,
        D // group_size) float32, ``amax / 7`` of each group. An all-zero row (group) has scale
        0 and dequantizes to 0; one holding inf or NaN has scale NaN and data 0 (it
        dequantizes to NaN). Pass one for keys and one for values to `attention_with_kvcache`.
    """
    x, name, groups = _validate.quantize_args(x, dtype, rotate, group_size)
    if rotate:
        return QuantizedKV(*_quantize.quantize_rows(_quantize.hadamard(x), name, groups),
                           rotated=True)
    return QuantizedKV(*_quantize.quantize_rows(x, name, groups))


@_public.public()
def dequantize_kv(kq):
    """The float32 numbers a `QuantizedKV` holds: ``data * scale`` (one scale per row, or per
    group of an int4 row), turned back by the Walsh-Hadamard matrix where the cache is rotated.

    Parameters
    ----------
    kq : QuantizedKV
        ``data`` (..., D) int8 or float8_e4m3fn and ``scale`` (...) float32, or int4's
        ``data`` (..., D // 2) uint8 and ``scale`` (..., D // group_size) float32.

    Returns
    -------
    (..., D) float32 array
    """
    data, scale, _ = _validate.quantized_value("kq", kq)
    rows = _quantize.dequantize_rows(data, scale)
    return _quantize.hadamard(rows) if kq.rotated else rows


# the gradients: `_backward` holds their argument handling and docstrings
attention_backward = _public.public()(_backward.attention_backward)
attention_varlen_backward = _public.public()(_backward.attention_varlen_backward)
