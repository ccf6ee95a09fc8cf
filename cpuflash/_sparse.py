"""Attention over listed keys (`key_indices`, DeepSeek V3.2's top-k sparse attention).

Each query row of each kv head attends to the key positions listed for it, AND the call's other
rules (causal, window, chunk, and a KV-cache call's mask_mod, evaluated on the listed keys). The
listed keys of one (batch entry, kv head, query row) are gathered, the visible ones first and in
position order, into key rows of their own; the heads of the group at that query row are the
query rows of one FA-2 tile over them, as `_run.forward_folded` folds a decoding step's heads.
A KV-cache call's score_mod runs in those tiles, given the call's positions through tables
(`_listed_score_mod`). The work and the memory grow with the
number of listed keys, not with the cache length, and a row's result does not depend on the
order of its list. Rows are taken a block at a time, so that the gathered copies stay within
`GATHER_BYTES`.

The backward gathers the same way, runs the FA-2 backward over the gathered rows and adds each
gathered key's and value's gradient back to its position, in a fixed order (`np.add.at`), so
the bits do not depend on the thread count.
"""

import dataclasses

import numba
import numpy as np

from . import (_call, _kvcache, _quantize, _run, _run_backward, _schedule, _threads,
               _user_functions, _validate_gradients)
from .kernels._band import SEQ_N_K

GATHER_BYTES = 64 * 2 ** 20  # the gathered keys and values of one block of rows, at most


def listed_keys(call, key_indices, n_keys):
    """``(keys, counts)``: each (batch, kv head, query row)'s visible listed positions in
    ascending order, first in their row of `keys` (the rest of the row is 0), and how many.
    `key_indices` is (B, Hk, Nq, topk) int64, checked; `n_keys` (B,) the keys of each entry."""
    n_q = call.n_q
    pos = (np.arange(n_q)[None, :] + (n_keys[:, None] - n_q))[:, None, :, None]  # (B, 1, Nq, 1)
    j = key_indices
    seen = j >= 0
    if call.causal or call.window[1] >= 0:
        seen &= j <= pos + max(call.window[1], 0)
    if call.window[0] >= 0:
        seen &= j >= pos - call.window[0]
    if call.chunk:
        seen &= j // call.chunk == pos // call.chunk
    beyond = np.iinfo(np.int64).max
    keys = np.sort(np.where(seen, j, beyond), axis=-1)
    counts = seen.sum(axis=-1)
    return np.where(keys == beyond, 0, keys), counts


