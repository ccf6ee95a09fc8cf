"""Your own score and mask functions, compiled into the FA-2 kernels (FlexAttention on the CPU).

A `score_mod(score, b, h, q_idx, kv_idx, *score_args)` and a `mask_mod(b, h, q_idx, kv_idx,
*mask_args)` are plain Python, compiled by Numba and inlined into the kernels' tiles
(`kernels._user`): the forward and the backward run them per score of the tiles they visit,
never on an ``Nq x Nk`` array. A `BlockMask` says which tiles are empty (never visited), full
(no `mask_mod` call) or partial.

Functions are told apart by a digest of their code, of the code of what they call and of the
values they read (`_digest`): a kernel compiled for them is cached on disk under that digest, so
the same function in a new process loads it, and an edited one compiles its own.
"""

import dis
import hashlib
import numbers
import threading
import types as pytypes

import numba
import numpy as np
from numba import types
from numba.core.registry import CPUDispatcher

from . import _backward, _schedule, _validate, api, tiling
from .kernels import _user
from .kernels._band import SEQ_N_K, SEQ_N_Q
from .kernels.backward import score_arg_grads

__all__ = ["BlockMask", "block_mask", "flex_attention", "flex_attention_backward"]

# the block mask's tiles when the caller names none: the backward's tiles (`tiling`), and the
# forward's where a block mask is given (`_user_call`), so that a kernel tile is one block: a
# document mask through it ran at 0.43x the speed of `attention_varlen` with the forward's own
# tiles (384 x 256, each meeting many blocks), 0.71x with these (2-core Zen 5, N = 2048)
DEFAULT_BLOCK = (tiling.BACKWARD_BLOCK_Q, tiling.BACKWARD_BLOCK_K)

_lock = threading.Lock()
_compiled = {}  # (role, function) -> (digest, jitted function, the values it reads)


def _fail(exc, message):
    raise exc(message) from None


# -- the user's functions -------------------------------------------------------------------

def _describe(value, seen):
    """Bytes that change when `value`, read by a user function, changes what it computes."""
    if isinstance(value, CPUDispatcher):
        value = value.py_func
    if isinstance(value, pytypes.FunctionType):
        return _digest(value, seen).encode()
    if isinstance(value, pytypes.ModuleType):
        return f"module {value.__name__}".encode()
    if isinstance(value, np.ndarray):
        return (f"array {value.dtype} {value.shape} ".encode()
                + hashlib.sha256(np.ascontiguousarray(value).tobytes()).digest())
    if isinstance(value, (numbers.Number, str, bytes, bool, type(None), np.generic)):
        return f"{type(value).__name__} {value!r}".encode()
    if isinstance(value, tuple):
        return b"(" + b",".join(_describe(x, seen) for x in value) + b")"
    return f"{type(value).__module__}.{type(value).__qualname__}".encode()


def _feed_code(digest, code, function, seen):
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    digest.update(f"{code.co_argcount} {code.co_varnames}".encode())
    for const in code.co_consts:
        if isinstance(const, pytypes.CodeType):
            _feed_code(digest, const, function, seen)
        else:
            digest.update(repr(const).encode())
    for name in code.co_names:
        if name in function.__globals__:
            digest.update(name.encode() + _describe(function.__globals__[name], seen))


def _digest(function, seen=None):
    """A hex digest of `function`'s code, of what it reads (globals, closure cells) and of the
    functions it calls, recursively."""
    seen = set() if seen is None else seen
    if id(function) in seen:
        return "recursive"
    seen.add(id(function))
    digest = hashlib.sha256(f"{function.__module__}.{function.__qualname__}".encode())
    _feed_code(digest, function.__code__, function, seen)
    for cell in function.__closure__ or ():
        digest.update(_describe(cell.cell_contents, seen))
    for value in function.__defaults__ or ():
        digest.update(_describe(value, seen))
    return digest.hexdigest()


_RAISES = {"RAISE_VARARGS", "RERAISE"}  # the opcodes of `raise` and `assert`


def _raising(function, seen=None):
    """The name of `function`, or of a function it calls, whose code has a `raise` or an
    `assert`; None when none has."""
    seen = set() if seen is None else seen
    if isinstance(function, CPUDispatcher):
        function = function.py_func
    if not isinstance(function, pytypes.FunctionType) or id(function) in seen:
        return None
    seen.add(id(function))
    codes = [function.__code__]
    for code in codes:
        if any(op.opname in _RAISES for op in dis.get_instructions(code)):
            return function.__qualname__
        codes += [const for const in code.co_consts if isinstance(const, pytypes.CodeType)]
        for name in code.co_names:
            culprit = _raising(function.__globals__.get(name), seen)
            if culprit is not None:
                return culprit
    for cell in function.__closure__ or ():
        culprit = _raising(cell.cell_contents, seen)
        if culprit is not None:
            return culprit
    return None


