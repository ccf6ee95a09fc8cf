"""User input in, kernel input out; or a clear exception before any work starts.

Every check raises `TypeError` (wrong kind of thing: dtypes, non-arrays) or `ValueError` (wrong
value: shapes, windows, lengths) with a message that names the argument in backticks, says what
was expected and what was given. Nothing here writes to the caller's arrays, so an error leaves
`out`, caches and inputs exactly as they were.

The kernels see a small, fixed set of array types: 4-D ``(batch, heads, rows, dim)`` arrays of
any strides in float32, float64 or uint16 (the bits of float16/bfloat16, widened inside the
kernel tile by tile), which keeps one compiled kernel per dtype.
"""

import math
import numbers
import sys
import warnings
from typing import NamedTuple

import numpy as np

from ._call import AttentionCall, _is_bfloat16, compute_dtype, kernel_view
from ._quantize import QUANT_MAX, QuantizedKV, format_name, hadamard
from .tiling import TileConfig

LAYOUTS = ("bhsd", "bshd")

# window sides are clamped to this (far beyond any sequence length)
WINDOW_LIMIT = 2 ** 40


# more query heads than any model has (MQA and DeepSeek's MLA put at most 128 on a kv head)
MOST_HEADS = 256


def _fail(exc, message):
    raise exc(message) from None


def _warn_bshd_look(shape):
    """Warn that 4-D arrays read as (batch, heads, seqlen, dim) look like flash-attn's
    (batch, seqlen, heads, dim): the shapes agree, and the result would be wrong unasked."""
    warnings.warn(f"`q` of shape {shape} is read as {shape[1]} heads of {shape[2]} rows "
                  f"(layout \"bhsd\", the default): more heads than rows and than any model "
                  f"has. If these are flash-attn's (batch, seqlen, heads, dim) arrays, pass "
                  f"`layout=\"bshd\"`", UserWarning, stacklevel=_caller_level())


def _caller_level():
    """The `stacklevel` of the first caller outside cpuflash (a warning points at its line)."""
    package = __file__.rsplit("_validate.py", 1)[0]
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def as_array(name, x):
    """`x` as a numpy array without copying; anything numpy cannot view is a TypeError."""
    if isinstance(x, np.ndarray):
        return x
    torch = sys.modules.get("torch")  # never imported here: a tensor means torch is loaded
    if torch is not None and isinstance(x, torch.Tensor):
        x = _without_grad(name, x, torch)
        try:  # .numpy(): what numpy.asarray returns for a plain tensor, at half the cost
            return x.numpy() if type(x) is torch.Tensor else np.asarray(x)
        except Exception as exc:  # noqa: BLE001 - bfloat16, or not on the CPU
            dtype = str(x.dtype).removeprefix("torch.")
            _fail(TypeError, f"`{name}` is a torch {dtype} tensor on {x.device}, which numpy "
                             f"cannot view ({exc}): `cpuflash.torch.attention` takes CPU "
                             f"tensors of every float dtype, bfloat16 included")
    elif isinstance(x, (list, tuple, numbers.Number, str, bytes)) or x is None:
        _fail(TypeError, f"`{name}` must be an array, got {type(x).__name__}")
    try:
        return np.asarray(x)
    except Exception as exc:  # noqa: BLE001 - any failure here means "not an array"
        _fail(TypeError, f"`{name}` must be an array (numpy, or viewable by numpy.asarray), "
                         f"got {type(x).__name__}: {exc}")


def _without_grad(name, tensor, torch):
    """A torch tensor numpy may view: one that requires grad only where grad mode is off."""
    if not tensor.requires_grad:
        return tensor
    if torch.is_grad_enabled():
        _fail(TypeError, f"`{name}` is a torch tensor that requires grad, but this "
                         f"numpy-level call has no autograd: no gradient would flow back "
                         f"through it. For inference call it under `torch.no_grad()` or "
                         f"`torch.inference_mode()` (or pass `{name}.detach()`); for gradients "
                         f"use `cpuflash.torch` (its `attention` and "
                         f"`scaled_dot_product_attention` are differentiable in q, k, v and "
                         f"sinks)")
    return tensor.detach()  # grad mode is off: the caller asked for no gradient


