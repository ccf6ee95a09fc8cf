"""cpuflash for JAX: attention on the CPU under `jax.jit`, `jax.grad` and `jax.vmap`.

``import cpuflash.jax`` needs jax (``pip install -e ".[jax]"``); ``import cpuflash`` alone never
imports it. Two functions:

- `attention` takes the keywords of `cpuflash.attention`;
- `dot_product_attention` is a drop-in for ``jax.nn.dot_product_attention`` with jax's semantics.

Both are XLA custom calls (``jax.ffi.ffi_call``) to one FFI target whose handler is a ctypes
function: it reads XLA's operand buffers as numpy arrays in place and lets cpuflash write the
results straight into XLA's result buffers, so nothing is copied on the way in or out
(`jax.pure_callback` copies every operand: docs/jax.md has the measurement). Gradients are a
`jax.custom_vjp` whose backward calls `cpuflash.attention_backward` the same way. Under
`jax.vmap` the mapped axes become leading axes of one cpuflash call (``vmap_method=
"expand_dims"``; an unmapped operand is broadcast to them as a stride-0 view).
"""

import functools
import math
import operator
from typing import NamedTuple

import numpy as np

try:
    import jax
    import jax.numpy as jnp
    from jax.custom_derivatives import SymbolicZero
except ImportError as exc:
    raise ImportError("cpuflash.jax needs jax (pip install -e \".[jax]\" in a cpuflash checkout, "
                      "or pip install \"jax[cpu]\"); the rest of cpuflash works without it"
                      ) from exc

from . import _jax_ffi, _keywords, _validate, api, reference

__all__ = ["attention", "dot_product_attention"]


# -- what the custom calls run, on numpy views of XLA's buffers

class _Options(NamedTuple):
    """The static part of a call: keywords, layout and which optional operands are present."""

    score: tuple  # the score keywords' slots (`_keywords.pack`), alibi_slopes an operand
    bshd: bool
    ndim: int  # of q without vmap's axes (at least 3)
    present: tuple  # (bias, mask, alibi_slopes, sinks): which are operands
    bias_grad: bool = False  # the backward computes the bias gradient


_EXTRAS = ("bias", "mask", "alibi_slopes", "sinks")


def _operands(options, arrays, others):
    """(vmap's leading shape, q, k, v, extras dict) as `cpuflash.attention` takes them: q, k, v
    broadcast to the leading shape and seen in (..., heads, rows, dim) order, and the
    ALiBi slopes spread over the leading axes. No copies: views only. `others`: the call's
    other arrays (results included), which share vmap's leading axes."""
    q, k, v, *rest = arrays
    extras = dict(zip([n for n, there in zip(_EXTRAS, options.present) if there], rest))
    n_lead = q.ndim - options.ndim
    lead = np.broadcast_shapes(*(x.shape[:n_lead] for x in list(arrays) + list(others)))
    q, k, v = (np.broadcast_to(x, lead + x.shape[n_lead:]) for x in (q, k, v))
    if options.bshd:
        q, k, v = (np.swapaxes(x, -3, -2) for x in (q, k, v))
    if "alibi_slopes" in extras:  # (lead..., 1 or core lead..., Hq) -> every leading axis
        extras["alibi_slopes"] = np.broadcast_to(extras["alibi_slopes"],
                                                 q.shape[:-3] + q.shape[-3:-2])
    return lead, q, k, v, extras


def _call_keywords(options, extras):
    return {**_keywords.unpack(options.score), **extras}


def _bhsd(options, x):
    return np.swapaxes(x, -3, -2) if options.bshd else x


def _each_example(function, options, lead, arrays, results):
    """`function` once per index of vmap's leading axes: for `sinks`, which cpuflash takes per
    head only and whose gradient must stay per example."""
    n_lead = len(lead)
    arrays = [np.broadcast_to(x, lead + x.shape[n_lead:]) for x in arrays]
    for index in np.ndindex(lead):
        function(options, [x[index] for x in arrays], [r[index] for r in results])


def _forward(options, arrays, results):
    lead, q, k, v, extras = _operands(options, arrays, results)
    if lead and "sinks" in extras:
        return _each_example(_forward, options, lead, arrays, results)
    out, lse = results
    _, lse_value = api.attention(q, k, v, return_lse=True, out=_bhsd(options, out),
                                 **_call_keywords(options, extras))
    np.copyto(lse, lse_value.reshape(lse.shape))