# what a user function may read besides its arguments: values Numba cannot be told to change
# (a changed global is not seen by the function it compiled, in this process or from the cache)
_CONSTANT_TYPES = (numbers.Number, str, bytes, type(None), np.generic, np.dtype, type,
                   pytypes.ModuleType, pytypes.BuiltinFunctionType, np.ufunc, types.Type)
_ARGUMENTS_OF = {"score_mod": "score_args", "mask_mod": "mask_args",
                 "score_mod_grad": "score_args"}
_MISSING = object()


def _reads(function, role, seen=None):
    """[(namespace, name, value)] of the globals and closure cells `function` reads, and those
    of the functions it calls; a TypeError naming one whose value can change in place (an
    array, a list, a tensor): Numba compiles such a value into the function, and the kernels
    would go on computing with the value it had at the first call."""
    seen = set() if seen is None else seen
    if isinstance(function, CPUDispatcher):
        function = function.py_func
    if not isinstance(function, pytypes.FunctionType) or id(function) in seen:
        return []
    seen.add(id(function))
    reads = []

    def check(where, value):
        if isinstance(value, tuple):
            for item in value:
                check(where, item)
        elif isinstance(value, (pytypes.FunctionType, CPUDispatcher)):
            reads.extend(_reads(value, role, seen))
        elif not isinstance(value, _CONSTANT_TYPES):
            kind = f"{type(value).__module__}.{type(value).__qualname__}"
            _fail(TypeError, f"`{role}` ({function.__qualname__}) reads {where}, a {kind}: Numba "
                             f"compiles the value it has at the first call into the function, "
                             f"so a later change to it would be ignored. Pass it in "
                             f"`{_ARGUMENTS_OF[role]}` (it arrives after kv_idx) instead")

    namespace = function.__globals__
    codes = [function.__code__]
    for code in codes:
        codes += [const for const in code.co_consts if isinstance(const, pytypes.CodeType)]
        instructions = list(dis.get_instructions(code))
        for i, op in enumerate(instructions):
            if op.opname not in ("LOAD_GLOBAL", "LOAD_NAME") or op.argval not in namespace:
                continue  # (a builtin)
            value = namespace[op.argval]
            reads.append((namespace, op.argval, value))
            where = f"the global `{op.argval}`"
            for attr in instructions[i + 1:]:  # `module.name`: the value the attribute holds
                if not isinstance(value, pytypes.ModuleType) or \
                        attr.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
                    break
                reads.append((value.__dict__, attr.argval, getattr(value, attr.argval, None)))
                value = getattr(value, attr.argval, None)
                where += f".{attr.argval}"
            check(where, value)
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        reads.append((cell, name, cell.cell_contents))
        check(f"`{name}` from its closure", cell.cell_contents)
    for value in function.__defaults__ or ():
        check("a default argument", value)
    return reads


def _unchanged(reads):
    """Whether every global and closure cell in `reads` still holds the value it held."""
    for namespace, name, value in reads:
        now = (namespace.cell_contents if isinstance(namespace, pytypes.CellType)
               else namespace.get(name, _MISSING))
        if now is not value:
            return False
    return True


def _user_function(role, function):
    """(digest, jitted function) of a user function given as `role` ("score_mod", ...)."""
    if isinstance(function, CPUDispatcher):
        function = function.py_func
    if not isinstance(function, pytypes.FunctionType):
        _fail(TypeError, f"`{role}` must be a Python function (or a numba.njit one), got "
                         f"{type(function).__name__}")
    with _lock:
        known = _compiled.get((role, function))
        # a global rebound to another constant since (`SCALE = 2.0`): compiled anew, under a
        # digest of its new value
        if known is None or not _unchanged(known[2]):
            # an exception raised on a worker thread of a kernel's parallel loop is lost (the
            # call returns as if nothing happened), on the calling thread it comes back as a
            # SystemError: no function that can raise runs in a kernel
            culprit = _raising(function)
            if culprit is not None:
                _fail(TypeError, f"`{role}` ({function.__qualname__}) must not raise: "
                                 f"{culprit} has a `raise` or an `assert`, and an exception "
                                 "cannot leave the kernels' parallel loops; return -inf (a "
                                 "score) or False (a mask) instead")
            reads = _reads(function, role)
            options = _user_options()
            jitted = numba.njit(**options)(function)
            described = sorted((name, sorted(value) if isinstance(value, set) else value)
                               for name, value in options.items())  # (sets: in a fixed order)
            digest = hashlib.sha256(f"{_digest(function)} {described}".encode())
            known = _compiled[(role, function)] = (digest.hexdigest(), jitted, reads)
    return known[:2]


