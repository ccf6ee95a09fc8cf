"""The score keywords that every attention function takes, defined once for the front ends.

`cpuflash.attention` and its relatives take them by name, each in its signature. The front ends
carry them further: the torch operators (`cpuflash.torch`, `cpuflash.flash_attn`) as typed
positional slots of their schemas, `cpuflash.jax` as a static tuple of the same slots,
`cpuflash.distributed` as keywords it passes on. They all convert through `pack` and `unpack`
here, so a new score keyword is one entry of `SCORE` for all of them (its checks stay in
`_validate`, which the numpy functions run on what `unpack` gives).
"""

from collections import namedtuple

from . import _validate

# `slots`: the (schema type, name) pairs of an operator's schema that carry it; `pack`: an
# expression of the keyword (by its name) that gives their values, plain Python (a schema holds
# no None for an int), as a tuple to spread; `unpack`: an expression of the slots (by their
# names) that gives back what the numpy functions take
Keyword = namedtuple("Keyword", "name default slots pack unpack")


def window_sides(window, name="window"):
    """``(left, right)`` ints from a window given as a pair (-1 = unbounded) or None."""
    if window is None:
        return -1, -1
    try:
        left, right = (int(side) for side in window)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a pair of ints (left, right), each >= -1, got "
                         f"{window!r}") from None
    return left, right


SCORE = (
    Keyword("causal", False, (("bool", "causal"),), "(bool(causal),)", "causal"),
    Keyword("scale", None, (("float?", "scale"),),
            "(None if scale is None else float(scale),)", "scale"),
    Keyword("window", None, (("int", "window_left"), ("int", "window_right")),
            "window_sides(window)",
            "None if (window_left, window_right) == (-1, -1) else (window_left, window_right)"),
    Keyword("chunk_size", None, (("int", "chunk_size"),),
            "(_validate.chunk_value(chunk_size),)", "chunk_size or None"),
    Keyword("softcap", 0.0, (("float", "softcap"),), "(float(softcap),)", "softcap"),
    Keyword("alibi_slopes", None, (("Tensor?", "alibi_slopes"),), "(alibi_slopes,)",
            "alibi_slopes"),
)

NAMES = tuple(keyword.name for keyword in SCORE)
DEFAULTS = {keyword.name: keyword.default for keyword in SCORE}
SLOT_NAMES = tuple(name for keyword in SCORE for _, name in keyword.slots)
N_SLOTS = len(SLOT_NAMES)
# the slots as a fragment of an operator's schema, in their order
SCHEMA = ", ".join(f"{kind} {name}" for keyword in SCORE for kind, name in keyword.slots)


def _generated(source):
    """A function compiled from source written out of `SCORE` (straight-line code: these run
    on every call of the torch functions, where a loop over the entries cost microseconds)."""
    scope = {"window_sides": window_sides, "_validate": _validate}
    exec(source, scope)
    return scope[source.split()[1].split("(")[0]]


# pack(**score keywords) -> the slot values (the keywords not given at their defaults)
pack = _generated(
    "def pack(*, " + ", ".join(f"{k.name}={k.default!r}" for k in SCORE) + "):\n"
    "    return " + " + ".join(k.pack for k in SCORE) + "\n")
# unpack(slots) -> the score keywords, by name, of `N_SLOTS` slot values
unpack = _generated(
    "def unpack(slots):\n"
    "    " + ", ".join(SLOT_NAMES) + ", = slots\n"
    "    return {" + ", ".join(f"{k.name!r}: {k.unpack}" for k in SCORE) + "}\n")
