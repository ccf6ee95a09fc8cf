"""`cpuflash.flash_attn`: flash-attn 2.x's functions on CPU tensors.

Values against the float64 reference with the accuracy rule, gradients against torch autograd
through a dense float64 implementation, the KV-cache options (rotary, cache_batch_idx,
cache_leftpad, paging) against references written here from flash-attn's documented semantics,
and a small model written for flash-attn run with the import swapped.
"""

import importlib
import inspect
import math
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: cpuflash.flash_attn needs it")
fa = pytest.importorskip("cpuflash.flash_attn", reason="cpuflash.flash_attn could not be imported")

import cpuflash  # noqa: E402
from cpuflash._keywords import pack  # noqa: E402  (the operators' score slots)
from accuracy import assert_close_to_reference  # noqa: E402
from helpers import check_varlen, cu_seqlens, packed, visible  # noqa: E402


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(2612)


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=dtype)


def bshd_qkv(gen, batch=2, n_q=37, n_k=53, heads_q=4, heads_k=2, d=40, dv=24,
             dtype=torch.float32):
    return (randn(gen, batch, n_q, heads_q, d, dtype=dtype),
            randn(gen, batch, n_k, heads_k, d, dtype=dtype),
            randn(gen, batch, n_k, heads_k, dv, dtype=dtype))


def reference_keywords(causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                       softmax_scale=None):
    """flash-attn's keywords as `cpuflash.reference.attention_reference` takes them."""
    return dict(causal=causal, window=None if tuple(window_size) == (-1, -1) else window_size,
                softcap=softcap, scale=softmax_scale,
                alibi_slopes=None if alibi_slopes is None else np.asarray(alibi_slopes))


CASES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (9, 3)},
    "causal window": {"causal": True, "window_size": (7, -1)},
    "softcap scale": {"softcap": 4.0, "softmax_scale": 0.3},
    "alibi": {"causal": True, "alibi_slopes": np.linspace(0.05, 0.4, 4, dtype=np.float32)},
}


# ------------------------------------------------------------------------------------------------
# values against the reference

@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("n_q, n_k", [(37, 53), (53, 37), (1, 113)])
def test_flash_attn_func_matches_reference(gen, case, n_q, n_k):
    kwargs = CASES[case]
    q, k, v = bshd_qkv(gen, n_q=n_q, n_k=n_k)
    slopes = kwargs.get("alibi_slopes")
    call = dict(kwargs, alibi_slopes=None if slopes is None else torch.from_numpy(slopes))
    out, lse, probs = fa.flash_attn_func(q, k, v, return_attn_probs=True, **call)
    assert out.shape == (2, n_q, 4, 24) and lse.shape == (2, 4, n_q) and probs is None
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert_close_to_reference(out.numpy(), q.numpy(), k.numpy(), v.numpy(), lse=lse.numpy(),
                              layout="bshd", **reference_keywords(**kwargs))
    assert torch.equal(fa.flash_attn_func(q, k, v, **call), out)


