"""The runner: a validated call in, the kernels run, the result out.

Below the public modules (`api`, `flex`, `_backward`), above the kernels. For each call it
chooses the route (the FA-2 forward, or the split-KV decoding kernel for one-row calls and KV
caches), the tiles (`tiling`) and the work items (`_schedule`), keeps what a repeated call can
reuse (`_plans`), writes new keys into a cache (`_kvcache`) and merges key splits (`_combine`).
"""

import dataclasses

import numpy as np

from . import (_call, _combine, _kvcache, _plans, _quantize, _schedule, _simd_bytes, _threads,
               _validate, tiling)
from ._simd import LANES_F32
from .kernels._band import (SEQ_BATCH_Q, SEQ_K_START, SEQ_N_K, SEQ_N_Q, SEQ_Q_START,
                            visible_keys)
from .kernels._layout import KEPT_BYTES
from .kernels._convert import BFLOAT16
from .kernels._pairs import FORWARD_PAIRS
from .kernels.decode import (decode as decode_kernel, decode_idot, decode_int4, decode_int4_idot,
                             decode_plain)
from .kernels.forward import fa2_forward, fa2_forward_plain


def attention_again(key, q, k, v, out, return_lse):
    """`cpuflash.attention`'s result when `key` (`plan_key`) found the plan of an earlier call
    and the checks that can fail for it pass; else None (the full path)."""
    setup = _plans.get(key)
    if setup.__class__ is Forward:
        return forward_again(setup, q, k, v, out, return_lse)
    if setup is not None and out is None:
        return decode_again(setup, q, k, v, None, return_lse)
    return None


def attention(call, layout, key, out_given, return_lse):
    """Run a validated `cpuflash.attention` call; `key`: its plan key (`plan_key`), or None
    for a call no later one may reuse."""
    if not (call.n_q and call.batch and call.n_heads):
        return call.result(return_lse)
    group = call.n_heads // call.n_kv_heads
    if (call.n_q == 1 and call.n_k and call.tiles is None and not call.bias.size
            and not call.mask.size and (group <= tiling.DECODE_MAX_ROWS or not foldable(call))):
        # one query row (a decoding step): the streaming decode kernel, in a number of key
        # splits that no thread count changes (the results must not depend on it). Calls of a
        # few rows keep the FA-2 kernel, which `python -m cpuflash warmup` compiles with one.
        setup = Decode(call, layout, call.n_k, ATTENTION_SPLIT_THREADS)
        if key is not None and not out_given:
            _plans.put(key, setup.frozen())
        n_keys = np.full(call.batch, call.n_k, dtype=np.int64)
        decode(setup, call.q, call.k, call.v, n_keys, call.n_k, call.out_bhsd, call.lse,
               call.sinks)
    elif foldable(call):
        forward_folded(call, _schedule.sequence_table(1, call.n_k, call.batch), call.k, call.v,
                       1)  # (unsplit: see `_folded_splits`)
    else:
        seqs = _schedule.sequence_table(call.n_q, call.n_k, call.batch)
        if rows_foldable(call, seqs):
            forward_folded_rows(call, seqs, call.k, call.v)
        else:
            if key is not None and call.copy_back is None:
                _plans.put(key, Forward(call, layout, seqs))
            forward(call, seqs)
    return call.result(return_lse)


def kvcache(call, layout, key, return_lse):
    """Run a validated `cpuflash.attention_with_kvcache` call: the new keys written in, then
    the decoding kernel, or for chunked prefill the FA-2 forward."""
    k, v = _kvcache.write_new_keys(call)  # every check has passed
    if not (call.n_q and call.batch):
        call.out_kernel[...] = 0
        call.lse[...] = -np.inf
        return call.result(return_lse)
    group = call.n_heads // call.n_kv_heads
    # (a quantized cache always takes the decode kernel, which reads its rows in place:
    # the FA-2 kernel would need a float copy)
    if (group * call.n_q <= tiling.DECODE_MAX_ROWS or call.quantized is not None
            or (call.n_q <= tiling.DECODE_MAX_QUERIES and not foldable(call))
            or streams_more_rows(call)):
        setup = Decode(call, layout, call.page_rows * call.block_table.shape[1], 0)
        if key is not None:
            _plans.put(key, setup.frozen())
        decode(setup, call.q, k, v, call.n_keys, call.n_k, call.out_bhsd, call.lse,
               call.sinks, scales=(call.k_scale, call.v_scale))
    else:  # chunked prefill: enough query rows per key block for the packed FA-2 kernel
        if call.paged:
            k, v = _kvcache.gather_pages(call)
        seqs = _schedule.sequence_table(call.n_q, 0, call.batch)
        seqs[:, SEQ_N_K] = call.n_keys
        if foldable(call):
            forward_folded(call, seqs, k, v, _threads.thread_count())
        elif rows_foldable(call, seqs):
            forward_folded_rows(call, seqs, k, v)
        else:
            forward(call, seqs, (call.q, k, v, call.out_kernel, call.lse))
    return call.result(return_lse)


