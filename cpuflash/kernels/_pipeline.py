"""The score pipeline: what a call does to its scores, declared once, in order.

A call's pipeline reaches the kernels as one named value, `Pipeline`, whose fields are the
steps' below, in the order the scores go through them (`_steps.modify_tile` runs them; the
README's "Scores" list says what each means). Each step names its fields, what the kernels do
with them and its derivative by the score it is given, which the backward chains
(`_steps.score_tile`'s `chain`). A step that is off holds its `off` value: a zero, or an array
of size 0, which the kernels test to skip it.

Adding a built-in step: its entry here, its validation in `_validate` (which fills the fields),
its tile step in `_steps.modify_tile` (with its factor into the chain where its derivative is
not 1): docs/design.md has the checklist.
"""

import textwrap
from collections import namedtuple

import numba
from numba import types

from .._jit import HELPER_OPTIONS, jit

Step = namedtuple("Step", "name fields does derivative")

STEPS = (
    Step("scale", ("scale",),
         "s = scale * q . k (the product is divided by the softcap where one follows)",
         "scale, applied by the backward's products"),
    Step("softcap", ("softcap",), "s = softcap * tanh(s / softcap); 0 = off",
         "1 - tanh(s / softcap)^2, into the chain"),
    Step("alibi", ("alibi",),
         "s -= slope[b, h] * |diagonal - key|; (batch, Hq) slopes, (batch, 0) = off",
         "1: a constant"),
    Step("bias", ("bias", "bias_map"),
         "s += bias[bias_map[sequence], h, row, key]; (Bx, Hq, Nq, Nk) broadcast, size 0 = off",
         "1: a constant"),
    Step("score_mod", ("functions", "score_args", "positions"),
         "s = score_mod(s, b, h, q_idx, kv_idx, *score_args): the user's, compiled in "
         "(`_user`); `positions`: q_idx is the query's position in its sequence, not its row",
         "found on dual numbers (`_user`), into the chain"),
    Step("visibility", ("left", "right", "chunk", "mask", "mask_map", "mask_args",
                        "block_states", "block_q", "block_k"),
         "-inf where a key is hidden: the window (left, right; -1 unbounded; causal is "
         "right = 0), the chunks (a row sees its own chunk of `chunk` positions; 0 = off), "
         "the bool mask (like bias), the user's mask_mod (with its args) and the block "
         "mask's tile states (EMPTY tiles never visited, FULL ones not asked)",
         "0 where hidden"),
    Step("sinks", ("sinks",), "exp(sinks[h]) joins each row's denominator; size 0 = off",
         "dsinks, summed by the backward's caller"),
)

FIELDS = tuple(field for step in STEPS for field in step.fields)
Pipeline = namedtuple("Pipeline", FIELDS)

# A parallel loop of Numba takes tuples one level deep: a kernel takes the pipeline as its
# `Flat` part and the user's argument tuples (`kernel_args`), and puts it together in its
# loops (`together`)
ARGUMENTS = ("score_args", "mask_args")
Flat = namedtuple("Flat", [field for field in FIELDS if field not in ARGUMENTS])


def kernel_args(pipeline):
    """(flat, score_args, mask_args): a `Pipeline` as the kernels' last arguments take it."""
    fields = pipeline._asdict()
    return (Flat(**{name: fields[name] for name in Flat._fields}),
            *(fields[name] for name in ARGUMENTS))


def kernel_types(compute, functions, score_args, mask_args):
    """The Numba types of `kernel_args`'s three for the compute dtype and the Numba types of
    the user's functions (`_user.UserFunctionsType`) and argument tuples."""
    calc = numba.from_dtype(compute)
    index1 = types.Array(types.int64, 1, "A", readonly=True)
    kinds = dict(
        scale=types.float64, softcap=types.float64,
        alibi=types.Array(calc, 2, "A", readonly=True),
        bias=types.Array(calc, 4, "A", readonly=True), bias_map=index1,
        functions=functions, score_args=score_args, positions=types.boolean,
        left=types.int64, right=types.int64, chunk=types.int64,
        mask=types.Array(types.bool_, 4, "A", readonly=True), mask_map=index1,
        mask_args=mask_args, block_states=types.Array(types.int8, 4, "A", readonly=True),
        block_q=types.int64, block_k=types.int64,
        sinks=types.Array(calc, 1, "A", readonly=True))
    return (types.NamedTuple([kinds[field] for field in Flat._fields], Flat),
            *(kinds[name] for name in ARGUMENTS))


def _generated(name, params, body):
    """A jitted function compiled from source written out of `FIELDS` (no field by hand)."""
    scope = {"Pipeline": Pipeline, "Flat": Flat}
    exec(f"def {name}({params}):\n" + textwrap.indent(body, "    "), scope)
    function = scope[name]
    function.__module__ = __name__
    # (a function from generated source cannot be cached on its own: the kernels inlining it are)
    return numba.njit(**dict(HELPER_OPTIONS, cache=False))(function)


# together(flat, score_args, mask_args) -> the `Pipeline` the kernels' steps take
together = _generated(
    "together", "flat, " + ", ".join(ARGUMENTS),
    "return Pipeline(" + ", ".join(f if f in ARGUMENTS else f"flat.{f}" for f in FIELDS) + ")")


@jit
def product_scale(mods):
    """What ``Q K^T`` is multiplied by before the modifiers: the scale, divided by the softcap
    where there is one (`_steps.modify_tile` takes it from there)."""
    return mods.scale / mods.softcap if mods.softcap > 0 else mods.scale
