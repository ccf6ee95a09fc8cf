"""cpuflash for torch: differentiable attention on CPU tensors, as torch custom operators.

``import cpuflash.torch`` needs torch (``pip install -e ".[torch]"`` in a clone); ``import
cpuflash`` alone never imports it. Two operators are registered with `torch.library`:

- ``cpuflash::attention`` returns ``(out, lse)``;
- ``cpuflash::attention_backward`` returns ``(dq, dk, dv, dsinks)``;

each with a fake (meta) implementation, so they trace under `torch.compile`, and the forward
with an autograd formula that calls the backward operator. Eager calls run the same functions
through a `torch.autograd.Function` instead (`_EagerAttention`), which skips the operators'
dispatch: it cost more than a small model's kernels. Tensors reach the kernels as numpy
views of torch's memory (bfloat16 through an int16 view read as ``ml_dtypes.bfloat16``) and the
results are written straight into tensors torch allocated: nothing is copied on the way.

`attention` takes the keywords of `cpuflash.attention`; `scaled_dot_product_attention` is a
drop-in for ``torch.nn.functional.scaled_dot_product_attention`` with torch's own semantics.
`flex_attention` and `create_block_mask` take the arguments of torch's FlexAttention functions;
they carry Python functions, which no operator schema can, so their gradients go through a
`torch.autograd.Function` instead of an operator.
"""

import math

import numpy as np

from . import _call, _extras, _keywords, api, flex

try:
    import torch
except ImportError as exc:
    raise _extras.missing("cpuflash.torch", "torch", "torch") from exc

__all__ = ["attention", "scaled_dot_product_attention", "flex_attention", "create_block_mask"]

Tensor = torch.Tensor


def _as_numpy(t):
    """A numpy view of the CPU tensor `t` (no copy); None stays None."""
    if t is None:
        return None
    if t.requires_grad:  # (`detach` costs a third of a plain tensor's view)
        t = t.detach()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: read the bits as ml_dtypes' type
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("bfloat16 tensors need the `ml_dtypes` package "
                            "(pip install ml_dtypes)") from None
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _as_tensor(a):
    """A CPU tensor sharing the memory of the numpy array `a` (the inverse of `_as_numpy`)."""
    if _call._is_bfloat16(a.dtype):  # ml_dtypes' type: hand torch the bits
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _lse_meta(q, layout):
    """Shape and dtype of the forward's log-sum-exp for `q`."""
    shape = (q.shape[0], q.shape[2], q.shape[1]) if layout == "bshd" else q.shape[:-1]
    return shape, (torch.float64 if q.dtype == torch.float64 else torch.float32)


def _score_keywords(slots):
    """The score keywords of `cpuflash.attention`, from an operator's score slots (tensors as
    numpy views)."""
    keywords = _keywords.unpack(slots)
    keywords["alibi_slopes"] = _as_numpy(keywords["alibi_slopes"])
    return keywords


# An operator's arguments: its tensors, then `_keywords.N_SLOTS` score slots, then the rest of
# `cpuflash.attention`'s keywords. The score slots come from `_keywords` (schema fragment and
# conversions), so a new score keyword needs no change here.
_REST = ("bias", "mask", "sinks", "layout")
_SINKS = _keywords.N_SLOTS + _REST.index("sinks")  # the position among the options


def _options(options):
    """The keywords of `cpuflash.attention` / `attention_backward` from an operator's options
    (score slots, then `_REST`), as numpy views."""
    n = _keywords.N_SLOTS
    bias, mask, sinks, layout = options[n:]
    return dict(_score_keywords(options[:n]), bias=_as_numpy(bias), mask=_as_numpy(mask),
                sinks=_as_numpy(sinks), layout=layout)


# -- the forward operator

def _forward(q, k, v, *options):
    """The forward's work, shared by the operator and the eager path: (out, lse) tensors."""
    # (a tuple: slicing a torch.Size costs more; measured: docs/history.md, "Per-call cost",
    # small calls)
    out = q.new_empty(tuple(q.shape)[:-1] + (v.shape[-1],))
    _, lse = api.attention(_as_numpy(q), _as_numpy(k), _as_numpy(v), return_lse=True,
                           out=_as_numpy(out), **_options(options))
    return out, torch.from_numpy(np.ascontiguousarray(lse))


