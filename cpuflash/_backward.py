"""The attention backward: the caller's arrays in, the gradients out.

The forward's validation (`_validate.attention_args`) reads q, k, v and the modifiers; this
module checks what only the backward takes (`dout`, `out`, `lse` and the optional `dq`, `dk`,
`dv`), deals the two passes' work items to the threads, runs `kernels.backward.fa2_backward`
and adds the sinks' gradient.
"""

import dataclasses

import numpy as np

from . import _plans, _schedule, _simd, _threads, _validate, tiling
from .kernels._band import SEQ_N_K, SEQ_N_Q
from .kernels.backward import fa2_backward, fa2_backward_plain

__all__ = ["attention_backward", "attention_varlen_backward"]


def attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, window=None,
                       softcap=0.0, alibi_slopes=None, bias=None, mask=None, sinks=None,
                       layout="bhsd", dq=None, dk=None, dv=None):
    """Gradients of `cpuflash.attention` with respect to q, k, v (and sinks).

    Parameters
    ----------
    dout : array shaped like `out`
        The gradient of the loss with respect to the attention output.
    q, k, v : arrays
        The forward's inputs, as `cpuflash.attention` takes them.
    out : (..., Hq, Nq, Dv) array (``(B, Nq, Hq, Dv)`` with ``"bshd"``)
        The forward's output for the same arguments.
    lse : (..., Hq, Nq) array (``(B, Hq, Nq)`` with ``"bshd"``)
        The forward's log-sum-exp (``return_lse=True``).
    causal, scale, window, softcap, alibi_slopes, bias, mask, sinks, layout
        The forward's keywords, unchanged. `alibi_slopes`, `bias` and `mask` are constants (no
        gradient).
    dq, dk, dv : arrays, optional
        Where to write the gradients (the shapes and dtypes of q, k, v); returned.

    Returns
    -------
    dq, dk, dv : arrays with the shapes, layout and dtypes of q, k, v
        With GQA, dk and dv sum over the query heads of each key/value head's group.
    dsinks : (Hq,) float32 array, only when `sinks` is given

    Notes
    -----
    The gradients are those of the score pipeline, softcap's tanh included. float16 and
    bfloat16 accumulate in float32 and are rounded once. Rows that see no key get zero
    gradients. Bitwise identical results whatever the thread count; extra memory O(N). A
    repeated call with the shapes, dtypes and options of an earlier one (and no `alibi_slopes`,
    `bias`, `mask` or `sinks`) skips the argument checks that cannot fail for them.
    """
    q, k, v = _validate.as_array("q", q), _validate.as_array("k", k), _validate.as_array("v", v)
    key = None
    if alibi_slopes is None and bias is None and mask is None and sinks is None:
        key = _plan_key(dout, q, k, v, out, lse, causal, scale, window, softcap, layout)
        setup = _plans.get(key) if key is not None else None
        if setup is not None:
            result = _backward_again(setup, dout, q, k, v, out, lse, dq, dk, dv)
            if result is not None:
                return result
    call = _validate.attention_args(
        q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks, layout=layout,
        return_lse=True)
    grads = gradient_args(call, (q, k, v), dout, out, lse, dq, dk, dv, layout)
    seqs = _schedule.sequence_table(call.n_q, call.n_k, call.batch)
    if key is not None and q.ndim == 4:
        _plans.put(key, _Backward(call, layout, seqs))
    delta = _run_backward(call, grads, seqs)
    result = grads.result()
    if call.sinks.size:
        result += (_sink_gradient(call.sinks, grads.lse, delta),)
    return result


@dataclasses.dataclass(slots=True, kw_only=True, eq=False)
class GradientCall:
    """What the backward adds to the forward's `AttentionCall`: its extra inputs as (batch,
    heads, rows, dim) arrays, and the three gradients, for the kernel and for the caller."""

    dout: np.ndarray  # (batch, Hq, Nq, Dv), the caller's dtype
    out: np.ndarray  # (batch, Hq, Nq, Dv), the caller's dtype
    lse: np.ndarray  # (batch, Hq, Nq), the compute dtype, C order
    kernel: tuple  # (dq, dk, dv) as the kernel writes them (uint16 bits for half precision)
    user: tuple  # (dq, dk, dv) in the caller's shapes
    copy_back: tuple  # per gradient: the caller's array to copy `user` into, or None

    def result(self):
        """``(dq, dk, dv)``, the caller's arrays where given."""
        grads = []
        for user, target in zip(self.user, self.copy_back):
            if target is not None:
                np.copyto(target, user)
                user = target
            grads.append(user)
        return tuple(grads)


