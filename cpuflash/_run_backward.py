"""The backward's runner: a validated call and its gradients' arrays in, the kernel run.

Chooses the tiles and the scheme (fused or split passes), deals the work items to the threads,
keeps what a repeated call can reuse (`_plans`), runs `kernels.backward.fa2_backward`, and finds
the sinks' gradient and, for `flex_attention_backward`, the gradients of `score_args`.
"""

import dataclasses

import numba
import numpy as np

from . import _call, _plans, _schedule, _simd, _threads, tiling
from ._validate_gradients import GradientCall
from .kernels._band import SEQ_N_K, SEQ_N_Q
from .kernels.backward import fa2_backward, fa2_backward_plain, score_arg_grads


def plan_key(dout, q, k, v, out, lse, causal, scale, window, chunk_size, softcap, layout):
    """The `_plans` key of a backward call with options of the common kinds (numpy arrays,
    options of their usual types: ``True`` never stands in for ``1``), or None."""
    if not (q.__class__ is np.ndarray and k.__class__ is np.ndarray
            and v.__class__ is np.ndarray and dout.__class__ is np.ndarray
            and out.__class__ is np.ndarray and lse.__class__ is np.ndarray
            and causal.__class__ is bool and layout.__class__ is str
            and (scale is None or scale.__class__ is float or scale.__class__ is int)
            and (softcap.__class__ is float or softcap.__class__ is int)
            and (chunk_size is None or chunk_size.__class__ is int)):
        return None
    if window is not None and not (window.__class__ is tuple and len(window) == 2
                                   and window[0].__class__ is int
                                   and window[1].__class__ is int):
        return None
    return ("backward", q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype, dout.shape,
            dout.dtype, out.shape, out.dtype, lse.shape, lse.dtype, causal, scale, window,
            chunk_size, softcap, layout)


class Backward:
    """What a repeated backward call needs besides its arrays (see `_plans`): the checked call
    of an earlier one with the same key, without its arrays, and its sequence table."""

    def __init__(self, call, layout, seqs):
        self.layout = layout
        self.launch = None  # (see `_plans.launch`)
        seqs.flags.writeable = False
        self.seqs = seqs
        self.call = call.without_arrays()


def backward_again(setup, dout, q, k, v, out, lse, dq, dk, dv):
    """A call whose key found `setup`: the checks that can fail for the same key (alignment,
    the given gradients), then the kernel. None when one fails: the full path then raises the
    error or handles the case (with copies)."""
    if not (q.flags.aligned and k.flags.aligned and v.flags.aligned and dout.flags.aligned
            and out.flags.aligned):
        return None
    call = setup.call
    read = [q, k, v, dout, out, lse]  # what a given gradient must not overlap
    user = []
    for x, like in ((dq, q), (dk, k), (dv, v)):
        if x is None:
            x = np.empty(like.shape, dtype=call.dtype)
        else:
            if not (x.__class__ is np.ndarray and x.shape == like.shape
                    and x.dtype == call.dtype and x.flags.writeable and x.flags.aligned):
                return None
            # (a loop: generators cost a small call measurably more here; docs/history.md,
            # "Per-call cost", the tiny model's backward)
            for y in read:
                if np.may_share_memory(x, y):
                    return None
            read.append(x)  # nor another gradient
        user.append(x)
    arrays = [q, k, v, dout, out] + user
    if setup.layout == "bshd":
        arrays = [x.swapaxes(1, 2) for x in arrays]
    view = _call.kernel_view
    grads = GradientCall(
        dout=arrays[3], out=arrays[4], lse=np.ascontiguousarray(lse, dtype=call.compute_dtype),
        kernel=(view(arrays[5]), view(arrays[6]), view(arrays[7])), user=tuple(user),
        copy_back=(None, None, None))
    backward(call, grads, setup.seqs, (view(arrays[0]), view(arrays[1]), view(arrays[2])),
                  plan=setup)
    return grads.user


def run(call, grads, layout, key):
    """Run a validated `cpuflash.attention_backward` call and return its gradients (`result`);
    its plan is kept under `key` (`plan_key`) unless that is None."""
    seqs = _schedule.sequence_table(call.n_q, call.n_k, call.batch)
    parts = head_parts(call)
    if parts > 1:
        return result(call, grads, _backward_in_parts(call, grads, seqs, parts))
    if key is not None:
        _plans.put(key, Backward(call, layout, seqs))
    return result(call, grads, backward(call, grads, seqs))


# An MQA call's query heads are cut into parts of at least this many for the backward, into
# at most this many work items of whole sequences (`head_parts`): constants, so that the bits
# do not depend on the thread count. Each part packs the key blocks again: 8 parts of 8 heads
# cost a one-thread call 0-20% more, 4 nothing measurable (docs/history.md, "Large groups")
PART_MIN_HEADS = 8
PART_MAX_ITEMS = 4