def _backward(options, arrays, results):
    dout, out, lse, *inputs = arrays
    lead, q, k, v, extras = _operands(options, inputs, [dout, out, lse] + results)
    if lead and "sinks" in extras:
        return _each_example(_backward, options, lead, arrays, results)
    dq, dk, dv, *rest = results
    dout, out = (np.broadcast_to(_bhsd(options, x), q.shape[:-1] + x.shape[-1:])
                 for x in (dout, out))
    lse = np.broadcast_to(lse, q.shape[:-1])
    grads = api.attention_backward(dout, q, k, v, out, lse, dq=_bhsd(options, dq),
                                   dk=_bhsd(options, dk), dv=_bhsd(options, dv),
                                   **_call_keywords(options, extras))
    if "sinks" in extras:
        np.copyto(rest.pop(0), grads[3], casting="unsafe")
    if options.bias_grad:
        _bias_gradient(options, rest.pop(0), dout, q, k, v, out, lse, extras)


def _bias_gradient(options, dbias, dout, q, k, v, out, lse, extras):
    """``dbias = dS = P (dP - delta)`` summed over the axes along which the bias broadcasts.

    The kernels do not return dS, so it is recomputed here head by head, densely in float64,
    from `reference.scores` (the oracle's score pipeline) and the forward's lse: ``Nq x Nk``
    temporaries per head, about the cost of one more forward pass.
    """
    n_heads, n_kv_heads = q.shape[-3], k.shape[-3]
    group = n_heads // n_kv_heads
    heads = q.shape[:-2]  # (leading..., Hq)
    full = heads + (q.shape[-2], k.shape[-2])
    bias = np.broadcast_to(extras["bias"], full)
    mask = extras.get("mask")
    mask = None if mask is None else np.broadcast_to(mask, full)
    alibi = extras.get("alibi_slopes")
    delta = np.einsum("...d,...d->...", dout, out, dtype=np.float64)
    acc = np.zeros(dbias.shape, dtype=np.float64)
    keep = [size > 1 for size in dbias.shape]
    keep_rows, keep_cols = keep[-2], keep[-1]
    for index in np.ndindex(heads):
        kv_index = index[:-1] + (index[-1] // group,)
        s, _ = reference.scores(
            q[index], k[kv_index], **dict(
                _keywords.unpack(options.score), bias=bias[index],
                alibi_slopes=None if alibi is None else alibi[index],
                mask=None if mask is None else mask[index]))
        row_lse = lse[index].astype(np.float64)[:, None]
        with np.errstate(invalid="ignore"):  # rows that see no key: -inf - -inf
            p = np.where(np.isneginf(s), 0.0, np.exp(s - row_lse))
        dp = dout[index].astype(np.float64) @ v[kv_index].astype(np.float64).T
        ds = p * (dp - delta[index][:, None])
        if not keep_rows:
            ds = ds.sum(axis=0, keepdims=True)
        if not keep_cols:
            ds = ds.sum(axis=1, keepdims=True)
        target = tuple(i if kept else 0 for i, kept in zip(index, keep))
        acc[target] += ds
    np.copyto(dbias, acc, casting="unsafe")


# -- the differentiable call

def _result_types(options, q, v):
    if options.bshd:
        out_shape = q.shape[:-1] + v.shape[-1:]
        lse_shape = q.shape[:-3] + (q.shape[-2], q.shape[-3])
    else:
        out_shape, lse_shape = q.shape[:-1] + v.shape[-1:], q.shape[:-1]
    lse_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    return (jax.ShapeDtypeStruct(out_shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, lse_dtype))


def _present(extras):
    return [x for x in extras if x is not None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(options, q, k, v, extras):
    return _jax_ffi.call(_forward, options, [q, k, v] + _present(extras),
                 _result_types(options, q, v))


def _attention_fwd(options, q, k, v, extras):
    bias, mask, alibi, sinks = extras
    if alibi is not None and alibi.perturbed:
        raise TypeError("`alibi_slopes` has no gradient in cpuflash.jax: differentiate with "
                        "respect to the other arguments, or pass "
                        "jax.lax.stop_gradient(alibi_slopes)")
    q, k, v = q.value, k.value, v.value
    values = tuple(None if x is None else x.value for x in extras)
    out, lse = _attention(options, q, k, v, values)
    bias_for_grad = values[0] if bias is not None and bias.perturbed else None
    return (out, lse), (q, k, v, out, lse, values, bias_for_grad)


def _attention_bwd(options, residuals, cotangents):
    q, k, v, out, lse, extras, bias_for_grad = residuals
    dout, dlse = cotangents
    if not isinstance(dlse, SymbolicZero):
        raise TypeError("the log-sum-exp of cpuflash.jax.attention carries no gradient: a loss "
                        "may use `out` only (or jax.lax.stop_gradient(lse))")
    if isinstance(dout, SymbolicZero):
        dout = jnp.zeros(out.shape, out.dtype)
    options = options._replace(bias_grad=bias_for_grad is not None)
    bias, mask, alibi, sinks = extras
    types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    if sinks is not None:
        types.append(jax.ShapeDtypeStruct(sinks.shape, sinks.dtype))
    if options.bias_grad:
        types.append(jax.ShapeDtypeStruct(bias.shape, bias.dtype))
    grads = list(_jax_ffi.call(_backward, options, [dout, out, lse, q, k, v] + _present(extras),
                               types))
    dq, dk, dv = grads[:3]
    dsinks = grads.pop(3) if sinks is not None else None
    dbias = grads[3] if options.bias_grad else None
    return dq, dk, dv, (dbias, None, None, dsinks)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


# -- the public functions

def _placeholder(x):
    """A numpy array with the shape and dtype of `x` and no memory behind it, for the checks."""
    if x is None:
        return None
    return np.broadcast_to(np.zeros((), dtype=x.dtype), x.shape)


def _with_leading_ones(x, ndim):
    if x is None or x.ndim >= ndim:
        return x
    return jnp.reshape(x, (1,) * (ndim - x.ndim) + x.shape)


def attention(q, k, v, *, causal=False, scale=None, window=None, chunk_size=None, softcap=0.0,
              alibi_slopes=None, bias=None, mask=None, sinks=None, layout="bhsd",
              return_lse=False):
    """`cpuflash.attention` for jax arrays on the CPU, under `jax.jit`, `jax.grad` and `jax.vmap`.

    Parameters
    ----------
    q, k, v : jax arrays
        As `cpuflash.attention` takes them: ``(..., Hq, Nq, D)``, ``(..., Hk, Nk, D)``,
        ``(..., Hk, Nk, Dv)`` (``(B, N, H, D)`` with ``layout="bshd"``); float32, float64,
        float16 or bfloat16.
    causal, scale, window, chunk_size, softcap, alibi_slopes, bias, mask, sinks, layout
        The keywords of `cpuflash.attention` (``causal`` aligned bottom-right, as in flash-attn;
        `dot_product_attention` has jax's top-left alignment). Static: `causal`, `scale`,
        `window`, `chunk_size`, `softcap`, `layout`.
    return_lse : bool
        Also return the log-sum-exp (float32, float64 for float64 inputs). It carries no
        gradient: differentiating a loss through it is a TypeError.

    Returns
    -------
    out : (..., Hq, Nq, Dv) array, the dtype of `q`
    lse : (..., Hq, Nq) array, only with ``return_lse=True``

    Notes
    -----
    Differentiable in `q`, `k`, `v`, `bias` and `sinks`; `mask` is boolean, and differentiating
    with respect to `alibi_slopes` is a TypeError. The gradient of `bias` (``dS``, summed over
    the axes along which it broadcasts) is computed only when a loss is differentiated with
    respect to it, densely per head (see `_bias_gradient`). A query row that sees no key gives
    0 and zero gradients.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    extras = [None if x is None else jnp.asarray(x) for x in (bias, mask, alibi_slopes, sinks)]
    # every check of cpuflash.attention, now, on arrays without memory: errors raise here
    # rather than inside XLA
    _validate.attention_args(
        *map(_placeholder, (q, k, v)), causal=causal, scale=scale, window=window,
        chunk_size=chunk_size, softcap=softcap, **dict(zip(_EXTRAS, map(_placeholder, extras))),
        layout=layout, return_lse=return_lse)
    squeeze = layout == "bhsd" and q.ndim == 2
    if squeeze:  # one head: a heads axis, so that vmap's axes are never taken for heads
        q, k, v = q[None], k[None], v[None]
    bias, mask, alibi, sinks = extras
    bias, mask = (_with_leading_ones(x, q.ndim) for x in (bias, mask))
    if alibi is not None and alibi.ndim == 1:
        alibi = _with_leading_ones(alibi, q.ndim - 2)  # (core lead..., Hq)
    options = _Options(
        score=_keywords.pack(causal=causal, scale=scale, window=window, chunk_size=chunk_size,
                             softcap=softcap),
        bshd=layout == "bshd", ndim=q.ndim,
        present=tuple(x is not None for x in (bias, mask, alibi, sinks)))
    out, lse = _attention(options, q, k, v, (bias, mask, alibi, sinks))
    if squeeze:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


class _NoCuDNNError(RuntimeError, ValueError):
    """``implementation="cudnn"`` on the CPU: a RuntimeError, as ``jax.nn.dot_product_attention``
    raises without cuDNN, and a ValueError, as cpuflash raises for an argument it cannot take."""


# What jax.nn.dot_product_attention's residual holds for a query row that sees no key: the
# log-sum-exp of its masked logits, which are all its masking constant -0.7 * (float32 max)
# (adding log(S) to it changes no bit in float32, where jax takes the log-sum-exp).
_JAX_NO_KEY_LSE = np.float32(-0.7 * np.finfo(np.float32).max)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, return_residual=False):
    """A drop-in for ``jax.nn.dot_product_attention`` on the CPU, with jax's semantics.

    Parameters
    ----------
    query : (B, T, N, H) or (T, N, H) array
    key, value : (B, S, K, H) or (S, K, H) arrays of one shape; ``N % K == 0`` (GQA/MQA: query
        head ``n`` reads key/value head ``n // (N // K)``)
    bias : float array broadcastable to (B, N, T, S), optional
        Added to the logits; differentiable (its gradient sums over its broadcast axes).
    mask : bool array broadcastable to (B, N, T, S), optional
        True means the key takes part.
    scale : float, optional
        Default ``1 / sqrt(H)``.
    is_causal : bool
        Aligned top-left, as in jax: query ``i`` sees key ``j <= i``. For ``T = 3``, ``S = 5``
        (``x`` = visible)::

            x . . . .
            x x . . .
            x x x . .

    query_seq_lengths, key_value_seq_lengths : (B,) int arrays, optional
        Query rows ``i >= query_seq_lengths[b]`` give 0; keys ``j >= key_value_seq_lengths[b]``
        take no part.
    local_window_size : int or (left, right), optional
        Query ``i`` sees keys ``i - left <= j <= i + right`` (an int is symmetric).
    implementation : None, "xla" or "cudnn"
        jax's choice of backend. None and "xla" give jax's XLA semantics, which this function
        computes with cpuflash's kernels. "cudnn" asks for cuDNN's GPU kernel, which a CPU does
        not have: it raises an error that is a RuntimeError (what jax raises on a machine
        without cuDNN) and a ValueError. Anything else is a ValueError, as in jax.
    return_residual : bool
        Also return the log-sum-exp of each query row's logits (``scale * q k^T + bias``,
        natural log), as jax does.

    Returns
    -------
    out : array shaped like `query`, the dtype of `query`
    residual : (B, T, N) or (T, N) array, the dtype of `query`, only with ``return_residual``
        The log-sum-exp, as ``jax.nn.dot_product_attention`` returns it; it carries no gradient
        (jax stops it too).

    Notes
    -----
    One difference from jax: a query row that sees no key at all (every key masked) gives 0
    and zero gradients here, where ``jax.nn.dot_product_attention`` gives the mean of the
    values (its masked logits are a large negative number, not -inf). The residual of such a
    row, and of a padding row ``i >= query_seq_lengths[b]``, is jax's: the log-sum-exp of
    logits that are all jax's masking constant, ``-0.7 * float32 max`` (about -2.4e38; -inf in
    float16), not cpuflash's -inf, so that code which combines residuals sees the numbers it
    sees from jax. Masks that cpuflash's bottom-right window can express (the rules above
    with ``T == S``, and most with ``T != S``) cost no memory; the others become an explicit
    (T, S) mask. float16 and bfloat16 are computed with float32 accumulation, as jax does.
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    shape = query.shape
    if query.ndim not in (3, 4) or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(f"`query`, `key` and `value` must all be (B, T, N, H) or all (T, N, H), "
                         f"got shapes {query.shape}, {key.shape} and {value.shape}")
    if value.shape != key.shape:
        raise ValueError(f"`value` must have the shape of `key` {key.shape}, got {value.shape}")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"`query`, `key` and `value` must have one dtype, got {query.dtype}, "
                        f"{key.dtype} and {value.dtype}")
    if query.ndim == 3:
        query, key, value = query[None], key[None], value[None]
    batch, n_q, n_heads, head_dim = query.shape
    _, n_k, n_kv_heads, _ = key.shape
    if query.shape[0] != key.shape[0] or query.shape[-1] != key.shape[-1]:
        raise ValueError(f"`query` {shape} and `key` {key.shape} must have the same batch size "
                         f"and head dim")
    if n_heads % n_kv_heads:
        raise ValueError(f"the number of query heads ({n_heads}) must be a multiple of the "
                         f"number of key/value heads ({n_kv_heads})")
    for name, x in (("bias", bias), ("mask", mask)):
        if x is not None and jnp.ndim(x) > 4:
            raise ValueError(f"`{name}` must have at most 4 dims (B, N, T, S), got shape "
                             f"{jnp.shape(x)}")
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(f"`mask` must be boolean (True = the key takes part; an additive "
                            f"mask is a `bias`), got dtype {mask.dtype}")
    lengths = {}
    for name, x in (("query_seq_lengths", query_seq_lengths),
                    ("key_value_seq_lengths", key_value_seq_lengths)):
        if x is not None:
            x = jnp.asarray(x)
            if x.shape != (batch,) or not jnp.issubdtype(x.dtype, jnp.integer):
                raise ValueError(f"`{name}` must be an int array of shape ({batch},), got "
                                 f"{x.dtype} {x.shape}")
        lengths[name] = x
    if implementation == "cudnn":
        raise _NoCuDNNError(
            "`implementation` 'cudnn' asks for cuDNN's GPU kernel, which cpuflash on the CPU "
            "is not (jax.nn.dot_product_attention raises RuntimeError 'cuDNN is not detected.' "
            "here too): pass implementation=None or 'xla', whose results cpuflash computes")
    if implementation not in (None, "xla"):
        raise ValueError(f"`implementation` must be None, 'xla' or 'cudnn', got "
                         f"{implementation!r}")
    window, visible = _visibility(is_causal, local_window_size, n_q, n_k)
    if visible is not None:
        mask = visible if mask is None else jnp.logical_and(mask, visible)
    kv_lengths = lengths["key_value_seq_lengths"]
    if kv_lengths is not None:
        filled = jnp.arange(n_k)[None, None, None, :] < kv_lengths[:, None, None, None]
        mask = filled if mask is None else jnp.logical_and(mask, filled)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    result = attention(query, key, value, scale=scale, window=window, bias=bias, mask=mask,
                       layout="bshd", return_lse=return_residual)
    out, lse = result if return_residual else (result, None)
    q_lengths = lengths["query_seq_lengths"]
    if q_lengths is not None:  # padding rows give 0, as jax gives
        rows = jnp.arange(n_q)[None, :, None, None] < q_lengths[:, None, None, None]
        out = jnp.where(rows, out, jnp.zeros((), out.dtype))
    out = jnp.reshape(out, shape)
    if not return_residual:
        return out
    residual = jnp.swapaxes(jax.lax.stop_gradient(lse), 1, 2)  # (B, N, T) -> jax's (B, T, N)
    no_key = jnp.isneginf(residual)
    if q_lengths is not None:
        no_key = no_key | (jnp.arange(n_q)[None, :, None] >= q_lengths[:, None, None])
    residual = jnp.where(no_key, _JAX_NO_KEY_LSE.astype(residual.dtype), residual)
    return out, jnp.reshape(residual.astype(query.dtype), shape[:-1])


