"""User score and mask functions inside the tiles (FlexAttention's `score_mod` and `mask_mod`).

A call's functions reach a kernel as one value of `UserFunctionsType`, a type that holds no data
and carries a key: a digest of the functions' code (`cpuflash.flex`). The overloads below look
the functions up by that key when the kernel compiles and inline them into its tile steps, so a
kernel compiled for one pair of functions is machine code like any other, cached on disk under a
signature that names the key (the same functions in another process hit that entry; an edited
function gets a new key, and so a new entry). Calls without user functions pass the type of
the empty key, for which every step below compiles to nothing.

The derivative of a `score_mod` by its score comes from forward-mode automatic differentiation:
the backward calls it on a `Dual` (value, slope) instead of a float, and the arithmetic and
`math` functions overloaded here carry the slope along (exact to rounding: each rule is the
derivative of its operation). Where the value of a dual is computed by the same operations in
the same types as the forward's float, the backward rebuilds the forward's scores bit for bit.
"""

import math
import operator

import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import NativeValue, intrinsic, lower_cast, make_attribute_wrapper, models, \
    overload, register_model, typeof_impl, unbox

from .._jit import HELPER_OPTIONS, jit

# what a tile of a block mask is (`cpuflash.flex.BlockMask`): no key visible, some, every one
EMPTY, PARTIAL, FULL = 0, 1, 2

# key -> (score_mod, mask_mod, score_mod_grad): the jitted functions of the calls compiled in
# this process. The forward and the backward of q, k, v are keyed by the first two (a
# score_mod_grad does not change them); the pass of `score_args`' gradients by all three.
REGISTRY = {"": (None, None, None)}


class UserFunctions:
    """The value a call passes for its functions: only the key of `REGISTRY` they are under."""

    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key


NONE = UserFunctions("")


class UserFunctionsType(types.Opaque):
    """The Numba type of `UserFunctions`: equal for equal keys, in any process."""

    def __init__(self, key):
        self.functions_key = key
        super().__init__(name=f"UserFunctions({key})")


@typeof_impl.register(UserFunctions)
def _typeof_user_functions(value, context):
    return UserFunctionsType(value.key)


register_model(UserFunctionsType)(models.OpaqueModel)


@unbox(UserFunctionsType)
def _unbox_user_functions(typ, obj, c):
    return NativeValue(cgutils.get_null_value(c.context.get_value_type(typ)))


# The end of every argument tuple in a kernel's `user`: the tuples are never empty, as a
# parallel loop of Numba cannot take an empty tuple in (the functions are called with
# ``*args[:-1]``)
ARGS_END = np.zeros(0, dtype=np.int8)


def with_end(args):
    """`args` as a kernel's `user` holds them (see `ARGS_END`)."""
    return tuple(args) + (ARGS_END,)


@jit
def query_index(mods, q0, diag0):
    """The `q_idx` the user's functions see for a tile's first row: its row in the call (`q0`),
    or with the pipeline's ``positions`` (a KV cache's queries) its position in the sequence
    (`diag0`, the key under its diagonal: bottom-right aligned)."""
    return diag0 if mods.positions else q0



def _functions(fns):
    return REGISTRY[fns.functions_key]


# -- the steps of the tile pipeline --------------------------------------------------------

def has_score_mod(fns):
    """Whether the call has a `score_mod` (a constant of the compiled kernel)."""


@overload(has_score_mod, jit_options=HELPER_OPTIONS)
def _has_score_mod(fns):
    present = _functions(fns)[0] is not None
    return lambda fns: present


def has_mask_mod(fns):
    """Whether the call has a `mask_mod` (a constant of the compiled kernel)."""


@overload(has_mask_mod, jit_options=HELPER_OPTIONS)
def _has_mask_mod(fns):
    present = _functions(fns)[1] is not None
    return lambda fns: present


def score_mod_tile(fns, scores, chain, rows, cols, spans, where, args):
    """``s = score_mod(s, b, h, q_idx, kv_idx, *args)`` over each row's span of the tile (row r
    at ``q_idx = q0 + r``, column c at ``kv_idx = kb + c``; ``where = (b, h, q0, kb)``,
    ``spans = (lo_off, hi_off)`` as `_layout.row_span` takes them). Where `chain` has rows (the
    backward), the mod runs on duals and ``chain *= d(mod)/d(s)``; `chain` holds 1 (or the
    softcap's factor) where the mod is met."""