def head_parts(call):
    """How many parts the query heads of a call with one kv head (MQA) are cut into for the
    backward: the fused scheme (`backward`) has one item per sequence and kv head, so a single
    sequence on one kv head left every thread but one idle, or took the split scheme's seven
    products for five. Each part's heads sum their dK and dV apart (`_backward_in_parts`);
    float32 and float64 only (the parts are summed unrounded)."""
    if not (call.n_kv_heads == 1 and call.half_kind == _call.NATIVE
            and call.user is _call.NO_USER_FUNCTIONS):
        return 1
    parts = max(1, min(PART_MAX_ITEMS // max(1, call.batch), call.n_heads // PART_MIN_HEADS))
    while call.n_heads % parts:
        parts -= 1
    return parts


def _backward_in_parts(call, grads, seqs, parts):
    """`backward` with the query heads cut into `parts` groups of one kv head each (the same
    keys and values, read through a view), so that the fused scheme has `parts` items a
    sequence; the parts' dK and dV are summed in their order. Returns `backward`'s delta."""
    def repeated(x):  # (B, 1, N, D) as (B, parts, N, D), without a copy
        view = np.lib.stride_tricks.as_strided(
            x, (x.shape[0], parts) + x.shape[2:], (x.strides[0], 0) + x.strides[2:])
        view.flags.writeable = False
        return view

    dq, dk, dv = grads.kernel
    dk_parts = np.empty((dk.shape[0], parts) + dk.shape[2:], dk.dtype)
    dv_parts = np.empty((dv.shape[0], parts) + dv.shape[2:], dv.dtype)
    cut = dataclasses.replace(call, k=repeated(call.k), v=repeated(call.v), n_kv_heads=parts)
    delta = backward(cut, dataclasses.replace(grads, kernel=(dq, dk_parts, dv_parts)), seqs)
    for whole, each in ((dk, dk_parts), (dv, dv_parts)):
        whole[...] = each[:, :1]
        for part in range(1, parts):
            whole += each[:, part:part + 1]
    return delta


def result(call, grads, delta):
    """What `cpuflash.attention_backward` returns once the kernel has written the gradients:
    dq, dk, dv, and the sinks' gradient when the call has sinks (`delta`: the kernel's
    ``rowsum(dout * out)``)."""
    gradients = grads.result()
    if call.sinks.size:
        gradients += (sink_gradient(call.sinks, grads.lse, delta),)
    return gradients


def sink_gradient(sinks, lse, delta):
    """``dsinks[h] = -sum_{b, i} exp(sinks[h] - lse[b, h, i]) * delta[b, h, i]`` (float32):
    a sink adds ``exp(sink)`` to every denominator of its head, and nothing else."""
    share = np.exp(sinks.astype(np.float64)[None, :, None] - lse.astype(np.float64))
    return (-(share * delta).sum(axis=(0, 2))).astype(np.float32)


def backward(call, grads, seqs, qkv=None, fused=None, plan=None):
    """Choose tiles and the scheme, deal the work items of the sequences `seqs` to the threads
    and run the kernel; returns ``delta = rowsum(dout * out)`` (batch, Hq, Nq). `qkv`: q, k, v
    as the kernel takes them, in place of the call's; `plan`: the `Backward` that keeps the
    launch (`backward_again`).

    `fused` (None: chosen by `_fuse`) runs one item per (sequence, kv head) that computes dQ
    too, instead of a key pass per key block and a query pass per query tile. Both sum in the
    same order, so the choice does not change the bits.
    """
    q, k, v = qkv or (call.q, call.k, call.v)
    delta = np.zeros(grads.lse.shape, dtype=grads.lse.dtype)  # written by the kernel
    if not (len(seqs) and call.n_heads and grads.lse.size + k.size):
        for grad in grads.kernel:  # nothing to sum: zero gradients (dk, dv of kv heads
            grad[...] = 0          # without query heads too)
        return delta
    n_threads = _threads.thread_count()
    if plan is None:
        launch = _backward_launch(call, seqs, n_threads, fused)
    else:
        valid = (n_threads, _fuse, tiling.backward_tiles, _threads.FORKED_AFTER_OPENMP)
        launch = _plans.launch(plan, valid,
                               lambda: _backward_launch(call, seqs, n_threads, fused))
    kernel, schedule, acc_columns, pipeline = launch
    tiles, q_items, q_chunks, k_items, k_chunks, fused = schedule
    dq, dk, dv = grads.kernel
    dq_acc = np.empty((dq.shape[0] * dq.shape[1] * dq.shape[2] if fused else 0, acc_columns),
                      dtype=call.compute_dtype)
    kernel(q, k, v, _call.kernel_view(grads.out),
           _call.kernel_view(grads.dout), grads.lse, delta, dq, dk, dv, dq_acc, seqs,
           q_items, q_chunks, k_items, k_chunks, fused, tiles.block_q, tiles.block_k,
           call.half_kind, *pipeline)
    return delta


def _backward_launch(call, seqs, n_threads, fused):
    """(kernel, schedule, dq_acc's columns, pipeline): what the call's shapes, options and the
    thread count decide of the backward kernel's arguments (`_backward_schedule`)."""
    key = ("backward", seqs.tobytes(), call.n_heads, call.n_kv_heads, call.window, call.chunk,
           n_threads, fused, _fuse, tiling.backward_tiles)
    schedule = _plans.schedule(key, lambda: _backward_schedule(call, seqs, n_threads, fused))
    width = 2 * _simd.lanes_for(call.compute_dtype)
    kernel = (fa2_backward_plain if call.plain() else fa2_backward).specialize(
        call.kernel_key())
    return kernel, schedule, -(-call.head_dim // width) * width, call.kernel_pipeline()


def _backward_schedule(call, seqs, n_threads, fused):
    """(tiles, query items and chunks, key items and chunks, fused) of the backward over the
    sequences `seqs` (see `_run_backward`)."""
    longest_q, longest_k = int(seqs[:, SEQ_N_Q].max()), int(seqs[:, SEQ_N_K].max())
    tiles = tiling.backward_tiles(longest_q, longest_k)
    group = call.n_heads // call.n_kv_heads
    q_items, q_cost = _schedule.work_items(seqs, call.n_heads, tiles.block_q, call.window,
                                           call.chunk, tiles.block_k)
    q_items, q_chunks = _schedule.balance(q_items, q_cost, n_threads)
    k_items, k_cost = _schedule.key_items(seqs, call.n_kv_heads, group, tiles.block_k,
                                          tiles.block_q, call.window, call.chunk)
    whole = _schedule.whole_sequences(seqs, call.n_kv_heads, k_items, k_cost)
    if fused is None:
        fused = _fuse(*whole, n_threads)
    k_items, k_chunks = _schedule.balance(*(whole if fused else (k_items, k_cost)), n_threads)
    return tiles, q_items, q_chunks, k_items, k_chunks, fused


# The fused scheme does 5 tile products where the split one does 7 (it rebuilds S and dP for
# dQ), and in all its items get through their work faster than the split's: it is chosen when
# its (sequence, kv head) items keep the threads busy for at least this share of the time. Each
# scheme forced in turn, the fused one won from a little below this share; the threshold keeps
# a margin above that break-even (measured: docs/history.md, "Backward").
FUSED_MIN_BUSY = 0.6


def _fuse(items, cost, n_threads):
    """Whether the fused scheme's `items` keep `n_threads` threads busy enough."""
    if len(items) < n_threads:
        return False
    # (the cost rides along as a last column, to be read in the dealt order)
    dealt, chunk_ptr = _schedule.balance(np.column_stack([items, cost]), cost, n_threads)
    owner = np.repeat(np.arange(len(chunk_ptr) - 1), np.diff(chunk_ptr))
    loads = np.bincount(owner, weights=dealt[:, -1], minlength=n_threads)
    return cost.sum() / (n_threads * loads.max()) >= FUSED_MIN_BUSY


# how many parts the gradients of `score_args` are summed in (each run by one thread at a
# time): fixed, so that the bits do not depend on the thread count
GRAD_SLOTS = 32


def score_arg_gradients(call, grads, seqs, delta, grad_fns, float_args):
    """The tuple of gradients of the float arrays of score_args (`_score_arg_grads`)."""
    longest_q, longest_k = int(seqs[:, SEQ_N_Q].max()), int(seqs[:, SEQ_N_K].max())
    tiles = tiling.backward_tiles(longest_q, longest_k)
    items, _ = _schedule.work_items(seqs, call.n_heads, tiles.block_q, call.window,
                                    call.chunk, tiles.block_k)
    n_slots = max(1, min(GRAD_SLOTS, len(items)))
    slot_ptr = np.linspace(0, len(items), n_slots + 1).round().astype(np.int64)
    parts = tuple(np.zeros((n_slots,) + x.shape, dtype=call.compute_dtype) for x in float_args)
    if len(items):
        kernel = score_arg_grads.specialize(
            (call.q.dtype, call.compute_dtype, _call.user_types(call.user),
             numba.typeof(grad_fns),
             numba.typeof(parts)))
        kernel(call.q, call.k, call.v, _call.kernel_view(grads.dout), grads.lse, delta,
               seqs, items, slot_ptr, tiles.block_q, tiles.block_k, call.half_kind,
               *call.kernel_pipeline(), grad_fns, parts)
    return tuple(part.sum(axis=0) for part in parts)
