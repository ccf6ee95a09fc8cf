"""Your own score and mask functions, compiled into the FA-2 kernels (FlexAttention on the CPU).

A `score_mod(score, b, h, q_idx, kv_idx, *score_args)` and a `mask_mod(b, h, q_idx, kv_idx,
*mask_args)` are plain Python, compiled by Numba and inlined into the kernels' tiles
(`kernels._user`): the forward and the backward run them per score of the tiles they visit,
never on an ``Nq x Nk`` array. A `BlockMask` says which tiles are empty (never visited), full
(no `mask_mod` call) or partial.

Functions are told apart by a digest of their code, of the code of what they call and of the
values they read (`_user_functions`): a kernel compiled for them is cached on disk under that
digest, so the same function in a new process loads it, and an edited one compiles its own.
"""

import numbers

import numba
import numpy as np
from numba import types

from . import _run, _run_backward, _schedule, _user_functions, _validate, _validate_gradients, \
    tiling
from ._user_functions import BlockMask
from .kernels import _user

__all__ = ["BlockMask", "block_mask", "flex_attention", "flex_attention_backward"]

# the block mask's tiles when the caller names none: the backward's tiles (`tiling`), and the
# forward's where a block mask is given (`_user_functions.with_user_functions`), so that a
# kernel tile is one block (docs/performance.md, "Your own functions")
DEFAULT_BLOCK = (tiling.BACKWARD_BLOCK_Q, tiling.BACKWARD_BLOCK_K)


def _fail(exc, message):
    raise exc(message) from None


# -- block masks ----------------------------------------------------------------------------

def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        _fail(ValueError, f"`{name}` must be a positive int, got {value!r}")
    return int(value)


