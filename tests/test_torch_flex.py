"""`cpuflash.torch.flex_attention` and `create_block_mask`: torch FlexAttention's signatures.

Outputs and lse are compared with torch's own ``flex_attention`` (eager, on the CPU), whose
score_mod closes over the tensors ours takes in `score_args`; torch refuses its backward on
the CPU, so the gradients are compared with a dense float64 torch autograd implementation of
the same functions, within the accuracy rule (at most twice the error of the same dense code in
float32). Each distinct (score_mod, mask_mod) pair compiles its own kernels: the tests share a
few module-level functions.
"""

import warnings

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: cpuflash.torch needs it")
ct = pytest.importorskip("cpuflash.torch", reason="cpuflash.torch could not be imported")
tflex = pytest.importorskip("torch.nn.attention.flex_attention",
                            reason="this torch has no FlexAttention")

import cpuflash  # noqa: E402

N_REL = 256  # the relative-position table covers distances -N_REL .. N_REL - 1


def rel_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, q_idx - kv_idx + N_REL]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def same_doc(b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


def rel_bias_grad(dscore, score, b, h, q_idx, kv_idx, table, dtable):
    dtable[h, q_idx - kv_idx + N_REL] += dscore
    return dscore


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(4321)


def qkv(gen, b, hq, hk, n_q, n_k, d, dtype):
    shapes = (b, hq, n_q, d), (b, hk, n_k, d), (b, hk, n_k, d)
    return tuple(torch.randn(*s, generator=gen, dtype=dtype).requires_grad_(True) for s in shapes)


def documents(gen, b, n):
    return torch.sort(torch.randint(0, 4, (b, n), generator=gen), dim=1).values


def dense(q, k, v, bias=None, mask=None):
    """Softmax attention on the full score matrix in q's dtype, through torch autograd."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if bias is not None:
        scores = scores + bias.to(q.dtype)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v


def dense_bias(table, n_q, n_k):
    qi, ki = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    return table[:, qi - ki + N_REL][None]  # (1, H, Nq, Nk)


def torch_flex(q, k, v, **kwargs):
    """torch's own flex_attention, forward only (it refuses gradients on the CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager-mode and deprecated-return_lse warnings
        return tflex.flex_attention(q.detach(), k.detach(), v.detach(), return_lse=True,
                                    **kwargs)


def gradients(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def assert_within_rule(got, oracle, plain, name):
    """`got` at most twice as far from the float64 `oracle` as the `plain` float32 dense code."""
    got, oracle, plain = (x.detach().double() for x in (got, oracle, plain))
    error = (got - oracle).abs().max().item()
    plain_error = (plain - oracle).abs().max().item()
    floor = 1e-6 * max(oracle.abs().max().item(), 1.0)
    assert error <= 2 * plain_error + floor, (name, error, plain_error)


def check_against_dense(q, k, v, out, bias, mask, dout):
    """out and its gradients against the dense implementation, float64 oracle and plain run in
    q's dtype (for float64 inputs the plain run is the oracle: the floor decides)."""
    wide = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    narrow = [x.detach().requires_grad_(True) for x in (q, k, v)]
    oracle_out = dense(*wide, bias=None if bias is None else bias.double(), mask=mask)
    plain_out = dense(*narrow, bias=bias, mask=mask)
    assert_within_rule(out, oracle_out, plain_out, "out")
    got = gradients(out, (q, k, v), dout)
    oracle = gradients(oracle_out, wide, dout.double())
    plain = gradients(plain_out, narrow, dout)
    for name, g, o, p in zip(("dq", "dk", "dv"), got, oracle, plain):
        assert g.dtype == q.dtype and g.shape == o.shape
        assert_within_rule(g, o, p, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_relative_bias_with_a_causal_block_mask(gen, dtype):
    b, h, n_q, n_k, d = 2, 3, 77, 77, 24
    q, k, v = qkv(gen, b, h, h, n_q, n_k, d, dtype)
    table = torch.randn(h, 2 * N_REL, generator=gen, dtype=dtype) * 0.5
    bm = ct.create_block_mask(causal, None, None, n_q, n_k, BLOCK_SIZE=16)
    out, lse = ct.flex_attention(q, k, v, score_mod=rel_bias, block_mask=bm, return_lse=True,
                                 score_args=(table,))
    assert out.dtype == dtype and lse.dtype == dtype and lse.shape == (b, h, n_q)

    def torch_rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + N_REL]

    torch_bm = tflex.create_block_mask(causal, None, None, n_q, n_k, device="cpu")
    t_out, t_lse = torch_flex(q, k, v, score_mod=torch_rel_bias, block_mask=torch_bm)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.detach(), t_out, **tol)
    torch.testing.assert_close(lse, t_lse.to(dtype), **tol)  # natural log, as torch's

    dout = torch.randn(out.shape, generator=gen, dtype=dtype)
    mask = torch.ones(n_q, n_k, dtype=torch.bool).tril()
    check_against_dense(q, k, v, out, dense_bias(table, n_q, n_k), mask, dout)


def test_document_mask_with_gqa(gen):
    b, hq, hk, n, d = 2, 4, 2, 90, 16
    q, k, v = qkv(gen, b, hq, hk, n, n, d, torch.float32)
    doc = documents(gen, b, n)
    bm = ct.create_block_mask(same_doc, b, None, n, n, args=(doc,), BLOCK_SIZE=(32, 16))
    assert isinstance(bm, cpuflash.BlockMask) and bm.block == (32, 16)
    out = ct.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    # the block mask's own mask_mod given beside it: the same call
    again = ct.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, mask_mod=same_doc,
                              mask_args=(doc,))
    assert torch.equal(out, again)

    def torch_same_doc(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    torch_bm = tflex.create_block_mask(torch_same_doc, b, None, n, n, device="cpu")
    t_out, _ = torch_flex(q, k, v, block_mask=torch_bm, enable_gqa=True)
    torch.testing.assert_close(out.detach(), t_out, rtol=1e-4, atol=1e-5)

    dout = torch.randn(out.shape, generator=gen)
    mask = (doc[:, None, :, None] == doc[:, None, None, :])  # (B, 1, Nq, Nk)
    check_against_dense(q, k, v, out, None, mask, dout)


def test_gradient_of_a_score_args_tensor(gen):
    b, h, n, d = 1, 2, 40, 16
    q, k, v = qkv(gen, b, h, h, n, n, d, torch.float32)
    table = (torch.randn(h, 2 * N_REL, generator=gen) * 0.5).requires_grad_(True)
    bm = ct.create_block_mask(causal, None, None, n, n)
    out = ct.flex_attention(q, k, v, score_mod=rel_bias, block_mask=bm, score_args=(table,),
                            score_mod_grad=rel_bias_grad)
    dout = torch.randn(out.shape, generator=gen)
    got = gradients(out, (q, k, v, table), dout)

    wide = [x.detach().double().requires_grad_(True) for x in (q, k, v, table)]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    oracle_out = dense(*wide[:3], bias=dense_bias(wide[3], n, n), mask=mask)
    oracle = gradients(oracle_out, wide, dout.double())
    for name, g, o in zip(("dq", "dk", "dv", "dtable"), got, oracle):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), o, rtol=1e-4, atol=1e-5, msg=name)


