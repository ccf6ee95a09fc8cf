"""The user's score and mask functions, checked and compiled for a validated call.

A `score_mod(score, b, h, q_idx, kv_idx, *score_args)` and a `mask_mod(b, h, q_idx, kv_idx,
*mask_args)` are plain Python, compiled by Numba and inlined into the kernels' tiles
(`kernels._user`). `with_user_functions` checks them, their arguments and a `BlockMask` against
a call from `_validate` and returns the call with them; nothing computes with them here.

Functions are told apart by a digest of their code, of the code of what they call and of the
values they read (`_digest`): a kernel compiled for them is cached on disk under that digest, so
the same function in a new process loads it, and an edited one compiles its own. A function may
read only values that cannot change in place (`_reads`): Numba compiles what it reads into it.
"""

import dataclasses
import dis
import hashlib
import numbers
import threading
import types as pytypes

import numba
import numpy as np
from numba import types
from numba.core.registry import CPUDispatcher

from . import _call, _validate, tiling
from .kernels import _user

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

# what a user function may read besides its arguments: values Numba cannot be told to change
# (a changed global is not seen by the function it compiled, in this process or from the cache)
_CONSTANT_TYPES = (numbers.Number, str, bytes, type(None), np.generic, np.dtype, type,
                   pytypes.ModuleType, pytypes.BuiltinFunctionType, np.ufunc, types.Type)
_ARGUMENTS_OF = {"score_mod": "score_args", "mask_mod": "mask_args",
                 "score_mod_grad": "score_args"}
_MISSING = object()


def _codes(function):
    """The code of `function` and of the functions and lambdas defined in it."""
    codes = [function.__code__]
    for code in codes:
        codes += [const for const in code.co_consts if isinstance(const, pytypes.CodeType)]
    return codes


def _own_reads(function):
    """[(namespace, name, value, where)]: what `function` itself reads besides its arguments.
    Its globals (and the value a ``module.name`` chain reaches), its closure cells (the cell
    as namespace) and its defaults (namespace None); `where` names it for a message."""
    reads = []
    namespace = function.__globals__
    for code in _codes(function):
        instructions = list(dis.get_instructions(code))
        for i, op in enumerate(instructions):
            if op.opname not in ("LOAD_GLOBAL", "LOAD_NAME") or op.argval not in namespace:
                continue  # (a builtin)
            value, where = namespace[op.argval], f"the global `{op.argval}`"
            reads.append((namespace, op.argval, value, where))
            for attr in instructions[i + 1:]:  # `module.name`: the value the attribute holds
                if not isinstance(value, pytypes.ModuleType) or \
                        attr.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
                    break
                owner, value = value, getattr(value, attr.argval, None)
                where += f".{attr.argval}"
                reads.append((owner.__dict__, attr.argval, value, where))
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        reads.append((cell, name, cell.cell_contents, f"`{name}` from its closure"))
    reads += [(None, None, value, "a default argument") for value in function.__defaults__ or ()]
    return reads


def _flat(value):
    """`value`, or the items of a tuple (of tuples), one by one."""
    if isinstance(value, tuple):
        for item in value:
            yield from _flat(item)
    else:
        yield value


def _reached(function):
    """[(function, `_own_reads(function)`)] for `function` and each Python function it reaches
    through what it reads (a numba.njit one by its Python function), each once."""
    reached, seen, todo = [], set(), [function]
    while todo:
        function = todo.pop(0)
        if isinstance(function, CPUDispatcher):
            function = function.py_func
        if not isinstance(function, pytypes.FunctionType) or id(function) in seen:
            continue
        seen.add(id(function))
        reads = _own_reads(function)
        reached.append((function, reads))
        todo += [item for read in reads for item in _flat(read[2])]
    return reached


def _raising(reached):
    """The name of the first of the `_reached` functions whose code has a `raise` or an
    `assert`; None when none has."""
    for function, _ in reached:
        for code in _codes(function):
            if any(op.opname in _RAISES for op in dis.get_instructions(code)):
                return function.__qualname__
    return None


