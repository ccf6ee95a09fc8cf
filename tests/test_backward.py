"""The attention backward (`cpuflash._backward.attention_backward`) against a dense float64
reference of the gradients, itself checked against torch's autograd."""

import numba
import numpy as np
import pytest

import cpuflash
from cpuflash._backward import attention_backward, attention_varlen_backward
from cpuflash.reference import attention_reference, probabilities

from accuracy import assert_within_rule, tolerance
from helpers import (assert_same_bits, heads_first, low_precision_dtype, negative, packed,
                     random_qkv, unaligned, visible)


# -- the dense reference of the gradients ---------------------------------------------------------

def attention_backward_reference(dout, q, k, v, *, causal=False, scale=None, window=None,
                                 chunk_size=None, softcap=0.0, alibi_slopes=None, bias=None, mask=None,
                                 sinks=None, layout="bhsd", dtype=np.float64, magnitudes=False):
    """The gradients of `attention_reference`'s output, densely, in `dtype`.

    Returns ``(dq, dk, dv)``, or ``(dq, dk, dv, dsinks)`` with `sinks`, shaped as q, k, v (and
    sinks). The probabilities come from the oracle (`cpuflash.reference.probabilities`), so the
    score pipeline is the oracle's; what is added here is the chain rule:

        D_i = sum_c dO_ic O_ic,   dP = dO V^T,   dS = P * (dP - D),
        dX = dS * (1 - tanh(X / softcap)^2)  (X = scale * Q K^T; no factor without a softcap),
        dQ = scale * dX K,   dK = scale * dX^T Q,   dV = P^T dO,
        dsinks_h = -sum_i exp(sink_h - lse_i) D_i,

    dK and dV summed over the query heads of each key/value head's group.

    With ``magnitudes=True``, the same sums of absolute values instead, each probability
    weighted by ``1 + |s| + |lse|`` (its rounding error is about eps times that): the size of
    the terms whose rounding makes a gradient's error, which can be far larger than the
    gradient where they cancel (one key: dS = dP - D is rounding noise around 0).
    """
    dtype = np.dtype(dtype)
    if layout == "bshd":  # (B, N, H, D) -> (B, H, N, D)
        q, k, v, dout = (np.swapaxes(x, 1, 2) for x in (q, k, v, dout))
    q, k, v, dout = (np.asarray(x).astype(dtype) for x in (q, k, v, dout))
    n_k, d = k.shape[-2:]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    options = dict(causal=causal, scale=scale, window=window, chunk_size=chunk_size,
                   softcap=softcap,
                   alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks, dtype=dtype)
    p, lse = probabilities(q, k, return_lse=True, **options)
    group = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    k_rep, v_rep = (np.repeat(x, group, axis=-3) if group > 1 else x for x in (k, v))
    t = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731

    chain = 1
    if softcap > 0:  # d softcap(x) / dx
        tanh = np.tanh(q @ t(k_rep) * dtype.type(scale) / dtype.type(softcap))
        chain = 1 - tanh * tanh
    out = p @ v_rep
    if magnitudes:
        with np.errstate(divide="ignore"):
            s = np.where(p > 0, np.log(p) + lse[..., None], 0)
        p = p * (1 + np.abs(s) + np.where(np.isfinite(lse), np.abs(lse), 0)[..., None])
        q, k_rep, v_rep, dout, out = (np.abs(x) for x in (q, k_rep, v_rep, dout, out))
    delta = (dout * out).sum(axis=-1, keepdims=True)
    ds = p * (dout @ t(v_rep) + (delta if magnitudes else -delta)) * chain
    dq = dtype.type(scale) * (ds @ k_rep)
    dk = dtype.type(scale) * (t(ds) @ q)
    dv = t(p) @ dout
    if group > 1:  # the query heads of a group add up
        dk, dv = (x.reshape(x.shape[:-3] + (k.shape[-3], group) + x.shape[-2:]).sum(axis=-3)
                  for x in (dk, dv))
    if layout == "bshd":
        dq, dk, dv = (np.swapaxes(x, 1, 2) for x in (dq, dk, dv))
    if sinks is None:
        return dq, dk, dv
    sink = np.asarray(sinks, dtype=dtype)[:, None]
    per_row = np.exp(sink - lse) * delta[..., 0]  # (..., Hq, Nq)
    dsinks = -per_row.reshape((-1,) + per_row.shape[-2:]).sum(axis=(0, 2))
    return dq, dk, dv, dsinks


