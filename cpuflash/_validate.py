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

import numpy as np

from .tiling import TileConfig

# How the kernels read the uint16 bits of a half-precision input.
NATIVE, FLOAT16, BFLOAT16 = 0, 1, 2

LAYOUTS = ("bhsd", "bshd")


def _fail(exc, message):
    raise exc(message) from None


def _is_bfloat16(dtype):
    return dtype.name == "bfloat16"


def as_array(name, x):
    """`x` as a numpy array without copying; anything numpy cannot view is a TypeError."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple, numbers.Number, str, bytes)) or x is None:
        _fail(TypeError, f"`{name}` must be an array, got {type(x).__name__}")
    try:
        return np.asarray(x)
    except Exception as exc:  # noqa: BLE001 - any failure here means "not an array"
        _fail(TypeError, f"`{name}` must be an array (numpy, or viewable by numpy.asarray), "
                         f"got {type(x).__name__}: {exc}")


def input_dtype(q, k, v):
    """The shared dtype of q, k, v; a TypeError naming the dtypes otherwise."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    if not (dtypes[0] == dtypes[1] == dtypes[2]):
        _fail(TypeError, "`q`, `k` and `v` must share one dtype, got "
                         f"{dtypes[0]}, {dtypes[1]} and {dtypes[2]}")
    dtype = dtypes[0]
    if dtype not in (np.float32, np.float64, np.float16) and not _is_bfloat16(dtype):
        _fail(TypeError, "`q`, `k` and `v` must be float32, float64, float16 or bfloat16, "
                         f"got {dtype}")
    return dtype


def compute_dtype(dtype):
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def kernel_view(x):
    """The array the kernels read: uint16 bits for half precision, aligned memory."""
    if x.dtype == np.float16 or _is_bfloat16(x.dtype):
        x = x.view(np.uint16)
    if not x.flags.aligned:
        x = x.copy()
    return x


def half_kind(dtype):
    if dtype == np.float16:
        return FLOAT16
    return BFLOAT16 if _is_bfloat16(dtype) else NATIVE


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
    """A float array argument (slopes, bias, sinks) converted to the compute dtype."""
    x = as_array(name, x)
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