def input_dtype(q, k, v, names=("q", "k", "v")):
    """The shared dtype of q, k, v; a TypeError naming the dtypes otherwise."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    what = "`{}`, `{}` and `{}`".format(*names)
    for name, dtype in zip(names, dtypes):
        if dtype.kind == "c":
            _fail(TypeError, f"`{name}` is {dtype}: complex attention is not supported (q, k, v "
                             f"must be float32, float64, float16 or bfloat16)")
    if not (dtypes[0] == dtypes[1] == dtypes[2]):
        _fail(TypeError, f"{what} must share one dtype, got "
                         f"{dtypes[0]}, {dtypes[1]} and {dtypes[2]}")
    dtype = dtypes[0]
    if dtype not in (np.float32, np.float64, np.float16) and not _is_bfloat16(dtype):
        _fail(TypeError, f"{what} must be float32, float64, float16 or bfloat16, got {dtype}")
    return dtype


def reshaped_view(x, shape):
    """`x` with a new shape, sharing memory; None when that needs a copy."""
    view = x.view()
    try:
        view.shape = shape
    except AttributeError:
        return None
    return view


def scale_value(scale, head_dim):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        _fail(TypeError, f"`scale` must be a real number or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        _fail(ValueError, f"`scale` must be finite, got {scale}")
    return float(scale)


def flag(name, value):
    if not isinstance(value, (bool, np.bool_)):
        _fail(TypeError, f"`{name}` must be True or False, got {value!r}")
    return bool(value)


def window_value(window, causal):
    """`window` as (left, right) ints, -1 meaning unbounded; causal forces right = 0."""
    if window is None:
        left, right = -1, -1
    else:
        if (not isinstance(window, (tuple, list)) or len(window) != 2
                or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
                           for w in window)):
            _fail(ValueError, f"`window` must be a pair of ints (left, right), got {window!r}")
        left, right = int(window[0]), int(window[1])
        if left < -1 or right < -1:
            _fail(ValueError, f"`window` sides must be >= -1 (-1 = unbounded), got {window!r}")
        # wider than any sequence is the same as unbounded; keeps the kernels' int64 sums exact
        left, right = min(left, WINDOW_LIMIT), min(right, WINDOW_LIMIT)
    if causal:
        right = 0
    return left, right


def softcap_value(softcap):
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        _fail(TypeError, f"`softcap` must be a real number, got {type(softcap).__name__}")
    if not (softcap >= 0 and math.isfinite(softcap)):
        _fail(ValueError, f"`softcap` must be finite and >= 0 (0 = off), got {softcap}")
    return float(softcap)


def tiles_value(tiles):
    if tiles is None or isinstance(tiles, TileConfig):
        return tiles
    if isinstance(tiles, (tuple, list)) and len(tiles) == 2:
        return TileConfig(*tiles)
    _fail(TypeError, f"`tiles` must be a TileConfig or a (block_q, block_k) pair, got {tiles!r}")


def float_operand(name, x, dtype):
    """A float array argument (slopes, bias, sinks) converted to the compute dtype; lists of
    numbers are welcome too."""
    x = np.asarray(x) if isinstance(x, (list, tuple)) else as_array(name, x)
    if x.dtype.kind != "f" and not _is_bfloat16(x.dtype):
        _fail(TypeError, f"`{name}` must be a float array, got dtype {x.dtype}")
    return x.astype(dtype, copy=False)


def exact_shape(name, x, shapes):
    """Check `x.shape` is one of `shapes` (a list of tuples)."""
    if x.shape not in shapes:
        expected = " or ".join(str(s) for s in shapes)
        _fail(ValueError, f"`{name}` must have shape {expected}, got {x.shape}")


def broadcast_operand(name, x, lead, tail):
    """A bias or mask broadcast to ``lead + tail`` without expanding it in memory.

    Returns ``(x4, batch_map)``: `x4` is ``(Bx,) + tail`` where ``Bx`` is the product of the
    leading axes `x` really has (broadcast axes have stride 0 and cost no memory), and
    ``batch_map[b]`` is the row of `x4` that flattened batch entry `b` reads.
    """
    full = tuple(lead) + tuple(tail)
    if x.ndim > len(full):
        _fail(ValueError, f"`{name}` must be broadcastable to {full}, got shape {x.shape}")
    try:
        if np.broadcast_shapes(x.shape, full) != full:
            raise ValueError
    except ValueError:
        _fail(ValueError, f"`{name}` must be broadcastable to {full}, got shape {x.shape}")
    x = x.reshape((1,) * (len(full) - x.ndim) + x.shape)
    own_lead = x.shape[:len(lead)]
    rows = math.prod(own_lead)
    x4 = np.broadcast_to(x.reshape((rows,) + x.shape[len(lead):]), (rows,) + tuple(tail))
    batch_map = np.broadcast_to(np.arange(rows, dtype=np.int64).reshape(own_lead), lead)
    return kernel_view(x4), np.ascontiguousarray(batch_map).reshape(-1)


def head_dims(q4, k4, v4, names=("q", "k", "v")):
    """Check the (..., heads, rows, dim) shapes of q, k, v against each other.

    Returns ``(n_heads, n_kv_heads, n_q, n_k, d, d_v)``. `names` are the arguments' names in
    the messages.
    """
    q, k, v = names
    n_heads, n_q, d = q4.shape[-3:]
    n_kv_heads, n_k, d_k = k4.shape[-3:]
    n_v_heads, n_v, d_v = v4.shape[-3:]
    if d_k != d:
        _fail(ValueError, f"`{k}` has head dim {d_k} but `{q}` has {d}")
    if d < 1 or d_v < 1:
        _fail(ValueError, f"head dims must be >= 1, got {d} for `{q}` and {d_v} for `{v}`")
    if n_v != n_k:
        _fail(ValueError, f"`{v}` has {n_v} keys but `{k}` has {n_k}")
    if n_v_heads != n_kv_heads:
        _fail(ValueError, f"`{v}` has {n_v_heads} heads but `{k}` has {n_kv_heads}")
    if n_kv_heads < 1:
        _fail(ValueError, f"`{k}` must have at least one head, got {n_kv_heads}")
    if n_heads % n_kv_heads:
        _fail(ValueError, f"the number of query heads ({n_heads}) must be a multiple of the "
                          f"number of key/value heads ({n_kv_heads})")
    return n_heads, n_kv_heads, n_q, n_k, d, d_v


def alibi_value(alibi_slopes, lead, n_heads, dtype):
    """ALiBi slopes as a (batch, heads) array (stride 0 over the batch for (Hq,) slopes);
    a (batch, 0) array when there are none."""
    batch = math.prod(lead)
    if alibi_slopes is None:
        return np.zeros((batch, 0), dtype=dtype)
    alibi = float_operand("alibi_slopes", alibi_slopes, dtype)
    exact_shape("alibi_slopes", alibi, [(n_heads,), tuple(lead) + (n_heads,)])
    return np.broadcast_to(alibi, tuple(lead) + (n_heads,)).reshape(batch, n_heads)


def sinks_value(sinks, n_heads, dtype):
    if sinks is None:
        return np.zeros(0, dtype=dtype)
    sinks = float_operand("sinks", sinks, dtype)
    exact_shape("sinks", sinks, [(n_heads,)])
    return sinks


# -- steps every builder takes: arrays, dtypes, layout, flags, shapes, then these scalars. Each
#    builder keeps its own order of checks, which decides the message when a call has several
#    errors.

def _dtypes(q, k, v, names=("q", "k", "v")):
    """(input dtype, compute dtype) of q, k, v; see `input_dtype`."""
    dtype = input_dtype(q, k, v, names)
    return dtype, compute_dtype(dtype)


def _layout(layout):
    if layout not in LAYOUTS:
        _fail(ValueError, f"`layout` must be one of {LAYOUTS}, got {layout!r}")


def _flags(causal, return_lse):
    """Check both flags; returns `causal` as a bool."""
    causal = flag("causal", causal)
    flag("return_lse", return_lse)
    return causal


def chunk_value(chunk_size):
    """`chunk_size` as an int, 0 for None (no chunks)."""
    if chunk_size is None:
        return 0
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        _fail(TypeError, f"`chunk_size` must be an int >= 1 or None, got "
                         f"{type(chunk_size).__name__}")
    if chunk_size < 1:
        _fail(ValueError, f"`chunk_size` must be >= 1 (None = no chunks), got {chunk_size}")
    return int(chunk_size)


def _scalars(scale, window, softcap, causal, head_dim, chunk_size):
    """(qk_scale, (left, right), softcap, chunk), checked."""
    return (scale_value(scale, head_dim), window_value(window, causal), softcap_value(softcap),
            chunk_value(chunk_size))


def attention_args(q, k, v, *, causal=False, scale=None, window=None, chunk_size=None,
                   softcap=0.0, alibi_slopes=None, bias=None, mask=None, sinks=None, layout="bhsd",
                   return_lse=False, out=None, tiles=None):
    """Validate the arguments of `cpuflash.attention` and build the kernel's view of them."""
    q, k, v = as_array("q", q), as_array("k", k), as_array("v", v)
    dtype, cdtype = _dtypes(q, k, v)
    _layout(layout)
    causal = _flags(causal, return_lse)

    # -- shapes: everything to (B, H, N, D)
    if layout == "bshd":
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.ndim != 4:
                _fail(ValueError, f"`{name}` must be 4-D (batch, seqlen, heads, dim) with "
                                  f"layout='bshd', got shape {x.shape}")
        lead = q.shape[:1]
        q4, k4, v4 = (np.swapaxes(x, 1, 2) for x in (q, k, v))
        if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
            _fail(ValueError, f"`q`, `k`, `v` must have the same batch size, got "
                              f"{q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    else:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.ndim < 2:
                _fail(ValueError, f"`{name}` must have at least 2 dims (..., seqlen, dim), "
                                  f"got shape {x.shape}")
        if not q.ndim == k.ndim == v.ndim:
            _fail(ValueError, f"`q`, `k`, `v` must have the same number of dims, got "
                              f"shapes {q.shape}, {k.shape}, {v.shape}")
        lead = q.shape[:-3]
        if k.shape[:-3] != lead or v.shape[:-3] != lead:
            _fail(ValueError, f"`q`, `k`, `v` must have equal leading (batch) axes, got "
                              f"shapes {q.shape}, {k.shape}, {v.shape}")
        q4, k4, v4 = (x if x.ndim >= 3 else x[None] for x in (q, k, v))
        if q.ndim == 4 and q.shape[1] > max(q.shape[2], MOST_HEADS):
            _warn_bshd_look(q.shape)
    batch = math.prod(lead)
    n_heads, n_kv_heads, n_q, n_k, d, d_v = head_dims(q4, k4, v4)
    q4, k4, v4 = (x.reshape((batch,) + x.shape[-3:]) for x in (q4, k4, v4))

    # -- scalars
    qk_scale, window, softcap, chunk = _scalars(scale, window, softcap, causal, d, chunk_size)
    tiles = tiles_value(tiles)

    # -- score modifiers
    alibi = alibi_value(alibi_slopes, lead, n_heads, cdtype)
    scores = (n_heads, n_q, n_k)
    bias4 = bias_map = mask4 = mask_map = None
    if bias is not None:
        bias4, bias_map = broadcast_operand("bias", float_operand("bias", bias, cdtype),
                                            lead, scores)
    if mask is not None:
        mask = np.asarray(mask) if isinstance(mask, (list, tuple)) else as_array("mask", mask)
        if mask.dtype != np.bool_:
            _fail(TypeError, f"`mask` must be a boolean array (True = the key takes part), "
                             f"got dtype {mask.dtype}")
        mask4, mask_map = broadcast_operand("mask", mask, lead, scores)
    sinks_arr = sinks_value(sinks, n_heads, cdtype)

    # -- output: the user's shape, and the (B, Hq, Nq, Dv) view the kernel writes
    if layout == "bshd":
        out_shape = (q.shape[0], n_q, n_heads, d_v)
        lse_shape = (q.shape[0], n_heads, n_q)
    else:
        out_shape = q.shape[:-1] + (d_v,)
        lse_shape = q.shape[:-1]
    copy_back = None
    if out is None:
        out_user = np.empty(out_shape, dtype=dtype)
    else:
        out = as_array("out", out)
        out_user = out_value(out, out_shape, dtype, (q, k, v))
        if out_user is not out:
            copy_back = out
    heads_first = np.swapaxes(out_user, 1, 2) if layout == "bshd" else out_user
    out_bhsd = reshaped_view(heads_first, (batch, n_heads, n_q, d_v))
    if out_bhsd is None:  # the user's strides cannot be flattened: write a copy, then copy it
        copy_back = out_user
        out_user = np.empty(out_shape, dtype=dtype)
        heads_first = np.swapaxes(out_user, 1, 2) if layout == "bshd" else out_user
        out_bhsd = reshaped_view(heads_first, (batch, n_heads, n_q, d_v))

    return AttentionCall(
        q=kernel_view(q4), k=kernel_view(k4), v=kernel_view(v4), dtype=dtype,
        batch=batch, n_heads=n_heads, n_kv_heads=n_kv_heads, n_q=n_q, n_k=n_k,
        head_dim=d, head_dim_v=d_v,
        qk_scale=qk_scale, softcap=softcap, alibi=alibi, bias=bias4, bias_map=bias_map,
        causal=causal, window=window, chunk=chunk, mask=mask4, mask_map=mask_map,
        sinks=sinks_arr, tiles=tiles,
        out_user=out_user, out_bhsd=out_bhsd, copy_back=copy_back, lse_shape=lse_shape)


def out_value(out, shape, dtype, inputs):
    """Check a user's `out` (already through `as_array`: a torch CPU tensor is viewed, not
    copied); returns it, or a fresh array (written, then copied over `out`) when it overlaps
    an input or is unaligned (the kernels would write a copy of it)."""
    if out.shape != shape:
        _fail(ValueError, f"`out` must have shape {shape}, got {out.shape}")
    if out.dtype != dtype:
        _fail(TypeError, f"`out` must have dtype {dtype} (that of `q`), got {out.dtype}")
    if not out.flags.writeable:
        _fail(ValueError, "`out` must be writeable, got a read-only array")
    if not out.flags.aligned or any(np.may_share_memory(out, x) for x in inputs):
        return np.empty(shape, dtype=dtype)
    return out


def cu_seqlens_value(name, cu, total, n_seqs=None):
    """Cumulative sequence lengths: 1-D ints, starting at 0, non-decreasing, ending at `total`."""
    cu = int_array(name, cu)
    if cu.ndim != 1 or cu.size < 1:
        _fail(ValueError, f"`{name}` must be 1-D with batch + 1 entries, got shape {cu.shape}")
    if n_seqs is not None and cu.size != n_seqs + 1:
        _fail(ValueError, f"`{name}` has {cu.size} entries but `cu_seqlens_q` has {n_seqs + 1}")
    if cu.dtype.kind == "u" and cu.max() > np.iinfo(np.int64).max:  # int64 would wrap it
        _fail(ValueError, f"`{name}` values must be at most the number of rows ({total}), got "
                          f"{cu.max()}")
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        _fail(ValueError, f"`{name}` must start at 0, got {cu[0]}")
    if np.any(np.diff(cu) < 0):
        at = int(np.argmax(np.diff(cu) < 0))
        _fail(ValueError, f"`{name}` must be non-decreasing, got {cu[at]} then {cu[at + 1]} "
                          f"at index {at}")
    if cu[-1] != total:
        _fail(ValueError, f"`{name}` must end at the number of rows ({total}), got {cu[-1]}")
    return cu


def varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal, scale, window, chunk_size,
                softcap, alibi_slopes, return_lse):
    """Validate `cpuflash.attention_varlen` and build the kernel's view of packed tokens."""
    q, k, v = as_array("q", q), as_array("k", k), as_array("v", v)
    dtype, cdtype = _dtypes(q, k, v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            _fail(ValueError, f"`{name}` must be 3-D (total_tokens, heads, dim), "
                              f"got shape {x.shape}")
    causal = _flags(causal, return_lse)
    # (total, H, D) -> (1, H, total, D): a view, sequences are row ranges of the one "batch"
    q4, k4, v4 = (np.swapaxes(x, 0, 1)[None] for x in (q, k, v))
    n_heads, n_kv_heads, total_q, total_k, d, d_v = head_dims(q4, k4, v4)
    cu_q = cu_seqlens_value("cu_seqlens_q", cu_seqlens_q, total_q)
    cu_k = cu_seqlens_value("cu_seqlens_k", cu_seqlens_k, total_k, n_seqs=cu_q.size - 1)
    n_seqs = cu_q.size - 1
    qk_scale, window, softcap, chunk = _scalars(scale, window, softcap, causal, d, chunk_size)
    alibi = alibi_value(alibi_slopes, (n_seqs,), n_heads, cdtype)

    out_user = np.empty((total_q, n_heads, d_v), dtype=dtype)
    return AttentionCall(
        q=kernel_view(q4), k=kernel_view(k4), v=kernel_view(v4), dtype=dtype,
        batch=n_seqs, n_heads=n_heads, n_kv_heads=n_kv_heads, n_q=total_q, n_k=total_k,
        head_dim=d, head_dim_v=d_v,
        qk_scale=qk_scale, softcap=softcap, alibi=alibi, causal=causal, window=window,
        chunk=chunk,
        out_user=out_user, out_bhsd=np.swapaxes(out_user, 0, 1)[None],
        lse_shape=(n_heads, total_q), cu_q=cu_q, cu_k=cu_k)


def int_array(name, x):
    """A small integer array (lengths, page tables); lists of ints are welcome too."""
    x = np.asarray(x) if isinstance(x, (list, tuple)) else as_array(name, x)
    if x.dtype.kind not in "iu":
        _fail(TypeError, f"`{name}` must be an integer array, got dtype {x.dtype}")
    return x


def kvcache_args(q, k_cache, v_cache, *, k, v, cache_seqlens, causal, scale, window,
                 chunk_size, softcap, alibi_slopes, sinks, block_table, layout, num_splits,
                 return_lse, value_dim=None, integer_dot=False):
    """Validate `cpuflash.attention_with_kvcache`. Nothing is written here: the new keys are
    checked, then written by `_kvcache.write_new_keys` once every check has passed, which also
    returns the kernel's view of the caches."""
    q = as_array("q", q)
    in_keys = value_dim is not None
    if in_keys:
        v_cache, v = values_in_keys(k_cache, v_cache, k, v, value_dim)
    quantized = quantized_pair(k_cache, v_cache)
    rotated = False
    if quantized is None:
        k_cache, v_cache = as_array("k_cache", k_cache), as_array("v_cache", v_cache)
        k_scale = v_scale = None
    else:
        rotated = bool(k_cache.rotated)
        k_cache, k_scale, v_cache, v_scale, quantized = quantized
    if (k is None) != (v is None):
        _fail(ValueError, "`k` and `v` must be given together (new keys and their values), "
                          f"got `k` {'None' if k is None else 'an array'} and "
                          f"`v` {'None' if v is None else 'an array'}")
    has_new = k is not None
    if has_new:
        k, v = as_array("k", k), as_array("v", v)
    if quantized is None:
        dtype, cdtype = _dtypes(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"))
        if has_new and not (k.dtype == v.dtype == dtype):
            _fail(TypeError, f"`k` and `v` must have the dtype of the cache ({dtype}), got "
                             f"{k.dtype} and {v.dtype}")
    else:
        dtype, cdtype = _quantized_dtypes(q, k, v)
    _layout(layout)
    causal = _flags(causal, return_lse)
    arrays = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    arrays += [("k", k), ("v", v)] if has_new else []
    for name, x in arrays:
        if x.ndim != 4:
            _fail(ValueError, f"`{name}` must be 4-D, got shape {x.shape}")
    # everything to (batch or page, heads, rows, dim)
    q4, kc4, vc4 = (np.swapaxes(x, 1, 2) if layout == "bshd" else x for x in (q, k_cache, v_cache))
    batch = q4.shape[0]
    n_heads, n_kv_heads, n_q, page_rows, d, d_v = head_dims(
        q4, *(_numbers(x, quantized) for x in (kc4, vc4)), names=("q", "k_cache", "v_cache"))
    k4 = v4 = None
    n_new = 0
    if has_new:
        k4, v4 = (np.swapaxes(x, 1, 2) if layout == "bshd" else x for x in (k, v))
        if k4.shape != (batch, n_kv_heads, k4.shape[2], d) or \
                v4.shape != (batch, n_kv_heads, k4.shape[2], d_v):
            _fail(ValueError, f"`k` and `v` must be (batch, kv heads, new, dim) = "
                              f"({batch}, {n_kv_heads}, n, {d}/{d_v}) in layout {layout!r}, "
                              f"got {k.shape} and {v.shape}")
        n_new = k4.shape[2]
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache), ("k_cache.scale", k_scale),
                            ("v_cache.scale", v_scale)):
            if cache is not None and not cache.flags.writeable:
                _fail(ValueError, f"`{name}` is read-only but new keys `k`/`v` must be "
                                  "written into it")

    if vc4.shape[0] != kc4.shape[0]:
        unit = "pages" if block_table is not None else "batch entries"
        _fail(ValueError, f"`v_cache` has {vc4.shape[0]} {unit} but `k_cache` has "
                          f"{kc4.shape[0]}")
    # -- pages: an unpaged cache is one page of Nmax rows per batch entry
    if block_table is None:
        if kc4.shape[0] != batch:
            _fail(ValueError, f"`k_cache` has batch {kc4.shape[0]} but `q` has {batch}")
        table = np.arange(batch, dtype=np.int64)[:, None]
    else:
        table = int_array("block_table", block_table)
        if table.ndim != 2 or table.shape[0] != batch:
            _fail(ValueError, f"`block_table` must have shape (batch={batch}, max_pages), got "
                              f"{table.shape}")
        table = table.astype(np.int64)
    n_max = table.shape[1] * page_rows

    # -- lengths
    if cache_seqlens is None:  # the cache is full: no room for new keys (checked below)
        seqlens = np.full(batch, n_max, dtype=np.int64)
    else:
        if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
            cache_seqlens = np.full(batch, cache_seqlens)
        seqlens = int_array("cache_seqlens", cache_seqlens)
        if seqlens.shape != (batch,):
            _fail(ValueError, f"`cache_seqlens` must have shape ({batch},), got {seqlens.shape}")
        seqlens = seqlens.astype(np.int64)
    if np.any(seqlens < 0) or np.any(seqlens > n_max - n_new):
        given = "None (a full cache)" if cache_seqlens is None else seqlens.tolist()
        _fail(ValueError, f"`cache_seqlens` must lie in [0, {n_max - n_new}] (cache length "
                          f"{n_max} minus {n_new} new keys), got {given}")
    n_keys = seqlens + n_new
    if block_table is not None:
        used = np.arange(table.shape[1])[None, :] * page_rows < n_keys[:, None]
        if np.any((table < 0) & used) or np.any((table >= kc4.shape[0]) & used):
            _fail(ValueError, f"`block_table` entries for the keys in use must lie in "
                              f"[0, {kc4.shape[0]}) (the number of pages)")

    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        _fail(TypeError, f"`num_splits` must be an int (0 = automatic), got {num_splits!r}")
    integer_dot_value(integer_dot, quantized)
    if num_splits < 0:
        _fail(ValueError, f"`num_splits` must be >= 0 (0 = automatic), got {num_splits}")
    qk_scale, window, softcap, chunk = _scalars(scale, window, softcap, causal, d, chunk_size)
    alibi = alibi_value(alibi_slopes, (batch,), n_heads, cdtype)
    sinks_arr = sinks_value(sinks, n_heads, cdtype)

    if layout == "bshd":
        out_user = np.empty((batch, n_q, n_heads, d_v), dtype=dtype)
        out_bhsd = np.swapaxes(out_user, 1, 2)
    else:
        out_user = out_bhsd = np.empty((batch, n_heads, n_q, d_v), dtype=dtype)
    fields = dict(
        dtype=dtype, batch=batch, n_heads=n_heads, n_kv_heads=n_kv_heads, n_q=n_q,
        n_k=int(n_keys.max(initial=0)), head_dim=d, head_dim_v=d_v,
        qk_scale=qk_scale, softcap=softcap, alibi=alibi, causal=causal, window=window,
        chunk=chunk, sinks=sinks_arr,
        out_user=out_user, out_bhsd=out_bhsd, lse_shape=(batch, n_heads, n_q),
        k_cache=kc4, v_cache=vc4, new_k=k4, new_v=None if in_keys else v4,
        block_table=np.ascontiguousarray(table),
        page_rows=page_rows, paged=block_table is not None, seqlens=seqlens, n_keys=n_keys,
        num_splits=int(num_splits))
    # `k`, `v`: the caches as given; `_kvcache.write_new_keys` hands the kernel its view of them
    # once the new keys are in (the view of an unaligned cache is a copy)
    if quantized is None:
        return AttentionCall(q=kernel_view(q4), k=kc4, v=vc4, **fields)
    # the kernel reads the quantized rows in place, widening them itself, and float32 queries (a
    # copy of the few query rows: one kernel per cache format, whatever the dtype of q)
    k_scale, v_scale = (np.swapaxes(x, 1, 2) if layout == "bshd" else x
                        for x in (k_scale, v_scale))
    if rotated:  # the cache holds rows turned by H: q turned too, new rows turned, then written
        rotatable("k_cache", d)
        rotatable("v_cache", d_v)
        q4 = hadamard(q4)
        if has_new:
            fields.update(new_k=hadamard(k4), new_v=hadamard(v4))
    return AttentionCall(q=np.asarray(q4, dtype=np.float32), k=kc4, v=vc4, quantized=quantized,
                         k_scale=k_scale, v_scale=v_scale, rotated=rotated,
                         integer_dot=integer_dot, **fields)


