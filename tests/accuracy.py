"""Shared by the tests: random inputs and the accuracy rule against the dense reference."""

import numpy as np

from cpuflash.reference import attention_reference


def random_qkv(rng, shape_q, shape_k, d_v=None, dtype=np.float32, layout="bhsd"):
    """q, k, v with normal entries; v's last axis is `d_v` (default: that of k)."""
    shape_v = shape_k[:-1] + ((d_v or shape_k[-1]),)
    return tuple(rng.standard_normal(s).astype(dtype) for s in (shape_q, shape_k, shape_v))


def tolerance(dtype):
    """The floor of the accuracy rule: a few roundings at the output's precision."""
    return 8 * float(np.finfo(np.float32 if dtype != np.float64 else np.float64).eps)


def assert_close_to_reference(got, q, k, v, *, lse=None, plain_dtype=None, **kwargs):
    """flash-attn's rule: error vs the oracle <= 2x the error of a plain implementation in the
    same precision, plus a tiny floor. Also checks the LSE when given.

    The oracle is the float64 reference (extended precision when the inputs are float64); the
    plain implementation is the same reference computed in the inputs' precision."""
    dtype = np.dtype(q.dtype)
    plain_dtype = plain_dtype or (np.float64 if dtype == np.float64 else np.float32)
    # the oracle must be more precise than the plain implementation: x87 extended for float64
    oracle = np.longdouble if plain_dtype == np.float64 else np.float64
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, dtype=oracle, **kwargs)
    plain, plain_lse = attention_reference(q, k, v, return_lse=True, dtype=plain_dtype, **kwargs)
    floor = tolerance(dtype) * float(np.abs(ref).max(initial=0))
    err = np.abs(got.astype(oracle) - ref).max(initial=0)
    plain_err = np.abs(plain.astype(oracle) - ref).max(initial=0)
    assert got.shape == ref.shape
    assert err <= 2 * plain_err + floor, f"max error {err:.3g} vs plain {plain_err:.3g}"
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
