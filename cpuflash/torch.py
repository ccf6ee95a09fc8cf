"""cpuflash for torch: differentiable attention on CPU tensors, as torch custom operators.

``import cpuflash.torch`` needs torch (``pip install -e ".[torch]"`` in a clone); ``import
cpuflash`` alone never imports it. Two operators are registered with `torch.library`:

- ``cpuflash::attention`` returns ``(out, lse)``;
- ``cpuflash::attention_backward`` returns ``(dq, dk, dv, dsinks)``;

each with a fake (meta) implementation, so they trace under `torch.compile`, and the forward
with an autograd formula that calls the backward operator. Tensors reach the kernels as numpy
views of torch's memory (bfloat16 through an int16 view read as ``ml_dtypes.bfloat16``) and the
results are written straight into tensors torch allocated: nothing is copied on the way.

`attention` takes the keywords of `cpuflash.attention`; `scaled_dot_product_attention` is a
drop-in for ``torch.nn.functional.scaled_dot_product_attention`` with torch's own semantics.
"""

import math
from typing import Optional

import numpy as np

from . import _extras, api

try:
    import torch
except ImportError as exc:
    raise _extras.missing("cpuflash.torch", "torch", "torch") from exc

__all__ = ["attention", "scaled_dot_product_attention"]

Tensor = torch.Tensor


def _as_numpy(t):
    """A numpy view of the CPU tensor `t` (no copy); None stays None."""
    if t is None:
        return None
    t = t.detach()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: read the bits as ml_dtypes' type
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("bfloat16 tensors need the `ml_dtypes` package "
                            "(pip install ml_dtypes)") from None
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _lse_meta(q, layout):
    """Shape and dtype of the forward's log-sum-exp for `q`."""
    shape = (q.shape[0], q.shape[2], q.shape[1]) if layout == "bshd" else q.shape[:-1]
    return shape, (torch.float64 if q.dtype == torch.float64 else torch.float32)


def _keywords(causal, scale, window_left, window_right, softcap, alibi_slopes, bias, mask,
              sinks, layout):
    """The keywords of `cpuflash.attention` / `attention_backward`, as numpy views."""
    window = None if (window_left, window_right) == (-1, -1) else (window_left, window_right)
    return dict(causal=causal, scale=scale, window=window, softcap=softcap,
                alibi_slopes=_as_numpy(alibi_slopes), bias=_as_numpy(bias),
                mask=_as_numpy(mask), sinks=_as_numpy(sinks), layout=layout)


# -- the forward operator

@torch.library.custom_op("cpuflash::attention", mutates_args=(), device_types="cpu")
def _attention_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float],
                  window_left: int, window_right: int, softcap: float,
                  alibi_slopes: Optional[Tensor], bias: Optional[Tensor], mask: Optional[Tensor],
                  sinks: Optional[Tensor], layout: str) -> tuple[Tensor, Tensor]:
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])
    _, lse = api.attention(
        _as_numpy(q), _as_numpy(k), _as_numpy(v), return_lse=True, out=_as_numpy(out),
        **_keywords(causal, scale, window_left, window_right, softcap, alibi_slopes, bias, mask,
                    sinks, layout))
    return out, torch.from_numpy(np.ascontiguousarray(lse))


@_attention_op.register_fake
def _(q, k, v, causal, scale, window_left, window_right, softcap, alibi_slopes, bias, mask,
      sinks, layout):
    shape, dtype = _lse_meta(q, layout)
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty(shape, dtype=dtype)


# -- the backward operator

@torch.library.custom_op("cpuflash::attention_backward", mutates_args=(), device_types="cpu")
def _attention_backward_op(
        dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
        scale: Optional[float], window_left: int, window_right: int, softcap: float,
        alibi_slopes: Optional[Tensor], bias: Optional[Tensor], mask: Optional[Tensor],
        sinks: Optional[Tensor], layout: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    result = api.attention_backward(
        _as_numpy(dout), _as_numpy(q), _as_numpy(k), _as_numpy(v), _as_numpy(out),
        _as_numpy(lse), dq=_as_numpy(dq), dk=_as_numpy(dk), dv=_as_numpy(dv),
        **_keywords(causal, scale, window_left, window_right, softcap, alibi_slopes, bias, mask,
                    sinks, layout))
    if sinks is None:
        dsinks = q.new_empty(0, dtype=torch.float32)
    else:  # float32 from the kernels; the gradient takes the parameter's dtype
        dsinks = torch.from_numpy(result[3]).to(sinks.dtype)
    return dq, dk, dv, dsinks


@_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, causal, scale, window_left, window_right, softcap, alibi_slopes,
      bias, mask, sinks, layout):
    dsinks = q.new_empty(0, dtype=torch.float32) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


# -- autograd: q, k, v and sinks are differentiable; lse, slopes, bias and mask are not

def _setup_context(ctx, inputs, output):
    (q, k, v, causal, scale, window_left, window_right, softcap, alibi_slopes, bias, mask,
     sinks, layout) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, bias, mask, sinks)
    ctx.options = (causal, scale, window_left, window_right, softcap)
    ctx.layout = layout
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, alibi_slopes, bias, mask, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.cpuflash.attention_backward(
        dout, q, k, v, out, lse, *ctx.options, alibi_slopes, bias, mask, sinks, ctx.layout)
    return (dq, dk, dv, None, None, None, None, None, None, None, None,
            dsinks if sinks is not None else None, None)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


