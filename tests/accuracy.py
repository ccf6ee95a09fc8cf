"""The accuracy rule: a kernel's output against the dense float64 reference (flash-attn's rule,
with a floor for the rounding of large logits). Input builders and other shared checks live in
`helpers.py`."""

import numpy as np

from cpuflash.reference import attention_reference, probabilities

# How many standard deviations of the score rounding (`score_rounding_spread`) an output element
# may be off on top of 2x the plain error. Measured with four correct float32 implementations
# (this kernel, and dense ones summing the dot products forwards, backwards, or with q
# pre-scaled by log2(e) for exp2): on 8000 problems at n_q = 15, n_k = 6, D = 57 with logits
# of +-25, where 61 failed the rule without this term, and on 10000 problems of the property
# tests' sizes and flags (24 failed), the most any of them needed was 1.86; 3 leaves a margin.
ROUNDING_SIGMAS = 3.0

# `score_rounding_spread` is skipped past this many query heads x Nk x Nk: at thousands of keys
# (where a tiny problem's luck no longer decides the plain error)
SPREAD_MAX_ELEMENTS = 2 ** 25


def working_eps(dtype):
    """The machine epsilon of the precision the kernels compute in for inputs of `dtype`
    (float32 for float32, float16 and bfloat16 inputs, float64 for float64)."""
    return float(np.finfo(np.float64 if np.dtype(dtype) == np.float64 else np.float32).eps)


def tolerance(dtype):
    """The fixed part of the floor: a few roundings at the output's precision, per unit of
    the output's largest magnitude (covers the rounding of ``P V``, of the division by the row
    sum and of the output itself)."""
    return 8 * working_eps(dtype)


def score_rounding_spread(q, k, v, out, lse, eps, **kwargs):
    """Standard deviation of each output element's error when every logit is rounded.

    A kernel computes each logit ``s_ij`` (after scale, softcap, ALiBi and bias) with a
    rounding error of about ``eps * |s_ij|`` (the magnitude of the final logit: where ALiBi or
    a bias cancels a larger score, the rounding of the parts is not counted). That error moves
    ``p_ij`` by the same relative amount and, to first order, output ``o_ic`` by
    ``p_ij * ds_ij * (v_jc - o_ic)``. Taking the roundings as independent, the spread of the
    error of ``o_ic`` is

        eps * sqrt(sum_j (p_ij * s_ij)^2 * (v_jc - o_ic)^2)

    which is what this returns, shaped like `out`, from the oracle's ``p``
    (`cpuflash.reference.probabilities`), ``s = log p + lse`` and ``out`` (all float64).

    It is large only where a few keys with large logits share a row: then the output depends
    steeply on the logits, and a tiny problem has too few outputs for the plain implementation's
    largest error to be a fair sample (it can be 10x smaller than another correct kernel's by
    luck). Where the softmax is diffuse or one-hot, it is small.

    Returns None past `SPREAD_MAX_ELEMENTS` (thousands of keys: test_long_causal_sequence has
    65536).
    """
    n_k = k.shape[-2]
    if np.prod(q.shape[:-2], dtype=np.int64) * n_k * n_k > SPREAD_MAX_ELEMENTS:
        return None
    p = probabilities(q, k, **kwargs)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(p > 0, np.log(p) + np.asarray(lse, np.float64)[..., None], 0.0)
    w = (p * s) ** 2
    v = np.asarray(v, np.float64)
    group = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    if group > 1:  # GQA / MQA: query head h reads kv head h // group
        v = np.repeat(v, group, axis=-3)
    o = np.asarray(out, np.float64)
    # sum_j w_ij (v_jc - o_ic)^2, expanded into matmuls (no (Nq, Nk, Dv) array)
    spread = w @ (v * v) - 2 * o * (w @ v) + o * o * w.sum(axis=-1, keepdims=True)
    return eps * np.sqrt(np.maximum(spread, 0.0))