def _plan_key(dout, q, k, v, out, lse, causal, scale, window, softcap, layout):
    """The `_plans` key of a backward call with options of the common kinds (numpy arrays,
    options of their usual types: ``True`` never stands in for ``1``), or None."""
    if not (q.__class__ is np.ndarray and k.__class__ is np.ndarray
            and v.__class__ is np.ndarray and dout.__class__ is np.ndarray
            and out.__class__ is np.ndarray and lse.__class__ is np.ndarray
            and causal.__class__ is bool and layout.__class__ is str
            and (scale is None or scale.__class__ is float or scale.__class__ is int)
            and (softcap.__class__ is float or softcap.__class__ is int)):
        return None
    if window is not None and not (window.__class__ is tuple and len(window) == 2
                                   and window[0].__class__ is int
                                   and window[1].__class__ is int):
        return None
    return ("backward", q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype, dout.shape,
            dout.dtype, out.shape, out.dtype, lse.shape, lse.dtype, causal, scale, window,
            softcap, layout)


class _Backward:
    """What a repeated backward call needs besides its arrays (see `_plans`): the checked call
    of an earlier one with the same key, without its arrays, and its sequence table."""

    def __init__(self, call, layout, seqs):
        self.layout = layout
        self.launch = None  # (see `_plans.launch`)
        seqs.flags.writeable = False
        self.seqs = seqs
        self.call = call.without_arrays()


def _backward_again(setup, dout, q, k, v, out, lse, dq, dk, dv):
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
            for y in read:  # (a loop: generators cost a small call's 4 us here)
                if np.may_share_memory(x, y):
                    return None
            read.append(x)  # nor another gradient
        user.append(x)
    arrays = [q, k, v, dout, out] + user
    if setup.layout == "bshd":
        arrays = [x.swapaxes(1, 2) for x in arrays]
    view = _validate.kernel_view
    grads = GradientCall(
        dout=arrays[3], out=arrays[4], lse=np.ascontiguousarray(lse, dtype=call.compute_dtype),
        kernel=(view(arrays[5]), view(arrays[6]), view(arrays[7])), user=tuple(user),
        copy_back=(None, None, None))
    _run_backward(call, grads, setup.seqs, (view(arrays[0]), view(arrays[1]), view(arrays[2])),
                  plan=setup)
    return grads.user


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *,
                              causal=False, scale=None, window=None, softcap=0.0,
                              alibi_slopes=None):
    """Gradients of `cpuflash.attention_varlen` with respect to q, k, v.

    Parameters
    ----------
    dout : (total_q, Hq, Dv) array
        The gradient of the loss with respect to the attention output.
    q, k, v, cu_seqlens_q, cu_seqlens_k
        The forward's packed inputs and cumulative lengths.
    out : (total_q, Hq, Dv) array
    lse : (Hq, total_q) array
        The forward's output and log-sum-exp (``return_lse=True``).
    causal, scale, window, softcap, alibi_slopes
        The forward's keywords, unchanged.

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtypes of q, k, v

    Each sequence's gradients are those of `attention_backward` on that sequence alone.
    """
    q, k, v = _validate.as_array("q", q), _validate.as_array("k", k), _validate.as_array("v", v)
    call = _validate.varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal,
                                 scale=scale, window=window, softcap=softcap,
                                 alibi_slopes=alibi_slopes, return_lse=True)
    grads = gradient_args(call, (q, k, v), dout, out, lse, None, None, None, "thd")
    _run_backward(call, grads, _schedule.varlen_table(call.cu_q, call.cu_k))
    return grads.result()