# -- the public functions

def _check_cpu(**tensors):
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"`{name}` is on device {t.device}, but cpuflash runs on the CPU "
                             f"only: pass CPU tensors (`{name}.cpu()`)")


def _tensor_or_none(x):
    return x if x is None or isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None,
              bias=None, mask=None, sinks=None, layout="bhsd", return_lse=False):
    """`cpuflash.attention` for CPU torch tensors, differentiable in q, k, v and sinks.

    Parameters
    ----------
    q, k, v : CPU tensors
        As `cpuflash.attention` takes them: ``(..., Hq, Nq, D)``, ``(..., Hk, Nk, D)``,
        ``(..., Hk, Nk, Dv)`` (``(B, N, H, D)`` with ``layout="bshd"``); float32, float64,
        float16 or bfloat16.
    causal, scale, window, softcap, alibi_slopes, bias, mask, sinks, layout
        The keywords of `cpuflash.attention` (``causal`` aligned bottom-right, as in flash-attn).
        `alibi_slopes`, `bias` and `mask` are constants (no gradient); `sinks` gets one.
    return_lse : bool
        Also return the log-sum-exp (float32, float64 for float64 inputs). It carries no
        gradient: a loss that uses it is not differentiated through it.

    Returns
    -------
    out : tensor (..., Hq, Nq, Dv), the dtype of `q`
    lse : tensor (..., Hq, Nq), only with ``return_lse=True``
    """
    alibi_slopes, bias, mask, sinks = map(_tensor_or_none, (alibi_slopes, bias, mask, sinks))
    _check_cpu(q=q, k=k, v=v, alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks)
    if window is None:
        left, right = -1, -1
    else:
        try:
            left, right = (int(side) for side in window)
        except (TypeError, ValueError):
            raise ValueError(f"`window` must be a pair of ints (left, right), each >= -1, got "
                             f"{window!r}") from None
    if scale is not None:
        scale = float(scale)
    out, lse = torch.ops.cpuflash.attention(q, k, v, bool(causal), scale, left, right,
                                            float(softcap), alibi_slopes, bias, mask, sinks,
                                            layout)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors.

    Torch's semantics throughout: `is_causal` aligns the diagonal top-left (query ``i`` sees
    key ``j <= i``) and combines with `attn_mask`; a bool `attn_mask` selects the keys that
    take part (True), a float one is added to the scores; key/value heads fewer than the query
    heads need ``enable_gqa=True`` (one key/value head broadcasts, as in torch); leading
    (batch) axes broadcast. A query row that sees no key gives 0 and zero gradients, as torch
    2.13 gives. Differentiable in query, key and value.

    Parameters
    ----------
    query : (..., Hq, L, E) tensor
    key : (..., Hk, S, E) tensor
    value : (..., Hk, S, Ev) tensor
    attn_mask : bool or float tensor broadcastable to (..., Hq, L, S), optional
    dropout_p : float
        Must be 0: cpuflash has no dropout (a ValueError otherwise).
    is_causal : bool
    scale : float, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool

    Returns
    -------
    (..., Hq, L, Ev) tensor, the dtype of `query`
    """
    if dropout_p != 0.0:
        raise ValueError(f"`dropout_p` must be 0 (cpuflash has no dropout), got {dropout_p}")
    _check_cpu(query=query, key=key, value=value, attn_mask=attn_mask)
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(f"`query`, `key` and `value` must have the same number of axes (>= 2), "
                         f"got shapes {tuple(query.shape)}, {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    if query.dim() >= 3:
        heads_q, heads_k = query.shape[-3], key.shape[-3]
        if heads_q != heads_k and heads_k != 1 and not enable_gqa:
            raise ValueError(f"`query` has {heads_q} heads but `key` has {heads_k}: different "
                             f"head counts need enable_gqa=True (as in torch)")
        if heads_k == 1 or enable_gqa:
            heads_k_out = heads_k
        else:
            heads_k_out = heads_q
        lead = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
        query = query.expand(*lead, heads_q, *query.shape[-2:])
        key = key.expand(*lead, heads_k_out, *key.shape[-2:])
        value = value.expand(*lead, heads_k_out, *value.shape[-2:])
    n_q, n_k = query.shape[-2], key.shape[-2]
    keywords = {}
    mask = bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = attn_mask
        else:
            bias = attn_mask.to(query.dtype)
    if is_causal:
        if n_q == n_k:  # top-left and bottom-right alignments agree
            keywords["causal"] = True
        elif n_q > n_k:  # j <= i is j <= i + (n_k - n_q) + right with right = n_q - n_k
            keywords["window"] = (-1, n_q - n_k)
        else:  # right would be negative, which a window cannot express: an explicit mask
            tri = torch.ones(n_q, n_k, dtype=torch.bool).tril()
            mask = tri if mask is None else mask & tri
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    return attention(query, key, value, scale=scale, bias=bias, mask=mask, **keywords)
