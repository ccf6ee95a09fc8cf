"""`cpuflash.jax`: the custom calls against the reference, jax.nn.dot_product_attention, and
themselves under jit, grad and vmap.

float64 runs inside ``jax.enable_x64(True)`` blocks, so that no other test sees x64 switched on.
"""

import importlib
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: cpuflash.jax needs it")
cj = pytest.importorskip("cpuflash.jax", reason="cpuflash.jax could not be imported")
jnp = jax.numpy

import cpuflash  # noqa: E402
from accuracy import assert_close_to_reference  # noqa: E402
from helpers import low_precision_dtype, random_qkv  # noqa: E402


def x64():
    return jax.enable_x64(True)


def shapes(layout, n_q, n_k, heads_q=4, heads_k=2, d=24, batch=2):
    if layout == "bshd":
        return (batch, n_q, heads_q, d), (batch, n_k, heads_k, d)
    return (batch, heads_q, n_q, d), (batch, heads_k, n_k, d)


# ------------------------------------------------------------------------------------------------
# attention: the keywords of cpuflash.attention

CASES = {
    "plain": ({}, {}),
    "causal Nq < Nk": ({"causal": True}, {"n_q": 37, "n_k": 53}),
    "causal Nq > Nk": ({"causal": True}, {"n_q": 53, "n_k": 37}),
    "window": ({"window": (7, 3)}, {}),
    "chunks": ({"causal": True, "chunk_size": 9}, {"n_q": 37, "n_k": 53}),
    "softcap + alibi": ({"softcap": 2.0, "alibi_slopes": np.array([0.5, 0.25, 0.1, 0.05],
                                                                    dtype=np.float32)}, {}),
    "bias + mask": ({"bias": "bias", "mask": "mask"}, {}),
    "sinks": ({"sinks": np.array([0.0, 1.0, -1.0, 2.0], dtype=np.float32)}, {}),
    "bshd": ({"causal": True, "layout": "bshd"}, {"layout": "bshd"}),
}


def case_inputs(rng, name, dtype=np.float32):
    keywords, shape = CASES[name]
    keywords = dict(keywords)
    n_q, n_k = shape.get("n_q", 41), shape.get("n_k", 41)
    shape_q, shape_k = shapes(shape.get("layout", "bhsd"), n_q, n_k)
    q, k, v = random_qkv(rng, shape_q, shape_k, d_v=16, dtype=dtype)
    if keywords.get("bias") == "bias":
        keywords["bias"] = rng.standard_normal((4, 1, n_k)).astype(np.float32)
    if keywords.get("mask") == "mask":
        keywords["mask"] = rng.random((2, 1, n_q, n_k)) < 0.7
    return q, k, v, keywords


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", CASES)
def test_attention_matches_reference(rng, name, dtype):
    dtype = np.dtype(np.float32) if dtype == "float32" else low_precision_dtype(dtype)
    q, k, v, keywords = case_inputs(rng, name, dtype)
    out, lse = cj.attention(q, k, v, return_lse=True, **keywords)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    plain = {} if dtype == np.float32 else {"plain_dtype": dtype}  # as test_features does
    assert_close_to_reference(np.asarray(out), q, k, v, lse=np.asarray(lse), **plain,
                              **keywords)
    # the numpy function on the same arrays: the same bits
    expected = cpuflash.attention(q, k, v, return_lse=True, **keywords)
    for got, want in zip((out, lse), expected):
        np.testing.assert_array_equal(np.asarray(got), want)
    # jit: the same custom call, the same bits
    jitted = jax.jit(lambda q, k, v: cj.attention(q, k, v, return_lse=True, **keywords))
    for got, expected in zip(jitted(q, k, v), (out, lse)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_attention_float64_one_head(rng):
    with x64():
        q, k, v = random_qkv(rng, (29, 8), (31, 8), dtype=np.float64)
        out, lse = jax.jit(lambda q, k, v: cj.attention(q, k, v, causal=True,
                                                        return_lse=True))(q, k, v)
        assert out.dtype == jnp.float64 and out.shape == (29, 8) and lse.shape == (29,)
        assert_close_to_reference(np.asarray(out), q, k, v, lse=np.asarray(lse), causal=True)


def weights(rng, out):
    return rng.standard_normal(out.shape).astype(out.dtype)


@pytest.mark.parametrize("name", CASES)
def test_grad_is_the_cpuflash_backward(rng, name):
    q, k, v, keywords = case_inputs(rng, name)
    keywords.pop("bias", None)  # a constant here: its gradient is tested below
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **keywords)
    w = weights(rng, out)
    sinks = keywords.pop("sinks", None)

    def loss(q, k, v, sinks):
        extra = {} if sinks is None else {"sinks": sinks}
        return jnp.sum(cj.attention(q, k, v, **keywords, **extra) * w)

    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    got = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, sinks)
    extra = {} if sinks is None else {"sinks": sinks}
    expected = cpuflash.attention_backward(w, q, k, v, out, lse, **keywords, **extra)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(np.asarray(g), e)


