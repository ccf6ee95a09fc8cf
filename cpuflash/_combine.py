"""Exact combination of partial attention results: merging key splits, adding the sinks.

A partial result over a set of keys is its normalized output and its log-sum-exp. Parts over
disjoint keys combine exactly: weight each output by ``exp(lse_s - lse)``, where ``lse`` is the
log of the summed ``exp(lse_s)``. An attention sink is a part with a log-sum-exp and no value row.
"""

import numpy as np


def merge(outs, lses):
    """Merge S partial results (validated by `_validate.merge_args`).

    ``outs`` is ``(S, ..., Dv)``, ``lses`` ``(S, ...)``; a part with lse ``-inf`` saw no key and
    its output is ignored. Returns ``(out, lse)`` in the dtypes of `outs` and `lses`; where no
    part saw a key, output 0 and lse ``-inf``.
    """
    top = lses.max(axis=0)
    shift = np.where(top == -np.inf, 0, top)  # rows no part saw: shift by 0, not by -inf
    with np.errstate(divide="ignore", invalid="ignore"):
        weights = np.exp(lses - shift)
        total = weights.sum(axis=0)
        lse = shift + np.log(total)
        # a part of weight 0 contributes nothing, even where its output is inf or NaN
        out = np.einsum("s...,s...d->...d", weights, np.where(weights[..., None] > 0, outs, 0))
        out = np.where(total[..., None] != 0, out / total[..., None], 0)
    return out.astype(outs.dtype), lse.astype(lses.dtype)


def add_sinks(out, lse, sinks):
    """`out` (B, Hq, Nq, Dv) and `lse` (B, Hq, Nq) with each head's sink (Hq,) joined to the
    softmax denominator: the output shrinks by ``exp(lse - new_lse)``."""
    sink = sinks[None, :, None]
    with_sink = np.logaddexp(lse, sink)
    return out * np.exp(lse - with_sink)[..., None], with_sink