def torch_gradients(dout, q, k, v, *, causal=False, scale=None, window=None, softcap=0.0,
                    alibi_slopes=None, bias=None, mask=None, sinks=None):
    """The same gradients by torch's autograd through a dense float64 attention written
    independently of `attention_reference` ("bhsd", 4-D; every row must see a key or a sink)."""
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in (q, k, v))
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    group = q.shape[-3] // k.shape[-3]
    keys, values = tk.repeat_interleave(group, dim=-3), tv.repeat_interleave(group, dim=-3)
    s = scale * tq @ keys.transpose(-1, -2)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(n_q)[:, None] + (n_k - n_q)
    j = torch.arange(n_k)[None, :]
    if alibi_slopes is not None:
        slopes = torch.tensor(np.asarray(alibi_slopes, np.float64))[..., None, None]
        s = s - slopes * (i - j).abs()
    if bias is not None:
        s = s + torch.tensor(np.asarray(bias, np.float64))
    seen = torch.ones(n_q, n_k, dtype=torch.bool)
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    if mask is not None:
        seen = seen & torch.tensor(mask)
    s = s.masked_fill(~seen, -torch.inf)
    tsinks = None
    if sinks is not None:
        tsinks = torch.tensor(np.asarray(sinks, np.float64), requires_grad=True)
        column = tsinks[:, None, None].expand(s.shape[:-1] + (1,))
        lse = torch.logsumexp(torch.cat([s, column], dim=-1), dim=-1, keepdim=True)
    else:
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
    out = torch.exp(s - lse) @ values
    (out * torch.tensor(np.asarray(dout, np.float64))).sum().backward()
    grads = tuple(x.grad.numpy() for x in (tq, tk, tv))
    return grads if sinks is None else grads + (tsinks.grad.numpy(),)


REFERENCE_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(4, 2)),
    "softcap": dict(softcap=2.0, scale=0.9),
    "alibi": dict(alibi_slopes=np.array([0.3, 0.1, 0.7, 0.2])),
    "bias": dict(bias="bias"),
    "mask": dict(mask="mask", causal=True),
    "sinks": dict(sinks=np.array([0.5, -1.0, 2.0, 0.0])),
    "everything": dict(causal=True, window=(5, -1), softcap=3.0, scale=0.5,
                       alibi_slopes=np.array([0.3, 0.1, 0.7, 0.2]), bias="bias", mask="mask",
                       sinks=np.array([0.5, -1.0, 2.0, 0.0])),
}


def _materialize(rng, options, n_q, n_k):
    """Random bias (2, 4, Nq, Nk) and mask (4, Nq, Nk) where a case asks for them; the mask
    keeps each row's diagonal key, so every row sees a key (torch would give NaN)."""
    options = dict(options)
    if options.get("bias") == "bias":
        options["bias"] = rng.standard_normal((2, 4, n_q, n_k))
    if options.get("mask") == "mask":
        mask = rng.random((4, n_q, n_k)) < 0.7
        mask[:, np.arange(n_q), np.arange(n_q) + n_k - n_q] = True
        options["mask"] = mask
    return options


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
@pytest.mark.parametrize("n_q,n_k", [(7, 7), (5, 9)])
def test_reference_gradients_match_torch_autograd(rng, case, n_q, n_k):
    q, k, v = random_qkv(rng, (2, 4, n_q, 6), (2, 2, n_k, 6), d_v=5, dtype=np.float64)
    dout = rng.standard_normal((2, 4, n_q, 5))
    options = _materialize(rng, REFERENCE_CASES[case], n_q, n_k)
    ours = attention_backward_reference(dout, q, k, v, **options)
    theirs = torch_gradients(dout, q, k, v, **options)
    assert len(ours) == len(theirs)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=name)


def test_reference_gradients_match_finite_differences(rng):
    """One more witness, torch-free: central differences of sum(dout * out) in float64."""
    q, k, v = random_qkv(rng, (1, 2, 4, 3), (1, 1, 5, 3), dtype=np.float64)
    dout = rng.standard_normal((1, 2, 4, 3))
    options = dict(causal=True, softcap=1.5, alibi_slopes=np.array([0.2, 0.4]),
                   sinks=np.array([0.3, -0.2]))
    grads = attention_backward_reference(dout, q, k, v, **options)

    def loss(q, k, v, sinks):
        out = attention_reference(q, k, v, **dict(options, sinks=sinks))
        return float((out * dout).sum())

    step = 1e-6
    args = [q, k, v, options["sinks"]]
    for which, grad in enumerate(grads):
        x = args[which]
        numeric = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[which][index] += step
            minus[which][index] -= step
            numeric[index] = (loss(*plus) - loss(*minus)) / (2 * step)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


# -- the accuracy rule ----------------------------------------------------------------------------