def gradient_args(call, qkv, dout, out, lse, dq, dk, dv, layout):
    """Check the backward's own arguments against the validated forward `call` (raising before
    anything is written) and build their kernel views. `layout` is the forward's, or "thd"
    for packed sequences."""
    out_shape, dtype = call.out_user.shape, call.dtype
    views = {}
    for name, x in (("dout", dout), ("out", out)):
        x = _validate.as_array(name, x)
        if x.dtype != dtype:
            _validate._fail(TypeError, f"`{name}` must have dtype {dtype} (that of `q`), got "
                                       f"{x.dtype}")
        if x.shape != out_shape:
            _validate._fail(ValueError, f"`{name}` must have the shape of the attention output "
                                        f"{out_shape}, got {x.shape}")
        views[name] = x
    lse = _validate.as_array("lse", lse)
    if lse.dtype.kind != "f":
        _validate._fail(TypeError, f"`lse` must be a float array (the forward's log-sum-exp), "
                                   f"got dtype {lse.dtype}")
    if lse.shape != call.lse_shape:
        _validate._fail(ValueError, f"`lse` must have shape {call.lse_shape}, got {lse.shape}")
    inputs = list(qkv) + [views["dout"], views["out"], lse]

    given = []
    for name, x, like in (("dq", dq, qkv[0]), ("dk", dk, qkv[1]), ("dv", dv, qkv[2])):
        if x is not None:
            x = _validate.as_array(name, x)
            if x.shape != like.shape:
                _validate._fail(ValueError, f"`{name}` must have shape {like.shape} (that of "
                                            f"`{name[1]}`), got {x.shape}")
            if x.dtype != dtype:
                _validate._fail(TypeError, f"`{name}` must have dtype {dtype}, got {x.dtype}")
            if not x.flags.writeable:
                _validate._fail(ValueError, f"`{name}` must be writeable, got a read-only array")
        given.append(x)

    kernel, user, copy_back = [], [], []
    for i, (x, like) in enumerate(zip(given, qkv)):
        others = inputs + [g for j, g in enumerate(given) if j != i and g is not None]
        target = None
        # a fresh array where the kernel cannot write the caller's: unaligned (its kernel view
        # would be a copy), or over an input the kernel still reads
        if x is None or not x.flags.aligned or any(np.may_share_memory(x, y) for y in others):
            target, x = x, np.empty(like.shape, dtype=dtype)
        shape4 = (call.q, call.k, call.v)[i].shape  # as the kernel reads the input
        view = _validate.reshaped_view(_heads_first(x, layout), shape4)
        if view is None:  # strides that cannot be flattened: write a copy, then copy it over
            target, x = x if target is None else target, np.empty(like.shape, dtype=dtype)
            view = _validate.reshaped_view(_heads_first(x, layout), shape4)
        kernel.append(_validate.kernel_view(view))
        user.append(x)
        copy_back.append(target)

    rows_shape = call.q.shape[:3]  # (batch, Hq, Nq) as the kernel reads them
    return GradientCall(
        dout=_heads_first(views["dout"], layout).reshape(rows_shape + (call.head_dim_v,)),
        out=_heads_first(views["out"], layout).reshape(rows_shape + (call.head_dim_v,)),
        lse=np.ascontiguousarray(lse.reshape(rows_shape), dtype=call.compute_dtype),
        kernel=tuple(kernel), user=tuple(user), copy_back=tuple(copy_back))


def _heads_first(x, layout):
    """`x` read as (..., heads, rows, dim), as the forward's validation reads q: bhsd as it is
    (one head for 2-D), bshd with its axes 1 and 2 swapped, packed (total, heads, dim) as one
    batch entry."""
    if layout == "bshd":
        return np.swapaxes(x, 1, 2)
    if layout == "thd":
        return np.swapaxes(x, 0, 1)[None]
    return x[None] if x.ndim < 3 else x


def _sink_gradient(sinks, lse, delta):
    """``dsinks[h] = -sum_{b, i} exp(sinks[h] - lse[b, h, i]) * delta[b, h, i]`` (float32):
    a sink adds ``exp(sink)`` to every denominator of its head, and nothing else."""
    share = np.exp(sinks.astype(np.float64)[None, :, None] - lse.astype(np.float64))
    return (-(share * delta).sum(axis=(0, 2))).astype(np.float32)


def _run_backward(call, grads, seqs, qkv=None, fused=None, plan=None):
    """Choose tiles and the scheme, deal the work items of the sequences `seqs` to the threads
    and run the kernel; returns ``delta = rowsum(dout * out)`` (batch, Hq, Nq). `qkv`: q, k, v
    as the kernel takes them, in place of the call's; `plan`: the `_Backward` that keeps the
    launch (`_backward_again`).

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
    kernel(q, k, v, _validate.kernel_view(grads.out),
           _validate.kernel_view(grads.dout), grads.lse, delta, dq, dk, dv, dq_acc, seqs,
           q_items, q_chunks, k_items, k_chunks, fused, tiles.block_q, tiles.block_k,
           call.half_kind, *pipeline)
    return delta


def _backward_launch(call, seqs, n_threads, fused):
    """(kernel, schedule, dq_acc's columns, pipeline): what the call's shapes, options and the
    thread count decide of the backward kernel's arguments (`_backward_schedule`)."""
    key = ("backward", seqs.tobytes(), call.n_heads, call.n_kv_heads, call.window, n_threads,
           fused, _fuse, tiling.backward_tiles)
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
                                           tiles.block_k)
    q_items, q_chunks = _schedule.balance(q_items, q_cost, n_threads)
    k_items, k_cost = _schedule.key_items(seqs, call.n_kv_heads, group, tiles.block_k,
                                          tiles.block_q, call.window)
    whole = _schedule.whole_sequences(seqs, call.n_kv_heads, k_items, k_cost)
    if fused is None:
        fused = _fuse(*whole, n_threads)
    k_items, k_chunks = _schedule.balance(*(whole if fused else (k_items, k_cost)), n_threads)
    return tiles, q_items, q_chunks, k_items, k_chunks, fused


# The fused scheme does 5 tile products where the split one does 7 (it rebuilds S and dP for
# dQ), and its items run 2.0-2.1x the split's work rate in all: it is chosen when its
# (sequence, kv head) items keep the threads busy for at least this share of the time. Forced
# either way on 2 cores (Zen 4): 3 kv heads (75% busy) 1.50-1.63x faster fused, 5 and 7
# (83%, 88%) 1.79-1.89x, one kv head (50%) 1.01-1.06x; so the break-even is near 48% busy.
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