_OPTIONS_SCHEMA = f"{_keywords.SCHEMA}, Tensor? bias, Tensor? mask, Tensor? sinks, str layout"
_attention_op = torch.library.custom_op(
    "cpuflash::attention", _forward, mutates_args=(), device_types="cpu",
    schema=f"(Tensor q, Tensor k, Tensor v, {_OPTIONS_SCHEMA}) -> (Tensor, Tensor)")


@_attention_op.register_fake
def _(q, k, v, *options):
    shape, dtype = _lse_meta(q, options[-1])
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty(shape, dtype=dtype)


# -- the backward operator

def _gradients(dout, q, k, v, out, lse, *options):
    """The backward's work, shared by the operator and the eager path: (dq, dk, dv, dsinks),
    dsinks None without sinks."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    result = api.attention_backward(
        _as_numpy(dout), _as_numpy(q), _as_numpy(k), _as_numpy(v), _as_numpy(out),
        _as_numpy(lse), dq=_as_numpy(dq), dk=_as_numpy(dk), dv=_as_numpy(dv),
        **_options(options))
    sinks = options[_SINKS]
    if sinks is None:
        return dq, dk, dv, None
    # float32 from the kernels; the gradient takes the parameter's dtype
    return dq, dk, dv, torch.from_numpy(result[3]).to(sinks.dtype)


def _backward_op_function(dout, q, k, v, out, lse, *options):
    dq, dk, dv, dsinks = _gradients(dout, q, k, v, out, lse, *options)
    if dsinks is None:  # (an operator returns tensors)
        dsinks = q.new_empty(0, dtype=torch.float32)
    return dq, dk, dv, dsinks


_attention_backward_op = torch.library.custom_op(
    "cpuflash::attention_backward", _backward_op_function, mutates_args=(), device_types="cpu",
    schema=f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
           f"{_OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)")


@_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, *options):
    sinks = options[_SINKS]
    dsinks = q.new_empty(0, dtype=torch.float32) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


# -- autograd: q, k, v and sinks are differentiable; lse, slopes, bias and mask are not

def _save(ctx, tensors, options):
    """Keep `tensors` and the tensors among `options` for the backward (`_saved`)."""
    held = [i for i, x in enumerate(options) if isinstance(x, Tensor)]
    ctx.save_for_backward(*tensors, *(options[i] for i in held))
    ctx.options = tuple(None if i in held else x for i, x in enumerate(options))
    ctx.held = held


def _saved(ctx):
    """(the `tensors` given to `_save`, its `options`), from `ctx`."""
    saved = ctx.saved_tensors
    n = len(saved) - len(ctx.held)
    options = list(ctx.options)
    for i, t in zip(ctx.held, saved[n:]):
        options[i] = t
    return saved[:n], options


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    _save(ctx, (q, k, v, out, lse), options)
    ctx.mark_non_differentiable(lse)


def _backward_through(gradients):
    """The operator's autograd backward, its gradients from `gradients`: the backward operator,
    or on the eager path the function the operator runs."""
    def backward(ctx, dout, _dlse):
        (q, k, v, out, lse), options = _saved(ctx)
        dq, dk, dv, dsinks = gradients(dout, q, k, v, out, lse, *options)
        grads = [None] * len(options)
        if options[_SINKS] is not None:
            grads[_SINKS] = dsinks
        return (dq, dk, dv, *grads)
    return backward


_attention_op.register_autograd(_backward_through(torch.ops.cpuflash.attention_backward),
                                setup_context=_setup_context)


def _eager_function(name, forward, setup_context, backward):
    """A `torch.autograd.Function` that runs an operator's `forward` and `setup_context` (as
    registered with torch.library) and ``backward(ctx, *grads)``, for eager calls.

    At a small model's layer (B16 H4 N64 D16 causal) the operators' dispatch costs about as
    much as the kernels, and this way costs a third less outside them (measured:
    docs/history.md, "Per-call cost", torch's operator dispatch). Same functions, same
    bits; the operators stay for `torch.compile`, `torch.export` and functorch's transforms.
    """
    # (the `forward(ctx, ...)` form: `setup_context` as a staticmethod of its own costs more,
    # measured there)
    def run(ctx, *inputs):
        output = forward(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(run),
        "backward": staticmethod(torch.autograd.function.once_differentiable(backward))})


_EagerAttention = _eager_function("_EagerAttention", _forward, _setup_context,
                                  _backward_through(_gradients))


def _eager(*tensors):
    """Whether a call on `tensors` (None allowed) may skip the operator: plain tensors, not
    traced by `torch.compile` or `torch.export`, outside functorch's transforms."""
    return (not torch.compiler.is_compiling()
            and not torch._C._are_functorch_transforms_active()
            and all(t is None or type(t) is Tensor for t in tensors))


# the options that are tensors (alibi_slopes, bias, mask, sinks): one slice, read per call
_TENSORS = slice(_keywords.SLOT_NAMES.index("alibi_slopes"), _SINKS + 1)
assert _keywords.SLOT_NAMES[_TENSORS.start:] + _REST[:3] == ("alibi_slopes",) + _REST[:3]


def _run_attention(q, k, v, *options):
    """``torch.ops.cpuflash.attention(q, k, v, *options)``, or its eager path (`_eager`)."""
    if not _eager(q, k, v, *options[_TENSORS]):
        return torch.ops.cpuflash.attention(q, k, v, *options)
    sinks = options[_SINKS]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or sinks is not None and sinks.requires_grad):
        return _EagerAttention.apply(q, k, v, *options)
    return _forward(q, k, v, *options)