def test_vmap_batches_into_one_call(rng, monkeypatch):
    q, k, v = random_qkv(rng, (3, 2, 4, 19, 16), (2, 2, 23, 16))
    calls = []
    original = cj.api.attention
    monkeypatch.setattr(cj.api, "attention", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    got = jax.jit(jax.vmap(lambda q: cj.attention(q, k, v, causal=True)))(q)
    assert len(calls) == 1  # one cpuflash call for the mapped axis: no Python loop
    for i in range(3):
        expected = cpuflash.attention(q[i], k, v, causal=True)
        np.testing.assert_allclose(np.asarray(got[i]), expected, rtol=1e-6, atol=1e-6)


def test_vmap_grad_per_example(rng):
    q, k, v = random_qkv(rng, (3, 4, 19, 16), (3, 2, 23, 16))
    bias = rng.standard_normal((3, 4, 19, 23)).astype(np.float32)
    sinks = rng.standard_normal((3, 4)).astype(np.float32)

    def loss(q, k, v, bias, sinks):
        return jnp.sum(cj.attention(q, k, v, bias=bias, sinks=sinks, causal=True) ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    # k mapped, v not: the unmapped operand is broadcast; sinks mapped: one call per example
    batched = jax.jit(jax.vmap(grad, in_axes=(0, 0, None, 0, 0)))(q, k, v[0], bias, sinks)
    for i in range(3):
        single = grad(q[i], k[i], v[0], bias[i], sinks[i])
        for b, s in zip(batched, single):
            np.testing.assert_allclose(np.asarray(b[i]), np.asarray(s), rtol=1e-5, atol=1e-6)


def test_nested_vmap(rng):
    q, k, v = random_qkv(rng, (2, 3, 4, 11, 8), (2, 3, 4, 13, 8))
    got = jax.vmap(jax.vmap(lambda q, k, v: cj.attention(q, k, v, window=(2, 2))))(q, k, v)
    expected = cpuflash.attention(q, k, v, window=(2, 2))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)


def test_inputs_and_output_are_xla_buffers(rng, monkeypatch):
    """The handler reads XLA's operand buffers and writes into its result buffer: no copies."""
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, (1, 2, 64, 32), (1, 2, 64, 32)))
    seen = {}
    original = cj.api.attention

    def spy(q, k, v, **keywords):
        seen["q"], seen["out"] = (x.__array_interface__["data"][0] for x in (q, keywords["out"]))
        return original(q, k, v, **keywords)

    monkeypatch.setattr(cj.api, "attention", spy)
    out = jax.jit(lambda q, k, v: cj.attention(q, k, v))(q, k, v)
    out.block_until_ready()
    assert seen["q"] == q.unsafe_buffer_pointer()
    assert seen["out"] == out.unsafe_buffer_pointer()


def test_bias_gradient_only_when_asked(rng, monkeypatch):
    q, k, v = random_qkv(rng, (1, 2, 9, 8), (1, 2, 9, 8))
    bias = rng.standard_normal((9, 9)).astype(np.float32)
    monkeypatch.setattr(cj, "_bias_gradient", lambda *a: pytest.fail("computed dbias"))
    jax.grad(lambda q: jnp.sum(cj.attention(q, k, v, bias=bias)))(q)


def test_reload_keeps_the_registered_handler(rng):
    q, k, v = random_qkv(rng, (1, 2, 9, 8), (1, 2, 9, 8))
    before = np.asarray(cj.attention(q, k, v, causal=True))
    importlib.reload(cj)
    np.testing.assert_array_equal(np.asarray(cj.attention(q, k, v, causal=True)), before)