def assert_gradients_close(got, dout, q, k, v, *, plain_dtype=None, **kwargs):
    """flash-attn's rule for each gradient: its error against the oracle is at most twice that
    of a plain implementation in the same precision (the dense reference computed in it), plus
    a floor of a few roundings of the gradient's largest magnitude.

    The oracle is the float64 reference (extended precision for float64 inputs). `dsinks` is
    float32 by contract: its floor is float32's whatever the inputs.
    """
    dtype = np.dtype(q.dtype)
    plain_dtype = plain_dtype or (np.float64 if dtype == np.float64 else np.float32)
    oracle = np.longdouble if plain_dtype == np.float64 else np.float64
    ref = attention_backward_reference(dout, q, k, v, dtype=oracle, **kwargs)
    plain = attention_backward_reference(dout, q, k, v, dtype=plain_dtype, **kwargs)
    sizes = attention_backward_reference(dout, q, k, v, magnitudes=True, **kwargs)
    assert len(got) == len(ref)
    for name, g, r, p, size, like in zip(("dq", "dk", "dv", "dsinks"), got, ref, plain, sizes,
                                         (q, k, v, np.zeros(0, np.float32))):
        assert g.shape == r.shape and g.dtype == like.dtype, \
            f"{name}: {g.dtype}{g.shape}, expected {like.dtype}{r.shape}"
        if not g.size:
            continue
        errors = np.abs(g.astype(oracle) - r)
        plain_error = float(np.abs(p.astype(oracle) - r).max())
        assert_within_rule(errors, plain_error, tolerance(like.dtype) * np.abs(size), name)


def forward_and_backward(rng, q, k, v, dout_dtype=None, **kwargs):
    """The forward's out and lse, a random dout, and the backward's result: (dout, grads)."""
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **kwargs)
    dout = rng.standard_normal(out.shape).astype(dout_dtype or out.dtype)
    return dout, attention_backward(dout, q, k, v, out, lse, **kwargs)


def check(rng, q, k, v, plain_dtype=None, **kwargs):
    dout, grads = forward_and_backward(rng, q, k, v, **kwargs)
    assert_gradients_close(grads, dout, q, k, v, plain_dtype=plain_dtype, **kwargs)
    return grads


# -- every feature, on awkward sizes --------------------------------------------------------------

SIZES = [(1, 1), (3, 3), (1, 239), (113, 239), (239, 113), (3, 70)]


@pytest.mark.parametrize("n_q,n_k", SIZES)
@pytest.mark.parametrize("causal", [False, True])
def test_sizes(rng, n_q, n_k, causal):
    q, k, v = random_qkv(rng, (2, 4, n_q, 40), (2, 2, n_k, 40), d_v=24)
    check(rng, q, k, v, causal=causal)


@pytest.mark.parametrize("d,d_v", [(40, 40), (59, 111), (111, 59), (256, 256), (1, 3)])
def test_head_dims(rng, d, d_v):
    q, k, v = random_qkv(rng, (1, 2, 113, d), (1, 2, 127, d), d_v=d_v)
    check(rng, q, k, v, causal=True)


@pytest.mark.parametrize("n_q,n_k", [(113, 239), (239, 113), (127, 127)])
@pytest.mark.parametrize("window", [(0, 0), (5, 0), (40, 7), (-1, 3), (17, -1), (300, 300)])
def test_windows(rng, n_q, n_k, window):
    q, k, v = random_qkv(rng, (1, 4, n_q, 32), (1, 2, n_k, 32))
    check(rng, q, k, v, window=window)
    check(rng, q, k, v, window=window, causal=True)


@pytest.mark.parametrize("n_q,n_k", [(113, 239), (239, 113), (127, 127)])
@pytest.mark.parametrize("chunk_size", [1, 16, 50, 128, 1000])
def test_chunks(rng, n_q, n_k, chunk_size):
    q, k, v = random_qkv(rng, (1, 4, n_q, 32), (1, 2, n_k, 32))
    check(rng, q, k, v, chunk_size=chunk_size)
    check(rng, q, k, v, chunk_size=chunk_size, causal=True, window=(40, -1))


@pytest.mark.parametrize("n_q,n_k", [(113, 239), (239, 113), (3, 70)])
@pytest.mark.parametrize("case", ["softcap", "large_softcap", "alibi", "alibi_batch", "bias",
                                  "mask", "sinks"])