# -- the public functions

def _check_cpu(**tensors):
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch tensor, got {type(t).__name__}")
        # (`is_cpu`: `t.device` costs a noticeable share of a small call's adapter; measured:
        # docs/history.md, "Per-call cost", small calls)
        if not t.is_cpu:
            raise ValueError(f"`{name}` is on device {t.device}, but cpuflash runs on the CPU "
                             f"only: pass CPU tensors (`{name}.cpu()`)")


def _tensor_or_none(x):
    return x if x is None or isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))


def attention(q, k, v, *, causal=False, scale=None, window=None, chunk_size=None, softcap=0.0,
              alibi_slopes=None, bias=None, mask=None, sinks=None, layout="bhsd",
              return_lse=False):
    """`cpuflash.attention` for CPU torch tensors, differentiable in q, k, v and sinks.

    Parameters
    ----------
    q, k, v : CPU tensors
        As `cpuflash.attention` takes them: ``(..., Hq, Nq, D)``, ``(..., Hk, Nk, D)``,
        ``(..., Hk, Nk, Dv)`` (``(B, N, H, D)`` with ``layout="bshd"``); float32, float64,
        float16 or bfloat16.
    causal, scale, window, chunk_size, softcap, alibi_slopes, bias, mask, sinks, layout
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
    score = _keywords.pack(causal=causal, scale=scale, window=window, chunk_size=chunk_size,
                           softcap=softcap, alibi_slopes=alibi_slopes)
    out, lse = _run_attention(q, k, v, *score, bias, mask, sinks, layout)
    return (out, lse) if return_lse else out


# torch 2.14 refuses an `attn_mask` with `is_causal=True`; 2.13 applied both. The drop-in does
# what the torch it runs with does.
MASK_WITH_CAUSAL = torch.__version__ < (2, 14)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors.

    The semantics of the torch it runs with: `is_causal` aligns the diagonal top-left (query
    ``i`` sees key ``j <= i``); a bool `attn_mask` selects the keys that take part (True), a
    float one (float32 or the dtype of `query`) is added to the scores; with both, torch 2.13
    applies both and torch 2.14 refuses them (a ValueError here). Leading axes, heads included,
    broadcast as torch broadcasts them (a 4-D query with 3-D or 2-D key and value, say); key and
    value heads that divide the query heads need ``enable_gqa=True``. A query row that sees no
    key gives 0 and zero gradients, as torch 2.13 and 2.14 give. Differentiable in query, key
    and value.

    Parameters
    ----------
    query : (..., Hq, L, E) tensor, at least 2-D
    key : (..., Hk, S, E) tensor, at least 2-D (at least 3-D with `enable_gqa`)
    value : (..., Hk, S, Ev) tensor, likewise
    attn_mask : bool or float tensor broadcastable to (..., Hq, L, S), optional
    dropout_p : float
        Must be 0: cpuflash has no dropout (a ValueError otherwise).
    is_causal : bool
    scale : float, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool

    Returns
    -------
    (..., Hq, L, Ev) tensor, the dtype of `query`; its leading axes are those of the inputs
    broadcast together
    """
    if dropout_p != 0.0:
        raise ValueError(f"`dropout_p` must be 0 (cpuflash has no dropout), got {dropout_p}")
    _check_cpu(query=query, key=key, value=value, attn_mask=attn_mask)
    if is_causal and attn_mask is not None and not MASK_WITH_CAUSAL:
        raise ValueError(f"`attn_mask` must be None when is_causal=True: torch "
                         f"{torch.__version__} refuses both (2.13 applied both); fold the causal "
                         f"mask into it (`attn_mask & torch.ones(L, S, dtype=torch.bool).tril()`)")
    out_dims = max(query.dim(), key.dim(), value.dim())
    query, key, value = _broadcast_heads(query, key, value, enable_gqa)
    n_q, n_k = query.shape[-2], key.shape[-2]
    causal, right = False, -1
    mask = bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = attn_mask
        elif attn_mask.dtype in (torch.float32, query.dtype):  # widened as the inputs are
            bias = attn_mask
        else:
            raise TypeError(f"`attn_mask` must be bool, float32 or the dtype of `query` "
                            f"({query.dtype}), as in torch, got {attn_mask.dtype}")
    if is_causal:
        if n_q == n_k:  # top-left and bottom-right alignments agree
            causal = True
        elif n_q > n_k:  # j <= i is j <= i + (n_k - n_q) + right with right = n_q - n_k
            right = n_q - n_k
        else:  # right would be negative, which a window cannot express: an explicit mask
            tri = torch.ones(n_q, n_k, dtype=torch.bool, device=query.device).tril()
            mask = tri if mask is None else mask & tri
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    # (`attention` without its checks, which the ones above cover)
    score = _keywords.pack(causal=causal, scale=scale, window=(-1, right))
    out, _ = _run_attention(query, key, value, *score, bias, mask, None, "bhsd")
    return out[0] if out_dims == 2 else out  # 2-D inputs were given a head axis


