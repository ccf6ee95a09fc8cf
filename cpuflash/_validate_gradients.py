"""The backward's own arguments (`dout`, `out`, `lse`, and `dq`, `dk`, `dv` to write into),
checked against the forward's validated call (`_validate`) before anything is written."""

import dataclasses

import numpy as np

from . import _call, _validate


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
        kernel.append(_call.kernel_view(view))
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