def _generated(source, n_args, namespace, n_grads=0):
    """The function defined by `source` (its loops call the user's function with ``{args}``),
    the ``n_args`` arguments taken out of the tuple `args` once, before the loops (``{unpack}``),
    and ``n_grads`` of `grads` after them. Written out, not ``*args``: a call that spreads a
    tuple of arrays keeps each array's reference counting in the loop, and the loop is then
    not vectorized. The loops count from 0 for the same reason: LLVM left
    ``range(max(..), min(..))`` scalar, where ``for i in range(count): c = first + i``
    vectorizes (measured: docs/history.md, "Your own functions (`flex_attention`)")."""
    names = [f"a{i}" for i in range(n_args)] + [f"g{i}" for i in range(n_grads)]
    sources = [f"args[{i}]" for i in range(n_args)] + [f"grads[{i}]" for i in range(n_grads)]
    unpack = f"{', '.join(names)}, = {', '.join(sources)}," if names else "pass"
    code = source.format(unpack=unpack, args="".join(f", {name}" for name in names))
    scope = dict(namespace)
    exec(code, scope)
    return scope[code.split("def ", 1)[1].split("(", 1)[0]]


# (generated sources cannot be cached on their own: the kernels that inline them are)
_GENERATED = dict(HELPER_OPTIONS, cache=False)


def _over_spans(params, body):
    """The source of ``apply(params)`` that runs `body` (lines about ``row[c]``, the score of
    query `q_idx` and key ``kb + c``) over each row's span of the tile, in the loop shape
    `_generated` says LLVM vectorizes; ``{unpack}`` and ``{args}`` are left for it."""
    body = body.replace("\n", "\n" + " " * 12)
    return f"""
def apply({params}):
    b, h, q0, kb = where
    lo_off, hi_off = spans
    {{unpack}}
    for r in range(rows):
        row, q_idx = scores[r], q0 + r
        first = max(0, r + lo_off)
        for i in range(min(cols, r + hi_off + 1) - first):
            c = first + i
            {body}
"""


_SCORE_MOD_FORWARD = _over_spans("fns, scores, chain, rows, cols, spans, where, args",
                                 "row[c] = score_mod(row[c], b, h, q_idx, kb + c{args})")

_SCORE_MOD = """
def apply(fns, scores, chain, rows, cols, spans, where, args):
    b, h, q0, kb = where
    lo_off, hi_off = spans
    {unpack}
    for r in range(rows):
        first = max(0, r + lo_off)
        count = min(cols, r + hi_off + 1) - first
        row, q_idx = scores[r], q0 + r
        if chain.shape[0] > 0:
            factors = chain[r]
            for i in range(count):
                c = first + i
                out = score_mod(dual(row[c], 1.0), b, h, q_idx, kb + c{args})
                row[c] = value_of(out)
                factors[c] *= slope_of(out)
        else:
            for i in range(count):
                c = first + i
                row[c] = score_mod(row[c], b, h, q_idx, kb + c{args})
"""


@overload(score_mod_tile, jit_options=_GENERATED)
def _score_mod_tile(fns, scores, chain, rows, cols, spans, where, args):
    score_mod = _functions(fns)[0]
    if score_mod is None:
        return lambda fns, scores, chain, rows, cols, spans, where, args: None
    namespace = dict(score_mod=score_mod, dual=dual, value_of=value_of, slope_of=slope_of)
    if not differentiable(score_mod, scores.dtype, args.types[:-1]):
        # (the forward: `cpuflash.flex` refuses a backward through such a mod before it runs)
        return _generated(_SCORE_MOD_FORWARD, len(args) - 1, namespace)
    return _generated(_SCORE_MOD, len(args) - 1, namespace)


def differentiable(score_mod, dtype, arg_types):
    """Whether the jitted `score_mod` compiles on a `DualType` of `dtype` with `arg_types` after
    the indices (then the error of Numba, or None)."""
    return dual_error(score_mod, dtype, arg_types) is None


def dual_error(score_mod, dtype, arg_types):
    """Numba's error compiling `score_mod` on a dual score, or None when it compiles."""
    try:
        score_mod.compile((DualType(dtype),) + (types.int64,) * 4 + tuple(arg_types))
    except Exception as exc:  # Numba's typing and lowering errors have no common base
        return exc
    return None