def test_alibi_per_batch_and_half_precision(gen):
    q, k, v = bshd_qkv(gen, d=64, dv=64)
    slopes = torch.rand(2, 4, generator=gen) * 0.3
    ref, ref_lse = fa.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes,
                                      return_attn_probs=True)[:2]
    assert_close_to_reference(ref.numpy(), q.numpy(), k.numpy(), v.numpy(), lse=ref_lse.numpy(),
                              layout="bshd", causal=True, alibi_slopes=slopes.numpy())
    for dtype in (torch.float16, torch.bfloat16):
        out = fa.flash_attn_func(q.to(dtype), k.to(dtype), v.to(dtype), causal=True,
                                 alibi_slopes=slopes)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_packed_functions_equal_unpacked(gen):
    qkv = randn(gen, 2, 29, 3, 4, 32)
    q, k, v = qkv.unbind(2)
    kwargs = dict(causal=True, window_size=(5, 0), softcap=3.0)
    expected = fa.flash_attn_func(q, k, v, **kwargs)
    assert torch.equal(fa.flash_attn_qkvpacked_func(qkv, **kwargs), expected)
    kv = torch.stack((k, v), dim=2)
    assert torch.equal(fa.flash_attn_kvpacked_func(q, kv, **kwargs), expected)

    lens = [5, 0, 17, 9]
    cu = torch.from_numpy(cu_seqlens(lens))
    qkv_packed = randn(gen, sum(lens), 3, 4, 32)
    q, k, v = qkv_packed.unbind(1)
    expected, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu, cu, 17, 17, return_attn_probs=True,
                                                 **kwargs)
    out, lse_packed, _ = fa.flash_attn_varlen_qkvpacked_func(qkv_packed, cu, 17,
                                                             return_attn_probs=True, **kwargs)
    assert torch.equal(out, expected) and torch.equal(lse_packed, lse)
    out = fa.flash_attn_varlen_kvpacked_func(q, torch.stack((k, v), dim=1), cu, cu, 17, 17,
                                             **kwargs)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_varlen_matches_reference(rng, case):
    kwargs = CASES[case]
    lens_q, lens_k = [5, 0, 130, 77, 1, 3], [9, 3, 120, 77, 0, 40]
    q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k)
    call = dict(kwargs)
    if "alibi_slopes" in call:
        call["alibi_slopes"] = torch.from_numpy(call["alibi_slopes"])
    out, lse, _ = fa.flash_attn_varlen_func(
        *map(torch.from_numpy, (q, k, v, cu_q, cu_k)), max(lens_q), max(lens_k),
        return_attn_probs=True, **call)
    assert out.shape == (sum(lens_q), 4, 24) and lse.shape == (4, sum(lens_q))
    check_varlen(out.numpy(), lse.numpy(), q, k, v, cu_q, cu_k, **reference_keywords(**kwargs))