def test_modifiers(rng, n_q, n_k, case):
    q, k, v = random_qkv(rng, (2, 4, n_q, 48), (2, 2, n_k, 48), d_v=40)
    options = {
        "softcap": dict(softcap=2.0, scale=0.5),
        "large_softcap": dict(softcap=30.0),
        "alibi": dict(alibi_slopes=rng.uniform(0.01, 0.5, 4).astype(np.float32)),
        "alibi_batch": dict(alibi_slopes=rng.uniform(0.01, 0.5, (2, 4)).astype(np.float32),
                            causal=True),
        "bias": dict(bias=rng.standard_normal((4, 1, n_k)).astype(np.float32)),
        "mask": dict(mask=rng.random((2, 1, n_q, n_k)) < 0.8, window=(50, 10)),
        "sinks": dict(sinks=rng.standard_normal(4).astype(np.float32), causal=True),
    }[case]
    if case == "large_softcap":
        q *= 6
    check(rng, q, k, v, **options)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_everything_at_once(rng, layout):
    n_q, n_k, hq = 131, 203, 4
    shape_q, shape_k = ((2, n_q, hq, 59), (2, n_k, 2, 59)) if layout == "bshd" else \
        ((2, hq, n_q, 59), (2, 2, n_k, 59))
    q, k, v = random_qkv(rng, shape_q, shape_k, d_v=40)
    check(rng, q, k, v, layout=layout, causal=True, window=(60, -1), softcap=5.0, scale=0.3,
          alibi_slopes=rng.uniform(0.01, 0.1, (2, hq)).astype(np.float32),
          bias=rng.standard_normal((hq, 1, n_k)).astype(np.float32),
          mask=rng.random((2, 1, n_q, n_k)) < 0.9,
          sinks=rng.standard_normal(hq).astype(np.float32))


@pytest.mark.parametrize("hq,hk", [(6, 1), (6, 3), (3, 3)])
def test_gqa_and_mqa(rng, hq, hk):
    q, k, v = random_qkv(rng, (2, hq, 100, 32), (2, hk, 150, 32), d_v=48)
    check(rng, q, k, v, causal=True)


@pytest.mark.parametrize("options", [dict(causal=True), dict(softcap=4.0, window=(50, 3)),
                                     dict(sinks="per head", alibi_slopes="per head")])
def test_mqa_heads_summed_in_parts(rng, restore_num_threads, monkeypatch, options):
    """An MQA group's heads are cut into parts for the backward (`_run_backward.head_parts`),
    whose dK and dV are summed: within the rule, dq and dsinks as uncut, the same bits for any
    thread count."""
    from cpuflash import _run_backward

    options = {name: (rng.standard_normal(16).astype(np.float32) / 4 if value == "per head"
                      else value) for name, value in options.items()}
    q, k, v = random_qkv(rng, (2, 16, 90, 32), (2, 1, 120, 32), d_v=24)
    cut = []
    real = _run_backward._backward_in_parts
    monkeypatch.setattr(_run_backward, "_backward_in_parts",
                        lambda *a: cut.append(a[-1]) or real(*a))
    results = []
    for threads in sorted({1, 2, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        results.append(check(np.random.default_rng(7), q, k, v, **options))
    assert cut and set(cut) == {2}
    for result in results[1:]:
        assert_same_bits(result, results[0])
    monkeypatch.setattr(_run_backward, "head_parts", lambda call: 1)
    whole = check(np.random.default_rng(7), q, k, v, **options)
    assert_same_bits(whole[0], results[0][0])  # dq: each head's own sum either way
    if "sinks" in options:
        assert_same_bits(whole[3], results[0][3])


@pytest.mark.parametrize("shapes", [((70, 24), (90, 24)), ((2, 3, 4, 50, 24), (2, 3, 2, 70, 24))],
                         ids=["one_head", "two_leading_axes"])
def test_leading_axes(rng, shapes):
    q, k, v = random_qkv(rng, *shapes, d_v=16)
    check(rng, q, k, v, causal=True)


@pytest.mark.parametrize("which", ["float64", "float16", "bfloat16"])
def test_dtypes(rng, which):
    dtype = np.dtype(np.float64) if which == "float64" else low_precision_dtype(which)
    q, k, v = random_qkv(rng, (2, 4, 113, 59), (2, 2, 203, 59), d_v=40, dtype=dtype)
    options = dict(causal=True, alibi_slopes=np.full(4, 0.05, np.float32), softcap=20.0)
    plain = None if which == "float64" else dtype  # the plain implementation in half precision
    grads = check(rng, q, k, v, plain_dtype=plain, **options)
    assert all(g.dtype == dtype for g in grads)


def test_strided_inputs(rng):
    """Transposed, sliced and negatively strided inputs give the bits of contiguous ones."""
    q, k, v = random_qkv(rng, (2, 4, 90, 32), (2, 2, 110, 32), d_v=48)
    options = dict(causal=True, softcap=4.0)
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    expected = attention_backward(dout, q, k, v, out, lse, **options)
    wide = np.zeros((2, 4, 90, 64), np.float32)
    wide[..., ::2] = q
    strided = (negative(dout), np.asfortranarray(wide[..., ::2]), negative(k),
               np.swapaxes(np.swapaxes(v, 2, 3).copy(), 2, 3), np.asfortranarray(out),
               negative(lse))
    assert_same_bits(attention_backward(*strided, **options), expected)


# -- rows and keys that see nothing, empty inputs -------------------------------------------------

def test_rows_that_see_no_key_get_zero_gradients(rng):
    """Fully masked rows, rows before the first key (causal, Nq > Nk) and keys no row sees."""
    q, k, v = random_qkv(rng, (1, 2, 120, 32), (1, 1, 100, 32))
    mask = rng.random((120, 100)) < 0.7
    mask[[0, 50, 119]] = False  # rows 0..19 see nothing by causality too
    mask[:, [3, 60]] = False  # keys nobody sees
    for sinks in (None, np.array([0.5, -0.5], np.float32)):
        dout, grads = forward_and_backward(rng, q, k, v, causal=True, mask=mask, sinks=sinks)
        dq, dk, dv = grads[:3]
        assert not dq[:, :, list(range(20)) + [50, 119]].any()
        assert not dk[:, :, [3, 60]].any() and not dv[:, :, [3, 60]].any()
        assert_gradients_close(grads, dout, q, k, v, causal=True, mask=mask, sinks=sinks)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("n_q,n_k,hq", [(0, 5, 2), (5, 0, 2), (0, 0, 2), (5, 5, 0)])
def test_empty(rng, monkeypatch, n_q, n_k, hq, fused):
    from cpuflash import _run_backward

    monkeypatch.setattr(_run_backward, "_fuse", lambda *args: fused)
    q, k, v = random_qkv(rng, (2, hq, n_q, 8), (2, 1, n_k, 8), d_v=4)
    sinks = np.zeros(hq, np.float32)
    dout, grads = forward_and_backward(rng, q, k, v, sinks=sinks)
    for g, x in zip(grads, (q, k, v, sinks)):
        assert g.shape == x.shape and not g.any()


# -- determinism ----------------------------------------------------------------------------------

@pytest.fixture
def restore_num_threads():
    before = numba.get_num_threads()
    yield
    numba.set_num_threads(before)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(40, 7), softcap=3.0),
                                     dict(sinks=np.array([0.1, 0.2, 0.3, 0.4], np.float32))])