def _integer(x):
    if isinstance(x, (bool, np.bool_)):
        raise TypeError
    return operator.index(x)


def _visibility(is_causal, local_window_size, n_q, n_k):
    """jax's top-left `is_causal` and `local_window_size` as cpuflash's bottom-right window
    when it can say the same, else as an explicit (T, S) mask: ``(window, visible)``."""
    left = right = None
    if local_window_size is not None:
        if isinstance(local_window_size, (int, np.integer)):
            local_window_size = (local_window_size, local_window_size)
        try:
            left, right = (_integer(side) for side in local_window_size)
        except (TypeError, ValueError):
            raise ValueError(f"`local_window_size` must be an int or a pair of ints (left, "
                             f"right), got {local_window_size!r}") from None
    if is_causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return None, None
    shift = n_k - n_q  # cpuflash's query i sits over key i + shift; jax's over key i
    window_left = -1 if left is None else left + shift
    window_right = -1 if right is None else right - shift
    if (left is None or window_left >= 0) and (right is None or window_right >= 0):
        return (window_left, window_right), None
    rows, cols = jnp.arange(n_q)[:, None], jnp.arange(n_k)[None, :]
    visible = jnp.ones((n_q, n_k), dtype=bool)
    if left is not None:
        visible = visible & (cols >= rows - left)
    if right is not None:
        visible = visible & (cols <= rows + right)
    return None, visible
