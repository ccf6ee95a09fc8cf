"""cpuflash with torch CPU tensors: no copies in or out, gradients, and a drop-in for torch's SDPA.

`cpuflash.attention` takes anything `numpy.asarray` can view, torch CPU tensors included, so torch
memory goes in as is, and ``torch.from_numpy`` (or ``out=tensor.numpy()``) hands the result back
without a copy. That numpy-level call carries no gradient, so a tensor that requires grad while
grad mode is on is refused there (no silent detach that would leave every gradient upstream of
attention None). For training, `cpuflash.torch` wraps the kernels as torch custom operators with
autograd: ``cpuflash.torch.attention`` (cpuflash's keywords) and
``cpuflash.torch.scaled_dot_product_attention``, a drop-in for
``torch.nn.functional.scaled_dot_product_attention`` checked here against torch on several cases,
values and gradients. Exits 0 with a message without torch.

    python examples/torch_interop.py
    python examples/torch_interop.py --small   # used by the tests
"""

import argparse

import cpuflash

try:
    import torch
    import torch.nn.functional as F

    import cpuflash.torch
except ImportError:
    torch = None


def show_zero_copy(n, d):
    """Tensors in, tensor out, and check by address that nothing was copied on the way."""
    q_t, k_t, v_t = (torch.randn(2, 4, n, d) for _ in range(3))
    q, k, v = (t.numpy() for t in (q_t, k_t, v_t))  # what cpuflash sees: views, no copies
    shared_in = all(a.ctypes.data == t.data_ptr() for a, t in ((q, q_t), (k, k_t), (v, v_t)))

    result = cpuflash.attention(q_t, k_t, v_t, causal=True)  # tensors are taken as they are
    out_t = torch.from_numpy(result)  # shares memory with `result`
    buffer_t = torch.empty(2, 4, n, d)  # or write straight into a preallocated torch tensor
    written = cpuflash.attention(q, k, v, causal=True, out=buffer_t.numpy())
    shared_out = (out_t.data_ptr() == result.ctypes.data
                  and written.ctypes.data == buffer_t.data_ptr())
    print(f"no copy in: {shared_in}, no copy out: {shared_out}, "
          f"results equal: {torch.equal(out_t, buffer_t)}")
    return shared_in and shared_out and torch.equal(out_t, buffer_t)


def show_gradients(n, d):
    """The numpy-level call refuses a tensor that requires grad; `cpuflash.torch` differentiates."""
    weight = torch.randn(d, d, requires_grad=True)  # a projection being trained
    x = torch.randn(2, 4, n, d)
    q = x @ weight  # requires grad
    try:
        cpuflash.attention(q, x, x)
    except TypeError as exc:
        refused = "requires grad" in str(exc)
        print(f"cpuflash.attention (grad mode on): refused, as it should be:\n  TypeError: {exc}")
    else:
        refused = False
        print("cpuflash.attention (grad mode on): NOT refused: a gradient would have been lost")
    grads = []
    for sdpa in (cpuflash.torch.scaled_dot_product_attention, F.scaled_dot_product_attention):
        weight.grad = None
        sdpa(x @ weight, x, x, is_causal=True).square().sum().backward()
        grads.append(weight.grad)
    err = ((grads[0] - grads[1]).abs().max() / grads[1].abs().max()).item()
    print(f"cpuflash.torch.scaled_dot_product_attention: weight gradient within {err:.1e} "
          f"(relative) of torch SDPA's")
    return refused and err < 1e-4


def compare_with_torch(name, q, k, v, **kwargs):
    """cpuflash's error vs torch float64 must be at most 2x torch float32's, on live rows."""
    ours = cpuflash.torch.scaled_dot_product_attention(q, k, v, **kwargs)
    theirs = F.scaled_dot_product_attention(q, k, v, **kwargs)
    mask = kwargs.get("attn_mask")
    float_mask = mask is not None and mask.is_floating_point()
    kwargs64 = dict(kwargs, attn_mask=mask.double()) if float_mask else kwargs
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kwargs64)
    # rows that see no key: cpuflash gives 0 (flash-attn's convention), torch 0 from 2.5 on
    # and NaN before; the errors are measured on the rows that see a key, and what each gives
    # on the others is printed
    dead = torch.zeros(ours.shape[:-1], dtype=torch.bool)
    if mask is not None:
        dead |= torch.isneginf(mask).all(-1) if float_mask else ~mask.any(-1)
    err = (ours - exact)[~dead].abs().max().item()
    torch_err = (theirs - exact)[~dead].abs().max().item()
    ok = err <= 2 * torch_err + 1e-6 and bool((ours[dead] == 0).all())
    note = ""
    if dead.any():
        note = (f"; in the {int(dead.sum())} rows that see no key cpuflash gives "
                f"{what(ours[dead])}, torch {what(theirs[dead])}")
    print(f"  {name:<20} max error {err:.1e} (torch float32 {torch_err:.1e}){note}  "
          f"{'OK' if ok else 'FAILED'}")
    return ok


def what(values):
    """What a block of outputs holds, in a word."""
    if bool((values == 0).all()):
        return "0"
    if bool(values.isnan().all()):
        return "NaN"
    return "other values"


def compare_all(n, d):
    """The drop-in against torch's on causal (three alignments), masks and GQA."""

    def qkv(n_q, n_k, heads_q=4, heads_k=4):
        return (torch.randn(2, heads_q, n_q, d), torch.randn(2, heads_k, n_k, d),
                torch.randn(2, heads_k, n_k, d))

    bool_mask = torch.rand(2, 1, n, n) < 0.3
    bool_mask[:, :, 0] = False  # a row with no key at all
    float_mask = torch.randn(n, n).masked_fill(torch.rand(n, n) < 0.5, float("-inf"))
    print(f"cpuflash.torch vs torch.nn.functional.scaled_dot_product_attention, D={d}:")
    ok = compare_with_torch("Nq == Nk, is_causal", *qkv(n, n), is_causal=True)
    ok &= compare_with_torch("Nq < Nk, is_causal", *qkv(n // 4, n), is_causal=True)
    ok &= compare_with_torch("Nq > Nk, is_causal", *qkv(n, n // 2), is_causal=True)
    ok &= compare_with_torch("bool mask", *qkv(n, n), attn_mask=bool_mask)
    ok &= compare_with_torch("float mask", *qkv(n, n), attn_mask=float_mask)
    ok &= compare_with_torch("GQA 8:2, is_causal", *qkv(n, n, 8, 2), is_causal=True,
                             enable_gqa=True)
    return ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes (for CI)")
    args = parser.parse_args(argv)
    if torch is None:
        print("torch is not installed: nothing to show (pip install torch)")
        return
    n, d = (128, 32) if args.small else (1024, 64)
    torch.manual_seed(0)
    ok = show_gradients(n, d)
    with torch.inference_mode():  # forward only here: no gradient wanted
        ok &= show_zero_copy(n, d)
        ok &= compare_all(n, d)
    if not ok:
        raise SystemExit("FAILED")
    print("OK")


if __name__ == "__main__":
    main()
