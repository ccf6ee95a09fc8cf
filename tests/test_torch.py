"""`cpuflash.torch`: the torch custom operators, their gradients and the SDPA drop-in.

gradcheck in float64 checks the autograd formula against finite differences; opcheck checks
the operators' registration (fake kernels, schema, autograd); the drop-in is compared with
``torch.nn.functional.scaled_dot_product_attention`` itself, values and gradients.
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: cpuflash.torch needs it")
ct = pytest.importorskip("cpuflash.torch", reason="cpuflash.torch could not be imported")
from cpuflash._keywords import pack  # noqa: E402  (the operators' score slots)
F = torch.nn.functional


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def randn(gen, *shape, dtype=torch.float64, grad=True):
    return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(grad)


def qkv(gen, n_q=5, n_k=7, heads_q=2, heads_k=2, d=8, dv=None, layout="bhsd",
        dtype=torch.float64, grad=True):
    dv = d if dv is None else dv
    if layout == "bshd":
        shapes = (2, n_q, heads_q, d), (2, n_k, heads_k, d), (2, n_k, heads_k, dv)
    else:
        shapes = (2, heads_q, n_q, d), (2, heads_k, n_k, d), (2, heads_k, n_k, dv)
    return tuple(randn(gen, *shape, dtype=dtype, grad=grad) for shape in shapes)


# ------------------------------------------------------------------------------------------------
# gradients: finite differences in float64

ATTENTION_CASES = {
    "plain": ({}, {}),
    "causal": ({"causal": True}, {}),
    "causal Nq > Nk": ({"causal": True}, {"n_q": 9, "n_k": 4}),
    "window": ({"window": (2, 1)}, {}),
    "chunks": ({"causal": True, "chunk_size": 3}, {"n_q": 9, "n_k": 11}),
    "softcap": ({"softcap": 1.5}, {}),
    "gqa": ({"causal": True}, {"heads_q": 4, "heads_k": 2}),
    "bshd": ({"causal": True, "layout": "bshd"}, {"layout": "bshd"}),
    "dv != d": ({"scale": 0.3}, {"dv": 5}),
}


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_gradcheck_attention(gen, case):
    keywords, shape = ATTENTION_CASES[case]
    q, k, v = qkv(gen, **shape)
    assert torch.autograd.gradcheck(lambda q, k, v: ct.attention(q, k, v, **keywords), (q, k, v))


def test_gradcheck_sinks_and_constants(gen):
    q, k, v = qkv(gen, heads_q=4, heads_k=2)
    sinks = randn(gen, 4)
    slopes = torch.rand(4, generator=gen, dtype=torch.float64)
    bias = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = torch.rand(2, 1, 5, 7, generator=gen) < 0.7

    def fn(q, k, v, sinks):
        return ct.attention(q, k, v, sinks=sinks, alibi_slopes=slopes, bias=bias, mask=mask)

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


def test_lse_matches_and_carries_no_gradient(gen):
    q, k, v = qkv(gen)
    out, lse = ct.attention(q, k, v, return_lse=True)
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v)
    assert out.requires_grad and not lse.requires_grad


SDPA_CASES = {
    "plain": {},
    "is_causal Nq < Nk": {"is_causal": True},
    "is_causal Nq > Nk": {"is_causal": True, "n_q": 9, "n_k": 4},
    "gqa": {"is_causal": True, "heads_q": 4, "heads_k": 2, "enable_gqa": True},
}


@pytest.mark.parametrize("case", SDPA_CASES, ids=str)
def test_gradcheck_sdpa(gen, case):
    keywords = dict(SDPA_CASES[case])
    shape = {name: keywords.pop(name) for name in ("n_q", "n_k", "heads_q", "heads_k")
             if name in keywords}
    q, k, v = qkv(gen, **shape)
    assert torch.autograd.gradcheck(
        lambda q, k, v: ct.scaled_dot_product_attention(q, k, v, **keywords), (q, k, v))


def test_gradcheck_sdpa_masks(gen):
    q, k, v = qkv(gen)
    bool_mask = torch.rand(5, 7, generator=gen) < 0.6
    float_mask = torch.randn(2, 1, 5, 7, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda q, k, v: ct.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask), (q, k, v))
    # a mask with is_causal=True: torch 2.14 refuses it (test_sdpa_mask_with_is_causal_as_torch)
    causal = ct.MASK_WITH_CAUSAL
    assert torch.autograd.gradcheck(
        lambda q, k, v: ct.scaled_dot_product_attention(q, k, v, attn_mask=float_mask,
                                                        is_causal=causal), (q, k, v))


# ------------------------------------------------------------------------------------------------
# registration: torch.library.opcheck on both operators

def test_opcheck_forward(gen):
    q, k, v = qkv(gen, heads_q=4, heads_k=2)
    sinks = randn(gen, 4)
    mask = torch.rand(5, 7, generator=gen) < 0.7
    op = torch.ops.cpuflash.attention.default
    causal = pack(causal=True)
    torch.library.opcheck(op, (q, k, v, *causal, None, None, None, "bhsd"))
    score = pack(scale=0.5, window=(3, 2), chunk_size=4, softcap=2.0)
    torch.library.opcheck(op, (q, k, v, *score, None, mask, sinks, "bhsd"))
    qb, kb, vb = qkv(gen, layout="bshd")
    torch.library.opcheck(op, (qb, kb, vb, *causal, None, None, None, "bshd"))


def test_opcheck_backward(gen):
    q, k, v = qkv(gen, grad=False)
    sinks = torch.randn(2, generator=gen, dtype=torch.float64)
    score = pack(causal=True, chunk_size=3)
    out, lse = torch.ops.cpuflash.attention(q, k, v, *score, None, None, sinks, "bhsd")
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.cpuflash.attention_backward.default,
                          (dout, q, k, v, out, lse, *score, None, None, sinks, "bhsd"))


def test_eager_calls_skip_the_operator_with_its_bits(gen):
    """Eager calls run the operator's functions without its dispatch (`_EagerAttention`): the
    same outputs and gradients, bit for bit, as the operator gives, sinks included."""
    q, k, v = qkv(gen, heads_q=4, heads_k=2, dtype=torch.float32)
    sinks = randn(gen, 4, dtype=torch.float32)
    score = pack(causal=True, softcap=1.5)

    def run(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
        out, lse = fn(*leaves[:3], *score, None, None, leaves[3], "bhsd")
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out, lse, [x.grad for x in leaves]

    eager = run(ct._run_attention)
    assert type(ct.attention(q, k, v).grad_fn).__name__ == "_EagerAttentionBackward"
    operator = run(torch.ops.cpuflash.attention)
    for ours, theirs in zip([eager[0], eager[1], *eager[2]],
                            [operator[0], operator[1], *operator[2]]):
        assert torch.equal(ours, theirs)
    with torch.no_grad():  # no gradient wanted: the forward alone, no graph
        assert ct.attention(q, k, v).grad_fn is None

    # a tensor subclass (FakeTensor under torch.compile, say) goes to the operator
    class Sub(torch.Tensor):
        pass

    assert ct._eager(q, k, v, None) and not ct._eager(q.detach().as_subclass(Sub), k, v, None)


# ------------------------------------------------------------------------------------------------
# the drop-in against torch's own SDPA (float32 values and gradients)

def compare_sdpa(q, k, v, tolerance=None, **keywords):
    """Outputs and gradients of the drop-in and of torch's SDPA, for the same inputs."""
    results = []
    for fn in (ct.scaled_dot_product_attention, F.scaled_dot_product_attention):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves, **keywords)
        (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        results.append([out.detach()] + [x.grad for x in leaves])
    for ours, theirs in zip(*results):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        if tolerance is None:
            torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
        else:
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=0,
                                       atol=tolerance * theirs.float().abs().max().item())
    return results[0][0]


