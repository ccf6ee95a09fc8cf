"""The attention backward's public functions: argument handling and docstrings.

The forward's validation (`_validate.attention_args`) reads q, k, v and the modifiers,
`_validate_gradients` what only the backward takes (`dout`, `out`, `lse` and the optional `dq`,
`dk`, `dv`); `_run_backward` runs the kernel and finds the sinks' gradient.
"""

import numpy as np

from . import _plans, _run_backward, _schedule, _sparse, _validate, _validate_gradients

__all__ = ["attention_backward", "attention_varlen_backward"]


def attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, window=None,
                       chunk_size=None, softcap=0.0, alibi_slopes=None, bias=None, mask=None,
                       sinks=None, layout="bhsd", dq=None, dk=None, dv=None, key_indices=None):
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
    causal, scale, window, chunk_size, softcap, alibi_slopes, bias, mask, sinks, layout
        The forward's keywords, unchanged. `alibi_slopes`, `bias` and `mask` are constants (no
        gradient).
    dq, dk, dv : arrays, optional
        Where to write the gradients (the shapes and dtypes of q, k, v); returned.
    key_indices : int array, optional
        The forward's listed keys (`cpuflash.attention`): only they get gradients.

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
    if (alibi_slopes is None and bias is None and mask is None and sinks is None
            and key_indices is None):
        key = _run_backward.plan_key(dout, q, k, v, out, lse, causal, scale, window,
                                     chunk_size, softcap, layout)
        setup = _plans.get(key) if key is not None else None
        if setup is not None:
            result = _run_backward.backward_again(setup, dout, q, k, v, out, lse, dq, dk, dv)
            if result is not None:
                return result
    call = _validate.attention_args(
        q, k, v, causal=causal, scale=scale, window=window, chunk_size=chunk_size,
        softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks,
        layout=layout, return_lse=True)
    grads = _validate_gradients.gradient_args(call, (q, k, v), dout, out, lse, dq, dk, dv, layout)
    if key_indices is not None:
        listed = _validate.key_indices_value(
            key_indices, call, np.full(call.batch, call.n_k),
            dict(alibi_slopes=alibi_slopes, bias=bias, mask=mask))
        return _run_backward.result(call, grads, _sparse.backward(call, grads, listed))
    return _run_backward.run(call, grads, layout, key if q.ndim == 4 else None)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *,
                              causal=False, scale=None, window=None, chunk_size=None,
                              softcap=0.0, alibi_slopes=None):
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
    causal, scale, window, chunk_size, softcap, alibi_slopes
        The forward's keywords, unchanged.

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtypes of q, k, v

    Each sequence's gradients are those of `attention_backward` on that sequence alone.
    """
    q, k, v = _validate.as_array("q", q), _validate.as_array("k", k), _validate.as_array("v", v)
    call = _validate.varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal,
                                 scale=scale, window=window, chunk_size=chunk_size,
                                 softcap=softcap, alibi_slopes=alibi_slopes, return_lse=True)
    grads = _validate_gradients.gradient_args(call, (q, k, v), dout, out, lse, None, None, None,
                                              "thd")
    _run_backward.backward(call, grads, _schedule.varlen_table(call.cu_q, call.cu_k))
    return grads.result()