def _gather(cache, scale, block_table, page_rows, b, hk, positions):
    """Rows `positions` (S, topk) of kv head `hk` (S,) of batch entries `b` (S,) of a cache of
    pages, as float32 rows where the cache is quantized (`_quantize.dequantize_rows`)."""
    pages = block_table[b[:, None], positions // page_rows]
    rows = positions % page_rows
    gathered = cache[pages, hk[:, None], rows]  # (S, topk, D)
    if scale is not None:
        return _quantize.dequantize_rows(gathered, scale[pages, hk[:, None], rows])
    return gathered


def _inside(k, v):
    """Whether `v` is the first columns of `k` (a view: DeepSeek MLA's latent cache)."""
    return (v.shape[:-1] == k.shape[:-1] and v.strides[:-1] == k.strides[:-1]
            and v.shape[-1] <= k.shape[-1]
            and v.__array_interface__["data"][0] == k.__array_interface__["data"][0])


def _blocks(call, topk, gathered_dtype):
    """Slices of the (batch, kv head, query row) list whose gathered keys and values fit."""
    per_row = topk * (call.head_dim + call.head_dim_v) * np.dtype(gathered_dtype).itemsize
    n = call.batch * call.n_kv_heads * call.n_q
    step = max(1, GATHER_BYTES // max(1, per_row))
    return [slice(start, min(n, start + step)) for start in range(0, n, step)]


class _Gathered:
    """One block of rows gathered: its query rows, keys, values and sequence table."""

    def __init__(self, call, k, v, scales, block_table, page_rows, keys, counts, rows):
        group = call.n_heads // call.n_kv_heads
        b, hk, i = np.unravel_index(np.arange(rows.start, rows.stop),
                                    (call.batch, call.n_kv_heads, call.n_q))
        self.where = b, hk, i
        heads = hk[:, None] * group + np.arange(group)[None, :]  # (S, group)
        self.heads = heads
        listed = keys.reshape(-1, keys.shape[-1])[rows]
        k_rows = _gather(k, scales[0], block_table, page_rows, b, hk, listed)
        if _inside(k, v) and scales[0] is scales[1]:  # values inside the keys: gathered with them
            v_rows = k_rows[..., :call.head_dim_v]
        else:
            v_rows = _gather(v, scales[1], block_table, page_rows, b, hk, listed)
        q_rows = call.q[b[:, None], heads, i[:, None]]  # (S, group, D), as the kernels read q
        if k_rows.dtype != q_rows.dtype:  # a quantized cache, read as float32: q too
            q_rows = q_rows.view(call.dtype).astype(np.float32)
        self.q, self.k, self.v = (x[:, None] for x in (q_rows, k_rows, v_rows))
        self.seqs = _schedule.sequence_table(group, 0, len(b))  # one sequence a row
        self.seqs[:, SEQ_N_K] = counts.reshape(-1)[rows]


def _gathered_call(call, gathered, out, lse, kernel_dtype):
    """The call that runs over `gathered`: one head of `group` rows a sequence, no rule, in
    as few tiles of rows as keep the threads busy (every tile of a sequence sees its keys)."""
    group = call.n_heads // call.n_kv_heads
    n = gathered.q.shape[0]
    return dataclasses.replace(
        call, q=gathered.q, k=gathered.k, v=gathered.v, dtype=kernel_dtype, batch=n, n_heads=1,
        n_kv_heads=1, n_q=group, n_k=gathered.k.shape[2], causal=False, window=(-1, -1),
        chunk=0, alibi=np.zeros((n, 0), call.alibi.dtype), sinks=None, bias=None, bias_map=None,
        mask=None, mask_map=None, out_user=out, out_bhsd=out, copy_back=None,
        lse_shape=lse.shape,
        tiles=_run.folded_tiles(call, n, group, _threads.thread_count()),
        k_cache=None, v_cache=None, quantized=None, k_scale=None, v_scale=None, new_k=None,
        new_v=None, block_table=None, seqlens=None, n_keys=None)


def forward(call, k, v, key_indices, n_keys, block_table, page_rows, scales=(None, None),
            score=None, heads=None):
    """Write the output and lse of `call` (validated; its key_indices (B, Hk, Nq, topk) int64
    checked) over the caches `k`, `v` as the kernels read them (pages of `page_rows` rows,
    `block_table`; quantized with `scales`), each entry's first `n_keys[b]` keys listable.
    `score`: (score_mod, score_args) of a KV-cache call, or None; `heads`: (step, first) when
    the call's head h is the caller's head ``h * step + first`` (`kvcache`'s one head of each
    group at a time), for the score_mod."""
    keys, counts = listed_keys(call, key_indices, n_keys)
    kernel_dtype = np.dtype(np.float32) if scales[0] is not None else call.dtype
    for rows in _blocks(call, keys.shape[-1], call.compute_dtype):
        gathered = _Gathered(call, k, v, scales, block_table, page_rows, keys, counts, rows)
        n, group = gathered.q.shape[0], gathered.q.shape[2]
        out = np.empty((n, 1, group, call.head_dim_v), dtype=kernel_dtype)
        lse = np.empty((n, 1, group), dtype=call.compute_dtype)
        folded = _gathered_call(call, gathered, out, lse, kernel_dtype)
        if score is not None:
            b, hk, i = gathered.where
            step, first = heads if heads is not None else (group, 0)
            where = (b, hk * step + first, n_keys[b] - call.n_q + i,
                     np.ascontiguousarray(keys.reshape(-1, keys.shape[-1])[rows]))
            folded = _user_functions.with_user_functions(
                folded, _listed_score_mod(score[0], len(score[1])), where + tuple(score[1]),
                None, (), None)
        _run.forward(folded, gathered.seqs, (folded.q, folded.k, folded.v,
                                             _call.kernel_view(out), lse))
        b, _, i = gathered.where
        at = (b[:, None], gathered.heads, i[:, None])
        rows_out, rows_lse = out[:, 0], lse[:, 0]
        if call.sinks.size:  # each head's sink joins its rows' denominators
            with_sink = np.logaddexp(rows_lse, call.sinks[gathered.heads])
            rows_out = rows_out.astype(call.compute_dtype) * np.exp(rows_lse - with_sink)[..., None]
            rows_lse = with_sink
        call.out_bhsd[at] = rows_out
        call.lse[at] = rows_lse


def attention(call, key_indices):
    """`cpuflash.attention` with `key_indices` (checked): the whole of k and v is listable."""
    n_keys = np.full(call.batch, call.n_k, dtype=np.int64)
    table = np.arange(call.batch, dtype=np.int64)[:, None]
    forward(call, call.k, call.v, key_indices, n_keys, table, max(call.n_k, 1))


_LISTED = {}  # (jitted score_mod, its argument count) -> `_listed_score_mod`'s function


def _listed_score_mod(score_mod, n_args):
    """`score_mod` (of `n_args` score_args) as the gathered rows' kernels call it: their
    (sequence, head 0, row, column) turned into the call's (batch entry, head, query position,
    key position) by the four tables that lead its arguments (`forward`). One function per
    score_mod, so that its kernel is compiled once; written out (Numba's functions take no
    ``*args``)."""
    _, user = _user_functions.user_function("score_mod", score_mod)  # (its latest compile)
    wrapped = _LISTED.get((user, n_args))
    if wrapped is None:
        args = "".join(f", a{i}" for i in range(n_args))
        scope = {"user": user}
        exec(f"def listed_score_mod(score, s, h, row, column, entry, head, position, key{args}):"
             f"\n    return user(score, entry[s], head[s] + row, position[s], key[s, column]"
             f"{args})\n", scope)
        wrapped = _LISTED[(user, n_args)] = scope["listed_score_mod"]
    return wrapped


def kvcache(call, key_indices, mask=None, score=None):
    """`cpuflash.attention_with_kvcache` with `key_indices` (checked): the new keys written,
    then each entry's first ``n_keys[b]`` cache positions listable. `mask`: (jitted
    mask_mod, its args) or None; the listed keys it hides are taken off the lists. `score`:
    (score_mod, score_args), or None; the gathered rows' kernels call it with the call's
    entries, heads and positions (`_listed_score_mod`)."""
    k, v = _kvcache.write_new_keys(call)
    scales = (None, None)
    if call.quantized is not None:  # gathered as the caller's dtypes (float8 is no uint8)
        k, v, scales = call.k_cache, call.v_cache, (call.k_scale, call.v_scale)
    pages = (call.n_keys, call.block_table, call.page_rows, scales, score)
    if mask is None:
        forward(call, k, v, key_indices, *pages)
        return
    group = call.n_heads // call.n_kv_heads
    kept = np.empty((call.batch, call.n_heads) + key_indices.shape[2:], dtype=np.bool_)
    _masked(mask[0], mask[1], key_indices, call.n_keys, group, kept)
    by_head = kept.reshape((call.batch, call.n_kv_heads, group) + kept.shape[2:])
    if np.all(by_head == by_head[:, :, :1]):  # the group's heads keep the same keys
        forward(call, k, v, np.where(by_head[:, :, 0], key_indices, -1), *pages)
        return
    # else one head of each group at a time, each with its own lists: the same kernels,
    # group times the launches
    for g in range(group):
        heads = slice(g, None, group)
        part = dataclasses.replace(
            call, q=call.q[:, heads], n_heads=call.n_kv_heads, out_bhsd=call.out_bhsd[:, heads],
            out_user=call.out_bhsd[:, heads], sinks=call.sinks[heads] if call.sinks.size
            else call.sinks, lse_shape=call.lse[:, heads].shape)
        forward(part, k, v, np.where(by_head[:, :, g], key_indices, -1), *pages, (group, g))
        call.lse[:, heads] = part.lse


@numba.njit(cache=False)
def _masked(mask_mod, mask_args, keys, n_keys, group, kept):
    """kept[b, h, i, s]: whether query row i of head h keeps its listed key s (b, the head's kv
    head), by ``mask_mod(b, h, q_idx, kv_idx, *mask_args)`` with the query's position in its
    sequence (bottom-right aligned) as a KV-cache call's kernels give it; unused slots are
    not kept."""
    n_q = keys.shape[2]
    for b in range(keys.shape[0]):
        for hk in range(keys.shape[1]):
            for i in range(n_q):
                position = n_keys[b] - n_q + i
                for g in range(group):
                    h = hk * group + g
                    for s in range(keys.shape[3]):
                        j = keys[b, hk, i, s]
                        kept[b, h, i, s] = j >= 0 and mask_mod(b, h, position, j, *mask_args)


def backward(call, grads, key_indices):
    """The gradients of `attention` with `key_indices` (checked) into `grads` (a
    `_validate_gradients.GradientCall`); returns ``delta = rowsum(dout * out)`` (B, Hq, Nq).
    Each block's gathered keys get their gradients from the FA-2 backward; they are added to
    their positions in row order (`np.add.at`), in the compute dtype, and rounded once."""
    n_keys = np.full(call.batch, call.n_k, dtype=np.int64)
    keys, counts = listed_keys(call, key_indices, n_keys)
    table = np.arange(call.batch, dtype=np.int64)[:, None]
    cdtype = call.compute_dtype
    dq = np.zeros(call.q.shape, dtype=cdtype)
    dk = np.zeros(call.k.shape, dtype=cdtype)
    dv = np.zeros(call.v.shape, dtype=cdtype)
    delta = np.zeros(grads.lse.shape, dtype=grads.lse.dtype)
    topk = keys.shape[-1]
    for rows in _blocks(call, topk, cdtype):
        gathered = _Gathered(call, call.k, call.v, (None, None), table, max(call.n_k, 1), keys,
                             counts, rows)
        b, hk, i = gathered.where
        at = (b[:, None], gathered.heads, i[:, None])
        out_rows = grads.out[at][:, None]
        lse_rows = np.ascontiguousarray(grads.lse[at][:, None])
        folded = _gathered_call(call, gathered, out_rows, lse_rows, call.dtype)
        parts = tuple(np.empty(shape, dtype=call.dtype)
                      for shape in (gathered.q.shape, gathered.k.shape, gathered.v.shape))
        part_grads = _validate_gradients.GradientCall(
            dout=grads.dout[at][:, None], out=out_rows, lse=lse_rows,
            kernel=tuple(_call.kernel_view(x) for x in parts), user=parts,
            copy_back=(None, None, None))
        delta[at] = _run_backward.backward(folded, part_grads, gathered.seqs,
                                           (gathered.q, gathered.k, gathered.v))[:, 0]
        dq_part, dk_part, dv_part = (x[:, 0].astype(cdtype) for x in parts)
        dq[at] = dq_part
        seen = np.arange(topk)[None, :] < gathered.seqs[:, SEQ_N_K][:, None]  # (S, topk)
        listed = keys.reshape(-1, topk)[rows]
        where = (np.broadcast_to(b[:, None], seen.shape)[seen],
                 np.broadcast_to(hk[:, None], seen.shape)[seen], listed[seen])
        np.add.at(dk, where, dk_part[seen])
        np.add.at(dv, where, dv_part[seen])
    for target, grad in zip(grads.kernel, (dq, dk, dv)):
        target.view(call.dtype)[...] = grad
    return delta
