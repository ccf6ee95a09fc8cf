"""The errors a new user meets first: flash-attn's layout, other libraries' keyword names, and
torch tensors that require grad (the numpy-level calls have no autograd: no gradient may be
dropped silently)."""

import inspect
import subprocess
import sys
import warnings

import numpy as np
import pytest

import cpuflash
from cpuflash import _public

f32 = np.float32
LAYOUT_HINT = r"pass `layout=\"bshd\"`"


def flash_attn_qkv(rng):
    """flash-attn's (batch, seqlen, heads, dim) arrays, GQA 4:2, Nq != Nk."""
    return (rng.standard_normal((2, 10, 4, 8)).astype(f32),
            rng.standard_normal((2, 12, 2, 8)).astype(f32),
            rng.standard_normal((2, 12, 2, 6)).astype(f32))


def flash_attn_cache(rng):
    """flash-attn's decoding arrays: q (B, 1, Hq, D), caches (B, Nmax, Hk, D), new k/v."""
    return dict(q=rng.standard_normal((2, 1, 8, 16)).astype(f32),
                k_cache=np.zeros((2, 64, 2, 16), f32), v_cache=np.zeros((2, 64, 2, 16), f32),
                k=rng.standard_normal((2, 1, 2, 16)).astype(f32),
                v=rng.standard_normal((2, 1, 2, 16)).astype(f32), cache_seqlens=5)


# -- flash-attn's layout passed without layout="bshd"

def test_bshd_arrays_under_default_layout_get_the_hint(rng):
    q, k, v = flash_attn_qkv(rng)
    with pytest.raises(ValueError, match=r"query heads \(10\) must be a multiple.*" + LAYOUT_HINT):
        cpuflash.attention(q, k, v)
    assert cpuflash.attention(q, k, v, layout="bshd").shape == (2, 10, 4, 6)


def test_bshd_hint_follows_every_shape_check(rng):
    # Nq = 8 is a multiple of Nk = 4, so the heads pass as bhsd; (Hq,) slopes then do not
    q, k, v = (rng.standard_normal((1, n, 2, 8)).astype(f32) for n in (8, 4, 4))
    slopes = np.ones(2, f32)
    with pytest.raises(ValueError, match=r"`alibi_slopes` must have shape \(8,\).*" + LAYOUT_HINT):
        cpuflash.attention(q, k, v, alibi_slopes=slopes)
    out = cpuflash.attention(q, k, v, alibi_slopes=slopes, layout="bshd")
    assert out.shape == (1, 8, 2, 8) and np.isfinite(out).all()


def test_bshd_hint_for_kvcache_writes_nothing(rng):
    args = flash_attn_cache(rng)
    k_cache = args["k_cache"]
    with pytest.raises(ValueError, match=r"key/value heads \(64\).*" + LAYOUT_HINT):
        cpuflash.attention_with_kvcache(**args)
    assert not k_cache.any()  # neither the call nor the hint's second check wrote the new keys
    out = cpuflash.attention_with_kvcache(**args, layout="bshd")
    assert out.shape == (2, 1, 8, 16) and k_cache[:, 5].any()


@pytest.mark.parametrize("case", ["fails as bshd too", "not 4-D", "layout given"])
def test_no_bshd_hint_where_it_would_not_help(rng, case):
    q, k, v = flash_attn_qkv(rng)
    kwargs = {}
    if case == "fails as bshd too":
        k = k[..., :7]
    elif case == "not 4-D":
        q, k, v = q[0], k[0], v[0]
    else:
        kwargs["layout"] = "bhsd"
        k, v = k[:, :, :1], v[:, :, :1]  # 3 query heads for 1 kv head as bshd: fine; bhsd: not
        q = q[:, :, :3]
    with pytest.raises(ValueError) as info:
        cpuflash.attention(q, k, v, **kwargs)
    if case == "layout given":  # an explicit "bhsd" still gets it: the arrays say bshd
        assert "layout=\"bshd\"" in str(info.value)
    else:
        assert "layout=\"bshd\"" not in str(info.value)