@pytest.mark.parametrize("n_q, n_k", [(5, 11), (11, 5), (8, 8)])
def test_sdpa_is_causal_top_left(gen, n_q, n_k):
    q, k, v = qkv(gen, n_q=n_q, n_k=n_k, dtype=torch.float32)
    compare_sdpa(q, k, v, is_causal=True)


def compare_or_refuse(q, k, v, **keywords):
    """The drop-in gives what the installed torch's SDPA gives, or refuses what it refuses."""
    try:
        F.scaled_dot_product_attention(q, k, v, **keywords)
    except RuntimeError as exc:
        assert "attn_mask" in str(exc) and "is_causal" in str(exc), exc
        with pytest.raises(ValueError, match=r"`attn_mask` must be None when is_causal=True: "
                                             r"torch 2\.1\d.* refuses both"):
            ct.scaled_dot_product_attention(q, k, v, **keywords)
        return "refused"
    compare_sdpa(q, k, v, **keywords)
    return "applied"


def test_sdpa_masks_scale_and_gqa(gen):
    q, k, v = qkv(gen, n_q=6, n_k=9, heads_q=6, heads_k=2, dtype=torch.float32)
    bool_mask = torch.rand(2, 1, 6, 9, generator=gen) < 0.7
    bool_mask[..., 0] = True
    float_mask = torch.randn(6, 9, generator=gen)
    compare_sdpa(q, k, v, attn_mask=bool_mask, enable_gqa=True)
    compare_sdpa(q, k, v, attn_mask=float_mask, enable_gqa=True, scale=0.2)
    compare_sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=float_mask,
                 enable_gqa=True, tolerance=2e-2)  # a float32 mask on bfloat16 inputs, as torch