def score_grad_tile(fns, ds, pre, rows, cols, spans, where, args, grads):
    """For each score of the tile that has a gradient (``ds``, the gradient of the loss by the
    score after the mod: 0 where a key is hidden), ``score_mod_grad(ds, pre, b, h, q_idx,
    kv_idx, *args, *grads)``, which adds into `grads` (`pre`: the mod's input)."""


_SCORE_GRAD = """
def apply(fns, ds, pre, rows, cols, spans, where, args, grads):
    b, h, q0, kb = where
    lo_off, hi_off = spans
    {unpack}
    for r in range(rows):
        for c in range(max(0, r + lo_off), min(cols, r + hi_off + 1)):
            if ds[r, c] != 0:
                score_mod_grad(ds[r, c], pre[r, c], b, h, q0 + r, kb + c{args})
"""


@overload(score_grad_tile, jit_options=_GENERATED)
def _score_grad_tile(fns, ds, pre, rows, cols, spans, where, args, grads):
    return _generated(_SCORE_GRAD, len(args) - 1, dict(score_mod_grad=_functions(fns)[2]),
                      n_grads=len(grads))


def slot_views(arrays, slot):
    """``tuple(x[slot] for x in arrays)``: one slot's part of each array (a tuple of arrays of
    any types)."""


@overload(slot_views, jit_options=dict(HELPER_OPTIONS, cache=False))  # (source made here)
def _slot_views(arrays, slot):
    names = ", ".join(f"arrays[{i}][slot]" for i in range(len(arrays)))
    namespace = {}
    exec(f"def views(arrays, slot):\n    return ({names},)", namespace)
    return namespace["views"]


def mask_mod_tile(fns, scores, rows, cols, spans, where, args):
    """-inf where ``mask_mod(b, h, q_idx, kv_idx, *args)`` is False, over each row's span."""


_MASK_MOD = _over_spans("fns, scores, rows, cols, spans, where, args",
                        "if not mask_mod(b, h, q_idx, kb + c{args}):\n    row[c] = -np.inf")


@overload(mask_mod_tile, jit_options=_GENERATED)
def _mask_mod_tile(fns, scores, rows, cols, spans, where, args):
    mask_mod = _functions(fns)[1]
    if mask_mod is None:
        return lambda fns, scores, rows, cols, spans, where, args: None
    return _generated(_MASK_MOD, len(args) - 1, dict(mask_mod=mask_mod, np=np))


def mask_mod_fill(fns, seen, rows, cols, spans, where, args):
    """``seen[r, c] = mask_mod(b, h, q_idx, kv_idx, *args)`` over each row's span, and the box
    that holds every True: ``(rows_seen, c_lo, c_hi)``, rows 0 .. rows_seen - 1 and columns
    c_lo .. c_hi - 1 (``rows_seen`` 0: none)."""


_MASK_MOD_FILL = """
def apply(fns, seen, rows, cols, spans, where, args):
    b, h, q0, kb = where
    lo_off, hi_off = spans
    {unpack}
    rows_seen, c_lo, c_hi = 0, cols, 0
    for r in range(rows):
        row, q_idx = seen[r], q0 + r
        first = max(0, r + lo_off)
        count = min(cols, r + hi_off + 1) - first
        n_seen = 0
        for i in range(count):
            c = first + i
            row[c] = mask_mod(b, h, q_idx, kb + c{args})
            n_seen += row[c]
        if n_seen:
            rows_seen = r + 1
            lo, hi = first, first + count - 1
            while not row[lo]:
                lo += 1
            while not row[hi]:
                hi -= 1
            c_lo, c_hi = min(c_lo, lo), max(c_hi, hi + 1)
    return rows_seen, c_lo, c_hi
"""


@overload(mask_mod_fill, jit_options=_GENERATED)
def _mask_mod_fill(fns, seen, rows, cols, spans, where, args):
    mask_mod = _functions(fns)[1]
    if mask_mod is None:  # (no partial tiles then)
        return lambda fns, seen, rows, cols, spans, where, args: (0, 0, 0)
    return _generated(_MASK_MOD_FILL, len(args) - 1, dict(mask_mod=mask_mod))


def mask_mod_sees(fns, b, h, q_idx, kv_idx, args):
    """`mask_mod` of one pair (True without one)."""


@overload(mask_mod_sees, jit_options=HELPER_OPTIONS)
def _mask_mod_sees(fns, b, h, q_idx, kv_idx, args):
    mask_mod = _functions(fns)[1]
    if mask_mod is None:
        return lambda fns, b, h, q_idx, kv_idx, args: True

    def sees(fns, b, h, q_idx, kv_idx, args):
        return mask_mod(b, h, q_idx, kv_idx, *args[:-1])
    return sees