def test_varlen_paged_keys(gen):
    lens_q, lens_k = [3, 0, 20, 1], [30, 0, 21, 64]
    cu_q, cu_k = (torch.from_numpy(cu_seqlens(lens)) for lens in (lens_q, lens_k))
    q = randn(gen, sum(lens_q), 4, 16)
    k_pages, v_pages = randn(gen, 12, 16, 2, 16), randn(gen, 12, 16, 2, 8)
    perm = torch.randperm(12, generator=gen).to(torch.int32)
    table = torch.full((4, 4), 99, dtype=torch.int32)  # 99: past a sequence's keys, never read
    table[0, :2], table[2, :2], table[3, :4] = perm[:2], perm[2:4], perm[4:8]
    # the dense keys the table points at, gathered by hand
    k, v = (torch.cat([pages[table[b, :-(-n // 16)].long()].flatten(0, 1)[:n]
                       for b, n in enumerate(lens_k)]) for pages in (k_pages, v_pages))
    expected = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 64, causal=True)
    out = fa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 20, 64, causal=True,
                                    block_table=table)
    assert torch.equal(out, expected)


# ------------------------------------------------------------------------------------------------
# gradients against torch autograd of a dense float64 implementation

def dense_attention(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, softmax_scale=None):
    """flash-attn's attention written densely in torch, (B, N, H, D); a row that sees no key
    gives 0 (its scores are made finite so that autograd stays finite there)."""
    n_q, n_k, heads = q.shape[1], k.shape[1], q.shape[2]
    group = heads // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        distance = (torch.arange(n_q)[:, None] + n_k - n_q - torch.arange(n_k)).abs()
        s = s - torch.as_tensor(alibi_slopes, dtype=s.dtype).view(-1, heads, 1, 1) * distance
    window = None if tuple(window_size) == (-1, -1) else tuple(window_size)
    sees = torch.from_numpy(visible(n_q, n_k, causal, window))
    s = s.masked_fill(~sees, torch.finfo(s.dtype).min)
    p = torch.softmax(s, dim=-1) * sees.any(-1, keepdim=True)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def gradients(fn, inputs, out_weights):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    (out * out_weights).sum().backward()
    return [out.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("n_q, n_k", [(13, 21), (21, 13)])
def test_flash_attn_func_gradients(gen, case, n_q, n_k):
    kwargs = CASES[case]
    q, k, v = bshd_qkv(gen, n_q=n_q, n_k=n_k, d=16, dv=8, dtype=torch.float64)
    weights = randn(gen, 2, n_q, 4, 8, dtype=torch.float64)
    ours = gradients(lambda q, k, v: fa.flash_attn_func(q, k, v, **kwargs), (q, k, v), weights)
    dense = gradients(lambda q, k, v: dense_attention(q, k, v, **kwargs), (q, k, v), weights)
    for got, expected in zip(ours, dense):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


def test_packed_gradients(gen):
    qkv = randn(gen, 2, 11, 3, 4, 16, dtype=torch.float64)
    weights = randn(gen, 2, 11, 4, 16, dtype=torch.float64)
    ours = gradients(lambda x: fa.flash_attn_qkvpacked_func(x, causal=True), (qkv,), weights)
    dense = gradients(lambda x: dense_attention(*x.unbind(2), causal=True), (qkv,), weights)
    for got, expected in zip(ours, dense):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_varlen_gradients(gen, case):
    kwargs = CASES[case]
    lens_q, lens_k = [4, 0, 13, 9], [7, 2, 13, 5]
    cu_q, cu_k = (torch.from_numpy(cu_seqlens(lens)) for lens in (lens_q, lens_k))
    q = randn(gen, sum(lens_q), 4, 16, dtype=torch.float64)
    k, v = randn(gen, sum(lens_k), 2, 16, dtype=torch.float64), randn(gen, sum(lens_k), 2, 8,
                                                                       dtype=torch.float64)
    weights = randn(gen, sum(lens_q), 4, 8, dtype=torch.float64)

    def per_sequence(q, k, v):
        outs = []
        for b in range(len(lens_q)):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            outs.append(dense_attention(q[None, rows], k[None, keys], v[None, keys],
                                        **kwargs)[0])
        return torch.cat(outs)

    ours = gradients(lambda q, k, v: fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 13, 13,
                                                               **kwargs), (q, k, v), weights)
    dense = gradients(per_sequence, (q, k, v), weights)
    for got, expected in zip(ours, dense):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


def test_opcheck_varlen_and_kvcache(gen):
    q, k, v = randn(gen, 12, 4, 8), randn(gen, 15, 2, 8), randn(gen, 15, 2, 8)
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 9, 15],
                                                                          dtype=torch.int32)
    q.requires_grad_()
    torch.library.opcheck(torch.ops.cpuflash.attention_varlen.default,
                          (q, k, v, cu_q, cu_k, *pack(causal=True, window=(3, -1))))
    out, lse = torch.ops.cpuflash.attention_varlen(q, k, v, cu_q, cu_k, *pack(causal=True))
    torch.library.opcheck(torch.ops.cpuflash.attention_varlen_backward.default,
                          (torch.randn_like(out), q.detach(), k, v, out.detach(), lse, cu_q, cu_k,
                           *pack(causal=True)))
    qc, k_cache, v_cache = randn(gen, 2, 1, 4, 8), randn(gen, 2, 10, 2, 8), randn(gen, 2, 10, 2, 8)
    new_k, new_v = randn(gen, 2, 1, 2, 8), randn(gen, 2, 1, 2, 8)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    torch.library.opcheck(torch.ops.cpuflash.attention_with_kvcache.default,
                          (qc, k_cache, v_cache, new_k, new_v, seqlens, None,
                           *pack(causal=True), 0))


def test_eager_calls_skip_the_operators_with_their_bits(gen):
    """Eager calls run the operators' functions without their dispatch: the same outputs,
    gradients and cache writes, bit for bit, as the operators; the caches' version counters
    move as the operator moves them."""
    q, k, v = randn(gen, 12, 4, 8), randn(gen, 15, 2, 8), randn(gen, 15, 2, 8)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 5, 12], [0, 9, 15]))
    options = pack(causal=True, window=(3, -1), softcap=1.5)
    results = []
    for run in (fa._run_varlen, torch.ops.cpuflash.attention_varlen):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = run(*leaves, cu_q, cu_k, *options)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        results.append([out, lse] + [x.grad for x in leaves])
    assert type(results[0][0].grad_fn).__name__ == "_EagerVarlenBackward"
    for ours, theirs in zip(*results):
        assert torch.equal(ours, theirs)

    qc, k_cache, v_cache = randn(gen, 2, 1, 4, 8), randn(gen, 2, 10, 2, 8), randn(gen, 2, 10, 2, 8)
    new_k, new_v = randn(gen, 2, 1, 2, 8), randn(gen, 2, 1, 2, 8)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    results = []
    for run in (fa._run_kvcache, torch.ops.cpuflash.attention_with_kvcache):
        caches = [k_cache.clone(), v_cache.clone()]
        versions = [c._version for c in caches]
        out = run(qc, *caches, new_k, new_v, seqlens, None, *pack(causal=True), 0)
        assert all(c._version > before for c, before in zip(caches, versions))
        results.append(list(out) + caches)
    for ours, theirs in zip(*results):
        assert torch.equal(ours, theirs)


