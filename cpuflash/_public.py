"""The public functions' boundary: the errors Python raises there, made helpful.

`public` wraps each public function: an unknown keyword gets cpuflash's name for it (flash-attn's
and torch's names are known, `FOREIGN_KEYWORDS`) or the closest valid one, and a shape error of
flash-attn's ``(batch, seqlen, heads, dim)`` arrays under the default layout gets a hint to pass
``layout="bshd"``. The checks themselves are `_validate`'s.
"""

import difflib
import functools
import inspect

from . import _threads


def _fail(exc, message):
    raise exc(message) from None


# Keywords of flash-attn, torch's scaled_dot_product_attention and kernels like them, as
# (cpuflash's keywords that do the job, what to tell the user). The text is used when the function
# has one of those keywords, or always when there are none (cpuflash does the job differently).
FOREIGN_KEYWORDS = {
    "softmax_scale": (("scale",), "flash-attn's `softmax_scale` is `scale` in cpuflash"),
    "sm_scale": (("scale",), "`sm_scale` is `scale` in cpuflash"),
    "scaling": (("scale",), "`scaling` is `scale` in cpuflash"),
    "window_size": (("window",), "flash-attn's `window_size` is `window` in cpuflash (the same "
                                 "(left, right) pair, -1 = unbounded)"),
    "is_causal": (("causal",), "torch's `is_causal` is `causal` in cpuflash, and cpuflash aligns "
                               "the diagonal bottom-right as flash-attn does (torch aligns it "
                               "top-left; the two agree only when Nq == Nk)"),
    "attn_mask": (("mask", "bias"), "torch's `attn_mask` is `mask` in cpuflash when boolean "
                                    "(True = the key takes part, as in torch) and `bias` when "
                                    "float (added to the scores)"),
    "return_softmax_lse": (("return_lse",), "flash-attn's `return_softmax_lse` is `return_lse` "
                                            "in cpuflash"),
    "logits_soft_cap": (("softcap",), "`logits_soft_cap` is `softcap` in cpuflash"),
    "block_tables": (("block_table",), "`block_tables` is `block_table` in cpuflash"),
    "seqlens_k": (("cache_seqlens",), "`seqlens_k` is `cache_seqlens` in cpuflash (the filled "
                                      "length of each batch entry's cache)"),
    "cu_seqlens": (("cu_seqlens_q",), "cpuflash takes `cu_seqlens_q` and `cu_seqlens_k` (the "
                                      "same array twice for self-attention)"),
    "query": (("q",), "torch's `query` is `q` in cpuflash"),
    "key": (("k",), "torch's `key` is `k` in cpuflash"),
    "value": (("v",), "torch's `value` is `v` in cpuflash"),
    "s_aux": (("sinks",), "`s_aux` (gpt-oss's attention sinks) is `sinks` in cpuflash"),
    "dropout_p": ((), "cpuflash has no attention dropout: leave `dropout_p` out"),
    "dropout": ((), "cpuflash has no attention dropout: leave `dropout` out"),
    "return_attn_probs": (("return_lse",), "cpuflash never forms the attention probabilities "
                                           "(no Nq x Nk matrix exists); `return_lse=True` returns "
                                           "each row's log-sum-exp"),
    "return_softmax": (("return_lse",), "cpuflash never forms the attention probabilities (no "
                                        "Nq x Nk matrix exists); `return_lse=True` returns each "
                                        "row's log-sum-exp"),
    "deterministic": ((), "cpuflash is always deterministic (bitwise identical results whatever "
                          "the thread count): leave `deterministic` out"),
    "enable_gqa": ((), "GQA is automatic in cpuflash whenever Hq is a multiple of Hk (query head "
                       "h reads key/value head h // (Hq // Hk)): leave `enable_gqa` out"),
    "max_seqlen_q": (("cu_seqlens_q",), "cpuflash reads the lengths from `cu_seqlens_q`: leave "
                                        "`max_seqlen_q` out"),
    "max_seqlen_k": (("cu_seqlens_k",), "cpuflash reads the lengths from `cu_seqlens_k`: leave "
                                        "`max_seqlen_k` out"),
    "rotary_cos": ((), "cpuflash applies no rotary embedding: rotate `q` and `k` before the call"),
    "rotary_sin": ((), "cpuflash applies no rotary embedding: rotate `q` and `k` before the call"),
    "rotary_interleaved": ((), "cpuflash applies no rotary embedding: rotate `q` and `k` before "
                               "the call"),
}