def _broadcast_heads(query, key, value, enable_gqa):
    """Views of query, key, value with one set of leading axes, as `attention` takes them.

    torch broadcasts every axis but the last two, the heads included; with `enable_gqa` the
    key/value heads of a group are repeated instead. Key/value heads stay fewer than the query
    heads wherever one count serves both (GQA and MQA run without repeating them).
    """
    q_shape, k_shape, v_shape = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    if (len(q_shape) == len(k_shape) == len(v_shape) == 4 and q_shape[0] == k_shape[0] == v_shape[0]
            and k_shape[1] == v_shape[1]
            and (q_shape[1] == k_shape[1] or enable_gqa and q_shape[1] % k_shape[1] == 0)):
        return query, key, value  # (B, H, N, D) each, heads equal or grouped: as they are
    tensors = {"query": query, "key": key, "value": value}
    for name, t in tensors.items():
        if t.dim() < 2:
            raise ValueError(f"`{name}` must have at least 2 axes (..., sequence, features), "
                             f"got shape {tuple(t.shape)}")
    def shapes():  # for the messages only: formatting costs a small call's time
        return ", ".join(f"`{name}` {tuple(t.shape)}" for name, t in tensors.items())

    if enable_gqa and min(key.dim(), value.dim()) < 3:
        raise ValueError(f"enable_gqa=True needs a heads axis in `key` and `value` (as in "
                         f"torch), got {shapes()}")
    query, key, value = (t if t.dim() >= 3 else t[None] for t in (query, key, value))
    heads_q, heads_k, heads_v = query.shape[-3], key.shape[-3], value.shape[-3]
    if enable_gqa:
        if heads_q % heads_k or heads_q % heads_v:
            raise ValueError(f"with enable_gqa=True the heads of `key` and `value` must divide "
                             f"those of `query`, got {shapes()}")
        if heads_k != heads_v:  # one count for both: the larger, or all query heads
            heads_kv = max(heads_k, heads_v) if min(heads_k, heads_v) == 1 else heads_q
            key, value = (t if t.shape[-3] == heads_kv else
                          t.repeat_interleave(heads_kv // t.shape[-3], dim=-3)
                          for t in (key, value))
        heads_kv = key.shape[-3]
    else:
        heads = max(heads_q, heads_k, heads_v)  # an axis like the others: equal or 1
        if not {heads_q, heads_k, heads_v} <= {heads, 1}:
            raise ValueError(f"`query` has {heads_q} heads but `key` has {heads_k} and `value` "
                             f"{heads_v}: different head counts need enable_gqa=True (as in "
                             f"torch), got {shapes()}")
        heads_q, heads_kv = heads, (1 if heads_k == heads_v == 1 else heads)
    lead = query.shape[:-3]
    try:
        if not lead == key.shape[:-3] == value.shape[:-3]:
            lead = torch.broadcast_shapes(lead, key.shape[:-3], value.shape[:-3])
    except RuntimeError:
        raise ValueError(f"the leading axes of `query`, `key` and `value` must broadcast "
                         f"together (as in torch), got {shapes()}") from None
    return tuple(t if t.shape[:-2] == (*lead, heads) else t.expand(*lead, heads, *t.shape[-2:])
                 for t, heads in ((query, heads_q), (key, heads_kv), (value, heads_kv)))


# -- FlexAttention: torch's signatures, the user's functions compiled by cpuflash.flex

def _args_as_numpy(name, args):
    """`args` with every tensor a numpy view of its memory (CPU tensors only)."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"`{name}` must be a tuple of tensors, arrays and numbers, got "
                        f"{type(args).__name__}")
    _check_cpu(**{f"{name}[{i}]": x for i, x in enumerate(args) if isinstance(x, torch.Tensor)})
    return tuple(_as_numpy(x) if isinstance(x, torch.Tensor) else x for x in args)


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, *, args=(), device="cpu", BLOCK_SIZE=None):
    """torch's ``create_block_mask`` for `flex_attention`: a cpuflash `BlockMask`.

    Parameters
    ----------
    mask_mod : function
        ``mask_mod(b, h, q_idx, kv_idx, *args) -> bool`` (True: the key takes part), compiled
        by Numba: it runs on integers, not on tensors (see `flex_attention`).
    B, H : int or None
        Batch entries and query heads; None (or 1) means the mask is the same for all.
    Q_LEN, KV_LEN : int
    args : tuple of tensors, arrays and numbers
        Passed to `mask_mod` after the indices; tensors are read through numpy views.
    device : "cpu"
        cpuflash runs on the CPU; any other device is a ValueError.
    BLOCK_SIZE : int or (int, int), optional
        The tiles (query rows, keys) whose state is recorded; default cpuflash's 96 (torch's
        default is 128; the results do not depend on it).

    Returns
    -------
    cpuflash.BlockMask
        It carries `mask_mod` and `args`: ``flex_attention(..., block_mask=bm)`` applies them.
    """
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"`device` must be 'cpu' (cpuflash runs on the CPU only), got {device!r}")
    if isinstance(BLOCK_SIZE, torch.Tensor):
        BLOCK_SIZE = int(BLOCK_SIZE)
    return flex.block_mask(mask_mod, 1 if B is None else B, 1 if H is None else H, Q_LEN,
                           KV_LEN, args=_args_as_numpy("args", args), block=BLOCK_SIZE)


class _FlexCall:
    """What one `flex_attention` call hands its backward besides tensors: the user's functions,
    their arguments as numpy views, and which arguments are tensors that get gradients."""

    def __init__(self, score_mod, score_args, mask_mod, mask_args, block_mask, scale,
                 score_mod_grad):
        self.keywords = dict(score_mod=score_mod, score_args=_args_as_numpy("score_args",
                                                                            score_args),
                             mask_mod=mask_mod, mask_args=_args_as_numpy("mask_args", mask_args),
                             block_mask=block_mask, scale=scale)
        self.score_mod_grad = score_mod_grad
        # the positions of the tensors of score_args, the inputs the Function differentiates
        self.tensor_slots = [i for i, x in enumerate(score_args) if isinstance(x, torch.Tensor)]
        # dscore_args from cpuflash holds one array per float array of score_args, in order
        self.float_slots = [i for i, x in enumerate(self.keywords["score_args"])
                            if isinstance(x, np.ndarray) and (x.dtype.kind == "f" or
                                                              _call._is_bfloat16(x.dtype))]


class _FlexFunction(torch.autograd.Function):
    """out, lse = flex_attention(q, k, v); differentiable in q, k, v and in the float tensors of
    score_args (those through `score_mod_grad`)."""

    @staticmethod
    def forward(ctx, call, q, k, v, *score_tensors):
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
        _, lse = flex.flex_attention(_as_numpy(q), _as_numpy(k), _as_numpy(v), return_lse=True,
                                     out=_as_numpy(out), **call.keywords)
        lse = torch.from_numpy(np.ascontiguousarray(lse))
        ctx.call = call
        ctx.save_for_backward(q, k, v, out, lse, *score_tensors)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        call = ctx.call
        q, k, v, out, lse, *score_tensors = ctx.saved_tensors
        wanted = [call.tensor_slots[i] for i, need in enumerate(ctx.needs_input_grad[4:])
                  if need]
        keywords = dict(call.keywords)
        if wanted and call.score_mod_grad is not None:
            keywords["score_mod_grad"] = call.score_mod_grad
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        result = flex.flex_attention_backward(
            _as_numpy(dout), _as_numpy(q), _as_numpy(k), _as_numpy(v), _as_numpy(out),
            _as_numpy(lse), dq=_as_numpy(dq), dk=_as_numpy(dk), dv=_as_numpy(dv), **keywords)
        grads = {}
        if "score_mod_grad" in keywords:
            for slot, g in zip(call.float_slots, result[-1]):
                grads[slot] = torch.from_numpy(np.asarray(g))
        score_grads = []
        for slot, t in zip(call.tensor_slots, score_tensors):
            g = grads.get(slot) if slot in wanted else None
            score_grads.append(None if g is None else g.to(t.dtype).reshape(t.shape))
        return (None, dq, dk, dv, *score_grads)


def _check_flex_shapes(query, key, value, enable_gqa):
    def shapes():
        return ", ".join(f"`{n}` {tuple(t.shape)}" for n, t in
                         (("query", query), ("key", key), ("value", value)))

    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"`query`, `key` and `value` must be 4-D (B, H, L, E), as in torch's "
                         f"flex_attention, got {shapes()}")
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"`key` and `value` must agree in batch, heads and length, got {shapes()}")
    if query.shape[0] != key.shape[0]:
        raise ValueError(f"`query` and `key` must have the same batch size, got {shapes()}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"`query` and `key` must have the same embedding size E, got {shapes()}")
    heads_q, heads_kv = query.shape[1], key.shape[1]
    if not enable_gqa and heads_q != heads_kv:
        raise ValueError(f"`query` has {heads_q} heads and `key`/`value` {heads_kv}: different "
                         f"head counts need enable_gqa=True (as in torch), got {shapes()}")
    if enable_gqa and heads_q % heads_kv:
        raise ValueError(f"with enable_gqa=True the heads of `key`/`value` ({heads_kv}) must "
                         f"divide those of `query` ({heads_q}), got {shapes()}")


# the user's functions run in Numba kernels that dynamo cannot trace: a graph break, named
@torch.compiler.disable(reason="cpuflash.torch.flex_attention runs the user's functions as "
                               "Numba code, outside the graph")
def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, *, score_args=(), mask_mod=None,
                   mask_args=(), score_mod_grad=None):
    """torch's ``flex_attention`` on CPU tensors, the user's functions compiled by Numba.

    Parameters
    ----------
    query : (B, Hq, L, E) tensor
    key : (B, Hkv, S, E) tensor
    value : (B, Hkv, S, Ev) tensor
        float32, float64, float16 or bfloat16 CPU tensors of one dtype.
    score_mod : function, optional
        ``score_mod(score, b, h, q_idx, kv_idx, *score_args) -> new score``, torch's signature
        with `score_args` appended. It runs on scalars inside the kernels, not on tensors:
        arithmetic, comparisons, ``if``, indexing arrays, `math`, ``abs``/``min``/``max``; no
        ``torch.where`` or other torch calls (a TypeError naming the function). A tensor it
        reads must come through `score_args` (a closure over a tensor does not compile).
    block_mask : cpuflash BlockMask, optional
        From `create_block_mask` (or `cpuflash.block_mask`); applies its `mask_mod`. torch's
        own BlockMask is a TypeError.
    scale : float, optional
        Default ``1 / sqrt(E)``, applied before `score_mod` as in torch.
    enable_gqa : bool
        Needed when `key`/`value` have fewer heads than `query` (they must divide them); `h` in
        the user's functions is the query head.
    return_lse : bool
        Also return the log-sum-exp of each row's scores, natural log as torch's, (B, Hq, L)
        float32 (float64 for float64 inputs) as torch's; ``-inf`` for a row that sees no key
        (its output is 0). It carries no gradient (torch's does on GPUs).
    score_args : tuple of tensors, arrays and numbers
        The extra arguments of `score_mod` (torch's closes over them instead).
    mask_mod : function, optional
        ``mask_mod(b, h, q_idx, kv_idx, *mask_args) -> bool`` applied without a block mask (to
        every score: slower than through `block_mask`), or the block mask's own function.
    mask_args : tuple of tensors, arrays and numbers
    score_mod_grad : function, optional
        ``score_mod_grad(dscore, score, b, h, q_idx, kv_idx, *score_args, *dscore_args)``,
        adding into `dscore_args` (one per float array of `score_args`) the gradient of the
        float tensors of `score_args` that require grad; without it those get no gradient.

    Returns
    -------
    out : (B, Hq, L, Ev) tensor, the dtype of `query`
    lse : (B, Hq, L) tensor, only with ``return_lse=True``

    Notes
    -----
    Differentiable in query, key and value (the derivative of `score_mod` by its score is found
    by cpuflash). Under `torch.compile` the call is a graph break (`torch.compiler.disable`):
    the code around it compiles (any backend, inductor included) and it runs as here,
    forward and backward; with ``fullgraph=True`` compiling fails (dynamo's Unsupported, naming
    this function). A function is compiled once per function and dtype,
    forward and backward each (seconds), and the kernels are cached on disk.
    """
    _check_cpu(query=query, key=key, value=value)
    _check_flex_shapes(query, key, value, bool(enable_gqa))
    if block_mask is not None and not isinstance(block_mask, flex.BlockMask):
        raise TypeError(f"`block_mask` must be a cpuflash BlockMask (from "
                        f"`cpuflash.torch.create_block_mask`), got {type(block_mask).__name__}")
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod),
                     ("score_mod_grad", score_mod_grad)):
        if fn is not None and not callable(fn):
            raise TypeError(f"`{name}` must be a function, got {type(fn).__name__}")
    if score_mod_grad is not None and score_mod is None:
        raise ValueError("`score_mod_grad` given without a `score_mod`")
    if scale is not None:
        scale = float(scale)
    call = _FlexCall(score_mod, score_args, mask_mod, mask_args, block_mask, scale,
                     score_mod_grad)
    score_tensors = [score_args[i] for i in call.tensor_slots]
    out, lse = _FlexFunction.apply(call, query, key, value, *score_tensors)
    return (out, lse) if return_lse else out