def test_torch_compile_traces_whole_graphs(gen):
    q, k, v = bshd_qkv(gen, n_q=9, n_k=9, d=16, dv=16)
    q.requires_grad_()
    batched = torch.compile(lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True),
                            fullgraph=True, backend="eager")
    torch.testing.assert_close(batched(q, k, v), fa.flash_attn_func(q, k, v, causal=True))
    cu = torch.tensor([0, 4, 18], dtype=torch.int32)
    packed_q, packed_k, packed_v = (x.reshape(18, x.shape[2], 16) for x in (q, k, v))
    varlen = torch.compile(lambda q, k, v: fa.flash_attn_varlen_func(q, k, v, cu, cu, 14, 14),
                           fullgraph=True, backend="eager")
    varlen(packed_q, packed_k, packed_v).sum().backward()
    assert q.grad is not None
    k_cache, v_cache = torch.zeros(2, 12, 2, 16), torch.zeros(2, 12, 2, 16)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    decode = torch.compile(lambda q, k, v: fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens), fullgraph=True, backend="eager")
    with torch.no_grad():
        decode(q[:, :1], k[:, :1], v[:, :1])
    assert torch.equal(k_cache[0, 3], k[0, 0]) and torch.equal(v_cache[1, 5], v[1, 0])


# ------------------------------------------------------------------------------------------------
# the KV cache: rotary, cache_batch_idx, cache_leftpad, paging

def rotary_reference(x, cos, sin, positions, interleaved):
    """flash-attn's apply_rotary_emb, from its documented formula: ``x * cos + rotate_half(x) *
    sin`` on the first rotary_dim dims at each token's position; rotate_half pairs (i, i + r/2)
    (``cat(-x2, x1)``) or, interleaved, (2i, 2i + 1)."""
    r = 2 * cos.shape[1]
    rot, rest = x[..., :r], x[..., r:]
    if interleaved:
        c = cos[positions].repeat_interleave(2, dim=-1)[:, :, None]
        s = sin[positions].repeat_interleave(2, dim=-1)[:, :, None]
        half = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    else:
        c = torch.cat((cos[positions],) * 2, dim=-1)[:, :, None]
        s = torch.cat((sin[positions],) * 2, dim=-1)[:, :, None]
        x1, x2 = rot.chunk(2, dim=-1)
        half = torch.cat((-x2, x1), dim=-1)
    return torch.cat((rot * c + half * s, rest), dim=-1)


def kvcache_case(gen, batch=3, entries=3, n_max=40, n_q=1, n_new=1, heads_q=4, heads_k=2, d=32,
                 dtype=torch.float64):
    q = randn(gen, batch, n_q, heads_q, d, dtype=dtype)
    k_cache = randn(gen, entries, n_max, heads_k, d, dtype=dtype)
    v_cache = randn(gen, entries, n_max, heads_k, d, dtype=dtype)
    k, v = (randn(gen, batch, n_new, heads_k, d, dtype=dtype) for _ in range(2))
    return q, k_cache, v_cache, k, v


def check_against_manual(out, lse, q, k_cache_after, v_cache_after, entries, starts, ends,
                         **kwargs):
    """Each batch entry against the reference over its keys: rows starts[b]:ends[b] of cache
    entry entries[b] (the new keys already written)."""
    slopes = kwargs.pop("alibi_slopes", None)
    for b in range(q.shape[0]):
        keys = slice(int(starts[b]), int(ends[b]))
        cache_k = k_cache_after[entries[b], keys][None].numpy()
        cache_v = v_cache_after[entries[b], keys][None].numpy()
        assert_close_to_reference(out[b:b + 1].numpy(), q[b:b + 1].numpy(), cache_k, cache_v,
                                  lse=lse[b:b + 1].numpy(), layout="bshd",
                                  alibi_slopes=None if slopes is None else np.asarray(slopes)[b],
                                  **kwargs)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal, n_q, n_new", [(True, 1, 1), (True, 5, 5), (False, 3, 3),
                                                (True, 3, 5), (False, 4, 2)])