class AttentionCall:
    """One validated `attention` call: the kernel's arrays and how to hand the result back."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def result(self, return_lse):
        if self.copy_back is not None:
            np.copyto(self.copy_back, self.out_user.view(self.copy_back.dtype))
            out = self.copy_back
        else:
            out = self.out_user
        if not return_lse:
            return out
        return out, self.lse.reshape(self.lse_shape)


def attention_args(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0,
                   alibi_slopes=None, bias=None, mask=None, sinks=None, layout="bhsd",
                   return_lse=False, out=None, tiles=None):
    """Validate the arguments of `cpuflash.attention` and build the kernel's view of them."""
    q, k, v = as_array("q", q), as_array("k", k), as_array("v", v)
    dtype = input_dtype(q, k, v)
    cdtype = compute_dtype(dtype)
    if layout not in LAYOUTS:
        _fail(ValueError, f"`layout` must be one of {LAYOUTS}, got {layout!r}")
    causal = flag("causal", causal)
    flag("return_lse", return_lse)

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
    batch = math.prod(lead)
    n_heads, n_q, d = q4.shape[-3:]
    n_kv_heads, n_k, d_k = k4.shape[-3:]
    n_v_heads, n_v, d_v = v4.shape[-3:]
    if d_k != d:
        _fail(ValueError, f"`k` has head dim {d_k} but `q` has {d}")
    if d < 1 or d_v < 1:
        _fail(ValueError, f"head dims must be >= 1, got {d} for `q` and {d_v} for `v`")
    if n_v != n_k:
        _fail(ValueError, f"`v` has {n_v} keys but `k` has {n_k}")
    if n_v_heads != n_kv_heads:
        _fail(ValueError, f"`v` has {n_v_heads} heads but `k` has {n_kv_heads}")
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        _fail(ValueError, f"the number of query heads ({n_heads}) must be a multiple of the "
                          f"number of key/value heads ({n_kv_heads})")
    q4, k4, v4 = (x.reshape((batch,) + x.shape[-3:]) for x in (q4, k4, v4))

    # -- scalars
    qk_scale = scale_value(scale, d)
    left, right = window_value(window, causal)
    softcap = softcap_value(softcap)
    tiles = tiles_value(tiles)

    # -- score modifiers
    no_batch = np.zeros(batch, dtype=np.int64)
    alibi = np.zeros((batch, 0), dtype=cdtype)
    if alibi_slopes is not None:
        alibi = float_operand("alibi_slopes", alibi_slopes, cdtype)
        exact_shape("alibi_slopes", alibi, [(n_heads,), tuple(lead) + (n_heads,)])
        alibi = np.broadcast_to(alibi, tuple(lead) + (n_heads,)).reshape(batch, n_heads)
    scores = (n_heads, n_q, n_k)
    bias4, bias_map = np.zeros((0, 0, 0, 0), dtype=cdtype), no_batch
    if bias is not None:
        bias4, bias_map = broadcast_operand("bias", float_operand("bias", bias, cdtype),
                                            lead, scores)
    mask4, mask_map = np.zeros((0, 0, 0, 0), dtype=np.bool_), no_batch
    if mask is not None:
        mask = as_array("mask", mask)
        if mask.dtype != np.bool_:
            _fail(TypeError, f"`mask` must be a boolean array (True = the key takes part), "
                             f"got dtype {mask.dtype}")
        mask4, mask_map = broadcast_operand("mask", mask, lead, scores)
    sinks_arr = np.zeros(0, dtype=cdtype)
    if sinks is not None:
        sinks_arr = float_operand("sinks", sinks, cdtype)
        exact_shape("sinks", sinks_arr, [(n_heads,)])

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
        out_user = out_value(out, out_shape, dtype, (q, k, v))
        if out_user is not out:
            copy_back = out
    out4 = np.swapaxes(out_user, 1, 2) if layout == "bshd" else out_user
    out_kernel = reshaped_view(out4, (batch, n_heads, n_q, d_v))
    if out_kernel is None:  # the user's strides cannot be flattened: write a copy, then copy it
        copy_back = out_user
        out_user = np.empty(out_shape, dtype=dtype)
        out4 = np.swapaxes(out_user, 1, 2) if layout == "bshd" else out_user
        out_kernel = reshaped_view(out4, (batch, n_heads, n_q, d_v))

    return AttentionCall(
        q=kernel_view(q4), k=kernel_view(k4), v=kernel_view(v4), out_kernel=kernel_view(out_kernel),
        dtype=dtype, compute_dtype=cdtype, half_kind=half_kind(dtype),
        lse=np.empty((batch, n_heads, n_q), dtype=cdtype), lse_shape=lse_shape,
        out_user=out_user, copy_back=copy_back,
        batch=batch, n_heads=n_heads, n_kv_heads=n_kv_heads, n_q=n_q, n_k=n_k,
        head_dim=d, head_dim_v=d_v,
        qk_scale=qk_scale, causal=causal, window=(left, right), softcap=softcap,
        alibi=alibi, bias=bias4, bias_map=bias_map, mask=mask4, mask_map=mask_map,
        sinks=sinks_arr, tiles=tiles,
    )


def out_value(out, shape, dtype, inputs):
    """Check a user's `out`; returns it, or a fresh array when it overlaps an input."""
    if not isinstance(out, np.ndarray):
        _fail(TypeError, f"`out` must be a numpy array, got {type(out).__name__}")
    if out.shape != shape:
        _fail(ValueError, f"`out` must have shape {shape}, got {out.shape}")
    if out.dtype != dtype:
        _fail(TypeError, f"`out` must have dtype {dtype} (that of `q`), got {out.dtype}")
    if not out.flags.writeable:
        _fail(ValueError, "`out` must be writeable, got a read-only array")
    if any(np.may_share_memory(out, x) for x in inputs):
        return np.empty(shape, dtype=dtype)  # written, then copied over the inputs it aliases
    return out