def test_no_hint_when_another_argument_fails_as_bshd_too(rng):
    q, k, v = flash_attn_qkv(rng)
    with pytest.raises(ValueError, match=r"key/value heads \(12\)$"):
        cpuflash.attention(q, k, v, window=(-3, 0))


def test_bshd_arrays_whose_shapes_agree_as_bhsd_get_a_warning(rng):
    """(2, 512, 8, 64) passes as 512 heads of 8 rows: a wrong answer without a word, unless
    the call warns."""
    q, k, v = (rng.standard_normal((2, 512, 8, 16)).astype(f32) for _ in range(3))
    with pytest.warns(UserWarning, match=r"read as 512 heads of 8 rows.*" + LAYOUT_HINT) as seen:
        cpuflash.attention(q, k, v)
    assert seen[0].filename == __file__  # it points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cpuflash.attention(q, k, v, layout="bshd")
        # a model's shapes: few heads, or more rows than heads
        cpuflash.attention(q[:, :8], k[:, :8], v[:, :8])
        x = rng.standard_normal((1, 300, 400, 8)).astype(f32)
        cpuflash.attention(x, x, x)


# -- flash-attn's and torch's keyword names

def call_args(rng):
    """Valid positional arguments of each public function."""
    x = rng.standard_normal((1, 2, 6, 8)).astype(f32)
    packed = rng.standard_normal((6, 2, 8)).astype(f32)
    cu = np.array([0, 6], np.int32)
    return {
        cpuflash.attention: (x, x, x),
        cpuflash.attention_varlen: (packed, packed, packed, cu, cu),
        cpuflash.attention_with_kvcache: (x[:, :, :1], x, x),
        cpuflash.merge_states: (np.zeros((2, 3, 8), f32), np.zeros((2, 3), f32)),
    }


ATTENTIONS = ["attention", "attention_varlen", "attention_with_kvcache"]
RENAMED = [
    # (keyword, value, pattern after "got an unexpected keyword argument '<keyword>'")
    ("softmax_scale", 0.1, r": flash-attn's `softmax_scale` is `scale` in cpuflash"),
    ("window_size", (4, 0), r": flash-attn's `window_size` is `window` in cpuflash"),
    ("is_causal", True, r": torch's `is_causal` is `causal` in cpuflash, and cpuflash aligns"),
    ("dropout_p", 0.0, r": cpuflash has no attention dropout: leave `dropout_p` out"),
    ("return_attn_probs", True, r": cpuflash never forms the attention probabilities .*"
                                r"`return_lse=True`"),
    ("deterministic", True, r": cpuflash is always deterministic"),
    ("enable_gqa", True, r": GQA is automatic in cpuflash whenever Hq is a multiple of Hk"),
    ("return_softmax_lse", True, r": flash-attn's `return_softmax_lse` is `return_lse`"),
    ("rotary_cos", None, r": cpuflash applies no rotary embedding"),
]


@pytest.mark.parametrize("name", ATTENTIONS)
@pytest.mark.parametrize("keyword,value,match", RENAMED, ids=[r[0] for r in RENAMED])
def test_foreign_keyword_names_cpuflash_s_own(rng, name, keyword, value, match):
    function = getattr(cpuflash, name)
    args = call_args(rng)[function]
    with pytest.raises(TypeError, match=rf"^cpuflash\.{name}\(\) got an unexpected keyword "
                                        rf"argument '{keyword}'{match}"):
        function(*args, **{keyword: value})