def test_kvcache_rotary(gen, interleaved, causal, n_q, n_new):
    q, k_cache, v_cache, k, v = kvcache_case(gen, n_q=n_q, n_new=n_new)
    seqlens = torch.tensor([0, 17, 40 - max(n_q, n_new)], dtype=torch.int32)
    angles = torch.rand(40, 8, generator=gen, dtype=torch.float64) * 2 * math.pi
    cos, sin = angles.cos(), angles.sin()  # rotary_dim 16 of headdim 32
    k_cache_before = k_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos,
                                          rotary_sin=sin, cache_seqlens=seqlens, causal=causal,
                                          rotary_interleaved=interleaved,
                                          return_softmax_lse=True)
    # k at positions cache_seqlens + i; q too when causal, else every query at cache_seqlens
    steps_new = seqlens.long()[:, None] + torch.arange(n_new)
    steps_q = seqlens.long()[:, None] + (torch.arange(n_q) if causal else torch.zeros(n_q).long())
    k_ro = rotary_reference(k, cos, sin, steps_new, interleaved)
    q_ro = rotary_reference(q, cos, sin, steps_q, interleaved)
    expected_cache = k_cache_before.clone()
    for b in range(3):
        expected_cache[b, seqlens[b]:seqlens[b] + n_new] = k_ro[b]
    torch.testing.assert_close(k_cache, expected_cache, atol=1e-14, rtol=0)
    check_against_manual(out, lse, q_ro, k_cache, v_cache, range(3), [0] * 3, seqlens + n_new,
                         causal=causal)


def test_kvcache_rotary_local_window_rotates_per_query(gen):
    q, k_cache, v_cache, k, v = kvcache_case(gen, n_q=4, n_new=4)
    seqlens = torch.tensor([3, 10, 30], dtype=torch.int32)
    angles = torch.rand(40, 16, generator=gen, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()  # the whole head dim
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos,
                                          rotary_sin=sin, cache_seqlens=seqlens,
                                          window_size=(6, 2), return_softmax_lse=True)
    positions = seqlens.long()[:, None] + torch.arange(4)
    q_ro = rotary_reference(q, cos, sin, positions, True)
    check_against_manual(out, lse, q_ro, k_cache, v_cache, range(3), [0] * 3, seqlens + 4,
                         window=(6, 2))


@pytest.mark.parametrize("with_new", [True, False])
def test_kvcache_batch_idx_and_leftpad(gen, with_new):
    n_new = 2 if with_new else 0
    q, k_cache, v_cache, k, v = kvcache_case(gen, batch=3, entries=5, n_q=2, n_new=2)
    entries = torch.tensor([4, 0, 2], dtype=torch.int32)
    seqlens = torch.tensor([12, 38, 30], dtype=torch.int32) - n_new
    leftpad = torch.tensor([6, 0, 9], dtype=torch.int32)  # gcd(40, 6, 0, 9) = 1: one-row pages
    slopes = torch.rand(3, 4, generator=gen) * 0.2
    kwargs = dict(causal=True, window_size=(20, -1), softcap=5.0)
    before = k_cache.clone(), v_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, k if with_new else None, v if with_new else None,
        cache_seqlens=seqlens, cache_batch_idx=entries, cache_leftpad=leftpad,
        alibi_slopes=slopes, return_softmax_lse=True, **kwargs)
    expected = [x.clone() for x in before]
    for b in range(3):  # the new keys go to the entry's rows cache_seqlens[b]:+n_new
        if with_new:
            rows = slice(int(seqlens[b]), int(seqlens[b]) + n_new)
            expected[0][entries[b], rows], expected[1][entries[b], rows] = k[b], v[b]
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])
    check_against_manual(out, lse, q, k_cache, v_cache, entries.long(), leftpad,
                         seqlens + n_new, **reference_keywords(alibi_slopes=slopes, **kwargs))


