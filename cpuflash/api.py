"""Public entry points: argument handling and docstrings, no math."""

import numpy as np

from . import (_backward, _combine, _kvcache, _plans, _quantize, _schedule, _threads, _validate,
               tiling)
from .kernels._band import SEQ_N_K, SEQ_N_Q
from .kernels.decode import decode, decode_plain
from .kernels.forward import fa2_forward, fa2_forward_plain


@_validate.public(_validate.attention_args)
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
            and tiles is None):
        q, k, v = _validate.as_array("q", q), _validate.as_array("k", k), _validate.as_array("v", v)
        key = _decode_key("attention", q, k, v, None, causal, scale, window, softcap, layout, 0,
                          return_lse)
        setup = _plans.get(key)
        if setup.__class__ is _Forward:
            result = _forward_again(setup, q, k, v, out, return_lse)
            if result is not None:
                return result
        elif setup is not None and out is None:
            result = _decode_again(setup, q, k, v, None, return_lse)
            if result is not None:
                return result
    call = _validate.attention_args(
        q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks, layout=layout,
        return_lse=return_lse, out=out, tiles=tiles)
    if not (call.n_q and call.batch and call.n_heads):
        return call.result(return_lse)
    group = call.n_heads // call.n_kv_heads
    if (call.n_q == 1 and call.n_k and group <= tiling.DECODE_MAX_ROWS and call.tiles is None
            and not call.bias.size and not call.mask.size):
        # one query row (a decoding step): the streaming decode kernel, in a number of key
        # splits that no thread count changes (the results must not depend on it). Calls of a
        # few rows keep the FA-2 kernel, which `python -m cpuflash warmup` compiles with one.
        setup = _Decode(call, layout, call.n_k, _ATTENTION_SPLIT_THREADS)
        if key is not None and q.ndim == 4 and out is None:
            _plans.put(key, setup.frozen())
        n_keys = np.full(call.batch, call.n_k, dtype=np.int64)
        _decode(setup, call.q, call.k, call.v, n_keys, call.n_k, call.out_bhsd, call.lse,
                call.sinks)
    else:
        seqs = _schedule.sequence_table(call.n_q, call.n_k, call.batch)
        if key is not None and q.ndim == 4 and call.copy_back is None:
            _plans.put(key, _Forward(call, layout, seqs))
        _run_forward(call, seqs)
    return call.result(return_lse)


class _Forward:
    """What a repeated FA-2 forward call needs besides its arrays: the checked call of an
    earlier one with the same key (`_decode_key`), and its sequence table. (A call's arrays
    are passed to `_run_forward` beside it: a copy of it with them would cost 5.7 us, a third
    of the checks skipped.)"""

    def __init__(self, call, layout, seqs):
        self.layout = layout
        self.n_k = call.n_k  # (not in the key, which leaves out the keys' axis)
        self.out_shape = call.out_user.shape
        self.lse_rows = call.lse.shape
        self.launch = None  # (see `_plans.launch`)
        seqs.flags.writeable = False
        self.seqs = seqs
        self.call = call.without_arrays()


def _forward_again(setup, q, k, v, out, return_lse):
    """A call whose key found `setup`: the checks that can fail for the same key (the keys'
    count, alignment, `out`), then the kernel. None when one fails: the full path then raises
    the error or handles the case."""
    axis = _SEQ_AXIS[setup.layout]
    if (k.shape[axis] != setup.n_k or v.shape[axis] != setup.n_k or not q.flags.aligned
            or not k.flags.aligned or not v.flags.aligned):
        return None
    if out is None:
        out = np.empty(setup.out_shape, dtype=setup.call.dtype)
    elif not (out.__class__ is np.ndarray and out.shape == setup.out_shape
              and out.dtype == setup.call.dtype and out.flags.writeable and out.flags.aligned
              and not (np.may_share_memory(out, q) or np.may_share_memory(out, k)
                       or np.may_share_memory(out, v))):
        return None
    out_bhsd = out
    if setup.layout == "bshd":
        q, k, v, out_bhsd = q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), \
            out.swapaxes(1, 2)
    lse = np.empty(setup.lse_rows, dtype=setup.call.compute_dtype)
    view = _validate.kernel_view
    _run_forward(setup.call, setup.seqs, (view(q), view(k), view(v), view(out_bhsd), lse),
                 setup)
    return (out, lse.reshape(setup.call.lse_shape)) if return_lse else out