# ------------------------------------------------------------------------------------------------
# dot_product_attention against jax.nn.dot_product_attention

def dpa_inputs(rng, t=21, s=27, n=4, kv=2, h=16, batch=2, dtype=np.float32):
    query = rng.standard_normal((batch, t, n, h)).astype(dtype)
    key = rng.standard_normal((batch, s, kv, h)).astype(dtype)
    value = rng.standard_normal((batch, s, kv, h)).astype(dtype)
    return query, key, value


DPA_CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "window": {"local_window_size": (4, 2)},
    "window int + causal": {"local_window_size": 3, "is_causal": True},
    "left only": {"local_window_size": (0, 30)},
    "bias B N T S": {"bias": (2, 4, 21, 27)},
    "bias 1 N 1 S": {"bias": (1, 4, 1, 27)},
    "bias B 1 1 S + causal": {"bias": (2, 1, 1, 27), "is_causal": True},
    "mask": {"mask": (2, 1, 21, 27)},
    "lengths": {"query_seq_lengths": [21, 13], "key_value_seq_lengths": [27, 9]},
    "scale": {"scale": 0.37, "is_causal": True},
    "causal T > S": {"is_causal": True, "sizes": (27, 21)},  # cpuflash's window, right = 6
    "window T > S": {"local_window_size": (2, 1), "sizes": (27, 21)},
}


def dpa_keywords(rng, case, dtype):
    keywords = dict(DPA_CASES[case])
    keywords.pop("sizes", None)
    if "bias" in keywords:
        keywords["bias"] = rng.standard_normal(keywords["bias"]).astype(dtype)
    if "mask" in keywords:
        keywords["mask"] = rng.random(keywords["mask"]) < 0.8
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in keywords:
            keywords[name] = np.array(keywords[name], dtype=np.int32)
    return keywords


def seen_rows(query, key, keywords):
    """Which query rows see at least one key under jax's rules: (B, 1, T), or (B, N, T) with
    a mask."""
    t, s = query.shape[1], key.shape[1]
    rows = np.arange(t)[:, None]
    cols = np.arange(s)[None, :]
    seen = np.ones((query.shape[0], t, s), dtype=bool)
    if keywords.get("is_causal"):
        seen &= cols <= rows
    window = keywords.get("local_window_size")
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        seen &= (cols >= rows - left) & (cols <= rows + right)
    if "key_value_seq_lengths" in keywords:
        seen &= cols[None] < keywords["key_value_seq_lengths"][:, None, None]
    if "mask" in keywords:
        seen = seen[:, None] & keywords["mask"]
        return seen.any(-1)  # (B, N, T)
    return seen.any(-1)[:, None]  # (B, 1, T)


@pytest.mark.parametrize("case", DPA_CASES)
def test_dot_product_attention_matches_jax(rng, case):
    t, s = DPA_CASES[case].get("sizes", (21, 27))
    query, key, value = dpa_inputs(rng, t=t, s=s)
    keywords = dpa_keywords(rng, case, np.float32)
    got = jax.jit(lambda q, k, v: cj.dot_product_attention(q, k, v, **keywords))(
        query, key, value)
    expected = jax.nn.dot_product_attention(query, key, value, **keywords)
    seen = np.broadcast_to(seen_rows(query, key, keywords), (2, 4, t))
    seen = np.swapaxes(seen, 1, 2)  # (B, T, N)
    got, expected = np.asarray(got), np.asarray(expected)
    np.testing.assert_allclose(got[seen], expected[seen], rtol=2e-5, atol=2e-5)
    assert not np.any(got[~seen])  # where jax averages all the values, cpuflash gives 0


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("case", DPA_CASES)
def test_dot_product_attention_residual_matches_jax(rng, case, implementation):
    """`implementation=` and `return_residual=` as jax takes them: the same output and the
    same residual (the log-sum-exp, (B, T, N)), under jit; rows that see no key hold jax's
    own number there."""
    t, s = DPA_CASES[case].get("sizes", (21, 27))
    query, key, value = dpa_inputs(rng, t=t, s=s)
    keywords = dpa_keywords(rng, case, np.float32)
    keywords.update(implementation=implementation, return_residual=True)
    got_out, got = jax.jit(lambda q, k, v: cj.dot_product_attention(q, k, v, **keywords))(
        query, key, value)
    expected_out, expected = jax.nn.dot_product_attention(query, key, value, **keywords)
    assert got.shape == expected.shape == (2, t, 4) and got.dtype == expected.dtype
    seen = np.swapaxes(np.broadcast_to(seen_rows(query, key, keywords), (2, 4, t)), 1, 2)
    if "query_seq_lengths" in keywords:  # jax masks every logit of a padding row
        seen = seen & (np.arange(t)[None, :, None]
                       < keywords["query_seq_lengths"][:, None, None])
    got, expected = np.asarray(got), np.asarray(expected)
    np.testing.assert_allclose(got[seen], expected[seen], rtol=2e-6, atol=2e-5)
    np.testing.assert_array_equal(got[~seen], expected[~seen])
    np.testing.assert_allclose(np.asarray(got_out)[seen], np.asarray(expected_out)[seen],
                               rtol=2e-5, atol=2e-5)