def assert_close_to_reference(got, q, k, v, *, lse=None, plain_dtype=None, plain=None,
                              **kwargs):
    """flash-attn's rule: error vs the oracle <= 2x the error of a plain implementation in the
    same precision, plus a floor. Also checks the LSE when given.

    The oracle is the float64 reference (extended precision when the inputs are float64); the
    plain implementation is the same reference computed in `plain_dtype` (default: the
    kernels' compute precision), or for the output, when given, ``plain(q, k, v, **kwargs)``.

    The floor, per output element ``o_ic``, has two parts:

    * ``tolerance(dtype) * max|o|``: a few roundings of the output's size;
    * ``ROUNDING_SIGMAS`` standard deviations of the error that rounding the logits gives
      that element (`score_rounding_spread`): about ``eps * |s| * |v - o|`` for each key that
      shares the row's probability.

    The second part keeps the rule from failing correct kernels on tiny problems with large
    logits. A float32 logit of 25 is off by ~25 eps, which moves the output by ~25 eps * |v|;
    with a handful of keys and rows the plain implementation may happen to round its few
    logits well, and 2x its error is then no bound for another correct kernel (1/12 of the
    kernel's error was seen at n_q = 15, n_k = 6, D = 57, logits of +-25).

    It changes little where the rule has power. On problems with hundreds of rows the plain
    error is the largest of many and 2x of it stays the larger part of the limit: the second
    part reaches 0.2-0.5 of the rest where logits are a few units and ~0.7 where they are
    +-25, at the elements that depend most steeply on the logits, and ~0 where the softmax is
    one-hot. A uniform relative error fails at 1.0-1.4x the size it did without it, and an
    output off by 1e-4 relative or a missed rescale fails on every awkward size
    (test_properties.py). It is left out beyond `SPREAD_MAX_ELEMENTS`.
    """
    dtype = np.dtype(q.dtype)
    plain_dtype = plain_dtype or (np.float64 if dtype == np.float64 else np.float32)
    # the oracle must be more precise than the plain implementation: x87 extended for float64
    oracle = np.longdouble if plain_dtype == np.float64 else np.float64
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, dtype=oracle, **kwargs)
    plain_out, plain_lse = attention_reference(q, k, v, return_lse=True, dtype=plain_dtype,
                                               **kwargs)
    if plain is not None:  # another plain implementation of the output (e.g. bf16_dot_reference)
        plain_out = plain(q, k, v, **kwargs)
    assert got.shape == ref.shape
    errors = np.abs(got.astype(oracle) - ref)
    plain_err = np.abs(plain_out.astype(oracle) - ref).max(initial=0)
    if errors.size:
        if kwargs.get("layout") == "bshd":  # the spread is computed on (B, H, N, D) arrays
            heads_first = [np.swapaxes(x, 1, 2) for x in (q, k, v, ref)]
            spread = score_rounding_spread(
                *heads_first, ref_lse, working_eps(dtype),
                **{name: value for name, value in kwargs.items() if name != "layout"})
            spread = None if spread is None else np.swapaxes(spread, 1, 2)
        else:
            spread = score_rounding_spread(q, k, v, ref, ref_lse, working_eps(dtype), **kwargs)
        floor = tolerance(dtype) * float(np.abs(ref).max())
        if spread is not None:
            floor = floor + ROUNDING_SIGMAS * spread
        assert_within_rule(errors, plain_err, floor, "output")
    if lse is not None:
        assert lse.shape == ref_lse.shape
        finite = np.isfinite(ref_lse)
        assert np.array_equal(np.isfinite(lse), finite)
        assert np.all(lse[~finite] == ref_lse[~finite])
        lse_floor = tolerance(dtype) * max(1.0, float(np.abs(ref_lse[finite]).max(initial=0)))
        lse_err = np.abs(lse[finite] - ref_lse[finite]).max(initial=0)
        plain_lse_err = np.abs(plain_lse[finite] - ref_lse[finite]).max(initial=0)
        assert lse_err <= 2 * plain_lse_err + lse_floor, \
            f"lse error {lse_err:.3g} vs plain {plain_lse_err:.3g}"


def assert_within_rule(errors, plain_err, floor, what):
    """Every element's error is at most twice the plain implementation's largest error plus its
    floor (a scalar or one per element); the message names the worst element of `what`."""
    floor = np.broadcast_to(floor, errors.shape)
    excess = errors - (2 * plain_err + floor)
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[worst] <= 0, (
        f"{what}: max error {errors.max():.3g} vs plain {plain_err:.3g}; at {worst} the error "
        f"{errors[worst]:.3g} exceeds 2 x plain + floor = {2 * plain_err:.3g} + "
        f"{float(floor[worst]):.3g}")


def bf16_dot_reference(q, k, v, **kwargs):
    """A plain bfloat16 implementation as the AVX512-BF16 kernels (and flash-attn on GPUs)
    compute: the scores and the softmax in float32 (products of bfloat16 numbers are exact in
    float32), P rounded to bfloat16, ``P V`` summed in float32, the output rounded to the
    inputs' dtype. For `assert_close_to_reference`'s `plain`; the keyword arguments are the
    reference's."""
    import ml_dtypes

    layout = kwargs.pop("layout", "bhsd")
    if layout == "bshd":  # the reference's (B, H, N, D) arrays, and back
        q, k, v = (np.swapaxes(x, -2, -3) for x in (q, k, v))
    p = probabilities(q, k, dtype=np.float32, **kwargs)
    p = p.astype(ml_dtypes.bfloat16).astype(np.float32)
    v = np.asarray(v, np.float32)
    if q.ndim >= 3 and q.shape[-3] != k.shape[-3]:  # GQA / MQA: query head h reads h // group
        v = np.repeat(v, q.shape[-3] // k.shape[-3], axis=-3)
    out = np.matmul(p, v).astype(q.dtype)
    return np.swapaxes(out, -2, -3) if layout == "bshd" else out
