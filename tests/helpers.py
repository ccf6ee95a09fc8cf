"""What the tests share: input builders, bitwise comparisons, per-sequence checks against the
reference, and running code in a fresh interpreter.

It imports numpy, cpuflash and `accuracy` only (not pytest), so the scripts that tests run in a
fresh interpreter may import it too (see `workloads.py`); a test module never is.
"""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from accuracy import assert_close_to_reference

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent


# -- inputs ---------------------------------------------------------------------------------------

def random_qkv(rng, shape_q, shape_k, d_v=None, dtype=np.float32):
    """q, k, v with normal entries; v's last axis is `d_v` (default: that of k)."""
    shape_v = shape_k[:-1] + ((d_v or shape_k[-1]),)
    return tuple(rng.standard_normal(s).astype(dtype) for s in (shape_q, shape_k, shape_v))


def low_precision_dtype(name):
    """numpy's float16, or ml_dtypes' bfloat16 (the test is skipped without ml_dtypes)."""
    if name == "float16":
        return np.dtype(np.float16)
    import pytest

    return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)


def cu_seqlens(lens):
    """The int32 cumulative lengths ``[0, l0, l0 + l1, ...]`` of packed sequences."""
    return np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int32)


def packed(rng, lens_q, lens_k, hq=4, hk=2, d=40, d_v=24, dtype=np.float32):
    """Packed ("thd") q, k, v of sequences of the given lengths, and their cu_seqlens."""
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q, k, v = random_qkv(rng, (cu_q[-1], hq, d), (cu_k[-1], hk, d), d_v=d_v, dtype=dtype)
    return q, k, v, cu_q, cu_k


def cache_case(rng, batch=3, hq=8, hk=2, n_max=300, d=64, d_v=48, n_new=1, n_q=1,
               dtype=np.float32, seqlens=None):
    """``(q, k_cache, v_cache, k, v, cache_seqlens)`` for `attention_with_kvcache` in "bhsd";
    random fill lengths unless `seqlens` is given."""
    k_cache, v_cache = (rng.standard_normal((batch, hk, n_max, dd)).astype(dtype)
                        for dd in (d, d_v))
    q = rng.standard_normal((batch, hq, n_q, d)).astype(dtype)
    k = rng.standard_normal((batch, hk, n_new, d)).astype(dtype)
    v = rng.standard_normal((batch, hk, n_new, d_v)).astype(dtype)
    if seqlens is None:
        seqlens = rng.integers(0, n_max - n_new + 1, batch)
    return q, k_cache, v_cache, k, v, np.asarray(seqlens, dtype=np.int32)