def test_dot_product_attention_residual_dtypes_and_grad(rng):
    """The residual has the dtype of `query` and jax's (T, N) shape for 3-D inputs, and, as
    in jax, carries no gradient: a loss through it differentiates to zero."""
    for dtype in (np.float16, low_precision_dtype("bfloat16")):
        query, key, value = (x[0] for x in dpa_inputs(rng, dtype=dtype))
        _, got = cj.dot_product_attention(query, key, value, is_causal=True,
                                          return_residual=True)
        _, expected = jax.nn.dot_product_attention(query, key, value, is_causal=True,
                                                   return_residual=True)
        assert got.shape == expected.shape == query.shape[:-1] and got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32),
                                   np.asarray(expected, np.float32), rtol=1e-2)
    query, key, value = dpa_inputs(rng)

    def loss(function):
        def f(q):
            out, residual = function(q, key, value, is_causal=True, return_residual=True)
            return jnp.sum(out ** 2) + jnp.sum(residual)
        return f

    got = jax.jit(jax.grad(loss(cj.dot_product_attention)))(query)
    expected = jax.grad(loss(jax.nn.dot_product_attention))(query)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-4)


def test_dot_product_attention_implementation_cudnn(rng):
    """On the CPU jax raises RuntimeError for cuDNN; the drop-in raises one that is also a
    ValueError, naming the argument."""
    query, key, value = dpa_inputs(rng)
    with pytest.raises(RuntimeError, match="cuDNN"):
        jax.nn.dot_product_attention(query, key, value, implementation="cudnn")
    for error in (RuntimeError, ValueError):
        with pytest.raises(error, match="`implementation` 'cudnn'"):
            cj.dot_product_attention(query, key, value, implementation="cudnn")


def test_dot_product_attention_no_key_rows(rng):
    query, key, value = dpa_inputs(rng)
    lengths = np.array([27, 0], dtype=np.int32)
    got = cj.dot_product_attention(query, key, value, key_value_seq_lengths=lengths)
    expected = jax.nn.dot_product_attention(query, key, value, key_value_seq_lengths=lengths)
    assert not np.any(np.asarray(got[1]))
    # jax gives the mean of the values there
    np.testing.assert_allclose(np.asarray(expected[1, 0, 0]), value[1].mean(0)[0], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(expected[0]), rtol=2e-5, atol=2e-5)
    # the residual there is jax's, not -inf
    _, got = cj.dot_product_attention(query, key, value, key_value_seq_lengths=lengths,
                                      return_residual=True)
    _, expected = jax.nn.dot_product_attention(query, key, value, key_value_seq_lengths=lengths,
                                               return_residual=True)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(expected[1]))
    assert np.all(np.isfinite(np.asarray(got[1])))


def test_dot_product_attention_three_dims_and_half(rng):
    for dtype in (np.float16, low_precision_dtype("bfloat16")):
        query, key, value = (x[0] for x in dpa_inputs(rng, dtype=dtype))
        got = cj.dot_product_attention(query, key, value, is_causal=True)
        expected = jax.nn.dot_product_attention(query, key, value, is_causal=True)
        assert got.shape == query.shape and got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                                   rtol=2e-2, atol=2e-2)


GRAD_CASES = ["plain", "causal", "window", "left only", "bias B N T S", "bias 1 N 1 S",
              "bias B 1 1 S + causal", "mask", "lengths", "causal T > S"]