def _run_forward(call, seqs, arrays=None, plan=None):
    """Choose tiles, deal the work items to threads and run the FA-2 kernel. `arrays`: (q, k,
    v, out, lse) as the kernel takes them, in place of the call's; `plan`: the `_Forward` that
    keeps the launch (`_forward_again`)."""
    n_threads = _threads.thread_count()
    if plan is None:
        launch = _forward_launch(call, seqs, n_threads)
    else:
        valid = (n_threads, tiling.choose_tiles, tiling.split_for_threads,
                 _threads.FORKED_AFTER_OPENMP)
        launch = _plans.launch(plan, valid, lambda: _forward_launch(call, seqs, n_threads))
    kernel, items, chunk_ptr, block_q, block_k, key_align, pipeline = launch
    q, k, v, out, lse = arrays or (call.q, call.k, call.v, call.out_kernel, call.lse)
    kernel(q, k, v, out, lse, seqs, items, chunk_ptr, block_q, block_k, key_align,
           call.half_kind, *pipeline)


def _forward_launch(call, seqs, n_threads):
    """(kernel, items, chunk_ptr, block_q, block_k, key_align, pipeline): the FA-2 kernel's
    arguments that the call's shapes, options and the thread count decide."""
    key = ("forward", seqs.tobytes(), call.n_heads, call.window, call.head_dim, call.head_dim_v,
           call.compute_dtype, call.tiles, n_threads, tiling.choose_tiles,
           tiling.split_for_threads)
    tiles, key_align, items, chunk_ptr = _plans.schedule(
        key, lambda: _forward_schedule(call, seqs, n_threads))
    kernel = (fa2_forward_plain if call.plain() else fa2_forward).specialize(call.kernel_key())
    return (kernel, items, chunk_ptr, tiles.block_q, tiles.block_k, key_align,
            call.kernel_pipeline())


def _forward_schedule(call, seqs, n_threads):
    """(tiles, key_align, items, chunk_ptr) of the FA-2 forward over the sequences `seqs`."""
    tiles = call.tiles
    longest_q, longest_k = int(seqs[:, SEQ_N_Q].max()), int(seqs[:, SEQ_N_K].max())
    if tiles is None:
        tiles = tiling.choose_tiles(call.head_dim, call.compute_dtype, head_dim_v=call.head_dim_v)
        tiles = tiling.split_for_threads(tiles, longest_q, len(seqs) * call.n_heads, n_threads)
        tiles = tiling.clamp_tiles(tiles, longest_q, longest_k)
        tiles, key_align = tiling.band_tiles(tiles, call.window)  # sized for the clamped rows
    else:
        key_align = tiles.block_k
    tiles = tiling.clamp_tiles(tiles, longest_q, longest_k)
    key_align = min(key_align, tiles.block_k)
    items, cost = _schedule.work_items(seqs, call.n_heads, tiles.block_q, call.window,
                                       key_align)
    items, chunk_ptr = _schedule.balance(items, cost, n_threads)
    return tiles, key_align, items, chunk_ptr