def test_sdpa_mask_with_is_causal_as_torch(gen):
    """torch 2.13 applies both; 2.14 refuses both (a RuntimeError there, a ValueError here)."""
    q, k, v = qkv(gen, n_q=6, n_k=9, heads_q=6, heads_k=2, dtype=torch.float32)
    bool_mask = torch.rand(2, 1, 6, 9, generator=gen) < 0.7
    bool_mask[..., 0] = True
    float_mask = torch.randn(6, 9, generator=gen)
    done = {compare_or_refuse(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True)
            for mask in (bool_mask, float_mask)}
    assert done == {"applied" if torch.__version__ < (2, 14) else "refused"}
    assert ct.MASK_WITH_CAUSAL == (done == {"applied"})


BROADCASTS = {  # query, key, value shapes (E = 8) that torch broadcasts, and enable_gqa
    "k/v batch 1, heads 1": ((2, 4, 5), (1, 1, 7), (1, 1, 7), False),
    "3-D": ((4, 5), (1, 7), (1, 7), False),
    "4-D query, 3-D key/value": ((2, 4, 5), (4, 7), (4, 7), False),
    "4-D query, 2-D key/value": ((2, 4, 5), (7,), (7,), False),
    "3-D query, 4-D key/value": ((4, 5), (2, 4, 7), (2, 4, 7), False),
    "query heads broadcast": ((2, 1, 5), (1, 3, 7), (1, 3, 7), False),
    "5-D query, 4-D key/value": ((3, 2, 4, 5), (2, 4, 7), (2, 4, 7), False),
    "key batch 2, value batch 1": ((2, 4, 5), (2, 4, 7), (1, 4, 7), False),
    "2-D": ((5,), (7,), (7,), False),
    "gqa, 4-D query, 3-D key/value": ((2, 4, 5), (2, 7), (2, 7), True),
    "gqa, key 2 heads, value 1": ((4, 5), (2, 7), (1, 7), True),
    "gqa, key 2 heads, value 4": ((4, 5), (2, 7), (4, 7), True),
}


@pytest.mark.parametrize("case", BROADCASTS, ids=str)
def test_sdpa_broadcasts_like_torch(gen, case):
    *shapes, gqa = BROADCASTS[case]
    q, k, v = (randn(gen, *shape, 8, dtype=torch.float32) for shape in shapes)
    out = compare_sdpa(q, k, v, enable_gqa=gqa)
    assert out.shape == F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa).shape
    compare_sdpa(q, k, v, enable_gqa=gqa, is_causal=True)


def test_sdpa_fully_masked_rows_as_torch(gen):
    q, k, v = qkv(gen, n_q=6, n_k=6, dtype=torch.float32)
    bool_mask = torch.rand(6, 6, generator=gen) < 0.6
    bool_mask[2] = False
    float_mask = torch.zeros(6, 6)
    float_mask[4] = float("-inf")
    for mask, row in ((bool_mask, 2), (float_mask, 4)):
        out = compare_sdpa(q, k, v, attn_mask=mask)
        assert torch.equal(out[:, :, row], torch.zeros_like(out[:, :, row]))  # torch 2.13-14: 0