@pytest.mark.parametrize("case", GRAD_CASES)
def test_dot_product_attention_grad_float64(rng, case):
    """Gradients (bias included) equal jax's own autodiff of jax.nn.dot_product_attention."""
    with x64():
        t, s = DPA_CASES[case].get("sizes", (21, 27))
        query, key, value = dpa_inputs(rng, t=t, s=s, dtype=np.float64)
        keywords = dpa_keywords(rng, case, np.float64)
        bias = keywords.pop("bias", None)
        w = rng.standard_normal(query.shape)

        def loss(function):
            def f(q, k, v, b):
                return jnp.sum(function(q, k, v, b, **keywords) * w)
            return f

        argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
        got = jax.jit(jax.grad(loss(cj.dot_product_attention), argnums))(
            query, key, value, bias)
        expected = jax.grad(loss(jax.nn.dot_product_attention), argnums)(
            query, key, value, bias)
        for g, e in zip(got, expected):
            assert g.dtype == jnp.float64
            # jax.nn rounds its softmax to float32 even for float64 inputs: 1e-7 relative
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)


def dense_float64(query, key, value, bias, is_causal):
    """jax.nn.dot_product_attention's formula with its softmax in float64 (MHA only)."""
    logits = jnp.einsum("btnh,bsnh->bnts", query, key) / np.sqrt(query.shape[-1]) + bias
    if is_causal:
        t, s = logits.shape[-2:]
        logits = jnp.where(jnp.tril(jnp.ones((t, s), bool)), logits, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), value)


@pytest.mark.parametrize("bias_shape", [(2, 4, 21, 27), (1, 4, 1, 27), (2, 1, 21, 1)])
def test_bias_gradient_float64(rng, bias_shape):
    """dbias to 1e-12 against autodiff of a dense float64 formula: dS summed over the axes
    along which the bias broadcasts."""
    with x64():
        query, key, value = dpa_inputs(rng, kv=4, dtype=np.float64)
        bias = rng.standard_normal(bias_shape)
        w = rng.standard_normal(query.shape)

        def loss(function):
            return lambda b: jnp.sum(function(query, key, value, b, is_causal=True) * w)

        got = jax.grad(loss(cj.dot_product_attention))(bias)
        expected = jax.grad(loss(dense_float64))(bias)
        assert got.shape == bias_shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-10,
                                   atol=1e-12)


def test_dot_product_attention_vmap_grad(rng):
    query, key, value = dpa_inputs(rng)
    bias = rng.standard_normal((3, 1, 4, 21, 27)).astype(np.float32)

    def loss(function):
        return lambda q, b: jnp.sum(function(q, key, value, b, is_causal=True) ** 2)

    got = jax.vmap(jax.grad(loss(cj.dot_product_attention), (0, 1)), in_axes=(None, 0))(
        query, bias)
    expected = jax.vmap(jax.grad(loss(jax.nn.dot_product_attention), (0, 1)),
                        in_axes=(None, 0))(query, bias)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# errors: before any work, naming the argument

def test_attention_errors_raise_at_trace_time(rng):
    q, k, v = random_qkv(rng, (1, 2, 9, 8), (1, 2, 9, 8))
    with pytest.raises(ValueError, match="`window` sides must be >= -1"):
        jax.jit(lambda q: cj.attention(q, k, v, window=(1, -3)))(q)
    with pytest.raises(TypeError, match="must share one dtype|dtype"):
        cj.attention(q, k.astype(np.float16), v)


def test_alibi_slopes_have_no_gradient(rng):
    q, k, v = random_qkv(rng, (1, 2, 9, 8), (1, 2, 9, 8))
    slopes = np.array([0.5, 0.25], dtype=np.float32)
    with pytest.raises(TypeError, match="`alibi_slopes` has no gradient"):
        jax.grad(lambda s: jnp.sum(cj.attention(q, k, v, alibi_slopes=s)))(slopes)


def test_lse_has_no_gradient(rng):
    q, k, v = random_qkv(rng, (1, 2, 9, 8), (1, 2, 9, 8))
    with pytest.raises(TypeError, match="log-sum-exp .* carries no gradient"):
        jax.grad(lambda q: jnp.sum(cj.attention(q, k, v, return_lse=True)[1]))(q)