@_validate.public()
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None,
                     window=None, softcap=0.0, alibi_slopes=None, return_lse=False):
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
    causal, scale, window, softcap : as in `attention`, aligned per sequence (bottom-right:
        query ``i`` of sequence ``b`` sits over key ``i + Nk_b - Nq_b``).
    alibi_slopes : (Hq,) or (B, Hq) float array, optional
    return_lse : bool

    Returns
    -------
    out : (total_q, Hq, Dv) array, the dtype of `q`
    lse : (Hq, total_q) array, only with ``return_lse=True``

    Work items are (sequence, head, query block): no work is spent on padding.
    """
    call = _validate.varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal,
                                 scale=scale, window=window, softcap=softcap,
                                 alibi_slopes=alibi_slopes, return_lse=return_lse)
    seqs = _schedule.varlen_table(call.cu_q, call.cu_k)
    if call.n_q and call.batch:
        _run_forward(call, seqs)
    return call.result(return_lse)


@_validate.public(_validate.kvcache_args)
def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None,
                           causal=True, scale=None, window=None, softcap=0.0,
                           alibi_slopes=None, sinks=None, block_table=None, layout="bhsd",
                           num_splits=0, return_lse=False, score_mod=None, score_args=(),
                           mask_mod=None, mask_args=()):
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
    scales = _quantized_scales(k_cache, v_cache, cache_seqlens)
    own = not (score_mod is None and mask_mod is None and _nothing(score_args)
               and _nothing(mask_args))
    if (block_table is None and alibi_slopes is None and sinks is None and not own
            and (k is None) == (v is None) and scales is not False):
        # (in the order of the full checks, so that a non-array fails with the same message)
        q = _validate.as_array("q", q)
        if scales is None:
            k_data = k_cache = _validate.as_array("k_cache", k_cache)
            v_data = v_cache = _validate.as_array("v_cache", v_cache)
            kind = "kvcache"
        else:  # a quantized cache: its scales' shapes and dtypes join the key
            k_data, v_data = k_cache.data, v_cache.data
            kind = ("kvcache", scales[0].shape, scales[0].dtype, scales[1].shape,
                    scales[1].dtype)
        if k is not None:
            k, v = _validate.as_array("k", k), _validate.as_array("v", v)
        key = _decode_key(kind, q, k_data, v_data, cache_seqlens, causal, scale, window,
                          softcap, layout, num_splits, return_lse, k, v)
        setup = _plans.get(key)
        if setup is not None:
            result = _decode_again(setup, q, k_data, v_data, cache_seqlens, return_lse, k, v,
                                   scales)
            if result is not None:
                return result
    call = _validate.kvcache_args(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, causal=causal, scale=scale,
        window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        block_table=block_table, layout=layout, num_splits=num_splits, return_lse=return_lse)
    if own:
        from . import flex

        flex._user_call(call, score_mod, score_args, mask_mod, mask_args, None, positions=True)
    _kvcache.write_new_keys(call)  # every check has passed
    if not (call.n_q and call.batch):
        call.out_kernel[...] = 0
        call.lse[...] = -np.inf
        return call.result(return_lse)
    group = call.n_heads // call.n_kv_heads
    # (a quantized cache always takes the decode kernel, which reads its 8-bit rows in place:
    # the FA-2 kernel would need a float copy)
    if group * call.n_q <= tiling.DECODE_MAX_ROWS or call.quantized is not None:
        setup = _Decode(call, layout, call.page_rows * call.block_table.shape[1], 0)
        if key is not None:
            _plans.put(key, setup.frozen())
        _decode(setup, call.q, call.k, call.v, call.n_keys, call.n_k, call.out_bhsd, call.lse,
                call.sinks, scales=(call.k_scale, call.v_scale))
    else:  # chunked prefill: enough query rows per key block for the packed FA-2 kernel
        if call.paged:
            call.k, call.v = _kvcache.gather_pages(call)
        seqs = _schedule.sequence_table(call.n_q, 0, call.batch)
        seqs[:, SEQ_N_K] = call.n_keys
        _run_forward(call, seqs)
    return call.result(return_lse)


def _nothing(args):
    return isinstance(args, (tuple, list)) and not args


@_validate.public()
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


@_validate.public()
def quantize_kv(x, dtype="int8"):
    """Quantize keys or values for an 8-bit KV cache: one symmetric scale per row.

    Parameters
    ----------
    x : (..., Hk, N, D) float array
        Keys or values (any float dtype; read as float32). Each row of D numbers (one token of
        one head) is quantized on its own.
    dtype : {"int8", "float8_e4m3"}
        The 8-bit format: int8, or ``ml_dtypes.float8_e4m3fn`` (needs ml_dtypes).

    Returns
    -------
    QuantizedKV(data, scale)
        ``data`` (..., Hk, N, D) int8 or float8_e4m3fn, ``x / scale`` rounded to nearest
        (ties to even); ``scale`` (..., Hk, N) float32, the float32 division ``amax / 127``
        (``/ 448`` for float8_e4m3) of the row's largest magnitude. An all-zero row has scale 0
        (and dequantizes to 0); a row holding inf or NaN has scale NaN and data 0 (it
        dequantizes to NaN). Pass one for keys and one for values to
        `attention_with_kvcache`.
    """
    x, name = _validate.quantize_args(x, dtype)
    return QuantizedKV(*_quantize.quantize_rows(x, name))


@_validate.public()
def dequantize_kv(kq):
    """The float32 numbers a `QuantizedKV` holds: ``data * scale`` (one scale per row).

    Parameters
    ----------
    kq : QuantizedKV
        ``data`` (..., D) int8 or float8_e4m3fn and ``scale`` (...) float32.

    Returns
    -------
    (..., D) float32 array
    """
    data, scale, _ = _validate.quantized_value("kq", kq)
    return _quantize.dequantize_rows(data, scale)


# The thread count that decides the key splits of `attention` calls taken by the decode kernel:
# a constant, since their results must not depend on the thread count (8 splits the keys of a
# single-head call over 4096 keys into 8, of one over 1024 into 2, as a KV-cache call on 8
# threads would).
_ATTENTION_SPLIT_THREADS = 8


class _Decode:
    """What the decode route of a call needs besides the call's arrays and lengths: everything
    its shapes, dtypes and options decide. `_plans` keeps it (`frozen`) for the next call with
    the same key (`_decode_key`)."""

    def __init__(self, call, layout, n_max, plan_threads):
        self.layout, self.dtype, self.compute_dtype = layout, call.dtype, call.compute_dtype
        self.native = call.dtype == call.compute_dtype  # the kernel may write the output
        self.batch, self.n_heads, self.n_kv_heads = call.batch, call.n_heads, call.n_kv_heads
        self.n_q, self.head_dim, self.head_dim_v = call.n_q, call.head_dim, call.head_dim_v
        self.half_kind = call.half_kind
        self.pipeline, self.user_types = call.kernel_pipeline(), call.kernel_key()[2]
        self.kernel = decode_plain if call.plain() else decode  # (`kernels.decode.PLAIN`)
        # its compiled kernel, once a call has asked for it (`Kernel.specialize` costs half a
        # microsecond of a short call)
        self.compiled = None
        self.sinks = call.sinks  # (also in the pipeline: the merge adds them)
        self.block_table, self.page_rows = call.block_table, call.page_rows
        self.n_max = n_max  # keys of a full cache (of every batch entry)
        self.num_splits = call.num_splits
        self.n_new = 0 if call.new_k is None else call.new_k.shape[2]  # keys written in
        self.plan_threads = plan_threads  # 0: numba's thread count at the call
        self.quantized = call.quantized  # a quantized cache's format, or None
        if self.block_table is None:  # `attention`: one page of all keys per batch entry
            self.block_table = np.arange(call.batch, dtype=np.int64)[:, None]
            self.page_rows = n_max
        self.full_keys = None
        self._lengths = (None, None)  # (n, `lengths(n)`) of the last call

    def lengths(self, n_k):
        """Each batch entry's key count, `n_k` for all, as the kernel reads them (read-only).
        The last one is kept: a model's layers all ask for the length of the same step."""
        last = self._lengths
        if last[0] != n_k:
            n_keys = np.full(self.batch, n_k, dtype=np.int64)
            n_keys.flags.writeable = False
            self._lengths = last = (n_k, n_keys)
        return last[1]

    def frozen(self):
        """This setup with its arrays read-only, and the lengths of a full cache, to share."""
        self.full_keys = np.full(self.batch, self.n_max, dtype=np.int64)
        pipeline = self.pipeline[0]
        for array in (self.block_table, self.full_keys, pipeline.alibi, pipeline.bias,
                      pipeline.bias_map, pipeline.mask, pipeline.mask_map, pipeline.sinks):
            array.flags.writeable = False
        return self