@pytest.mark.parametrize("name,keyword,match", [
    ("attention", "attn_mask", r"is `mask` in cpuflash when boolean .* and `bias` when float"),
    ("attention", "query", r"torch's `query` is `q` in cpuflash"),
    ("attention_varlen", "max_seqlen_q", r"reads the lengths from `cu_seqlens_q`"),
    ("attention_varlen", "cu_seqlens", r"takes `cu_seqlens_q` and `cu_seqlens_k`"),
    ("attention_with_kvcache", "block_tables", r"`block_tables` is `block_table` in cpuflash"),
    ("attention_with_kvcache", "seqlens_k", r"`seqlens_k` is `cache_seqlens` in cpuflash"),
    ("attention_with_kvcache", "sm_scale", r"`sm_scale` is `scale` in cpuflash"),
    # a name whose cpuflash equivalent this function lacks: where it lives instead
    # (`\b`: cpuflash.attention itself, whichever other functions follow it)
    ("attention_varlen", "attn_mask", r": cpuflash's `mask` or `bias` for it is a keyword of "
                                      r"cpuflash\.attention\b.* \(the keywords of "
                                      r"cpuflash\.attention_varlen: q, k, v, cu_seqlens_q"),
    ("attention", "max_seqlen_k", r": cpuflash's `cu_seqlens_k` for it is a keyword of "
                                  r"cpuflash\.attention_varlen"),
    ("attention_varlen", "bias", r"`bias` is a keyword of cpuflash\.attention\b.* \("),
    ("attention", "cache_seqlens", r"`cache_seqlens` is a keyword of "
                                   r"cpuflash\.attention_with_kvcache"),
])
def test_foreign_keyword_per_function(rng, name, keyword, match):
    function = getattr(cpuflash, name)
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{keyword}'.*{match}"):
        function(*call_args(rng)[function], **{keyword: None})


def test_every_foreign_keyword_gets_a_message_on_every_function(rng):
    for function, args in call_args(rng).items():
        for keyword in _public.FOREIGN_KEYWORDS:
            if keyword in inspect.signature(function).parameters:
                continue  # e.g. attention's own `k`
            with pytest.raises(TypeError, match=rf"unexpected keyword argument '{keyword}'"):
                function(*args, **{keyword: None})


def test_unknown_keyword_names_the_closest_and_lists_the_valid_ones(rng):
    x = call_args(rng)[cpuflash.attention]
    with pytest.raises(TypeError, match=r"argument 'casual': did you mean `causal`\? \(the "
                                        r"keywords of cpuflash\.attention: q, k, v, causal, "):
        cpuflash.attention(*x, casual=True)
    with pytest.raises(TypeError, match=r"argument 'zzz' \(the keywords of "
                                        r"cpuflash\.merge_states: outs, lses\)$"):
        cpuflash.merge_states(*call_args(rng)[cpuflash.merge_states], zzz=1)


def test_several_unknown_keywords_are_all_named(rng):
    x = call_args(rng)[cpuflash.attention]
    with pytest.raises(TypeError, match=r"'dropout_p'.*; .*'softmax_scale'"):
        cpuflash.attention(*x, dropout_p=0.0, softmax_scale=0.1, causal=True)


def test_other_type_errors_are_unchanged(rng):
    x = call_args(rng)[cpuflash.attention]
    with pytest.raises(TypeError, match=r"missing 1 required positional argument: 'v'"):
        cpuflash.attention(x[0], x[1])
    with pytest.raises(TypeError, match=r"got multiple values for argument 'q'"):
        cpuflash.attention(*x, q=x[0])
    with pytest.raises(TypeError, match=r"^`scale` must be a real number or None, got str$"):
        cpuflash.attention(*x, scale="0.1")


def test_valid_calls_work_and_signatures_are_the_real_ones(rng):
    args = call_args(rng)
    for function in args:
        assert "*args" not in str(inspect.signature(function))  # not a wrapper's
        assert function.__doc__ and function.__wrapped__.__name__ == function.__name__
    assert str(inspect.signature(cpuflash.attention)).startswith("(q, k, v, *, causal=False, ")
    q, k, v = args[cpuflash.attention]
    out, lse = cpuflash.attention(q, k, v, causal=True, scale=0.3, return_lse=True)
    ref = cpuflash.attention.__wrapped__(q, k, v, causal=True, scale=0.3)
    np.testing.assert_array_equal(out, ref)
    assert lse.shape == (1, 2, 6)
    assert cpuflash.attention_varlen(*args[cpuflash.attention_varlen]).shape == (6, 2, 8)
    assert cpuflash.merge_states(*args[cpuflash.merge_states])[0].shape == (3, 8)