def _reads(reached, role):
    """[(namespace, name, value)] of the globals and closure cells the `_reached` functions
    read; a TypeError naming one whose value can change in place (an array, a list, a tensor):
    Numba compiles such a value into the function, and the kernels would go on computing with
    the value it had at the first call."""
    for function, reads in reached:
        for _, _, value, where in reads:
            for item in _flat(value):
                if not isinstance(item, (_CONSTANT_TYPES, pytypes.FunctionType, CPUDispatcher)):
                    kind = f"{type(item).__module__}.{type(item).__qualname__}"
                    _fail(TypeError, f"`{role}` ({function.__qualname__}) reads {where}, a "
                                     f"{kind}: Numba compiles the value it has at the first call "
                                     f"into the function, so a later change to it would be "
                                     f"ignored. Pass it in `{_ARGUMENTS_OF[role]}` (it arrives "
                                     f"after kv_idx) instead")
    return [(namespace, name, value) for _, reads in reached
            for namespace, name, value, _ in reads if namespace is not None]


def _unchanged(reads):
    """Whether every global and closure cell in `reads` still holds the value it held."""
    for namespace, name, value in reads:
        now = (namespace.cell_contents if isinstance(namespace, pytypes.CellType)
               else namespace.get(name, _MISSING))
        if now is not value:
            return False
    return True


def user_function(role, function):
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
            reached = _reached(function)
            culprit = _raising(reached)
            if culprit is not None:
                _fail(TypeError, f"`{role}` ({function.__qualname__}) must not raise: "
                                 f"{culprit} has a `raise` or an `assert`, and an exception "
                                 "cannot leave the kernels' parallel loops; return -inf (a "
                                 "score) or False (a mask) instead")
            reads = _reads(reached, role)
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


def check_compiles(role, function, jitted, arg_types, want):
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


def args_value(name, args):
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
        if x.dtype == np.float16 or _call._is_bfloat16(x.dtype):
            x = x.astype(np.float32)  # read widened, as the kernels read such q, k, v
        if x.dtype.kind not in "biuf":
            _fail(TypeError, f"`{name}[{i}]` must be a bool, integer or float array, got "
                             f"dtype {x.dtype}")
        values.append(np.ascontiguousarray(x))
    return tuple(values)


def listed_functions(score_mod, score_args, mask_mod, mask_args, compute):
    """(score, mask) of a call whose functions run outside the kernels' own indices (listed
    keys, `_sparse`), each checked and compiled for the call's argument types as a kernel's are,
    before any work: score = (score_mod, its args), mask = (jitted mask_mod, its args), None
    where there is none."""
    score_args, mask_args = args_value("score_args", score_args), args_value("mask_args",
                                                                              mask_args)
    _args_without_function(score_mod, score_args, mask_mod, mask_args)
    score = mask = None
    if score_mod is not None:
        _checked("score_mod", score_mod, score_args, compute)
        score = (score_mod, score_args)
    if mask_mod is not None:
        mask = (_checked("mask_mod", mask_mod, mask_args, compute)[1], mask_args)
    return score, mask


def _args_without_function(score_mod, score_args, mask_mod, mask_args):
    """The ValueError of arguments given for a function that is not."""
    if mask_mod is None and mask_args:
        _fail(ValueError, "`mask_args` given without a `mask_mod`")
    if score_mod is None and score_args:
        _fail(ValueError, "`score_args` given without a `score_mod`")


def _checked(role, function, args, compute):
    """(digest, jitted function) of the user's `function` as `role`, compiled now for the
    call's argument types (`check_compiles`): the score (of dtype `compute`, for a score_mod),
    b, h, q_idx, kv_idx, then `args`."""
    lead = (numba.from_dtype(compute),) if role == "score_mod" else ()
    digest, jitted = user_function(role, function)
    arg_types = lead + (types.int64,) * 4 + tuple(numba.typeof(x) for x in args)
    check_compiles(role, function, jitted, arg_types,
                   "number" if role == "score_mod" else "bool")
    return digest, jitted