def _quantized_scales(k_cache, v_cache, cache_seqlens):
    """None for float caches; (k scale, v scale) for two QuantizedKV caches of numpy arrays
    given with `cache_seqlens` (the arrays' shapes then are the key's, whole); False for any
    other call with a QuantizedKV: the full path."""
    k_quantized = isinstance(k_cache, _quantize.QuantizedKV)
    v_quantized = isinstance(v_cache, _quantize.QuantizedKV)
    if not (k_quantized or v_quantized):
        return None
    if not (k_quantized and v_quantized and cache_seqlens is not None
            and k_cache.scale.__class__ is np.ndarray and v_cache.scale.__class__ is np.ndarray):
        return False
    return k_cache.scale, v_cache.scale


def _decode_key(kind, q, k, v, cache_seqlens, causal, scale, window, softcap, layout,
                num_splits, return_lse, new_k=None, new_v=None):
    """The `_plans` key of a call with options of the common kinds, or None (the full path).
    `new_k`, `new_v`: the new keys and values of a KV-cache call, or None."""
    if new_k is None:
        new = None
    elif new_k.__class__ is np.ndarray and new_v.__class__ is np.ndarray:
        new = (new_k.shape, new_k.dtype, new_v.shape, new_v.dtype)
    else:
        return None
    if not (causal.__class__ is bool and return_lse.__class__ is bool
            and layout.__class__ is str and num_splits.__class__ is int
            and (scale is None or scale.__class__ is float or scale.__class__ is int)
            and (softcap.__class__ is float or softcap.__class__ is int)
            and q.__class__ is np.ndarray and k.__class__ is np.ndarray
            and v.__class__ is np.ndarray):
        return None
    if window is not None and not (window.__class__ is tuple and len(window) == 2
                                   and window[0].__class__ is int
                                   and window[1].__class__ is int):
        return None
    if cache_seqlens is None or cache_seqlens.__class__ in (int, np.ndarray):
        lengths = None if cache_seqlens is None else cache_seqlens.__class__
    else:
        return None
    k_shape, v_shape = k.shape, v.shape
    if cache_seqlens is None and new is None and k.ndim == v.ndim == 4:
        # every key of the arrays is attended to: their length is the call's, not the plan's
        # (transformers' caches grow by one key a step, so each step has a new length)
        axis = _SEQ_AXIS.get(layout, 2)
        k_shape, v_shape = _without(k_shape, axis), _without(v_shape, axis)
    return (kind, q.shape, q.dtype, k_shape, k.dtype, v_shape, v.dtype, causal, scale, window,
            softcap, layout, num_splits, lengths, new)


