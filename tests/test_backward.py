"""The attention backward (`cpuflash._backward.attention_backward`) against a dense float64
reference of the gradients, itself checked against torch's autograd."""

import numpy as np
import pytest

from cpuflash.reference import attention_reference

from helpers import random_qkv


# -- the dense reference of the gradients ---------------------------------------------------------

def attention_backward_reference(dout, q, k, v, *, causal=False, scale=None, window=None,
                                 softcap=0.0, alibi_slopes=None, bias=None, mask=None,
                                 sinks=None, layout="bhsd", dtype=np.float64):
    """The gradients of `attention_reference`'s output, densely, in `dtype`.

    Returns ``(dq, dk, dv)``, or ``(dq, dk, dv, dsinks)`` with `sinks`, shaped as q, k, v (and
    sinks). The probabilities come from `attention_reference` itself (run on an identity matrix
    of values), so the score pipeline is the oracle's; what is added here is the chain rule:

        D_i = sum_c dO_ic O_ic,   dP = dO V^T,   dS = P * (dP - D),
        dX = dS * (1 - tanh(X / softcap)^2)  (X = scale * Q K^T; no factor without a softcap),
        dQ = scale * dX K,   dK = scale * dX^T Q,   dV = P^T dO,
        dsinks_h = -sum_i exp(sink_h - lse_i) D_i,

    dK and dV summed over the query heads of each key/value head's group.
    """
    dtype = np.dtype(dtype)
    if layout == "bshd":  # (B, N, H, D) -> (B, H, N, D)
        q, k, v, dout = (np.swapaxes(x, 1, 2) for x in (q, k, v, dout))
    q, k, v, dout = (np.asarray(x).astype(dtype) for x in (q, k, v, dout))
    n_k, d = k.shape[-2:]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    options = dict(causal=causal, scale=scale, window=window, softcap=softcap,
                   alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks, dtype=dtype)
    identity = np.broadcast_to(np.eye(n_k, dtype=dtype), k.shape[:-1] + (n_k,))
    p, lse = attention_reference(q, k, identity, return_lse=True, **options)
    group = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    k_rep, v_rep = (np.repeat(x, group, axis=-3) if group > 1 else x for x in (k, v))
    t = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731

    out = p @ v_rep
    delta = (dout * out).sum(axis=-1, keepdims=True)
    ds = p * (dout @ t(v_rep) - delta)
    if softcap > 0:
        tanh = np.tanh(q @ t(k_rep) * dtype.type(scale) / dtype.type(softcap))
        ds = ds * (1 - tanh * tanh)
    dq = dtype.type(scale) * (ds @ k_rep)
    dk = dtype.type(scale) * (t(ds) @ q)
    dv = t(p) @ dout
    if group > 1:  # the query heads of a group add up
        dk, dv = (x.reshape(x.shape[:-3] + (-1, group) + x.shape[-2:]).sum(axis=-3)
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