# the keywords of each public function, filled in by `public`
PUBLIC_KEYWORDS = {}


def public(validate=None):
    """Decorate a public function so that the errors Python raises at its boundary help.

    An unknown keyword (Python's bare "unexpected keyword argument") gets cpuflash's name for it,
    or what cpuflash does instead, or the closest valid keyword. With `validate` (the function's
    argument check, taking the same arguments), a ValueError for 4-D arrays under the default
    layout gets a hint when the arrays pass as flash-attn's ``(batch, seqlen, heads, dim)``.
    Valid calls pay one Python call and a ``try``; the work is done only on the error paths.
    """
    def decorate(function):
        keywords = tuple(name for name, p in inspect.signature(function).parameters.items()
                         if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        PUBLIC_KEYWORDS[function.__name__] = keywords

        @functools.wraps(function)
        def checked(*args, **kwargs):
            if not _threads.SETTLED:
                _threads.settle_layer()
            try:
                return function(*args, **kwargs)
            except TypeError as exc:
                # a TypeError whose traceback ends in this frame came from binding the
                # arguments, before the function ran
                if exc.__traceback__.tb_next is None:
                    message = unknown_keywords(function.__name__, kwargs)
                    if message:
                        _fail(TypeError, message)
                raise
            except ValueError as exc:
                if validate is not None:
                    hint = layout_hint(function, validate, args, kwargs)
                    if hint:
                        _fail(ValueError, f"{exc}{hint}")
                raise
        return checked
    return decorate


def unknown_keywords(function_name, kwargs):
    """What to say about the keywords in `kwargs` that `function_name` lacks ("" if none)."""
    keywords = PUBLIC_KEYWORDS[function_name]
    messages = []
    for name in kwargs:
        if name in keywords:
            continue
        message = f"cpuflash.{function_name}() got an unexpected keyword argument '{name}'"
        targets, text = FOREIGN_KEYWORDS.get(name, ((), ""))
        if text and (not targets or any(t in keywords for t in targets)):
            message += f": {text}"
        else:  # where the keyword (or cpuflash's name for it) lives, or the closest one here
            wanted = targets or (name,)
            elsewhere = [f"cpuflash.{other}" for other, theirs in PUBLIC_KEYWORDS.items()
                         if other != function_name and any(w in theirs for w in wanted)]
            close = difflib.get_close_matches(name, keywords, n=1)
            if elsewhere:
                what = " or ".join(f"`{w}`" for w in wanted)
                what = f"cpuflash's {what} for it" if targets else what
                message += f": {what} is a keyword of {' and '.join(elsewhere)}"
            elif close:
                message += f": did you mean `{close[0]}`?"
            message += f" (the keywords of cpuflash.{function_name}: {', '.join(keywords)})"
        messages.append(message)
    return "; ".join(messages)


def layout_hint(function, validate, args, kwargs):
    """A hint to pass ``layout="bshd"`` when the call fails as "bhsd" but passes as "bshd"."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except TypeError:
        return ""
    bound.apply_defaults()
    arguments = bound.arguments
    arrays = list(arguments.values())[:3]  # q, k, v (or q, k_cache, v_cache)
    four_d = all(len(getattr(x, "shape", ())) == 4 for x in arrays)
    if arguments.get("layout") != "bhsd" or not four_d:
        return ""

    taken = inspect.signature(validate).parameters  # (the user's functions are checked later)
    arguments = {name: value for name, value in arguments.items() if name in taken}

    def passes(layout):
        try:
            validate(**dict(arguments, layout=layout))  # checks only: nothing is written
        except (TypeError, ValueError):
            return False
        return True

    if passes("bhsd") or not passes("bshd"):
        return ""
    return ("; if these are flash-attn's (batch, seqlen, heads, dim) arrays, pass "
            "`layout=\"bshd\"` (the default, \"bhsd\", reads (batch, heads, seqlen, dim))")