def test_kvcache_leftpad_pages_and_int_seqlens(gen):
    # left pads that share a divisor with the cache length: pages of 8 rows
    q, k_cache, v_cache, k, v = kvcache_case(gen, batch=2, entries=2, n_q=1, n_new=1)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=30,
                                     cache_leftpad=torch.tensor([8, 24], dtype=torch.int32),
                                     causal=True)
    lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=31, causal=True,
                                     cache_leftpad=torch.tensor([8, 24], dtype=torch.int32),
                                     return_softmax_lse=True)[1]
    check_against_manual(out, lse, q, k_cache, v_cache, [0, 1], [8, 24], [31, 31], causal=True)


def test_kvcache_paged_equals_contiguous(gen):
    q, k_cache, v_cache, k, v = kvcache_case(gen, batch=2, entries=2, n_max=48, n_q=3, n_new=3)
    seqlens = torch.tensor([20, 45], dtype=torch.int32)
    order = torch.tensor([3, 0, 5, 1, 4, 2])  # 6 pages of 16 rows, shuffled
    k_pages = torch.empty(6, 16, 2, 32, dtype=k_cache.dtype)
    v_pages = torch.empty_like(k_pages)
    k_pages[order], v_pages[order] = k_cache.reshape(6, 16, 2, 32), v_cache.reshape(6, 16, 2, 32)
    table = order.view(2, 3).to(torch.int32)
    expected = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                          causal=True, num_splits=2)
    out = fa.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=seqlens,
                                     block_table=table, causal=True, num_splits=2)
    torch.testing.assert_close(out, expected, atol=1e-13, rtol=0)
    torch.testing.assert_close(k_pages[order].reshape(k_cache.shape), k_cache, atol=0, rtol=0)


def test_kvcache_defaults_are_flash_attns(gen):
    # causal=False by default, a full cache when cache_seqlens is None
    q, k_cache, v_cache, _, _ = kvcache_case(gen, n_q=3)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True)
    assert lse.shape == (3, 4, 3)
    check_against_manual(out, lse, q, k_cache, v_cache, range(3), [0] * 3, [40] * 3)


# ------------------------------------------------------------------------------------------------
# signatures and errors

FLASH_ATTN_2_8_SIGNATURES = {  # from flash-attn 2.8.3's flash_attn_interface.py
    "flash_attn_func": "(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, "
                       "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
                       "deterministic=False, return_attn_probs=False)",
    "flash_attn_qkvpacked_func": "(qkv, dropout_p=0.0, softmax_scale=None, causal=False, "
                                 "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
                                 "deterministic=False, return_attn_probs=False)",
    "flash_attn_kvpacked_func": "(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, "
                                "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
                                "deterministic=False, return_attn_probs=False)",
    "flash_attn_varlen_func": "(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
                              "max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False, "
                              "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
                              "deterministic=False, return_attn_probs=False, block_table=None)",
    "flash_attn_varlen_qkvpacked_func": "(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, "
                                        "softmax_scale=None, causal=False, window_size=(-1, -1), "
                                        "softcap=0.0, alibi_slopes=None, deterministic=False, "
                                        "return_attn_probs=False)",
    "flash_attn_varlen_kvpacked_func": "(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
                                       "max_seqlen_k, dropout_p=0.0, softmax_scale=None, "
                                       "causal=False, window_size=(-1, -1), softcap=0.0, "
                                       "alibi_slopes=None, deterministic=False, "
                                       "return_attn_probs=False)",
    "flash_attn_with_kvcache": "(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, "
                               "rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, "
                               "cache_leftpad=None, block_table=None, softmax_scale=None, "
                               "causal=False, window_size=(-1, -1), softcap=0.0, "
                               "rotary_interleaved=True, alibi_slopes=None, num_splits=0, "
                               "return_softmax_lse=False)",
}


@pytest.mark.parametrize("name", FLASH_ATTN_2_8_SIGNATURES)
def test_signatures_are_flash_attns(name):
    assert str(inspect.signature(getattr(fa, name))) == FLASH_ATTN_2_8_SIGNATURES[name]
    assert name in fa.__all__


def test_deterministic_and_nonpositive_softcap_accepted(gen):
    q, k, v = bshd_qkv(gen)
    expected = fa.flash_attn_func(q, k, v)
    assert torch.equal(fa.flash_attn_func(q, k, v, deterministic=True, softcap=-1.0), expected)