_SEQ_AXIS = {"bhsd": 2, "bshd": 1}  # the sequence axis of 4-D arrays


def _without(shape, axis):
    return shape[:axis] + (None,) + shape[axis + 1:]


def _decode_again(setup, q, k, v, cache_seqlens, return_lse, new_k=None, new_v=None,
                  scales=None):
    """A call whose key found `setup`: only the checks that can fail for the same key (values,
    alignment, a writable cache), then the new keys written in and the kernel. None when a
    check fails: the full path then raises the error. `k`, `v`: the cache arrays (a quantized
    cache's 8-bit data, its (k, v) scales in `scales`)."""
    arrays = (k, v) if scales is None else (k, v) + tuple(scales)
    if not (q.flags.aligned and k.flags.aligned and v.flags.aligned
            and (scales is None or all(x.flags.aligned for x in scales))):
        return None  # the full path copies them
    if new_k is not None and not all(x.flags.writeable for x in arrays):
        return None
    room = setup.n_max - setup.n_new  # the largest valid length
    page_rows = setup.page_rows
    if cache_seqlens is None:
        if setup.n_new:
            return None
        starts, n_keys, n_k = None, setup.full_keys, setup.n_max
        if setup.block_table.shape[1] == 1:  # unpaged: the arrays' own length (see _decode_key)
            axis = _SEQ_AXIS[setup.layout]
            n_k = k.shape[axis]
            if n_k == 0 or v.shape[axis] != n_k:
                return None  # the full path: no keys, or a mismatch it names
            if n_k != setup.n_max:
                n_keys = setup.lengths(n_k)
                page_rows = n_k
    elif cache_seqlens.__class__ is int:
        if not 0 <= cache_seqlens <= room:
            return None
        starts = [cache_seqlens] * setup.batch
        n_k = cache_seqlens + setup.n_new
        n_keys = setup.lengths(n_k)
    else:
        if cache_seqlens.dtype.kind not in "iu" or cache_seqlens.shape != (setup.batch,):
            return None
        starts = cache_seqlens.tolist()
        longest = max(starts)
        if min(starts) < 0 or longest > room:
            return None
        n_k = longest + setup.n_new
        n_keys = cache_seqlens.astype(np.int64)
        if setup.n_new:
            n_keys += setup.n_new
    if setup.layout == "bshd":
        q, k, v = q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)
        out_user = np.empty((setup.batch, setup.n_q, setup.n_heads, setup.head_dim_v),
                            dtype=setup.dtype)
        out_bhsd = out_user.swapaxes(1, 2)
    else:
        out_user = out_bhsd = np.empty((setup.batch, setup.n_heads, setup.n_q,
                                        setup.head_dim_v), dtype=setup.dtype)
    if scales is not None and setup.layout == "bshd":
        scales = tuple(x.swapaxes(1, 2) for x in scales)
    if new_k is not None:  # every check has passed: into each entry's rows after its length
        if setup.layout == "bshd":
            new_k, new_v = new_k.swapaxes(1, 2), new_v.swapaxes(1, 2)
        if scales is not None:  # quantized first, as the full path writes them
            (new_k, k_scale), (new_v, v_scale) = (_quantize.quantize_rows(x, setup.quantized)
                                                  for x in (new_k, new_v))
        for b, start in enumerate(starts):
            k[b, :, start:start + setup.n_new] = new_k[b]
            v[b, :, start:start + setup.n_new] = new_v[b]
            if scales is not None:
                scales[0][b, :, start:start + setup.n_new] = k_scale[b]
                scales[1][b, :, start:start + setup.n_new] = v_scale[b]
    if scales is not None:  # as `_validate.kvcache_args` hands them to the kernel
        q = np.asarray(q, dtype=np.float32)
        k, v = _validate.bits_view(k), _validate.bits_view(v)
    elif setup.half_kind != _validate.NATIVE:
        q, k, v = q.view(np.uint16), k.view(np.uint16), v.view(np.uint16)
    lse = np.empty((setup.batch, setup.n_heads, setup.n_q), dtype=setup.compute_dtype)
    _decode(setup, q, k, v, n_keys, n_k, out_bhsd, lse, setup.sinks, page_rows, scales)
    return (out_user, lse) if return_lse else out_user