def test_bits_do_not_depend_on_the_thread_count(rng, restore_num_threads, options):
    q, k, v = random_qkv(rng, (2, 4, 230, 40), (2, 2, 250, 40), d_v=24)
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    results = []
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS, 2} - {0}):
        if threads <= numba.config.NUMBA_NUM_THREADS:
            numba.set_num_threads(threads)
            results += [attention_backward(dout, q, k, v, out, lse, **options) for _ in range(2)]
    for result in results[1:]:
        assert_same_bits(result, results[0])


# -- outputs given by the caller ------------------------------------------------------------------

def test_gradients_written_in_place(rng):
    q, k, v = random_qkv(rng, (2, 3, 2, 40, 16), (2, 3, 1, 50, 16), d_v=8)
    out, lse = cpuflash.attention(q, k, v, return_lse=True, causal=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    expected = attention_backward(dout, q, k, v, out, lse, causal=True)
    # a Fortran-ordered dq (its leading axes cannot be flattened without a copy), a dk read
    # through negative strides, a C-ordered dv
    given = (np.asfortranarray(np.full_like(q, np.nan)), negative(np.full_like(k, np.nan)),
             np.full_like(v, np.nan))
    got = attention_backward(dout, q, k, v, out, lse, causal=True, dq=given[0], dk=given[1],
                             dv=given[2])
    assert all(g is x for g, x in zip(got, given))
    assert_same_bits(got, expected)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gradients_written_unaligned(rng, layout):
    """Gradients given in memory one byte off its alignment are written all the same."""
    q, k, v = random_qkv(rng, (1, 40, 2, 16), (1, 50, 1, 16))
    if layout == "bhsd":
        q, k, v = (np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k, v))
    out, lse = cpuflash.attention(q, k, v, return_lse=True, causal=True, layout=layout)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    expected = attention_backward(dout, q, k, v, out, lse, causal=True, layout=layout)
    given = tuple(unaligned(np.full_like(x, np.nan)) for x in (q, k, v))
    got = attention_backward(dout, q, k, v, out, lse, causal=True, layout=layout,
                             dq=given[0], dk=given[1], dv=given[2])
    assert all(g is x for g, x in zip(got, given))
    assert_same_bits(got, expected)