def test_score_args_tensor_without_score_mod_grad_gets_no_gradient(gen):
    q, k, v = qkv(gen, 1, 3, 3, 77, 77, 24, torch.float32)
    table = (torch.randn(3, 2 * N_REL, generator=gen) * 0.5).requires_grad_(True)
    bm = ct.create_block_mask(causal, None, None, 77, 77, BLOCK_SIZE=16)
    out = ct.flex_attention(q, k, v, score_mod=rel_bias, block_mask=bm, score_args=(table,))
    out.sum().backward()
    assert table.grad is None and q.grad is not None


def test_a_bfloat16_table_as_torch_code_keeps_it(gen):
    """torch's own FlexAttention tests build their tables in the model's dtype: read widened,
    with the gradient in the table's dtype."""
    q, k, v = qkv(gen, 1, 2, 2, 40, 40, 16, torch.float32)
    table = (torch.randn(2, 2 * N_REL, generator=gen) * 0.5).bfloat16().requires_grad_(True)
    out = ct.flex_attention(q, k, v, score_mod=rel_bias, score_args=(table,),
                            score_mod_grad=rel_bias_grad)
    widened = table.detach().float().requires_grad_(True)
    again = ct.flex_attention(q, k, v, score_mod=rel_bias, score_args=(widened,),
                              score_mod_grad=rel_bias_grad)
    assert torch.equal(out, again)
    out.sum().backward()
    again.sum().backward()
    assert table.grad.dtype == torch.bfloat16
    assert torch.equal(table.grad, widened.grad.bfloat16())