# ------------------------------------------------------------------------------------------------
# dtypes

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_forward_and_backward(gen, dtype):
    pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes")
    q, k, v = qkv(gen, n_q=33, n_k=47, heads_q=4, heads_k=2, d=16, dtype=torch.float32)
    grads = []
    for precision in (dtype, torch.float32):
        leaves = [x.detach().to(precision).requires_grad_() for x in (q, k, v)]
        out = ct.attention(*leaves, causal=True)
        out.float().square().sum().backward()
        assert out.dtype == precision and all(x.grad.dtype == precision for x in leaves)
        grads.append([out.detach()] + [x.grad for x in leaves])
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    for half, full in zip(*grads):
        torch.testing.assert_close(half.float(), full.float(), atol=tol * full.abs().max().item(),
                                   rtol=0)


# ------------------------------------------------------------------------------------------------
# torch.compile

class TinyAttention(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, attention):
        b, n, dim = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, dim // self.heads).unbind(2)
        y = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, dim))


@pytest.mark.slow
def test_torch_compile_of_a_small_model(gen):
    torch.manual_seed(0)
    model = TinyAttention()
    x = torch.randn(2, 10, 16, generator=gen)
    compiled = torch.compile(model, fullgraph=True)
    expected = model(x, F.scaled_dot_product_attention)
    got = compiled(x, ct.scaled_dot_product_attention)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    got.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected.square().sum().backward()
    for ours, theirs in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# errors

def test_dropout_is_refused(gen):
    q, k, v = qkv(gen)
    with pytest.raises(ValueError, match=r"`dropout_p` must be 0 \(cpuflash has no dropout\)"):
        ct.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


def test_heads_differ_without_enable_gqa(gen):
    q, k, v = qkv(gen, heads_q=4, heads_k=2)
    with pytest.raises(ValueError, match=r"`query` has 4 heads but `key` has 2.*enable_gqa=True"):
        ct.scaled_dot_product_attention(q, k, v)


def test_sdpa_shapes_torch_refuses(gen):
    q, k, v = qkv(gen, heads_q=4, heads_k=2)
    with pytest.raises(ValueError, match=r"`key` must have at least 2 axes.*got shape \(8,\)"):
        ct.scaled_dot_product_attention(q, k[0, 0, 0], v)
    with pytest.raises(ValueError, match=r"leading axes of `query`, `key` and `value` must "
                                         r"broadcast.*`key` \(3, 2, 7, 8\)"):
        ct.scaled_dot_product_attention(q, k[:1].expand(3, 2, 7, 8), v, enable_gqa=True)
    with pytest.raises(ValueError, match=r"heads of `key` and `value` must divide those of "
                                         r"`query`"):
        ct.scaled_dot_product_attention(q[:, :3], k, v, enable_gqa=True)
    with pytest.raises(ValueError, match=r"enable_gqa=True needs a heads axis"):
        ct.scaled_dot_product_attention(q, k[0, 0], v[0, 0], enable_gqa=True)
    with pytest.raises(TypeError, match=r"`attn_mask` must be bool, float32 or the dtype of "
                                        r"`query` \(torch.float64\), as in torch, got "
                                        r"torch.int64"):
        ct.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.long),
                                        enable_gqa=True)


def test_non_cpu_tensors_are_refused(gen):
    q, k, v = qkv(gen)
    with pytest.raises(ValueError, match=r"`q` is on device meta.*CPU only"):
        ct.attention(q.to("meta"), k, v)
    with pytest.raises(ValueError, match=r"`attn_mask` is on device meta.*CPU only"):
        ct.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 7, device="meta"))


def test_non_tensors_are_refused(gen):
    q, k, v = qkv(gen)
    with pytest.raises(TypeError, match=r"`k` must be a torch tensor, got ndarray"):
        ct.attention(q, k.detach().numpy(), v)


def test_bad_window(gen):
    q, k, v = qkv(gen)
    with pytest.raises(ValueError, match=r"`window` must be a pair of ints"):
        ct.attention(q, k, v, window=(1, "x"))


def test_cpuflash_errors_pass_through(gen):
    q, k, v = qkv(gen)
    with pytest.raises(ValueError, match=r"softcap"):
        ct.attention(q, k, v, softcap=-1.0)