def test_gradients_written_over_inputs(rng):
    """dq=q (and dv=dout): the inputs are read in full before a gradient is written."""
    q, k, v = random_qkv(rng, (1, 2, 60, 16), (1, 2, 60, 16))
    out, lse = cpuflash.attention(q, k, v, return_lse=True, causal=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    expected = attention_backward(dout, q, k, v, out, lse, causal=True)
    got = attention_backward(dout, q, k, v, out, lse, causal=True, dq=q, dv=dout)
    assert got[0] is q and got[2] is dout
    assert_same_bits(got, expected)


# -- bad input ------------------------------------------------------------------------------------

def _bad_call_arguments(rng):
    q, k, v = random_qkv(rng, (1, 2, 10, 8), (1, 1, 12, 8), d_v=4)
    out, lse = cpuflash.attention(q, k, v, return_lse=True)
    dout = np.ones_like(out)
    return dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)


BAD_INPUTS = [
    (dict(dout=np.ones((1, 2, 10, 5), np.float32)), ValueError,
     r"`dout` must have the shape of the attention output \(1, 2, 10, 4\)"),
    (dict(dout=np.ones((1, 2, 10, 4), np.float64)), TypeError, "`dout` must have dtype float32"),
    (dict(dout=[1.0]), TypeError, "`dout` must be an array"),
    (dict(out=np.ones((1, 2, 9, 4), np.float32)), ValueError, "`out` must have the shape"),
    (dict(out=np.ones((1, 2, 10, 4), np.float16)), TypeError, "`out` must have dtype float32"),
    (dict(lse=np.zeros((1, 2, 11), np.float32)), ValueError,
     r"`lse` must have shape \(1, 2, 10\)"),
    (dict(lse=np.zeros((1, 2, 10), np.int32)), TypeError, "`lse` must be a float array"),
    (dict(dq=np.zeros((1, 2, 10, 9), np.float32)), ValueError, "`dq` must have shape"),
    (dict(dk=np.zeros((1, 1, 12, 8), np.float64)), TypeError, "`dk` must have dtype float32"),
    (dict(dv="readonly"), ValueError, "`dv` must be writeable"),
    (dict(k=np.ones((1, 1, 12, 8), np.float64)), TypeError, "must share one dtype"),
    (dict(window=(1, 2, 3)), ValueError, "`window` must be a pair"),
    (dict(softcap=-1.0), ValueError, "`softcap` must be finite and >= 0"),
    (dict(layout="sbhd"), ValueError, "`layout` must be one of"),
]


@pytest.mark.parametrize("changes,exc,match", BAD_INPUTS)
def test_bad_input_is_rejected_before_anything_is_written(rng, changes, exc, match):
    arguments = _bad_call_arguments(rng)
    outputs = dict(dq=np.full_like(arguments["q"], 7.0), dk=np.full_like(arguments["k"], 7.0),
                   dv=np.full_like(arguments["v"], 7.0))
    changes = dict(changes)
    if changes.get("dv") == "readonly":
        changes["dv"] = np.zeros_like(arguments["v"])
        changes["dv"].flags.writeable = False
    arguments.update(outputs)
    arguments.update(changes)
    positional = [arguments.pop(name) for name in ("dout", "q", "k", "v", "out", "lse")]
    with pytest.raises(exc, match=match):
        attention_backward(*positional, **arguments)
    for name, x in outputs.items():
        if name not in changes:
            assert np.all(x == 7.0), f"{name} was written"


@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(40, 7), softcap=3.0),
                                     dict(mask="mask", sinks=np.array([0.1, 0.2, 0.3, 0.4]))])
def test_both_schemes_give_the_same_bits(rng, monkeypatch, options):
    """The fused pass (one item per sequence and kv head, dQ summed there too) and the split
    passes (key blocks for dK/dV, query tiles for dQ) sum in the same order: the choice between
    them, which depends on the thread count, never changes a bit."""
    from cpuflash import _run_backward

    q, k, v = random_qkv(rng, (2, 4, 230, 40), (2, 2, 250, 40), d_v=24)
    options = dict(options)
    if "mask" in options:
        options["mask"] = rng.random((230, 250)) < 0.8
        options["sinks"] = options["sinks"].astype(np.float32)
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    results = []
    for fused in (False, True):
        monkeypatch.setattr(_run_backward, "_fuse", lambda *args, fused=fused: fused)
        results.append(attention_backward(dout, q, k, v, out, lse, **options))
    assert_gradients_close(results[0], dout, q, k, v, **options)
    assert_same_bits(results[1], results[0])