def streams_more_rows(call):
    """Whether a KV-cache call of more rows a head than `tiling.DECODE_MAX_QUERIES` streams all
    the same: with AVX-512 vectors, in float32 (float16 widened), up to
    `tiling.WIDE_DECODE_MAX_QUERIES` rows a head and `tiling.WIDE_DECODE_MAX_ROWS` a kv head."""
    group = call.n_heads // call.n_kv_heads
    return (LANES_F32 == 16 and call.compute_dtype == np.float32 and call.half_kind != BFLOAT16
            and tiling.DECODE_MAX_QUERIES < call.n_q <= tiling.WIDE_DECODE_MAX_QUERIES
            and group * call.n_q <= tiling.WIDE_DECODE_MAX_ROWS)


def foldable(call):
    """Whether a decoding step of a large GQA/MQA group (one query row per head, more heads to
    a kv head than `DECODE_MAX_ROWS`) runs faster as the FA-2 forward of its groups
    (`forward_folded`) than in the streaming kernel, which reads each key row once for all
    the group's rows too and splits the keys over the threads: where the FA-2 tiles multiply
    bfloat16 pairs (AVX512-BF16, AMX) and the streaming kernel widens (measured: docs/
    performance.md, "Large groups, MLA and top-k keys"). Its rows must all see the same keys
    through the same steps: no step that depends on the head or the row (ALiBi, bias, mask,
    sinks, the user's functions), and an unquantized cache."""
    return (call.n_q == 1 and call.n_heads // call.n_kv_heads > tiling.DECODE_MAX_ROWS
            and call.half_kind == BFLOAT16 and FORWARD_PAIRS and not call.sinks.size
            and _rows_alike(call))


def _rows_alike(call):
    """Whether every query row of a call sees its keys through the same steps, whatever its
    head and row (visibility aside): no ALiBi, bias, mask or user function, no tiles of the
    caller's, and an unquantized cache (the folded routes' FA-2 kernel reads float keys)."""
    return (call.quantized is None and call.tiles is None and call.alibi.shape[1] == 0
            and not call.bias.size and not call.mask.size
            and call.user is _call.NO_USER_FUNCTIONS)


def forward_folded(call, seqs, k, v, split_threads):
    """A `foldable` call as the FA-2 forward of its groups: the heads of a kv head are the query
    rows of one tile, so each key block is read once per tile of rows, not once per head (and
    a thread gets rows enough for its micro-kernels). `seqs`: the call's sequence table, one
    query row a sequence; `k`, `v`: the keys and values as the kernel reads them;
    `split_threads`: the thread count that sets the key splits (`_folded_splits`).

    One row sees keys ``lo .. n_k - 1`` of its sequence, by its window and chunk (the key under
    the row is the last one, so causal hides none): the folded call attends to that range with
    no visibility rule, which every row of the group shares. Split, each split's rows are a
    sequence of their own, written into a part of the output's shape, and the parts merge
    exactly (`_combine.merge_into`) in the compute dtype."""
    group = call.n_heads // call.n_kv_heads
    n_k = seqs[:, SEQ_N_K]
    lo = np.clip(_window_start(call, n_k), 0, n_k)
    n_groups = call.batch * call.n_kv_heads
    n_splits, split_len = _folded_splits(call, n_groups, int((n_k - lo).max()), split_threads)
    # split s of batch entry b: sequence s * B + b, its rows batch s * B + b of q and out
    folded_seqs = np.concatenate([seqs] * n_splits)
    start = np.tile(lo, n_splits) + np.repeat(np.arange(n_splits) * split_len, len(seqs))
    folded_seqs[:, SEQ_BATCH_Q] += np.repeat(np.arange(n_splits) * len(seqs), len(seqs))
    folded_seqs[:, SEQ_N_Q] = group
    folded_seqs[:, SEQ_K_START] += start
    folded_seqs[:, SEQ_N_K] = np.clip(np.tile(n_k, n_splits) - start, 0, split_len)

    def rows(x):  # (B, Hq, 1, X) as (B, Hk, group, X): row g of kv head hk is head hk*group+g
        s = x.strides
        return np.lib.stride_tricks.as_strided(
            x, (x.shape[0], call.n_kv_heads, group, x.shape[3]), (s[0], s[1] * group, s[1], s[3]))

    if n_splits == 1:
        q, out = rows(call.q), rows(call.out_kernel)
        lse = call.lse.reshape(call.batch, call.n_kv_heads, group)
    else:
        parts = np.empty((n_splits * call.batch,) + call.out_kernel.shape[1:],
                         call.compute_dtype)
        part_lse = np.empty((n_splits * call.batch,) + call.lse.shape[1:], call.compute_dtype)
        q, out = np.concatenate([rows(call.q)] * n_splits), rows(parts)
        lse = part_lse.reshape(-1, call.n_kv_heads, group)
    folded = dataclasses.replace(
        call, q=q, n_heads=call.n_kv_heads, n_q=group, n_k=int(folded_seqs[:, SEQ_N_K].max()),
        causal=False, window=(-1, -1), chunk=0, out_bhsd=out,
        tiles=folded_tiles(call, n_groups * n_splits, group, _threads.thread_count()))
    forward(folded, folded_seqs, (q, k, v, out, lse))
    if n_splits > 1:
        _merge_parts(call, parts.reshape((n_splits, call.batch) + parts.shape[1:]),
                     part_lse.reshape((n_splits,) + call.lse.shape))