def block_mask(mask_mod, B, H, Nq, Nk, *, args=(), block=None):
    """The `BlockMask` of `mask_mod` for `B` batch entries, `H` query heads and `Nq` x `Nk`
    scores (B or H may be 1: the mask is then the same for every batch entry or head).

    `mask_mod(b, h, q_idx, kv_idx, *args)` returns True where the key takes part. It is called
    once for every (b, h, q_idx, kv_idx), compiled; reuse the result across layers and calls.
    `block` is ``(block_q, block_k)`` or one int for both, default 96 (the kernels then take
    the blocks for their tiles; they do for any multiples of 24 and 32).
    """
    if mask_mod is None:
        _fail(TypeError, "`mask_mod` must be a function, got None")
    B, H, Nq, Nk = (_positive(n, x) for n, x in (("B", B), ("H", H), ("Nq", Nq), ("Nk", Nk)))
    if block is None:
        block = DEFAULT_BLOCK
    elif isinstance(block, numbers.Integral):
        block = (block, block)
    if not (isinstance(block, (tuple, list)) and len(block) == 2):
        _fail(ValueError, f"`block` must be an int or (block_q, block_k), got {block!r}")
    block = (_positive("block[0]", block[0]), _positive("block[1]", block[1]))
    args = _user_functions.args_value("args", args)
    digest, jitted = _user_functions.user_function("mask_mod", mask_mod)
    _user_functions.check_compiles("mask_mod", mask_mod, jitted,
                    (types.int64,) * 4 + tuple(numba.typeof(x) for x in args), "bool")
    states = np.empty((B, H, -(-Nq // block[0]), -(-Nk // block[1])), dtype=np.int8)
    _block_states(jitted, _user.with_end(args), states, Nq, Nk, block[0], block[1])
    return BlockMask(mask_mod, args, (B, H, Nq, Nk), block, states)


@numba.njit(nogil=True, cache=False)
def _block_states(mask_mod, args, states, n_q, n_k, block_q, block_k):
    for b in range(states.shape[0]):
        for h in range(states.shape[1]):
            for i in range(states.shape[2]):
                for j in range(states.shape[3]):
                    seen = hidden = 0
                    for q in range(i * block_q, min(n_q, (i + 1) * block_q)):
                        for k in range(j * block_k, min(n_k, (j + 1) * block_k)):
                            if mask_mod(b, h, q, k, *args[:-1]):
                                seen += 1
                            else:
                                hidden += 1
                    states[b, h, i, j] = (_user.EMPTY if seen == 0 else
                                         _user.FULL if hidden == 0 else _user.PARTIAL)


# -- attention ------------------------------------------------------------------------------

def flex_attention(q, k, v, *, score_mod=None, score_args=(), mask_mod=None, mask_args=(),
                   block_mask=None, causal=False, scale=None, window=None, chunk_size=None,
                   softcap=0.0, alibi_slopes=None, bias=None, mask=None, sinks=None, layout="bhsd",
                   return_lse=False, out=None, tiles=None):
    """`cpuflash.attention` with your own score and mask functions compiled into its tiles.

    Parameters
    ----------
    q, k, v, causal, scale, window, chunk_size, softcap, alibi_slopes, bias, mask, sinks,
    layout, return_lse, out, tiles
        As in `cpuflash.attention`.
    score_mod : function, optional
        ``score_mod(score, b, h, q_idx, kv_idx, *score_args) -> new score``, torch
        FlexAttention's signature with the extra arguments appended: `b` the batch entry, `h`
        the query head, `q_idx` and `kv_idx` the row indices in the call. It runs after the
        built-in steps (scale, softcap, ALiBi, bias) and before the masks.
    score_args : tuple of arrays and numbers
        Passed to `score_mod` after the indices.
    mask_mod : function, optional
        ``mask_mod(b, h, q_idx, kv_idx, *mask_args) -> bool``: False hides the key (with the
        built-in rules: a key takes part where every rule lets it).
    mask_args : tuple of arrays and numbers
    block_mask : BlockMask, optional
        From `cpuflash.block_mask`: its empty tiles are never visited and its full ones call
        no `mask_mod`. It brings its `mask_mod` and args (give `mask_mod` too only as the same
        function). Without one, `mask_mod` is called for every score.

    Returns
    -------
    As `cpuflash.attention`.

    Notes
    -----
    Functions are compiled by Numba once per function and dtype (the kernels with them
    inlined are cached on disk); one Numba cannot compile is a TypeError naming it. Indices
    into `score_args`/`mask_args` arrays are not bounds-checked: they must be in range.
    """
    call = _validate.attention_args(
        q, k, v, causal=causal, scale=scale, window=window, chunk_size=chunk_size,
        softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks,
        layout=layout, return_lse=return_lse, out=out, tiles=tiles)
    call = _user_functions.with_user_functions(call, score_mod, score_args, mask_mod,
                                               mask_args, block_mask)
    if not (call.n_q and call.batch and call.n_heads):
        return call.result(return_lse)
    _run.forward(call, _schedule.sequence_table(call.n_q, call.n_k, call.batch))
    return call.result(return_lse)


def flex_attention_backward(dout, q, k, v, out, lse, *, score_mod=None, score_args=(),
                            mask_mod=None, mask_args=(), block_mask=None, causal=False,
                            scale=None, window=None, chunk_size=None, softcap=0.0,
                            alibi_slopes=None, bias=None,
                            mask=None, sinks=None, layout="bhsd", dq=None, dk=None, dv=None,
                            score_mod_grad=None):
    """Gradients of `flex_attention` with respect to q, k, v (and sinks).

    Takes the forward's arguments and `dout`, `out`, `lse` as `cpuflash.attention_backward`
    does. The derivative of `score_mod` by its score is found by cpuflash (forward-mode
    automatic differentiation: `score_mod` runs on dual numbers, through ``+ - * / **``,
    comparisons, ``abs``, ``min``, ``max`` and ``math.exp, log, log1p, sqrt, tanh, sin, cos``).

    score_mod_grad : function, optional
        ``score_mod_grad(dscore, score, b, h, q_idx, kv_idx, *score_args, *dscore_args)``:
        for the gradients of the float arrays in `score_args`. `score` is the mod's input and
        `dscore` the gradient of the loss by its output; it adds this score's share into
        `dscore_args` (one zeroed array per float array of `score_args`, in the compute dtype:
        float64 for float64 inputs, else float32). Its return value is not used (the gradient
        by the score comes from the dual numbers).

    Returns ``(dq, dk, dv)``, then ``dsinks`` with `sinks`, then with `score_mod_grad` the
    tuple ``dscore_args``. Each is bitwise the same for any thread count: the shares of
    `dscore_args` are summed per fixed run of query tiles, and the runs in order.
    """
    q, k, v = _validate.as_array("q", q), _validate.as_array("k", k), _validate.as_array("v", v)
    call = _validate.attention_args(
        q, k, v, causal=causal, scale=scale, window=window, chunk_size=chunk_size,
        softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks,
        layout=layout, return_lse=True)
    call = _user_functions.with_user_functions(call, score_mod, score_args, mask_mod,
                                               mask_args, block_mask)
    if score_mod is not None:
        _user_functions.check_differentiable(score_mod, call)
    grads = _validate_gradients.gradient_args(call, (q, k, v), dout, out, lse, dq, dk, dv, layout)
    seqs = _schedule.sequence_table(call.n_q, call.n_k, call.batch)
    wanted = None
    if score_mod_grad is not None:  # (checked before anything is written)
        wanted = _user_functions.score_grad_setup(call, score_mod, score_mod_grad)
    delta = _run_backward.backward(call, grads, seqs)
    result = grads.result()
    if call.sinks.size:
        result += (_run_backward.sink_gradient(call.sinks, grads.lse, delta),)
    if wanted is not None:
        result += (_run_backward.score_arg_gradients(call, grads, seqs, delta, *wanted),)
    return result