def test_agrees_with_torch_sdpa_backward(rng):
    """A witness that shares no code with the reference: torch's own SDPA backward (float64;
    its causal diagonal is top-left, the same as cpuflash's for Nq == Nk)."""
    torch = pytest.importorskip("torch")
    q, k, v = random_qkv(rng, (2, 4, 150, 64), (2, 4, 150, 64), d_v=48)
    dout, grads = forward_and_backward(rng, q, k, v, causal=True, scale=0.2)
    tq, tk, tv = (torch.tensor(x.astype(np.float64), requires_grad=True) for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=0.2)
    out.backward(torch.tensor(dout.astype(np.float64)))
    for got, x in zip(grads, (tq, tk, tv)):
        expected = x.grad.numpy()
        np.testing.assert_allclose(got, expected, atol=2e-5 * np.abs(expected).max(), rtol=0)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(300, 40), softcap=8.0)])
def test_long_sequences(rng, options):
    q, k, v = random_qkv(rng, (1, 2, 1023, 128), (1, 1, 1500, 128), d_v=96)
    check(rng, q, k, v, **options)


# -- non-finite values reach only the rows and keys that see them --------------------------------

# one row of each input made non-finite in a few lanes: a NaN key element; NaN, inf and -inf in
# a value row; inf in a query; NaN in an output gradient
NONFINITE = {"k": {0: np.nan}, "v": {0: np.nan, 1: np.inf, -1: -np.inf}, "q": {3: np.inf},
             "dout": {1: np.nan}}


def with_row(x, row_axis, j, values):
    """A copy of `x` with row j (on `row_axis`, every head) given `values` ({lane: value})."""
    x = x.copy()
    rows = np.moveaxis(x, row_axis, -2)
    for lane, value in values.items():
        rows[..., j, lane] = value
    return x


def check_hidden_nonfinite(run, arrays, sees, which, j, row_axis=-2):
    """Row j of `arrays[which]` (a key row of k or v, a query row of q or dout) made non-finite
    changes no bit of the gradients that cannot see it, against the same row made 0.

    `run(q, k, v, dout)` gives (dq, dk, dv) with rows on `row_axis`; `sees` is the (rows, keys)
    visibility. A key reaches dQ of the rows that see it, and through them dK, dV of every key
    those rows see; a query row reaches dQ of itself and dK, dV of the keys it sees.
    """
    zeroed, bad = dict(arrays), dict(arrays)
    zeroed[which] = with_row(arrays[which], row_axis, j, dict.fromkeys(NONFINITE[which], 0.0))
    bad[which] = with_row(arrays[which], row_axis, j, NONFINITE[which])
    clean, got = run(**zeroed), run(**bad)
    if which in ("k", "v"):
        rows_hit = sees[:, j]
        keys_hit = sees[rows_hit].any(axis=0)
    else:
        rows_hit = np.arange(sees.shape[0]) == j
        keys_hit = sees[j]
    for name, g, c, hit in zip(("dq", "dk", "dv"), got, clean, (rows_hit, keys_hit, keys_hit)):
        assert np.isfinite(c).all(), name
        g, c = np.moveaxis(g, row_axis, -2), np.moveaxis(c, row_axis, -2)
        assert_same_bits(g[..., ~hit, :], c[..., ~hit, :],
                         f"{which} row {j} non-finite: {name} of the rows/keys that cannot see it")
    return int((~rows_hit).sum() + (~keys_hit).sum())


def _hiding_rule(rng, rule, n_q, n_k):
    if rule == "mask":  # rows of a 6-row group that differ, and random keys
        mask = rng.random((n_q, n_k)) < 0.6
        mask[::2, :] |= rng.random((1, n_k)) < 0.5
        mask[1::2, :] &= rng.random((1, n_k)) < 0.5
        return dict(mask=mask, window=(80, -1))
    return {"causal": dict(causal=True), "window": dict(window=(17, 23)),
            "window_left": dict(window=(45, 0), softcap=5.0)}[rule]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rule", ["causal", "window", "window_left", "mask"])