def test_under_torch_compile(gen):
    """A graph break: the torch code around the call compiles, the call runs as in eager."""
    q, k, v = qkv(gen, 2, 3, 3, 77, 77, 24, torch.float32)
    table = torch.randn(3, 2 * N_REL, generator=gen) * 0.5
    bm = ct.create_block_mask(causal, None, None, 77, 77, BLOCK_SIZE=16)

    def layer(q, k, v):
        out = ct.flex_attention(q * 2.0, k, v, score_mod=rel_bias, block_mask=bm,
                                score_args=(table,))
        return (out * 3.0).sum()

    eager = layer(q, k, v)
    eager_grads = gradients(eager, (q, k, v), None)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager")(q, k, v)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for g, e in zip(gradients(compiled, (q, k, v), None), eager_grads):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="flex_attention runs the user"):
        torch._dynamo.reset()
        torch.compile(layer, backend="eager", fullgraph=True)(q, k, v)


# -- errors ---------------------------------------------------------------------------------

def test_errors(gen):
    q, k, v = qkv(gen, 1, 4, 2, 8, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        ct.flex_attention(q, k, v)
    q3, k3, v3 = qkv(gen, 1, 3, 2, 8, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="must divide"):
        ct.flex_attention(q3, k3, v3, enable_gqa=True)
    with pytest.raises(ValueError, match="4-D"):
        ct.flex_attention(q[0], k[0], v[0], enable_gqa=True)
    with pytest.raises(ValueError, match="same batch size"):
        ct.flex_attention(q, torch.cat([k, k]), torch.cat([v, v]), enable_gqa=True)
    with pytest.raises(ValueError, match="embedding size"):
        ct.flex_attention(q, k[..., :4], v, enable_gqa=True)
    with pytest.raises(ValueError, match="`key` and `value` must agree"):
        ct.flex_attention(q, k, v[:, :, :5], enable_gqa=True)
    with pytest.raises(TypeError, match="`query` must be a torch tensor"):
        ct.flex_attention(q.detach().numpy(), k, v, enable_gqa=True)
    with pytest.raises(TypeError, match="`score_mod` must be a function"):
        ct.flex_attention(q, k, v, score_mod=3, enable_gqa=True)
    with pytest.raises(ValueError, match="`score_mod_grad` given without a `score_mod`"):
        ct.flex_attention(q, k, v, score_mod_grad=rel_bias_grad, enable_gqa=True)
    with pytest.raises(TypeError, match="`score_args` must be a tuple"):
        ct.flex_attention(q, k, v, score_mod=rel_bias, score_args=torch.zeros(2),
                          enable_gqa=True)
    torch_bm = tflex.create_block_mask(causal, None, None, 8, 8, device="cpu")
    with pytest.raises(TypeError, match="create_block_mask"):
        ct.flex_attention(q, k, v, block_mask=torch_bm, enable_gqa=True)
    with pytest.raises(ValueError, match="`device` must be 'cpu'"):
        ct.create_block_mask(causal, 1, 1, 8, 8, device="meta")
    with pytest.raises(ValueError, match="`block` must be an int or"):
        ct.create_block_mask(causal, 1, 1, 8, 8, BLOCK_SIZE=(1, 2, 3))
    with pytest.raises(ValueError, match="`Nq` must be a positive int"):
        ct.create_block_mask(causal, 1, 1, 0, 8)
    bm = ct.create_block_mask(causal, 1, 1, 16, 8)
    with pytest.raises(ValueError, match="`block_mask` was built for"):
        ct.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