def integer_dot_value(integer_dot, quantized):
    """Check `integer_dot` of `attention_with_kvcache`: a bool, True only with an int8 or int4
    cache (`quantized`: the cache's format, or None)."""
    if integer_dot.__class__ is not bool:
        _fail(TypeError, f"`integer_dot` must be a bool, got {integer_dot!r}")
    if integer_dot and quantized not in ("int8", "int4"):
        got = "a float cache" if quantized is None else f"a {quantized} cache"
        _fail(ValueError, f"`integer_dot=True` needs int8 or int4 caches "
                          f"(`cpuflash.quantize_kv`), got {got}")


class _Shape(NamedTuple):
    shape: tuple


def _numbers(data, quantized):
    """What `head_dims` reads of a cache of format `quantized`: its shape, in numbers (two a
    byte for int4)."""
    if quantized != "int4":
        return data
    return _Shape(data.shape[:-1] + (2 * data.shape[-1],))


def bits_view(data):
    """A quantized cache as the kernels read it: int8 and int4 pairs as they are,
    float8_e4m3fn as its uint8 bits (Numba has no float8)."""
    return data if data.dtype == np.int8 else data.view(np.uint8)


def key_indices_value(key_indices, call, n_keys, others):
    """`key_indices` as (B, Hk, Nq, topk) int64 (a list for all kv heads broadcast over them),
    each entry -1 (unused) or a key position of its batch entry, below `n_keys[b]`. `others`:
    the call's arguments that cannot be combined with it, by name."""
    for name, value in others.items():
        if value is not None and value is not False:
            _fail(ValueError, f"`key_indices` cannot be combined with `{name}`: listed keys "
                              f"take causal, window, chunk_size, softcap, sinks and (in "
                              f"attention_with_kvcache) score_mod and mask_mod only")
    keys = int_array("key_indices", key_indices)
    batch, n_kv, n_q = call.batch, call.n_kv_heads, call.n_q
    if keys.ndim == 3 and keys.shape[:2] == (batch, n_q):
        keys = keys[:, None]
    if keys.ndim != 4 or keys.shape[:3] not in ((batch, n_kv, n_q), (batch, 1, n_q)):
        _fail(ValueError, f"`key_indices` must be (batch, Nq, topk) = ({batch}, {n_q}, k) or "
                          f"(batch, kv heads, Nq, topk) = ({batch}, {n_kv}, {n_q}, k), got shape "
                          f"{keys.shape}")
    keys = np.broadcast_to(keys.astype(np.int64), (batch, n_kv, n_q, keys.shape[3]))
    limit = np.asarray(n_keys, dtype=np.int64)[:, None, None, None]
    bad = (keys < -1) | (keys >= limit)
    if bad.any():
        at = tuple(int(x) for x in np.argwhere(bad)[0])
        _fail(ValueError, f"`key_indices` must hold -1 (an unused slot) or key positions "
                          f"0 .. {int(limit[at[0], 0, 0, 0]) - 1} of batch entry {at[0]}, got "
                          f"{int(keys[at])} at {at} (kv head axis included)")
    return keys