# -- torch tensors that require grad

@pytest.mark.slow
def test_import_cpuflash_does_not_import_torch():
    code = "import sys, cpuflash; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="torch is not installed: the torch checks need it")


def test_tensor_requiring_grad_is_refused_under_grad_mode(torch, rng):
    q, k, v = (torch.from_numpy(x) for x in call_args(rng)[cpuflash.attention])
    q_grad = q.clone().requires_grad_()
    with pytest.raises(TypeError, match=r"`q` is a torch tensor that requires grad, but this "
                                        r"numpy-level call has no autograd: no gradient would "
                                        r"flow back.*"
                                        r"`torch\.no_grad\(\)`.*`cpuflash\.torch`"):
        cpuflash.attention(q_grad, k, v)
    bias = torch.zeros(6, 6, requires_grad=True)
    with pytest.raises(TypeError, match=r"`bias` is a torch tensor that requires grad"):
        cpuflash.attention(q, k, v, bias=bias)
    with pytest.raises(TypeError, match=r"`k_cache` is a torch tensor that requires grad"):
        cpuflash.attention_with_kvcache(q[:, :, :1], k.clone().requires_grad_(), v)
    with pytest.raises(TypeError, match=r"`q` is a torch tensor that requires grad"):
        cpuflash.attention_varlen(q_grad[0].transpose(0, 1), k[0].transpose(0, 1),
                                  v[0].transpose(0, 1), [0, 6], [0, 6])
    with pytest.raises(TypeError, match=r"`outs` is a torch tensor that requires grad"):
        cpuflash.merge_states([torch.zeros(3, 8, requires_grad=True)], [torch.zeros(3)])


def test_tensors_without_grad_or_under_no_grad_work(torch, rng):
    x = call_args(rng)[cpuflash.attention]
    expected = cpuflash.attention(*x, causal=True)
    q, k, v = (torch.from_numpy(a) for a in x)
    np.testing.assert_array_equal(cpuflash.attention(q, k, v, causal=True), expected)
    q_grad = q.clone().requires_grad_()
    for no_grad in (torch.no_grad, torch.inference_mode):  # the caller said so deliberately
        with no_grad():
            np.testing.assert_array_equal(cpuflash.attention(q_grad, k, v, causal=True),
                                          expected)
    np.testing.assert_array_equal(
        cpuflash.attention(q_grad.detach(), k, v, causal=True), expected)


# -- an adapter without its optional dependencies

@pytest.mark.parametrize("adapter, blocked, extra", [
    ("cpuflash.torch", "torch", "torch"),
    ("cpuflash.transformers", "transformers", "transformers"),
    ("cpuflash.distributed", "mpi4py", "mpi"),
])
def test_a_missing_extra_gets_the_command_that_installs_it(monkeypatch, adapter, blocked, extra):
    """cpuflash is installed from a clone: `pip install "cpuflash[torch]"` would find nothing."""
    import importlib

    monkeypatch.setitem(sys.modules, blocked, None)  # `import <blocked>` raises ImportError
    monkeypatch.delitem(sys.modules, adapter, raising=False)
    with pytest.raises(ImportError, match=rf"^{adapter} needs .*: in your clone of cpuflash, "
                                          rf"pip install -e \"\.\[{extra}\]\""):
        importlib.import_module(adapter)


def test_a_tensor_numpy_cannot_view_points_to_cpuflash_torch(torch, rng):
    q, k, v = (torch.from_numpy(x) for x in call_args(rng)[cpuflash.attention])
    with pytest.raises(TypeError, match=r"`q` is a torch bfloat16 tensor on cpu, which "
                                        r"numpy cannot view \(.*BFloat16.*\): "
                                        r"`cpuflash\.torch\.attention` takes CPU tensors of "
                                        r"every float dtype, bfloat16 included"):
        cpuflash.attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    with pytest.raises(TypeError, match=r"`bias` is a torch float32 tensor on meta"):
        cpuflash.attention(q, k, v, bias=torch.zeros(6, 6, device="meta"))