def test_ffi_target_without_plan():
    call = jax.ffi.ffi_call(cj._jax_ffi.TARGET, jax.ShapeDtypeStruct((2,), jnp.float32))
    with pytest.raises(Exception, match="without its `plan` attribute"):
        jax.block_until_ready(call(jnp.ones(2)))


DPA_ERRORS = [
    (ValueError, "must all be \\(B, T, N, H\\)", lambda q, k, v: ((q[0, 0], k, v), {})),
    (ValueError, "`value` must have the shape of `key`", lambda q, k, v: ((q, k, v[..., :8]), {})),
    (TypeError, "must have one dtype", lambda q, k, v: ((q, k, v.astype(np.float16)), {})),
    (ValueError, "same batch size and head dim", lambda q, k, v: ((q[:1], k, v), {})),
    (ValueError, "multiple of the number of key/value heads",
     lambda q, k, v: ((q[:, :, :3], k, v), {})),
    (ValueError, "`bias` must have at most 4 dims",
     lambda q, k, v: ((q, k, v), {"bias": np.zeros((1, 1, 1, 21, 27), np.float32)})),
    (TypeError, "`mask` must be boolean",
     lambda q, k, v: ((q, k, v), {"mask": np.zeros((21, 27), np.float32)})),
    (ValueError, "`key_value_seq_lengths` must be an int array of shape \\(2,\\)",
     lambda q, k, v: ((q, k, v), {"key_value_seq_lengths": np.array([3, 4, 5])})),
    (ValueError, "`local_window_size` must be an int or a pair",
     lambda q, k, v: ((q, k, v), {"local_window_size": (1.5, 2)})),
    (ValueError, "`implementation` must be None, 'xla' or 'cudnn', got 'flash'",
     lambda q, k, v: ((q, k, v), {"implementation": "flash"})),
    (ValueError, "`bias` must be broadcastable",
     lambda q, k, v: ((q, k, v), {"bias": np.zeros((3, 27), np.float32)})),
]


@pytest.mark.parametrize("error, message, make", DPA_ERRORS, ids=[m for _, m, _ in DPA_ERRORS])
def test_dot_product_attention_errors(rng, error, message, make):
    args, keywords = make(*dpa_inputs(rng))
    with pytest.raises(error, match=message):
        cj.dot_product_attention(*args, **keywords)


def test_import_error_names_the_extra():
    code = ("import sys; sys.modules['jax'] = None\n"
            "try:\n    import cpuflash.jax\nexcept ImportError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert "cpuflash.jax needs jax" in result.stdout, result.stderr


def test_bias_gradient_with_every_modifier(rng):
    """dbias along a random direction against a central difference of the float64 forward,
    with softcap, ALiBi, a mask, sinks and GQA in the pipeline."""
    with x64():
        q, k, v = random_qkv(rng, (2, 4, 13, 8), (2, 2, 17, 8), dtype=np.float64)
        keywords = dict(softcap=3.0, alibi_slopes=np.array([0.3, 0.2, 0.1, 0.05]),
                        mask=rng.random((2, 1, 13, 17)) < 0.8, sinks=np.zeros(4), window=(9, 2))
        bias = rng.standard_normal((4, 13, 17))
        direction = rng.standard_normal(bias.shape)
        w = rng.standard_normal((2, 4, 13, 8))

        def loss(b):
            return jnp.sum(cj.attention(q, k, v, bias=b, **keywords) * w)

        grad = jax.grad(loss)(bias)
        eps = 1e-6
        slope = (loss(bias + eps * direction) - loss(bias - eps * direction)) / (2 * eps)
        np.testing.assert_allclose(float(jnp.sum(grad * direction)), float(slope), rtol=1e-7)


def test_bias_gradient_bfloat16(rng):
    dtype = low_precision_dtype("bfloat16")
    query, key, value = dpa_inputs(rng, dtype=dtype)
    bias = rng.standard_normal((1, 4, 21, 27)).astype(dtype)
    grad = jax.grad(lambda b: jnp.sum(cj.dot_product_attention(query, key, value, b) ** 2))(bias)
    expected = jax.grad(lambda b: jnp.sum(
        jax.nn.dot_product_attention(query, key, value, b).astype(np.float32) ** 2))(bias)
    assert grad.dtype == dtype
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(expected, np.float32),
                               rtol=0.1, atol=0.05 * float(np.abs(np.asarray(expected,
                                                                               np.float32)).max()))