def _user_options():
    """How user functions are compiled (part of their kernels' key): as the kernels' helpers
    (LLVM inlines them into the tile loops)."""
    from ._jit import FASTMATH

    return dict(nogil=True, error_model="numpy", boundscheck=False, fastmath=set(FASTMATH))


def _check_compiles(role, function, jitted, arg_types, want):
    """Compile `jitted` for `arg_types` now, so that a function Numba cannot compile, or one
    returning the wrong kind of value, is a TypeError naming it before any work."""
    name = getattr(function, "__qualname__", role)
    try:
        jitted.compile(tuple(arg_types))
        result = jitted.overloads[tuple(arg_types)].signature.return_type
    except Exception as exc:  # Numba's typing and lowering errors have no common base
        reason = str(exc).strip().splitlines()
        reason = "; ".join(line.strip() for line in reason[:6] if line.strip())
        _fail(TypeError, f"`{role}` ({name}) cannot be compiled by Numba for arguments "
                         f"({', '.join(str(t) for t in arg_types)}): {reason}")
    if want == "bool" and not isinstance(result, types.Boolean):
        _fail(TypeError, f"`{role}` ({name}) must return a bool (True: the key takes part), "
                         f"got {result}")
    if want == "number" and not isinstance(result, (types.Number, types.Boolean)):
        _fail(TypeError, f"`{role}` ({name}) must return a number (the new score), got {result}")


def _args_value(name, args):
    """A `score_args`/`mask_args` value as the kernels take it: a tuple of arrays and numbers,
    arrays C-contiguous (so that one kernel serves any strides)."""
    if not isinstance(args, (tuple, list)):
        _fail(TypeError, f"`{name}` must be a tuple of arrays and numbers, got "
                         f"{type(args).__name__}")
    values = []
    for i, x in enumerate(args):
        if isinstance(x, (bool, numbers.Integral, numbers.Real, np.generic)):
            values.append(x)
            continue
        x = _validate.as_array(f"{name}[{i}]", x)  # a torch tensor, a list
        if x.dtype == np.float16 or _validate._is_bfloat16(x.dtype):
            x = x.astype(np.float32)  # read widened, as the kernels read such q, k, v
        if x.dtype.kind not in "biuf":
            _fail(TypeError, f"`{name}[{i}]` must be a bool, integer or float array, got "
                             f"dtype {x.dtype}")
        values.append(np.ascontiguousarray(x))
    return tuple(values)


def _functions(score_mod, mask_mod, score_args, mask_args, compute):
    """`_user.UserFunctions` of the call, registered for the kernels' compile, after checking
    that the functions compile for the call's argument types."""
    score_type = numba.from_dtype(compute)
    index = (types.int64,) * 4
    key_parts = []
    registered = [None, None]
    for slot, (role, function, args, want, lead) in enumerate((
            ("score_mod", score_mod, score_args, "number", (score_type,) + index),
            ("mask_mod", mask_mod, mask_args, "bool", index))):
        if function is None:
            key_parts.append("-")
            continue
        digest, jitted = _user_function(role, function)
        arg_types = lead + tuple(numba.typeof(x) for x in args)
        _check_compiles(role, function, jitted, arg_types, want)
        key_parts.append(digest[:20])
        registered[slot] = jitted
    if registered == [None, None]:
        return _user.NONE
    key = "_".join(key_parts)
    _user.REGISTRY.setdefault(key, tuple(registered) + (None,))
    return _user.UserFunctions(key)


def _grad_functions(fns, score_mod_grad):
    """`_user.UserFunctions` of the call's functions and its `score_mod_grad`."""
    digest, jitted = _user_function("score_mod_grad", score_mod_grad)
    key = f"{fns.key}_g{digest[:20]}"
    _user.REGISTRY.setdefault(key, _user.REGISTRY[fns.key][:2] + (jitted,))
    return _user.UserFunctions(key), jitted


# -- block masks ----------------------------------------------------------------------------