def functions_of(score_mod, mask_mod, score_args, mask_args, compute):
    """`_user.UserFunctions` of the call, registered for the kernels' compile, after checking
    that the functions compile for the call's argument types."""
    key_parts = []
    registered = [None, None]
    for slot, (role, function, args) in enumerate((("score_mod", score_mod, score_args),
                                                    ("mask_mod", mask_mod, mask_args))):
        if function is None:
            key_parts.append("-")
            continue
        digest, jitted = _checked(role, function, args, compute)
        key_parts.append(digest[:20])
        registered[slot] = jitted
    if registered == [None, None]:
        return _user.NONE
    key = "_".join(key_parts)
    _user.REGISTRY.setdefault(key, tuple(registered) + (None,))
    return _user.UserFunctions(key)


def grad_functions(fns, score_mod_grad):
    """`_user.UserFunctions` of the call's functions and its `score_mod_grad`."""
    digest, jitted = user_function("score_mod_grad", score_mod_grad)
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



# -- a call's functions ---------------------------------------------------------------------

def with_user_functions(call, score_mod, score_args, mask_mod, mask_args, block_mask,
                        positions=False):
    """The validated `call` with the user's functions (its `user`, and the block mask's tiles
    where the caller gave none), checked against it; `call` itself when there are none.
    `positions`: the functions see a query's position in its sequence (a KV cache's queries),
    not its row in the call."""
    score_args = args_value("score_args", score_args)
    states = _call.NO_USER_FUNCTIONS.block_states
    block = (1, 1)
    tiles = call.tiles
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
        elif user_function("mask_mod", mask_mod)[0] != user_function(
                "mask_mod", block_mask.mask_mod)[0]:
            _fail(ValueError, "`mask_mod` must be the function `block_mask` was built from "
                              "(or be left out: the block mask brings its own)")
        states, block = block_mask.states, block_mask.block
        if (call.tiles is None and block[0] % tiling.BLOCK_Q_MULTIPLE == 0
                and block[1] % tiling.KEY_PANEL == 0):
            tiles = tiling.TileConfig(*block)  # a kernel tile is one block
    mask_args = args_value("mask_args", mask_args)
    _args_without_function(score_mod, score_args, mask_mod, mask_args)
    fns = functions_of(score_mod, mask_mod, score_args, mask_args, call.compute_dtype)
    if fns is _user.NONE:
        return call
    user = _call.UserFunctions(
        functions=fns, score_args=_user.with_end(score_args), mask_args=_user.with_end(mask_args),
        block_states=states, block_q=block[0], block_k=block[1], positions=positions)
    return dataclasses.replace(call, user=user, tiles=tiles)


def score_grad_setup(call, score_mod, score_mod_grad):
    """(grad functions, the float arrays of score_args): checked and compiled."""
    if score_mod is None:
        _fail(ValueError, "`score_mod_grad` given without a `score_mod`")
    float_args = [x for x in call.user.score_args[:-1] if isinstance(x, np.ndarray)
                  and x.dtype.kind == "f"]
    if not float_args:
        _fail(ValueError, "`score_mod_grad` given, but `score_args` holds no float array to "
                          "differentiate")
    grad_fns, jitted = grad_functions(call.user.functions, score_mod_grad)
    score_type = numba.from_dtype(call.compute_dtype)
    grad_types = [numba.typeof(np.zeros((0,) * x.ndim, dtype=call.compute_dtype))
                  for x in float_args]
    arg_types = ((score_type, score_type) + (types.int64,) * 4
                 + tuple(numba.typeof(x) for x in call.user.score_args[:-1])
                 + tuple(grad_types))
    check_compiles("score_mod_grad", score_mod_grad, jitted, arg_types, None)
    return grad_fns, float_args


def check_differentiable(score_mod, call):
    """A TypeError naming `score_mod` when it cannot run on dual numbers."""
    _, jitted = user_function("score_mod", score_mod)
    error = _user.dual_error(jitted, numba.from_dtype(call.compute_dtype),
                             [numba.typeof(x) for x in call.user.score_args[:-1]])
    if error is not None:
        reason = "; ".join(line.strip() for line in str(error).strip().splitlines()[:4]
                           if line.strip())
        _fail(TypeError, f"`score_mod` ({score_mod.__qualname__}) cannot be differentiated "
                         f"by cpuflash: it must use only + - * / **, comparisons, abs, min, max "
                         f"and math.exp/log/log1p/sqrt/tanh/sin/cos on the score. Numba says: "
                         f"{reason}")