def values_in_keys(k_cache, v_cache, k, v, value_dim):
    """(v_cache, v) for values that are the first `value_dim` columns of the keys (DeepSeek
    MLA's latent cache): views of `k_cache` and `k`, a quantized cache's with the keys' scales
    (an int4 cache's first groups)."""
    if v_cache is not None:
        _fail(ValueError, "`value_dim` reads the values from the keys' first columns: "
                          "`v_cache` must be None, got a cache")
    if v is not None:
        _fail(ValueError, "with `value_dim`, new values come inside the new keys: `v` must be "
                          "None, got an array")
    if isinstance(value_dim, bool) or not isinstance(value_dim, numbers.Integral):
        _fail(TypeError, f"`value_dim` must be an int, got {type(value_dim).__name__}")
    quantized = isinstance(k_cache, QuantizedKV)
    if quantized:
        data, scale, name = quantized_value("k_cache", k_cache)
    else:
        data, name = as_array("k_cache", k_cache), None
    width = (2 if name == "int4" else 1) * data.shape[-1] if data.ndim else 0
    if not 0 < value_dim <= width:
        _fail(ValueError, f"`value_dim` must be in 1 .. {width} (the keys' head dim), got "
                          f"{value_dim}")
    if quantized and k_cache.rotated:
        _fail(ValueError, "`value_dim` cannot read values from a rotated cache (its columns "
                          "are mixed by the rotation): quantize it without `rotate`")
    if name == "int4":  # whole groups of the keys' numbers, two a byte
        group = width // scale.shape[-1]
        if value_dim % group:
            _fail(ValueError, f"`value_dim` must be a multiple of the int4 cache's group size "
                              f"{group}, got {value_dim}")
        v_cache = QuantizedKV(data[..., :value_dim // 2], scale[..., :value_dim // group])
    elif quantized:
        v_cache = QuantizedKV(data[..., :value_dim], scale)
    else:
        v_cache = data[..., :value_dim]
    return v_cache, None if k is None else as_array("k", k)[..., :value_dim]


def quantized_pair(k_cache, v_cache):
    """None for float caches; for quantized ones (k data, k scale, v data, v scale, format
    name), checked as `quantized_value` checks them and against each other. A mix of the two
    kinds is a TypeError naming them."""
    k_quantized, v_quantized = isinstance(k_cache, QuantizedKV), isinstance(v_cache, QuantizedKV)
    if not (k_quantized or v_quantized):
        return None
    if k_quantized != v_quantized:
        kinds = ["a QuantizedKV" if quantized else f"a {type(cache).__name__}"
                 for quantized, cache in ((k_quantized, k_cache), (v_quantized, v_cache))]
        _fail(TypeError, f"`k_cache` and `v_cache` must both be QuantizedKV (the same "
                         f"format) or both float arrays, got `k_cache` {kinds[0]} and "
                         f"`v_cache` {kinds[1]}")
    k_data, k_scale, k_name = quantized_value("k_cache", k_cache)
    v_data, v_scale, v_name = quantized_value("v_cache", v_cache)
    if k_name != v_name:
        _fail(TypeError, f"`k_cache` and `v_cache` must share one format, got {k_name} "
                         f"({k_data.dtype}) and {v_name} ({v_data.dtype})")
    if bool(k_cache.rotated) != bool(v_cache.rotated):
        _fail(ValueError, f"`k_cache` and `v_cache` must both be rotated or neither, got "
                          f"rotated={bool(k_cache.rotated)} and {bool(v_cache.rotated)}")
    return k_data, k_scale, v_data, v_scale, k_name


def quantized_value(name, kq):
    """(data, scale, format name) of a QuantizedKV argument: data int8 or float8_e4m3fn, scale
    float32 of shape ``data.shape[:-1]``."""
    if not isinstance(kq, QuantizedKV):
        _fail(TypeError, f"`{name}` must be a cpuflash.QuantizedKV (from "
                         f"cpuflash.quantize_kv), got {type(kq).__name__}")
    data, scale = as_array(f"{name}.data", kq.data), as_array(f"{name}.scale", kq.scale)
    format_ = format_name(data.dtype, scale.ndim, data.ndim)
    if format_ is None:
        _fail(TypeError, f"`{name}.data` must be int8 or float8_e4m3fn (a scale per row), or "
                         f"uint8 (int4: a scale per group, one more axis), got {data.dtype} "
                         f"with a {scale.ndim}-D scale")
    if scale.dtype != np.float32:
        _fail(TypeError, f"`{name}.scale` must be float32, got {scale.dtype}")
    if format_ == "int4":
        if data.ndim < 1 or scale.shape[:-1] != data.shape[:-1] or scale.shape[-1] < 1 \
                or (2 * data.shape[-1]) % scale.shape[-1]:
            _fail(ValueError, f"`{name}.scale` of an int4 cache must be (..., D // group_size) "
                              f"with `{name}.data` (..., D // 2) = {data.shape}, a whole "
                              f"number of groups a row, got {scale.shape}")
    elif data.ndim < 1 or scale.shape != data.shape[:-1]:
        _fail(ValueError, f"`{name}.scale` must have the shape of `{name}.data` without its "
                          f"last axis, {data.shape[:-1]}, got {scale.shape}")
    return data, scale, format_


def _quantized_dtypes(q, k, v):
    """(output dtype, compute dtype) of a call on quantized caches: q float32, float16 or
    bfloat16; new keys and values of one float dtype (they are quantized as they are
    written)."""
    if q.dtype not in (np.float32, np.float16) and not _is_bfloat16(q.dtype):
        _fail(TypeError, f"`q` must be float32, float16 or bfloat16 with a quantized cache, "
                         f"got {q.dtype}")
    if k is not None and not (k.dtype == v.dtype and (k.dtype.kind == "f"
                                                      or _is_bfloat16(k.dtype))):
        _fail(TypeError, f"`k` and `v` must share one float dtype (they are quantized as they "
                         f"are written into the cache), got {k.dtype} and {v.dtype}")
    return q.dtype, np.dtype(np.float32)


def quantize_args(x, dtype, rotate=False, group_size=32):
    """Validate `cpuflash.quantize_kv`: (x as an array, format name, scales a row)."""
    x = as_array("x", x)
    if x.dtype.kind != "f" and not _is_bfloat16(x.dtype):
        _fail(TypeError, f"`x` must be a float array, got dtype {x.dtype}")
    if x.ndim < 1:
        _fail(ValueError, f"`x` must have at least one axis (rows of D numbers), got shape "
                          f"{x.shape}")
    if not isinstance(dtype, str) or dtype not in QUANT_MAX:
        _fail(ValueError, f"`dtype` must be one of {tuple(QUANT_MAX)}, got {dtype!r}")
    flag("rotate", rotate)
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        _fail(TypeError, f"`group_size` must be an int, got {type(group_size).__name__}")
    d = x.shape[-1]
    if dtype != "int4":
        if group_size != 32:
            _fail(ValueError, f"`group_size` applies to int4 only ({dtype} has one scale a "
                              f"row), got {group_size}")
    elif d % 2 or group_size < 1 or d % group_size:
        _fail(ValueError, f"an int4 cache needs an even head dim (two numbers a byte) that is a "
                          f"multiple of `group_size`: got head dim {d} and group_size "
                          f"{group_size}")
    if rotate:
        rotatable("x", d)
    return x, dtype, d // group_size if dtype == "int4" else 1


def rotatable(name, d):
    """A rotation's head dim: a power of two (the Walsh-Hadamard matrix's sizes)."""
    if d < 1 or d & (d - 1):
        _fail(ValueError, f"a rotated cache needs a head dim that is a power of two (the "
                          f"Walsh-Hadamard matrix's sizes): `{name}` has {d}")


def merge_args(outs, lses):
    """Validate `cpuflash.merge_states`: a stack of S partial outputs and their LSEs."""
    outs, lses = stacked("outs", outs), stacked("lses", lses)
    for name, x in (("outs", outs), ("lses", lses)):
        if x.dtype not in (np.float32, np.float64):
            _fail(TypeError, f"`{name}` must be float32 or float64, got {x.dtype}")
    if outs.ndim < 2 or lses.shape != outs.shape[:-1]:
        _fail(ValueError, f"`outs` must be (S, ..., Dv) and `lses` (S, ...) with the same "
                          f"leading shape, got {outs.shape} and {lses.shape}")
    if outs.shape[0] < 1:
        _fail(ValueError, "`outs` must hold at least one partial result, got 0")
    return outs, lses


def stacked(name, parts):
    """An (S, ...) array, or a sequence of S arrays of one shape stacked into one."""
    if not isinstance(parts, (list, tuple)):
        return as_array(name, parts)
    parts = [as_array(name, part) for part in parts]
    if not parts:
        _fail(ValueError, f"`{name}` must hold at least one partial result, got 0")
    shapes = {part.shape for part in parts}
    if len(shapes) > 1:
        _fail(ValueError, f"the parts of `{name}` must share one shape, got "
                          f"{sorted(shapes)}")
    return np.stack(parts)