def to_pages(cache, page_size, order):
    """A paged copy of a (B, H, Nmax, D) cache: page p of batch b goes to order[b, p]."""
    batch, heads, n_max, d = cache.shape
    pages = np.empty((order.size, heads, page_size, d), dtype=cache.dtype)
    for b in range(batch):
        for p in range(n_max // page_size):
            pages[order[b, p]] = cache[b, :, p * page_size:(p + 1) * page_size]
    return pages


def with_new_keys(cache, new, seqlens):
    """A copy of a (B, H, Nmax, D) cache with the (B, H, Nnew, D) rows `new` written at
    positions ``seqlens[b]:seqlens[b] + Nnew``, as `attention_with_kvcache` writes them."""
    cache = cache.copy()
    for b, s in enumerate(seqlens):
        cache[b, :, s:s + new.shape[2]] = new[b]
    return cache


def heads_first(x):
    """A packed (tokens, heads, dim) array as (heads, tokens, dim), or bshd as bhsd per batch."""
    return np.swapaxes(x, 0, 1)


def unaligned(x):
    """A copy of `x` in memory one byte off its dtype's alignment (8-bit data: as it is, having
    no alignment to miss)."""
    if x.dtype.itemsize == 1:
        return x
    raw = np.zeros(x.nbytes + 1, dtype=np.uint8)
    y = raw[1:].view(x.dtype).reshape(x.shape)
    y[...] = x
    assert not y.flags.aligned
    return y


def strided(x):
    """A copy of the 4-D `x` read through strides: every other row of a longer array."""
    y = np.zeros(x.shape[:2] + (2 * x.shape[2],) + x.shape[3:], dtype=x.dtype)[:, :, ::2]
    y[...] = x
    return y


def fortran(x):
    return np.asfortranarray(x)


def negative(x):
    """The same values, read through negative strides on every axis."""
    flip = (slice(None, None, -1),) * x.ndim
    return np.ascontiguousarray(x[flip])[flip]


def readonly(x):
    x = np.array(x, copy=True)
    x.flags.writeable = False
    return x


# -- comparisons ----------------------------------------------------------------------------------

def as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


def assert_same_bits(got, expected, what=""):
    """Every array of two results has the same dtype, shape and bytes (NaNs included)."""
    got, expected = as_tuple(got), as_tuple(expected)
    assert len(got) == len(expected), what
    for i, (a, b) in enumerate(zip(got, expected)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{what}[{i}]: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        if a.tobytes() != b.tobytes():
            bits = f"u{a.itemsize}"
            diff = np.flatnonzero(a.reshape(-1).view(bits) != b.reshape(-1).view(bits))
            where = np.unravel_index(diff[0], a.shape) if a.ndim else ()
            raise AssertionError(
                f"{what}[{i}]: {diff.size} of {a.size} elements differ in their bits, first "
                f"at {tuple(int(x) for x in where)}: {a[where]!r} vs {b[where]!r}")


def digest(result):
    """A hash of the dtypes, shapes and bytes of a result (an array or a tuple of them)."""
    h = hashlib.sha256()
    for x in as_tuple(result):
        h.update(str((x.dtype, x.shape)).encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def assert_same_nonfinite(got, expected, what=""):
    """NaN, +inf and -inf at the same places in both (finite values are not compared)."""
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.shape == expected.shape, f"{what}: shapes {got.shape} vs {expected.shape}"
    for name, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        differ = test(got) != test(expected)
        assert not differ.any(), (f"{what}: {name} at {differ.sum()} places where the other "
                                  f"has none or the reverse, first at "
                                  f"{np.argwhere(differ)[0].tolist()}")


def snapshot(*values):
    """``(arrays, copies)`` of the numpy arrays among `values` (lists and dicts searched too),
    for `assert_unchanged`."""
    arrays = []

    def collect(x):
        if isinstance(x, np.ndarray):
            arrays.append(x)
        elif isinstance(x, (list, tuple)):
            for item in x:
                collect(item)
        elif isinstance(x, dict):
            for item in x.values():
                collect(item)

    for value in values:
        collect(value)
    return arrays, [x.copy() for x in arrays]


def assert_unchanged(taken, what="an argument changed"):
    """Every array of a `snapshot` still has its bits."""
    for x, before in zip(*taken):
        assert_same_bits(x, before, what)


def check_varlen(out, lse, q, k, v, cu_q, cu_k, alibi_slopes=None, **kwargs):
    """Each packed sequence of an `attention_varlen` result against the reference."""
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        slopes = None if alibi_slopes is None else (
            alibi_slopes if np.ndim(alibi_slopes) == 1 else alibi_slopes[b])
        assert_close_to_reference(heads_first(out[rows]), heads_first(q[rows]),
                                  heads_first(k[keys]), heads_first(v[keys]),
                                  lse=None if lse is None else lse[:, rows],
                                  alibi_slopes=slopes, **kwargs)


def check_kvcache(out, lse, q, k_cache, v_cache, n_keys, alibi_slopes=None, **kwargs):
    """Each batch entry of an `attention_with_kvcache` result ("bhsd", unpaged; the new keys
    already written) against the reference over its first ``n_keys[b]`` cached keys."""
    for b in range(q.shape[0]):
        n = int(n_keys[b])
        slopes = None if alibi_slopes is None else (
            alibi_slopes if np.ndim(alibi_slopes) == 1 else alibi_slopes[b])
        assert_close_to_reference(out[b], q[b], k_cache[b, :, :n], v_cache[b, :, :n],
                                  lse=None if lse is None else lse[b], alibi_slopes=slopes,
                                  **kwargs)


# -- fresh interpreters ---------------------------------------------------------------------------

def run_python(code, *args, env=None, timeout=240, cwd=None, prefix=()):
    """Run `code` (dedented) in a fresh interpreter with command-line `args`; returns the
    CompletedProcess (never raises on the exit code)."""
    return subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def explain(result):
    """A failed subprocess's exit code, stdout and stderr, for an assertion message."""
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def clean_env(**extra):
    """The variables a login shell has, none that locate libraries or steer Numba."""
    keep = ("PATH", "HOME", "LANG", "TMPDIR", "USER")
    env = {name: os.environ[name] for name in keep if name in os.environ}
    return dict(env, **extra)


def last_json_line(result):
    """The JSON object a script printed last."""
    return json.loads(result.stdout.strip().splitlines()[-1])


def visible(n_q, n_k, causal=False, window=None):
    """The (n_q, n_k) bool matrix of the keys each query row sees by `causal` and `window`
    (API.md's rule, bottom-right aligned)."""
    rows = np.arange(n_q)[:, None] + (n_k - n_q)
    cols = np.arange(n_k)[None, :]
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    sees = np.ones((n_q, n_k), dtype=bool)
    if left >= 0:
        sees &= cols >= rows - left
    if right >= 0:
        sees &= cols <= rows + right
    return sees


def check_modified_decoding(rng, q, k_cache, v_cache):
    """A quantized cache's decoding step with a window, softcap, ALiBi and sinks, split in two,
    against the reference on its dequantized rows (entries of 1 and of all 333 keys)."""
    import cpuflash

    hq = q.shape[1]
    seqlens = np.array([1, 333], np.int32)
    kwargs = dict(window=(200, 0), softcap=15.0,
                  sinks=rng.standard_normal(hq).astype(np.float32))
    slopes = rng.uniform(0.01, 0.1, hq).astype(np.float32)
    out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                               num_splits=2, return_lse=True,
                                               alibi_slopes=slopes, **kwargs)
    check_kvcache(out, lse, q, cpuflash.dequantize_kv(k_cache), cpuflash.dequantize_kv(v_cache),
                  seqlens, causal=True, alibi_slopes=slopes, **kwargs)