class BlockMask:
    """Which tiles of a `mask_mod` are empty, partial or full, found once (`block_mask`).

    ``states[b, h, i, j]`` is `EMPTY`, `PARTIAL` or `FULL` for the query rows ``i * block_q ..``
    and the keys ``j * block_k ..``; a batch or head axis of length 1 stands for all. The
    mask it was built from travels with it: ``flex_attention(..., block_mask=bm)`` applies it.
    """

    EMPTY, PARTIAL, FULL = _user.EMPTY, _user.PARTIAL, _user.FULL

    def __init__(self, mask_mod, args, shape, block, states):
        self.mask_mod = mask_mod
        self.args = args
        self.shape = shape  # (B, H, Nq, Nk)
        self.block = block  # (block_q, block_k)
        self.states = states

    def sparsity(self):
        """The share of (b, h) tiles that are empty, as torch's `BlockMask.sparsity` (in %)."""
        return 100.0 * float(np.mean(self.states == _user.EMPTY))

    def __repr__(self):
        counts = {name: int(np.sum(self.states == value)) for name, value in
                  (("empty", self.EMPTY), ("partial", self.PARTIAL), ("full", self.FULL))}
        return (f"BlockMask(shape={self.shape}, block={self.block}, "
                + ", ".join(f"{k}={v}" for k, v in counts.items()) + ")")


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
    args = _args_value("args", args)
    digest, jitted = _user_function("mask_mod", mask_mod)
    _check_compiles("mask_mod", mask_mod, jitted,
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

def _user_call(call, score_mod, score_args, mask_mod, mask_args, block_mask, positions=False):
    """Put the user's functions into the validated `call` (its `user`), checking them and the
    block mask against it. `positions`: the functions see a query's position in its sequence
    (a KV cache's queries), not its row in the call."""
    score_args = _args_value("score_args", score_args)
    states = _validate.NO_USER_FUNCTIONS.block_states
    block = (1, 1)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            _fail(TypeError, f"`block_mask` must be a cpuflash BlockMask (from "
                             f"`cpuflash.block_mask`), got {type(block_mask).__name__}")
        B, H, Nq, Nk = block_mask.shape
        if (B not in (1, call.batch) or H not in (1, call.n_heads) or Nq != call.n_q
                or Nk != call.n_k):
            _fail(ValueError, f"`block_mask` was built for (B, H, Nq, Nk) = {block_mask.shape};"
                              f" this call needs B in (1, {call.batch}), H in (1, "
                              f"{call.n_heads}), Nq = {call.n_q}, Nk = {call.n_k}")
        if mask_mod is None:
            mask_mod, mask_args = block_mask.mask_mod, block_mask.args
        elif _user_function("mask_mod", mask_mod)[0] != _user_function(
                "mask_mod", block_mask.mask_mod)[0]:
            _fail(ValueError, "`mask_mod` must be the function `block_mask` was built from "
                              "(or be left out: the block mask brings its own)")
        states, block = block_mask.states, block_mask.block
        if (call.tiles is None and block[0] % tiling.BLOCK_Q_MULTIPLE == 0
                and block[1] % tiling.KEY_PANEL == 0):
            call.tiles = tiling.TileConfig(*block)  # a kernel tile is one block
    mask_args = _args_value("mask_args", mask_args)
    if mask_mod is None and mask_args:
        _fail(ValueError, "`mask_args` given without a `mask_mod`")
    if score_mod is None and score_args:
        _fail(ValueError, "`score_args` given without a `score_mod`")
    fns = _functions(score_mod, mask_mod, score_args, mask_args, call.compute_dtype)
    if fns is _user.NONE:
        return
    call.user = _validate.UserFunctions(
        functions=fns, score_args=_user.with_end(score_args), mask_args=_user.with_end(mask_args),
        block_states=states, block_q=block[0], block_k=block[1], positions=positions)


def flex_attention(q, k, v, *, score_mod=None, score_args=(), mask_mod=None, mask_args=(),
                   block_mask=None, causal=False, scale=None, window=None, softcap=0.0,
                   alibi_slopes=None, bias=None, mask=None, sinks=None, layout="bhsd",
                   return_lse=False, out=None, tiles=None):
    """`cpuflash.attention` with your own score and mask functions compiled into its tiles.

    Parameters
    ----------
    q, k, v, causal, scale, window, softcap, alibi_slopes, bias, mask, sinks, layout,
    return_lse, out, tiles
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
        q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks, layout=layout,
        return_lse=return_lse, out=out, tiles=tiles)
    _user_call(call, score_mod, score_args, mask_mod, mask_args, block_mask)
    if not (call.n_q and call.batch and call.n_heads):
        return call.result(return_lse)
    api._run_forward(call, _schedule.sequence_table(call.n_q, call.n_k, call.batch))
    return call.result(return_lse)


def flex_attention_backward(dout, q, k, v, out, lse, *, score_mod=None, score_args=(),
                            mask_mod=None, mask_args=(), block_mask=None, causal=False,
                            scale=None, window=None, softcap=0.0, alibi_slopes=None, bias=None,
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
        q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks, layout=layout,
        return_lse=True)
    _user_call(call, score_mod, score_args, mask_mod, mask_args, block_mask)
    if score_mod is not None:
        _check_differentiable(score_mod, call)
    grads = _backward.gradient_args(call, (q, k, v), dout, out, lse, dq, dk, dv, layout)
    seqs = _schedule.sequence_table(call.n_q, call.n_k, call.batch)
    wanted = None
    if score_mod_grad is not None:  # (checked before anything is written)
        wanted = _score_grad_setup(call, score_mod, score_mod_grad)
    delta = _backward._run_backward(call, grads, seqs)
    result = grads.result()
    if call.sinks.size:
        result += (_backward._sink_gradient(call.sinks, grads.lse, delta),)
    if wanted is not None:
        result += (_score_arg_gradients(call, grads, seqs, delta, *wanted),)
    return result


# how many parts the gradients of `score_args` are summed in (each run by one thread at a
# time): fixed, so that the bits do not depend on the thread count
GRAD_SLOTS = 32


def _score_grad_setup(call, score_mod, score_mod_grad):
    """(grad functions, the float arrays of score_args): checked and compiled."""
    if score_mod is None:
        _fail(ValueError, "`score_mod_grad` given without a `score_mod`")
    float_args = [x for x in call.user.score_args[:-1] if isinstance(x, np.ndarray)
                  and x.dtype.kind == "f"]
    if not float_args:
        _fail(ValueError, "`score_mod_grad` given, but `score_args` holds no float array to "
                          "differentiate")
    grad_fns, jitted = _grad_functions(call.user.functions, score_mod_grad)
    score_type = numba.from_dtype(call.compute_dtype)
    grad_types = [numba.typeof(np.zeros((0,) * x.ndim, dtype=call.compute_dtype))
                  for x in float_args]
    arg_types = ((score_type, score_type) + (types.int64,) * 4
                 + tuple(numba.typeof(x) for x in call.user.score_args[:-1])
                 + tuple(grad_types))
    _check_compiles("score_mod_grad", score_mod_grad, jitted, arg_types, None)
    return grad_fns, float_args


def _score_arg_gradients(call, grads, seqs, delta, grad_fns, float_args):
    """The tuple of gradients of the float arrays of score_args (`_score_arg_grads`)."""
    longest_q, longest_k = int(seqs[:, SEQ_N_Q].max()), int(seqs[:, SEQ_N_K].max())
    tiles = tiling.backward_tiles(longest_q, longest_k)
    items, _ = _schedule.work_items(seqs, call.n_heads, tiles.block_q, call.window,
                                    tiles.block_k)
    n_slots = max(1, min(GRAD_SLOTS, len(items)))
    slot_ptr = np.linspace(0, len(items), n_slots + 1).round().astype(np.int64)
    parts = tuple(np.zeros((n_slots,) + x.shape, dtype=call.compute_dtype) for x in float_args)
    if len(items):
        kernel = score_arg_grads.specialize(
            (call.q.dtype, call.compute_dtype, _validate.user_types(call.user),
             numba.typeof(grad_fns),
             numba.typeof(parts)))
        kernel(call.q, call.k, call.v, _validate.kernel_view(grads.dout), grads.lse, delta,
               seqs, items, slot_ptr, tiles.block_q, tiles.block_k, call.half_kind,
               *call.kernel_pipeline(), grad_fns, parts)
    return tuple(part.sum(axis=0) for part in parts)


def _check_differentiable(score_mod, call):
    """A TypeError naming `score_mod` when it cannot run on dual numbers."""
    _, jitted = _user_function("score_mod", score_mod)
    error = _user.dual_error(jitted, numba.from_dtype(call.compute_dtype),
                             [numba.typeof(x) for x in call.user.score_args[:-1]])
    if error is not None:
        reason = "; ".join(line.strip() for line in str(error).strip().splitlines()[:4]
                           if line.strip())
        _fail(TypeError, f"`score_mod` ({score_mod.__qualname__}) cannot be differentiated "
                         f"by cpuflash: it must use only + - * / **, comparisons, abs, min, max "
                         f"and math.exp/log/log1p/sqrt/tanh/sin/cos on the score. Numba says: "
                         f"{reason}")