def test_hidden_nonfinite_values_reach_no_gradient(rng, monkeypatch, rule, fused):
    """A key or value row holding inf or NaN changes nothing in dQ of the rows that cannot see
    it (nor dK, dV reached only through those rows), and a query or output-gradient row
    nothing in dK, dV of the keys it cannot see: the forward's guarantee, kept by the
    backward. Rows and keys on and next to the edges of tiles, panels and row groups."""
    from cpuflash import _run_backward

    monkeypatch.setattr(_run_backward, "_fuse", lambda *args: fused)
    n_q, n_k = 150, 200
    q, k, v = random_qkv(rng, (1, 2, n_q, 40), (1, 1, n_k, 40), d_v=24)
    dout = rng.standard_normal((1, 2, n_q, 24)).astype(np.float32)
    options = _hiding_rule(rng, rule, n_q, n_k)
    sees = visible(n_q, n_k, options.get("causal", False), options.get("window"))
    if "mask" in options:
        sees &= options["mask"]

    def run(q, k, v, dout):
        out, lse = cpuflash.attention(q, k, v, return_lse=True, **options)
        return attention_backward(dout, q, k, v, out, lse, **options)

    arrays = dict(q=q, k=k, v=v, dout=dout)
    hidden = 0
    for j in (0, 31, 32, 63, 64, 95, 96, 97, 101, 150, 191, 192, n_k - 1):
        hidden += check_hidden_nonfinite(run, arrays, sees, "k", j)
        hidden += check_hidden_nonfinite(run, arrays, sees, "v", j)
    for i in (0, 5, 6, 95, 96, 101, n_q - 1):
        hidden += check_hidden_nonfinite(run, arrays, sees, "q", i)
        hidden += check_hidden_nonfinite(run, arrays, sees, "dout", i)
    assert hidden > 0


@pytest.mark.parametrize("fused", [False, True])
def test_hidden_nonfinite_values_stay_in_their_packed_sequence(rng, monkeypatch, fused):
    """Packed sequences: a non-finite row of one sequence changes no bit of its neighbours'
    gradients (nor of its own rows and keys that cannot see it)."""
    from cpuflash import _run_backward

    monkeypatch.setattr(_run_backward, "_fuse", lambda *args: fused)
    lens_q, lens_k = [5, 0, 130, 77, 40], [7, 3, 100, 200, 40]
    q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k)
    dout = rng.standard_normal((cu_q[-1], 4, 24)).astype(np.float32)
    options = dict(causal=True, window=(50, -1))
    sees = np.zeros((cu_q[-1], cu_k[-1]), dtype=bool)
    for b in range(len(lens_q)):
        sees[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = visible(lens_q[b], lens_k[b], **options)

    def run(q, k, v, dout):
        out, lse = cpuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
        return attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **options)

    arrays = dict(q=q, k=k, v=v, dout=dout)
    for j in sorted({0, 6, 7, 9, 10, 50, 109, 110, 111, 200, 309, 310, cu_k[-1] - 1}):
        check_hidden_nonfinite(run, arrays, sees, "k", j, row_axis=0)
        check_hidden_nonfinite(run, arrays, sees, "v", j, row_axis=0)
    for i in sorted({0, 4, 5, 6, 100, 134, 135, 211, 212, cu_q[-1] - 1}):
        check_hidden_nonfinite(run, arrays, sees, "q", i, row_axis=0)
        check_hidden_nonfinite(run, arrays, sees, "dout", i, row_axis=0)


# -- packed sequences -----------------------------------------------------------------------------

@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 32])
def test_varlen(rng, monkeypatch, fused, chunk_size):
    """Each packed sequence's gradients are those of the sequence alone (empty ones too), and
    the fused and split schemes give the same bits."""
    from cpuflash import _run_backward

    monkeypatch.setattr(_run_backward, "_fuse", lambda *args: fused)
    lens_q, lens_k = [5, 0, 130, 1, 77, 40], [7, 3, 100, 0, 200, 40]
    q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k)
    slopes = rng.uniform(0.01, 0.3, (len(lens_q), 4)).astype(np.float32)
    options = dict(causal=True, window=(50, -1), softcap=4.0, chunk_size=chunk_size)
    out, lse = cpuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True,
                                         alibi_slopes=slopes, **options)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                           alibi_slopes=slopes, **options)
    for b in range(len(lens_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        got = tuple(heads_first(x) for x in (dq[rows], dk[keys], dv[keys]))
        assert_gradients_close(got, heads_first(dout[rows]), heads_first(q[rows]),
                               heads_first(k[keys]), heads_first(v[keys]),
                               alibi_slopes=slopes[b], **options)
    monkeypatch.setattr(_run_backward, "_fuse", lambda *args: not fused)
    assert_same_bits(attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                               alibi_slopes=slopes, **options), (dq, dk, dv))


def test_varlen_bad_input(rng):
    q, k, v, cu_q, cu_k = packed(rng, [3, 4], [5, 6])
    out, lse = cpuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
    with pytest.raises(ValueError, match=r"`lse` must have shape \(4, 7\)"):
        attention_varlen_backward(out, q, k, v, out, lse.T, cu_q, cu_k)
    with pytest.raises(ValueError, match="`cu_seqlens_k` must end at the number of rows"):
        attention_varlen_backward(out, q, k, v, out, lse, cu_q, cu_q)