def _folded_splits(call, n_groups, n_keys, n_threads):
    """(splits, keys a split) of `forward_folded`'s keys: the call's `num_splits`, or the fewest
    splits of each of its `n_groups` groups that deal the work most evenly over `n_threads`
    threads (with `folded_tiles`' tiles of rows), of at least `tiling.MIN_SPLIT_KEYS` keys,
    from key block borders. Three groups on two threads take two splits each: bfloat16 MLA
    (128 heads on one latent head, D576, 4096 keys, the caches flushed between calls) 1.06-1.20x,
    Zen 4. One group on two threads takes none: its rows already spread over both, and split
    it ran 0.92x. `attention` calls pass one thread: their bits may not depend on the thread
    count."""
    block_k = tiling.choose_tiles(call.head_dim, call.compute_dtype,
                                  head_dim_v=call.head_dim_v).block_k

    def load(splits):  # the busiest thread's share of a group
        tiles = _row_tiles(n_groups * splits, n_threads)
        return -(-n_groups * splits * tiles // n_threads) / (splits * tiles)

    n_splits = call.num_splits
    if not n_splits:
        most = max(4, -(-n_threads // n_groups))
        n_splits = min(range(1, most + 1), key=lambda s: (load(s), s))
        n_splits = max(1, min(n_splits, n_keys // tiling.MIN_SPLIT_KEYS))
    n_splits = max(1, min(n_splits, -(-n_keys // block_k)))
    split_len = -(-n_keys // n_splits)
    return n_splits, -(-split_len // block_k) * block_k


def rows_foldable(call, seqs):
    """Whether a call of a few query rows a head on a GQA/MQA group (a chunk of a prefill
    from a cache, speculative decoding's draft rows) runs as the FA-2 forward of its groups
    (`forward_folded_rows`): a head's rows fill less than half a query tile, and the keys of a
    kv head its rows see are more than a thread keeps packed (`_layout.KEPT_BYTES`), so the
    FA-2 forward, a head at a time, would pack each key block again for every head's few rows
    (below that, the heads share the packed blocks and folding gains nothing: docs/
    performance.md, "Large groups, MLA and top-k keys"). Work items of several heads
    (`_heads_an_item`) pack each block once too, but at 9-16 rows a head the folded tiles ran
    1.06-1.31x faster, their micro-kernels' row groups full. Every row must see its keys through
    the same steps (see `foldable`), its window aside: causal or no right side, and a left
    side, if any, of at least ``Nq - 1`` keys, so that the rows' bands overlap (the sinks join
    after the merge; with `chunk_size`, each sequence's rows must lie in one chunk). `seqs`:
    the call's sequence table (each sequence must have a key for every query row)."""
    group = call.n_heads // call.n_kv_heads
    if not (1 < call.n_q and group > 1):
        return False
    left, right = call.window
    if right != (0 if call.causal else -1) or 0 <= left < call.n_q - 1:
        return False
    tiles = tiling.choose_tiles(call.head_dim, call.compute_dtype, head_dim_v=call.head_dim_v)
    n_keys = seqs[:, SEQ_N_K]
    if int(n_keys.min()) < call.n_q:
        return False
    if call.chunk and np.any((n_keys - 1) // call.chunk != (n_keys - call.n_q) // call.chunk):
        return False  # a sequence's rows in two chunks see different keys
    return (2 * call.n_q <= tiles.block_q and _visible_key_bytes(call, seqs) > KEPT_BYTES
            and _rows_alike(call))


def _window_start(call, n_keys, row=0):
    """Each sequence's first key that query row `row` (at the bottom right of `n_keys` keys)
    sees, by the window's left side and its chunk."""
    left, right = call.window
    return visible_keys(n_keys - call.n_q + row, 1, n_keys, left, right, call.chunk, 0, 1)[0]


def _visible_key_bytes(call, seqs):
    """The bytes of the keys and values that all the query rows of a sequence of `seqs` see
    together, in the sequence that shows the most (`_band.visible_keys`, as a tile of them all
    reads them)."""
    n_q, n_k = seqs[:, SEQ_N_Q], seqs[:, SEQ_N_K]
    lo, hi = visible_keys(n_k - n_q, n_q, n_k, *call.window, call.chunk, 0, 1)
    return int((hi - lo).max()) * (call.head_dim + call.head_dim_v) * call.compute_dtype.itemsize


def forward_folded_rows(call, seqs, k, v):
    """A `rows_foldable` call as the FA-2 forward of its groups: row ``g * Nq + i`` of kv head
    hk is query row i of head ``hk * group + g``, so a key block is packed once for the whole
    group's rows. The rows differ only at the ends of their bands (query row i, at the bottom
    right, sees keys ``max(c, n_k - Nq + i - left) .. n_k - Nq + i`` causal, c the start of
    their chunk, 0 without `chunk_size`): the folded rows attend to the keys every row sees
    with no visibility rule; causal's last ``Nq - 1`` keys go a head at a time with causal's
    rule, and the keys a window's left side shows the first rows only go a query row at a
    time, its group's heads folded (`_window_heads`). The parts merge exactly
    (`_combine.merge_into`), from outputs in the compute dtype (half-precision ones are rounded
    once, merged, the sinks joined): the call's memory beside its output is these parts, of the
    output's shape. `seqs`, `k`, `v`: as `forward_folded` takes them."""
    batch, n_heads, n_q, d = call.q.shape
    n_kv, dv, group = call.n_kv_heads, call.head_dim_v, n_heads // call.n_kv_heads
    n_k = seqs[:, SEQ_N_K]
    lo = _window_start(call, n_k, n_q - 1)  # each sequence's first key every row sees
    shared = (n_k - n_q + 1 if call.causal else n_k) - lo  # the keys every row sees
    window_heads = bool(np.any(_window_start(call, n_k) < lo))
    parts = np.empty((1 + call.causal + window_heads, batch, n_heads, n_q, dv),
                     call.compute_dtype)
    part_lse = np.empty(parts.shape[:-1], call.compute_dtype)

    folded_seqs = seqs.copy()
    folded_seqs[:, SEQ_N_Q] = group * n_q
    folded_seqs[:, SEQ_K_START] += lo
    folded_seqs[:, SEQ_N_K] = shared
    q = call.q.reshape(batch, n_kv, group * n_q, d)  # (a copy where the heads are apart)
    out = parts[0].reshape(batch, n_kv, group * n_q, dv)
    lse = part_lse[0].reshape(batch, n_kv, group * n_q)
    no_sinks = call.sinks[:0]  # (joined to the merged rows: a head's sink is not a row's)
    folded = dataclasses.replace(
        call, q=q, n_heads=n_kv, n_q=group * n_q, n_k=int(shared.max()), causal=False,
        window=(-1, -1), chunk=0, out_bhsd=out, sinks=no_sinks,
        tiles=_balanced_tiles(call, batch * n_kv, group * n_q, _threads.thread_count()))
    forward(folded, folded_seqs, (q, k, v, out, lse))
    if call.causal:
        tail_seqs = seqs.copy()
        tail_seqs[:, SEQ_K_START] += lo + shared
        tail_seqs[:, SEQ_N_K] = n_q - 1  # row i sees the first i of them (bottom right)
        tail = dataclasses.replace(call, n_k=n_q - 1, window=(-1, 0), chunk=0,
                                   out_bhsd=parts[1], sinks=no_sinks)
        forward(tail, tail_seqs, (call.q, k, v, parts[1], part_lse[1]))
    if window_heads:
        _window_heads(call, seqs, k, v, lo, parts[-1], part_lse[-1])
    _merge_parts(call, parts, part_lse)


def _merge_parts(call, parts, part_lse):
    """The parts of a call's result, each over keys of its own (`parts` (S, B, Hq, Nq, Dv) and
    `part_lse` (S, B, Hq, Nq), in the compute dtype), merged exactly (`_combine.merge_into`)
    into its output and lse, its sinks joined, a half-precision output rounded once."""
    merged = call.out_kernel if call.half_kind == _call.NATIVE else \
        np.empty(call.out_kernel.shape, call.compute_dtype)
    if len(parts) > 1:
        _combine.merge_into(parts, part_lse, merged, call.lse)
    else:
        merged[...] = parts[0]
        call.lse[...] = part_lse[0]
    if call.sinks.size:
        merged[...], call.lse[...] = _combine.add_sinks(merged, call.lse, call.sinks)
    if merged is not call.out_kernel:  # rounded to nearest even, as the kernels round
        call.out_kernel[...] = merged.astype(call.out_bhsd.dtype).view(call.out_kernel.dtype)


def _window_heads(call, seqs, k, v, lo, out, lse):
    """`forward_folded_rows`' part of the keys before `lo` (each sequence's first key every
    row sees) into `out` (B, Hq, Nq, Dv) and `lse` (B, Hq, Nq): query row i sees those from
    its own first one on (`_window_start`), so its group's heads fold into a sequence of
    `group` rows that sees them with no visibility rule; a row that sees none of them gets no
    key (lse -inf)."""
    batch, n_heads, n_q, d = call.q.shape
    n_kv, dv, group = call.n_kv_heads, call.head_dim_v, n_heads // call.n_kv_heads
    n_k = seqs[:, SEQ_N_K]
    tables = []
    for i in range(n_q - 1):  # (the last row sees none)
        start = _window_start(call, n_k, i)
        table = seqs[start < lo]
        table[:, SEQ_Q_START] = (table[:, SEQ_Q_START] + i) * group
        table[:, SEQ_N_Q] = group
        table[:, SEQ_K_START] += start[start < lo]
        table[:, SEQ_N_K] = (lo - start)[start < lo]
        tables.append(table)
    rows_seqs = np.concatenate(tables)
    # row i * group + g of kv head hk: query row i of head hk * group + g
    q = np.ascontiguousarray(
        call.q.reshape(batch, n_kv, group, n_q, d).swapaxes(2, 3)).reshape(
            batch, n_kv, n_q * group, d)
    rows_out = np.zeros((batch, n_kv, n_q * group, dv), call.compute_dtype)
    rows_lse = np.full(rows_out.shape[:-1], -np.inf, call.compute_dtype)
    rows = dataclasses.replace(
        call, q=q, n_heads=n_kv, n_q=n_q * group, n_k=int(rows_seqs[:, SEQ_N_K].max()),
        causal=False, window=(-1, -1), chunk=0, out_bhsd=rows_out, sinks=call.sinks[:0],
        tiles=folded_tiles(call, len(rows_seqs) * n_kv, group, _threads.thread_count()))
    forward(rows, rows_seqs, (q, k, v, rows_out, rows_lse))
    out[...] = rows_out.reshape(batch, n_kv, n_q, group, dv).swapaxes(2, 3).reshape(out.shape)
    lse[...] = rows_lse.reshape(batch, n_kv, n_q, group).swapaxes(2, 3).reshape(lse.shape)


def _balanced_tiles(call, n_groups, rows, n_threads):
    """Tiles for `n_groups` groups of `rows` query rows, as many a group as keep the threads
    equally busy (three tiles on two threads would leave one idle a third of the time), no
    larger than `tiling.choose_tiles` makes them. A row's arithmetic does not depend on its
    tile, so neither do the results."""
    tiles = tiling.choose_tiles(call.head_dim, call.compute_dtype, head_dim_v=call.head_dim_v)
    per_group = -(-rows // tiles.block_q)
    for more in range(n_threads):
        if n_groups * (per_group + more) % n_threads == 0:
            per_group += more
            break
    return tiling.TileConfig(tiling.round_rows(-(-rows // per_group)), tiles.block_k)


def folded_tiles(call, n_groups, group, n_threads):
    """The tiles of a call whose `n_groups` groups of `group` rows each see the same keys (a
    folded decoding step, `_sparse`'s gathered rows): a group's rows are dealt in as few tiles
    as keep the threads busy (`split_for_threads` aims at two a thread, for calls whose tiles
    differ in cost), of up to `tiling.MAX_BLOCK_Q` rows whatever the cache model's
    `block_q`: each tile packs every key block it reads again, which cost more than its state's
    spill from L2 (bfloat16 MLA, D576, 128-384 heads on one thread: one tile 1.05-1.12x tiles
    of the model's 120 rows; top-2048 keys in float32 1.10x; Zen 4)."""
    tiles = tiling.choose_tiles(call.head_dim, call.compute_dtype, head_dim_v=call.head_dim_v)
    block_q = tiling.round_rows(-(-group // _row_tiles(n_groups, n_threads)))
    return tiling.TileConfig(min(block_q, tiling.MAX_BLOCK_Q), tiles.block_k)


def _row_tiles(n_groups, n_threads):
    """How many tiles `folded_tiles` deals each of `n_groups` groups' rows into: enough for
    every thread to have one."""
    return -(-n_threads // n_groups)


class Forward:
    """What a repeated FA-2 forward call needs besides its arrays: the checked call of an
    earlier one with the same key (`plan_key`), and its sequence table. (A call's arrays
    are passed to `forward` beside it: a copy of it with them would give back much of what
    skipping the checks saves; measured: docs/history.md, "Per-call cost", small calls.)"""

    def __init__(self, call, layout, seqs):
        self.layout = layout
        self.n_k = call.n_k  # (not in the key, which leaves out the keys' axis)
        self.out_shape = call.out_user.shape
        self.lse_rows = call.lse.shape
        self.launch = None  # (see `_plans.launch`)
        seqs.flags.writeable = False
        self.seqs = seqs
        self.call = call.without_arrays()


def forward_again(setup, q, k, v, out, return_lse):
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
    view = _call.kernel_view
    forward(setup.call, setup.seqs, (view(q), view(k), view(v), view(out_bhsd), lse),
                 setup)
    return (out, lse.reshape(setup.call.lse_shape)) if return_lse else out


def forward(call, seqs, arrays=None, plan=None):
    """Choose tiles, deal the work items to threads and run the FA-2 kernel. `arrays`: (q, k,
    v, out, lse) as the kernel takes them, in place of the call's; `plan`: the `Forward` that
    keeps the launch (`forward_again`)."""
    n_threads = _threads.thread_count()
    q, k, v, out, lse = arrays or (call.q, call.k, call.v, call.out_kernel, call.lse)
    if plan is None:
        launch = _forward_launch(call, seqs, n_threads, out.dtype)
    else:
        valid = (n_threads, tiling.choose_tiles, tiling.split_for_threads,
                 _threads.FORKED_AFTER_OPENMP)
        launch = _plans.launch(plan, valid,
                               lambda: _forward_launch(call, seqs, n_threads, out.dtype))
    kernel, items, chunk_ptr, block_q, block_k, key_align, heads, pipeline = launch
    kernel(q, k, v, out, lse, seqs, items, chunk_ptr, block_q, block_k, key_align, heads,
           call.half_kind, *pipeline)


def _forward_launch(call, seqs, n_threads, out_dtype):
    """(kernel, items, chunk_ptr, block_q, block_k, key_align, heads, pipeline): the FA-2
    kernel's arguments that the call's shapes, options and the thread count decide (and the
    dtype of the output it writes: the inputs', or the compute dtype for a part to merge)."""
    key = ("forward", seqs.tobytes(), call.n_heads, call.n_kv_heads, call.window, call.chunk,
           call.head_dim, call.head_dim_v, call.compute_dtype, call.tiles, n_threads,
           tiling.choose_tiles, tiling.split_for_threads, _heads_an_item, KEPT_BYTES)
    tiles, key_align, heads, items, chunk_ptr = _plans.schedule(
        key, lambda: _forward_schedule(call, seqs, n_threads))
    kernel_key = call.kernel_key()
    if out_dtype != call.q.dtype:
        kernel_key += (out_dtype,)
    kernel = (fa2_forward_plain if call.plain() else fa2_forward).specialize(kernel_key)
    return (kernel, items, chunk_ptr, tiles.block_q, tiles.block_k, key_align, heads,
            call.kernel_pipeline())


def _forward_schedule(call, seqs, n_threads):
    """(tiles, key_align, heads, items, chunk_ptr) of the FA-2 forward over the sequences
    `seqs` (`heads`: the heads a work item runs, `_heads_an_item`)."""
    tiles = call.tiles
    longest_q, longest_k = int(seqs[:, SEQ_N_Q].max()), int(seqs[:, SEQ_N_K].max())
    heads = 1
    if tiles is None:
        tiles = tiling.choose_tiles(call.head_dim, call.compute_dtype, head_dim_v=call.head_dim_v)
        heads = _heads_an_item(call, tiles, seqs, n_threads)
        tiles = tiling.split_for_threads(tiles, longest_q, len(seqs) * call.n_heads // heads,
                                         n_threads)
        tiles = tiling.clamp_tiles(tiles, longest_q, longest_k)
        tiles, key_align = tiling.band_tiles(tiles, call.window)  # sized for the clamped rows
    else:
        key_align = tiles.block_k
    tiles = tiling.clamp_tiles(tiles, longest_q, longest_k)
    key_align = min(key_align, tiles.block_k)
    items, cost = _schedule.work_items(seqs, call.n_heads, tiles.block_q, call.window,
                                       call.chunk, key_align, heads)
    items, chunk_ptr = _schedule.balance(items, cost, n_threads)
    return tiles, key_align, heads, items, chunk_ptr


def _heads_an_item(call, tiles, seqs, n_threads):
    """How many heads of a kv head a work item of the FA-2 forward runs, each key block packed
    once for all of them: more than one where a head's rows fill at most half a query tile
    and the keys a kv head's rows see outgrow the packed blocks a thread keeps
    (`_layout.KEPT_BYTES`), which a head at a time would pack again for every head's few rows
    (a chunk of a prefill from a cache with a modifier the folded rows do not take, speculative
    decoding's draft rows). Then the most heads (a divisor of the group) whose rows hold no more
    state than one query tile (`tiling.choose_tiles`' L2 model) and that leave each thread an
    item. A head's steps do not depend on the heads beside it, so neither do the results."""
    group = call.n_heads // call.n_kv_heads
    rows = tiling.round_rows(int(seqs[:, SEQ_N_Q].max()))
    if group == 1 or 2 * rows > tiles.block_q or _visible_key_bytes(call, seqs) <= KEPT_BYTES:
        return 1
    fits = [h for h in range(2, group + 1) if group % h == 0 and h * rows <= tiles.block_q
            and len(seqs) * call.n_heads // h >= n_threads]
    return max(fits, default=1)


# The thread count that decides the key splits of `attention` calls taken by the decode kernel:
# a constant, since their results must not depend on the thread count (8 splits the keys of a
# single-head call over 4096 keys into 8, of one over 1024 into 2, as a KV-cache call on 8
# threads would).
ATTENTION_SPLIT_THREADS = 8


class Decode:
    """What the decode route of a call needs besides the call's arrays and lengths: everything
    its shapes, dtypes and options decide. `_plans` keeps it (`frozen`) for the next call with
    the same key (`plan_key`)."""

    def __init__(self, call, layout, n_max, plan_threads):
        self.layout, self.dtype, self.compute_dtype = layout, call.dtype, call.compute_dtype
        self.native = call.dtype == call.compute_dtype  # the kernel may write the output
        self.batch, self.n_heads, self.n_kv_heads = call.batch, call.n_heads, call.n_kv_heads
        self.n_q, self.head_dim, self.head_dim_v = call.n_q, call.head_dim, call.head_dim_v
        self.half_kind = call.half_kind
        # the score pipeline as the kernel takes it (`_pipeline.kernel_args`), apart: spreading
        # a tuple into the call would cost a short call more than these three reads
        self.flat, self.score_args, self.mask_args = call.kernel_pipeline()
        self.user_types = call.kernel_key()[2]
        integer = call.integer_dot and _simd_bytes.INTEGER_ROUTE
        if call.quantized == "int4":
            self.kernel = decode_int4_idot if integer else decode_int4
        elif integer:  # (an int8 cache: `kernels.decode.IDOT`)
            self.kernel = decode_idot
        else:  # (`kernels.decode.PLAIN`)
            self.kernel = decode_plain if call.plain() else decode_kernel
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
        self.rotated = call.rotated  # its rows turned (`_quantize.hadamard`)
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
        flat = self.flat
        for array in (self.block_table, self.full_keys, flat.alibi, flat.bias, flat.bias_map,
                      flat.mask, flat.mask_map, flat.sinks):
            array.flags.writeable = False
        return self


def quantized_scales(k_cache, v_cache, cache_seqlens):
    """None for float caches; (k scale, v scale) for two QuantizedKV caches of numpy arrays
    given with `cache_seqlens` (the arrays' shapes then are the key's, whole); False for any
    other call with a QuantizedKV: the full path."""
    k_quantized = isinstance(k_cache, _quantize.QuantizedKV)
    v_quantized = isinstance(v_cache, _quantize.QuantizedKV)
    if not (k_quantized or v_quantized):
        return None
    if not (k_quantized and v_quantized and cache_seqlens is not None
            and k_cache.rotated == v_cache.rotated
            and k_cache.scale.__class__ is np.ndarray and v_cache.scale.__class__ is np.ndarray):
        return False
    return k_cache.scale, v_cache.scale


def plan_key(kind, q, k, v, cache_seqlens, causal, scale, window, chunk_size, softcap, layout,
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
            and (chunk_size is None or chunk_size.__class__ is int)
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
            chunk_size, softcap, layout, num_splits, lengths, new)


_SEQ_AXIS = {"bhsd": 2, "bshd": 1}  # the sequence axis of 4-D arrays


def _without(shape, axis):
    return shape[:axis] + (None,) + shape[axis + 1:]


def decode_again(setup, q, k, v, cache_seqlens, return_lse, new_k=None, new_v=None,
                  scales=None):
    """A call whose key found `setup`: only the checks that can fail for the same key (values,
    alignment, a writable cache), then the new keys written in and the kernel. None when a
    check fails: the full path then raises the error. `k`, `v`: the cache arrays (a quantized
    cache's data, its (k, v) scales in `scales`)."""
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
        if setup.block_table.shape[1] == 1:  # unpaged: the arrays' own length (see plan_key)
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
    if setup.rotated:  # as `_validate.kvcache_args` turns them
        q = _quantize.hadamard(q)
    if new_k is not None:  # every check has passed: into each entry's rows after its length
        if setup.layout == "bshd":
            new_k, new_v = new_k.swapaxes(1, 2), new_v.swapaxes(1, 2)
        if setup.rotated:
            new_k, new_v = _quantize.hadamard(new_k), _quantize.hadamard(new_v)
        if scales is not None:  # quantized first, as the full path writes them
            (new_k, k_scale), (new_v, v_scale) = (
                _quantize.quantize_rows(x, setup.quantized, _kvcache.groups(scale))
                for x, scale in zip((new_k, new_v), scales))
        for b, start in enumerate(starts):
            k[b, :, start:start + setup.n_new] = new_k[b]
            v[b, :, start:start + setup.n_new] = new_v[b]
            if scales is not None:
                scales[0][b, :, start:start + setup.n_new] = k_scale[b]
                scales[1][b, :, start:start + setup.n_new] = v_scale[b]
    if scales is not None:  # as `_validate.kvcache_args` hands them to the kernel
        q = np.asarray(q, dtype=np.float32)
        k, v = _validate.bits_view(k), _validate.bits_view(v)
    elif setup.half_kind != _call.NATIVE:
        q, k, v = q.view(np.uint16), k.view(np.uint16), v.view(np.uint16)
    lse = np.empty((setup.batch, setup.n_heads, setup.n_q), dtype=setup.compute_dtype)
    decode(setup, q, k, v, n_keys, n_k, out_bhsd, lse, setup.sinks, page_rows, scales)
    if setup.rotated:  # (`AttentionCall.result`'s turn back)
        out_bhsd[...] = _quantize.hadamard(out_bhsd)
    return (out_user, lse) if return_lse else out_user


# the scales of a float cache (the kernel's quantized steps are skipped)
_NO_SCALES = np.zeros((0, 0, 0), dtype=np.float32)
_NO_SCALES.flags.writeable = False


def decode(setup, q, k, v, n_keys, n_k, out_bhsd, lse, sinks, page_rows=None, scales=None):
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
           plan.block_k, setup.half_kind, setup.flat, setup.score_args, setup.mask_args,
           part_out, part_lse, n_threads)
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


