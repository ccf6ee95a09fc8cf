"""Exact combination of partial attention results: merging key splits, adding the sinks.

A partial result over a set of keys is its normalized output and its log-sum-exp. Parts over
disjoint keys combine exactly: weight each output by ``exp(lse_s - lse)``, where ``lse`` is the
log of the summed ``exp(lse_s)``. An attention sink is a part with a log-sum-exp and no value row.
"""

import numpy as np
from numba import types

from ._jit import Kernel, array


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


def merge_into(outs, lses, out, lse):
    """`merge` of the decode kernel's splits, compiled: ``outs`` (S, B, H, N, Dv) and ``lses``
    (S, B, H, N) into ``out`` (B, H, N, Dv) and ``lse`` (B, H, N), all in the compute dtype.

    A decode step merges a few rows; numpy's dozen small operations would cost more than the
    kernel's work at short caches. Same rule as `merge`, with the weights and sums in float64.
    """
    _merge_kernel.specialize(out.dtype)(outs, lses, out, lse)


def _merge_rows(outs, lses, out, lse):
    n_parts, batch, n_heads, n_rows, dv = outs.shape
    row = np.empty(dv, dtype=np.float64)
    weights = np.empty(n_parts, dtype=np.float64)
    for b in range(batch):
        for h in range(n_heads):
            for i in range(n_rows):
                # -- the largest lse (NaN if any is NaN) is the shift; rows no part saw: 0
                top = -np.inf
                for s in range(n_parts):
                    x = np.float64(lses[s, b, h, i])
                    if x > top or x != x:
                        top = x
                    if x != x:
                        break
                shift = 0.0 if top == -np.inf else top
                total = 0.0
                for s in range(n_parts):
                    weights[s] = np.exp(np.float64(lses[s, b, h, i]) - shift)
                    total += weights[s]
                lse[b, h, i] = shift + np.log(total)
                # -- a part of weight 0 contributes nothing, even where its output is inf or NaN
                row[:] = 0.0
                for s in range(n_parts):
                    if weights[s] > 0:
                        for x in range(dv):
                            row[x] += weights[s] * np.float64(outs[s, b, h, i, x])
                for x in range(dv):
                    out[b, h, i, x] = row[x] / total if total != 0 else 0.0


def _merge_signature(dtype):
    return types.void(array(dtype, 5, readonly=True), array(dtype, 4, readonly=True),
                      array(dtype, 4), array(dtype, 3))


_merge_kernel = Kernel(_merge_rows, _merge_signature, "split merge", parallel=False)