def test_errors(gen):
    q, k, v = bshd_qkv(gen)
    with pytest.raises(ValueError, match=r"`dropout_p` must be 0 .* got 0.1"):
        fa.flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"`window_size` must be a pair of ints"):
        fa.flash_attn_func(q, k, v, window_size=8)
    with pytest.raises(ValueError, match=r"`qkv` must be \(batch_size, seqlen, 3, nheads, "
                                         r"headdim\), got shape \(2, 37, 4, 40\)"):
        fa.flash_attn_qkvpacked_func(q)
    with pytest.raises(ValueError, match=r"`kv` must be \(total_k, 2, nheads_k, headdim\)"):
        fa.flash_attn_varlen_kvpacked_func(q[0], q[0], [0, 37], [0, 53], 37, 53)


def test_varlen_paged_errors(gen):
    cu = torch.tensor([0, 3, 40], dtype=torch.int32)
    q, pages = randn(gen, 40, 2, 8), randn(gen, 4, 16, 2, 8)
    with pytest.raises(ValueError, match=r"with `block_table`, `k` must be paged .* room for "
                                         r"the longest sequence \(37 keys\)"):
        fa.flash_attn_varlen_func(q, pages, pages, cu, cu, 37, 37,
                                  block_table=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`block_table` entries .* \[0, 4\) .* got 0..7"):
        fa.flash_attn_varlen_func(q, pages, pages, cu, cu, 37, 37,
                                  block_table=torch.tensor([[0, 0, 0], [1, 2, 7]],
                                                           dtype=torch.int32))


def test_kvcache_errors(gen):
    q, k_cache, v_cache, k, v = kvcache_case(gen, batch=2, entries=2)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    cos = sin = torch.ones(40, 8, dtype=torch.float64)
    taken = k_cache.clone()
    with pytest.raises(ValueError, match=r"`cache_seqlens` must be given with new keys `k`"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v)
    with pytest.raises(ValueError, match=r"`rotary_cos` and `rotary_sin` must be given together"
                                         r".*`rotary_sin` None"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                   rotary_cos=cos)
    with pytest.raises(ValueError, match=r"must be given together, with new keys `k`.*`k` None"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, rotary_cos=cos,
                                   rotary_sin=sin)
    with pytest.raises(ValueError, match=r"rotary_dim <= headdim \(32\), got \(40, 24\)"):
        wide = torch.ones(40, 24, dtype=torch.float64)
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                   rotary_cos=wide, rotary_sin=wide)
    with pytest.raises(ValueError, match=r"have 5 positions, but position 5 is rotated"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                   rotary_cos=cos[:5], rotary_sin=sin[:5])
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"`block_table` \(a paged cache\) cannot be combined"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table,
                                   cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`cache_batch_idx` must be \(batch_size=2,\) with "
                                         r"entries in \[0, 2\) .* got \[0, 2\]"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache,
                                   cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"0 <= cache_leftpad <= cache_seqlens <= 39 .* got "
                                         r"\[4, 0\] and \[3, 5\]"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                   cache_leftpad=torch.tensor([4, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"<= 39 .* got \[0, 0\] and \[3, 40\]"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                   cache_seqlens=torch.tensor([3, 40], dtype=torch.int32),
                                   cache_leftpad=torch.tensor([0, 0], dtype=torch.int32))
    seq_first = k_cache.transpose(0, 1).contiguous().transpose(0, 1)  # (entries, N, ...) strided
    with pytest.raises(ValueError, match=r"`cache_leftpad` needs caches whose batch and sequence "
                                         r"axes can be viewed as one"):
        fa.flash_attn_with_kvcache(q, seq_first, seq_first.clone(), k, v, cache_seqlens=seqlens,
                                   cache_leftpad=torch.tensor([3, 0], dtype=torch.int32))
    assert torch.equal(k_cache, taken)  # nothing written by a call that failed


def test_kvcache_paged_block_table_bounds(gen):
    """flash-attn's test_flash_attn_kvcache_paged_block_table_bounds: keys past the rows the
    block table addresses (max_num_blocks_per_seq * page_block_size) raise flash-attn's
    RuntimeError naming `block_table`; here it is a ValueError too. cpuflash's own function
    keeps its ValueError naming `cache_seqlens`."""
    q, _, _, k, v = kvcache_case(gen, batch=2, n_new=2)
    k_pages, v_pages = randn(gen, 6, 16, 2, 32, dtype=q.dtype), randn(gen, 6, 16, 2, 32,
                                                                      dtype=q.dtype)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)  # room for 32 keys a sequence
    taken = k_pages.clone()
    for error in (RuntimeError, ValueError):
        # the cache alone past the table
        with pytest.raises(error, match=r"`block_table` has room for 32 keys .* "
                                        r"`cache_seqlens` plus 0 new keys reaches 33"):
            fa.flash_attn_with_kvcache(q, k_pages, v_pages, block_table=table,
                                       cache_seqlens=torch.tensor([5, 33], dtype=torch.int32))
        # a cache full to the table's capacity, plus new keys
        with pytest.raises(error, match=r"`block_table` .* plus 2 new keys reaches 34"):
            fa.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, block_table=table,
                                       cache_seqlens=torch.tensor([32, 3], dtype=torch.int32))
    assert torch.equal(k_pages, taken)  # nothing written
    # up to the capacity is fine
    fa.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, block_table=table,
                               cache_seqlens=torch.tensor([30, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`cache_seqlens` must lie in \[0, 30\]") as caught:
        cpuflash.attention_with_kvcache(
            q.numpy(), k_pages.numpy(), v_pages.numpy(), k=k.numpy(), v=v.numpy(),
            cache_seqlens=np.array([32, 3], dtype=np.int32), block_table=table.numpy(),
            layout="bshd")
    assert not isinstance(caught.value, RuntimeError)
    # the check reads the lengths when the operator runs: a compiled call keeps its one graph
    decode = torch.compile(lambda seqlens: fa.flash_attn_with_kvcache(
        q, k_pages, v_pages, block_table=table, cache_seqlens=seqlens), fullgraph=True,
        backend="eager")
    decode(torch.tensor([5, 32], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="`block_table`"):
        decode(torch.tensor([5, 40], dtype=torch.int32))


# ------------------------------------------------------------------------------------------------
# a model written for flash-attn, run with the import swapped

@pytest.fixture
def model_module(monkeypatch):
    """tests/flash_attn_model.py imported with `flash_attn` resolving to cpuflash.flash_attn."""
    monkeypatch.setitem(sys.modules, "flash_attn", fa)
    monkeypatch.delitem(sys.modules, "flash_attn_model", raising=False)
    module = importlib.import_module("flash_attn_model")
    yield module
    sys.modules.pop("flash_attn_model", None)


def test_model_written_for_flash_attn_trains_and_decodes(model_module):
    with torch.random.fork_rng():  # the weights' initialisation draws from the global generator
        torch.manual_seed(0)
        flash = model_module.TinyLM().double()
    sdpa = model_module.TinyLM(use_flash=False).double()
    sdpa.load_state_dict(flash.state_dict())
    tokens = torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(5))

    # -- a training step: same loss, same gradients, same weights after the update
    losses = []
    for model in (flash, sdpa):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.detach())
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch.testing.assert_close(losses[0], losses[1], atol=1e-12, rtol=0)
    for (name, p_flash), p_sdpa in zip(flash.named_parameters(), sdpa.parameters()):
        assert p_flash.grad is not None and p_flash.grad.abs().sum() > 0, name
        torch.testing.assert_close(p_flash.grad, p_sdpa.grad, atol=1e-11, rtol=1e-9, msg=name)
        torch.testing.assert_close(p_flash, p_sdpa, atol=1e-12, rtol=1e-10, msg=name)

    # -- decoding with flash_attn_with_kvcache (rotary applied by the call) against SDPA over
    # the whole generated sequence
    generated, step_logits = flash.generate(tokens[:, :7], n_new=12)
    assert generated.shape == (3, 19)
    with torch.no_grad():
        full_logits = sdpa(generated[:, :-1])
    torch.testing.assert_close(step_logits, full_logits, atol=1e-10, rtol=1e-10)
    assert torch.equal(generated[:, 7:], full_logits[:, 6:].argmax(-1))