@jit
def tile_state(mods, b, h, q0, rows, kb, cols):
    """EMPTY, PARTIAL or FULL: what the block mask of the pipeline `mods` (its `block_states`
    of blocks of `block_q` x `block_k`) says of the tile of rows q0 .. q0 + rows - 1 and keys
    kb .. kb + cols - 1 (the kernel's tiles need not be the block mask's: a tile is EMPTY when every
    block it meets is, FULL when every one is). Without a block mask: PARTIAL with a `mask_mod`
    (it is called for every pair), FULL without."""
    states, block_q, block_k = mods.block_states, mods.block_q, mods.block_k
    if not has_mask_mod(mods.functions):
        return FULL
    if states.shape[0] == 0:
        return PARTIAL
    sb = b if states.shape[0] > 1 else 0
    sh = h if states.shape[1] > 1 else 0
    empty = full = True
    for i in range(q0 // block_q, (q0 + rows - 1) // block_q + 1):
        for j in range(kb // block_k, (kb + cols - 1) // block_k + 1):
            state = states[sb, sh, i, j]
            empty = empty and state == EMPTY
            full = full and state == FULL
    return EMPTY if empty else FULL if full else PARTIAL


# -- dual numbers: d(score_mod)/d(score) -------------------------------------------------

class DualType(types.Type):
    """A value and its derivative by the score, both of `dtype` (a float type)."""

    def __init__(self, dtype):
        self.dtype = dtype
        super().__init__(name=f"Dual({dtype})")

    def unify(self, typingctx, other):
        """Branches that return duals of two float types, or a dual and a number, meet in the
        wider type, as the floats of the forward do (a number becomes a dual of slope 0)."""
        if isinstance(other, DualType):
            other = other.dtype
        if isinstance(other, (types.Number, types.Boolean)):
            dtype = typingctx.unify_pairs(self.dtype, other)
            if isinstance(dtype, types.Float):
                return DualType(dtype)
        return None


@lower_cast(DualType, DualType)
def _dual_to_dual(context, builder, fromty, toty, val):
    source = cgutils.create_struct_proxy(fromty)(context, builder, value=val)
    result = cgutils.create_struct_proxy(toty)(context, builder)
    result.value = context.cast(builder, source.value, fromty.dtype, toty.dtype)
    result.slope = context.cast(builder, source.slope, fromty.dtype, toty.dtype)
    return result._getvalue()


@lower_cast(types.Number, DualType)
@lower_cast(types.Boolean, DualType)
def _number_to_dual(context, builder, fromty, toty, val):
    result = cgutils.create_struct_proxy(toty)(context, builder)
    result.value = context.cast(builder, val, fromty, toty.dtype)
    result.slope = context.get_constant(toty.dtype, 0.0)
    return result._getvalue()


@register_model(DualType)
class _DualModel(models.StructModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, [("value", fe_type.dtype), ("slope", fe_type.dtype)])


make_attribute_wrapper(DualType, "value", "value")
make_attribute_wrapper(DualType, "slope", "slope")


@intrinsic
def _make_dual(typingctx, value, slope):
    """A dual of `value`'s float type (the slope converted to it)."""
    dtype = value if isinstance(value, types.Float) else types.float64

    def codegen(context, builder, signature, args):
        dual_value = cgutils.create_struct_proxy(signature.return_type)(context, builder)
        dual_value.value = context.cast(builder, args[0], signature.args[0], dtype)
        dual_value.slope = context.cast(builder, args[1], signature.args[1], dtype)
        return dual_value._getvalue()
    return DualType(dtype)(value, slope), codegen


@jit
def dual(value, slope):
    """The dual (value, slope): a score whose derivative is tracked is ``dual(score, 1)``."""
    return _make_dual(value, slope)


def value_of(x):
    """The value of a dual, or `x` itself."""


@overload(value_of, jit_options=HELPER_OPTIONS)
def _value_of(x):
    if isinstance(x, DualType):
        return lambda x: x.value
    return lambda x: x


def slope_of(x):
    """The slope of a dual; 0 for a number (a mod whose result does not depend on the score)."""


@overload(slope_of, jit_options=HELPER_OPTIONS)
def _slope_of(x):
    if isinstance(x, DualType):
        return lambda x: x.slope
    return lambda x: 0.0


def _is_dual(*xs):
    return any(isinstance(x, DualType) for x in xs)


def _real(x):
    return isinstance(x, (types.Number, types.Boolean, DualType))


def _binary(op, rule):
    """Overload `op` for duals: ``rule(a, da, b, db) -> (value, slope)`` with da, db the slopes
    (0 for a number)."""
    @overload(op, jit_options=HELPER_OPTIONS)
    def dual_op(a, b):
        if not (_is_dual(a, b) and _real(a) and _real(b)):
            return None

        def impl(a, b):
            av, bv = value_of(a), value_of(b)
            value, slope = rule(av, slope_of(a), bv, slope_of(b))
            return _make_dual(value, slope)
        return impl


@jit
def _add_rule(a, da, b, db):
    return a + b, da + db


@jit
def _sub_rule(a, da, b, db):
    return a - b, da - db


@jit
def _mul_rule(a, da, b, db):
    return a * b, da * b + a * db


@jit
def _div_rule(a, da, b, db):
    return a / b, (da * b - a * db) / (b * b)


_binary(operator.add, _add_rule)
_binary(operator.sub, _sub_rule)
_binary(operator.mul, _mul_rule)
_binary(operator.truediv, _div_rule)


@overload(operator.pow, jit_options=HELPER_OPTIONS)
def _dual_pow(a, b):
    if not (isinstance(a, DualType) and isinstance(b, types.Number)):
        return None  # (a dual exponent: not supported; Numba says so)
    return lambda a, b: _make_dual(a.value ** b, b * a.value ** (b - 1) * a.slope)


@overload(operator.neg, jit_options=HELPER_OPTIONS)
def _dual_neg(a):
    if isinstance(a, DualType):
        return lambda a: _make_dual(-a.value, -a.slope)


@overload(operator.pos, jit_options=HELPER_OPTIONS)
def _dual_pos(a):
    if isinstance(a, DualType):
        return lambda a: a


@overload(abs, jit_options=HELPER_OPTIONS)
def _dual_abs(a):
    if isinstance(a, DualType):
        return lambda a: _make_dual(abs(a.value), -a.slope if a.value < 0 else a.slope)


def _comparison(op):
    @overload(op, jit_options=HELPER_OPTIONS)
    def dual_compare(a, b):
        if _is_dual(a, b) and _real(a) and _real(b):
            return lambda a, b: op(value_of(a), value_of(b))


for _op in (operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne):
    _comparison(_op)


def _choice(function, pick_first):
    """min/max of two operands, one of them a dual: the slope of the one chosen."""
    @overload(function, jit_options=HELPER_OPTIONS)
    def dual_choice(a, b):
        if not (_is_dual(a, b) and _real(a) and _real(b)):
            return None

        def impl(a, b):
            first = pick_first(value_of(a), value_of(b))
            chosen = function(value_of(a), value_of(b))
            return _make_dual(chosen, slope_of(a) if first else slope_of(b))
        return impl


@jit
def _first_is_max(a, b):
    return a >= b


@jit
def _first_is_min(a, b):
    return a <= b


_choice(max, _first_is_max)
_choice(min, _first_is_min)


def _unary(function, rule):
    """Overload `function` (of `math`) for duals: ``rule(x, fx) -> d function / dx``."""
    @overload(function, jit_options=HELPER_OPTIONS)
    def dual_function(x):
        if isinstance(x, DualType):
            def impl(x):
                fx = function(x.value)
                return _make_dual(fx, rule(x.value, fx) * x.slope)
            return impl


@jit
def _exp_rule(x, fx):
    return fx


@jit
def _log_rule(x, fx):
    return 1.0 / x


@jit
def _sqrt_rule(x, fx):
    return 0.5 / fx


@jit
def _tanh_rule(x, fx):
    return 1.0 - fx * fx


@jit
def _sin_rule(x, fx):
    return math.cos(x)


@jit
def _cos_rule(x, fx):
    return -math.sin(x)


@jit
def _log1p_rule(x, fx):
    return 1.0 / (1.0 + x)


_unary(math.exp, _exp_rule)
_unary(math.log, _log_rule)
_unary(math.sqrt, _sqrt_rule)
_unary(math.tanh, _tanh_rule)
_unary(math.sin, _sin_rule)
_unary(math.cos, _cos_rule)
_unary(math.log1p, _log1p_rule)