# the scales of a float cache (the kernel's quantized steps are skipped)
_NO_SCALES = np.zeros((0, 0, 0), dtype=np.float32)
_NO_SCALES.flags.writeable = False


def _decode(setup, q, k, v, n_keys, n_k, out_bhsd, lse, sinks, page_rows=None, scales=None):
    """Split-KV streaming decode into `out_bhsd` and `lse`, then the exact merge of the splits
    (and the sinks). `q`, `k`, `v` as the kernels read them; `page_rows`: the cache's rows per
    page when they are not the setup's (an unpaged cache of another length); `scales`: the
    (k, v) scales of a quantized cache, (pages, Hk, page rows) float32, or None."""
    if page_rows is None:
        page_rows = setup.page_rows
    k_scale, v_scale = (_NO_SCALES, _NO_SCALES) if scales is None or scales[0] is None \
        else scales
    n_threads = _threads.thread_count()
    plan = _plans.decode_plan(n_k, setup.batch * setup.n_kv_heads, setup.plan_threads or n_threads,
                              setup.head_dim, setup.compute_dtype, setup.num_splits)
    direct = setup.native and not sinks.size  # the kernel or the merge writes the output
    if plan.n_splits == 1 and direct:
        part_out, part_lse = out_bhsd[None], lse[None]
    else:
        part_out = np.empty((plan.n_splits, setup.batch, setup.n_heads, setup.n_q,
                             setup.head_dim_v), dtype=setup.compute_dtype)
        part_lse = np.empty(part_out.shape[:-1], dtype=setup.compute_dtype)
    kernel = setup.compiled
    if kernel is None or _threads.FORKED_AFTER_OPENMP:
        kernel = setup.compiled = setup.kernel.specialize((k.dtype, setup.compute_dtype,
                                                           q.dtype, setup.user_types))
    kernel(q, k, v, k_scale, v_scale, setup.block_table, page_rows, n_keys, plan.split_len,
           plan.block_k, setup.half_kind, *setup.pipeline, part_out, part_lse, n_threads)
    if plan.n_splits > 1:
        out = out_bhsd if direct else np.empty(part_out.shape[1:], dtype=setup.compute_dtype)
        _combine.merge_into(part_out, part_lse, out, lse)
    elif direct:
        return
    else:
        out = part_out[0]
        lse[...] = part_lse[0]
    if sinks.size:
        out, lse[...] = _combine.add_sinks(out, lse, sinks)
    if out is not out_bhsd:
        out_bhsd[...] = out  # rounds to a half-precision output dtype here


# the gradients: `_backward` holds their argument handling and docstrings
attention_backward = _validate.public()(_backward.attention_backward)
attention_varlen_backward = _validate.public()(_backward.attention_varlen_backward)
