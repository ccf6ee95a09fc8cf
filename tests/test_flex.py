"""User score and mask functions compiled into the kernels (`cpuflash.flex_attention`).

Most checks write a user function that means the same as a built-in modifier (a bias table, a
bool mask, a softcap) and compare with the built-in call, whose accuracy the other test files
establish against the dense oracle: the forward through the accuracy rule on the dense
equivalent, the gradients against the built-in backward in float64.
"""

import math
import uuid

import numba
import numpy as np
import pytest

import cpuflash

from accuracy import assert_close_to_reference, assert_within_rule, tolerance
from helpers import assert_same_bits, explain, random_qkv, run_python

N_REL = 512  # the relative-position table covers distances -N_REL .. N_REL - 1


def rel_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, q_idx - kv_idx + N_REL]


def same_doc(b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


def tanh_cap(score, b, h, q_idx, kv_idx):
    return 30.0 * math.tanh(score / 30.0)


def dense_bias(table, n_q, n_k):
    qi, ki = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    return table[:, qi - ki + N_REL][None]  # (1, H, Nq, Nk)


def dense_doc_mask(doc, n_q, n_k):
    return doc[:, None, :n_q, None] == doc[:, None, None, :n_k]  # (B, 1, Nq, Nk)


def documents(rng, batch, n):
    """Sorted document ids per row of each batch entry (a packed batch): (batch, n) int64."""
    return np.sort(rng.integers(0, 4, size=(batch, n)), axis=1)


@pytest.fixture
def case(rng):
    b, hq, hk, n, d = 2, 4, 2, 150, 40
    q, k, v = random_qkv(rng, (b, hq, n, d), (b, hk, n, d))
    table = (rng.standard_normal((hq, 2 * N_REL)) * 0.5).astype(np.float32)
    return q, k, v, table, documents(rng, b, n)


@pytest.mark.parametrize("causal", [False, True])
def test_score_mod_is_the_bias_it_computes(case, causal):
    q, k, v, table, _ = case
    n = q.shape[2]
    out, lse = cpuflash.flex_attention(q, k, v, score_mod=rel_bias, score_args=(table,),
                                       causal=causal, return_lse=True)
    bias = dense_bias(table, n, n)
    assert_close_to_reference(out, q, k, v, lse=lse, bias=bias, causal=causal)
    # the same additions as the built-in bias step, in the same order: the same bits
    assert_same_bits(out, cpuflash.attention(q, k, v, bias=bias, causal=causal))


def test_mask_mod_with_and_without_block_mask(case):
    q, k, v, table, doc = case
    b, hq, n, _ = q.shape
    mask = dense_doc_mask(doc, n, n)
    expected = cpuflash.attention(q, k, v, mask=mask, causal=True)
    plain = cpuflash.flex_attention(q, k, v, mask_mod=same_doc, mask_args=(doc,), causal=True)
    assert_close_to_reference(plain, q, k, v, mask=mask, causal=True)
    assert_same_bits(plain, expected)
    for block in (16, (32, 8), 64, 1000):
        bm = cpuflash.block_mask(same_doc, b, 1, n, n, args=(doc,), block=block)
        got = cpuflash.flex_attention(q, k, v, block_mask=bm, causal=True)
        assert_same_bits(got, expected, f"block {block}")


def test_block_mask_states(rng):
    doc = np.repeat(np.arange(4), 32)[None]  # four documents of 32 rows
    bm = cpuflash.block_mask(same_doc, 1, 1, 128, 128, args=(doc,), block=32)
    assert np.array_equal(bm.states[0, 0], np.where(np.eye(4, dtype=bool), bm.FULL, bm.EMPTY))
    bm = cpuflash.block_mask(same_doc, 1, 1, 128, 128, args=(doc,), block=48)
    assert bm.states.shape == (1, 1, 3, 3)
    assert bm.states[0, 0, 0, 0] == bm.PARTIAL and bm.states[0, 0, 0, 2] == bm.EMPTY
    assert bm.sparsity() == pytest.approx(100 * 4 / 9)  # (0, 2), (1, 2), (2, 0), (2, 1)


def test_everything_at_once(case):
    q, k, v, table, doc = case
    b, hq, n, _ = q.shape
    q, k, v = (np.swapaxes(x, 1, 2) for x in (q, k, v))  # bshd
    slopes = np.linspace(0.1, 0.4, hq).astype(np.float32)
    sinks = np.linspace(-1, 1, hq).astype(np.float32)
    kwargs = dict(window=(40, 3), softcap=25.0, alibi_slopes=slopes, sinks=sinks, layout="bshd")
    bm = cpuflash.block_mask(same_doc, b, hq, n, n, args=(doc,), block=24)
    out = cpuflash.flex_attention(q, k, v, score_mod=rel_bias, score_args=(table,),
                                  block_mask=bm, **kwargs)
    # the user's bias comes after the built-in steps, as the dense bias does
    assert_close_to_reference(out, q, k, v, bias=dense_bias(table, n, n),
                              mask=dense_doc_mask(doc, n, n), **kwargs)


def test_float64_and_the_scores_dtype(rng):
    q, k, v = random_qkv(rng, (1, 2, 70, 16), (1, 2, 90, 16), dtype=np.float64)
    table = rng.standard_normal((2, 2 * N_REL))
    out = cpuflash.flex_attention(q, k, v, score_mod=rel_bias, score_args=(table,))
    assert out.dtype == np.float64
    assert_close_to_reference(out, q, k, v, bias=dense_bias(table, 70, 90))


def test_numba_jitted_functions_and_closures(case):
    q, k, v, table, doc = case
    n = q.shape[2]
    shift = 0.25

    def shifted(score, b, h, q_idx, kv_idx):
        return score + shift * (h + 1)

    out = cpuflash.flex_attention(q, k, v, score_mod=numba.njit(shifted))
    bias = np.broadcast_to(0.25 * np.arange(1, 5, dtype=np.float32)[None, :, None, None],
                           (1, 4, n, n))
    assert_close_to_reference(out, q, k, v, bias=bias)


def test_a_row_that_sees_no_key(rng):
    q, k, v = random_qkv(rng, (1, 1, 40, 8), (1, 1, 40, 8))

    def hide_row_7(b, h, q_idx, kv_idx):
        return q_idx != 7

    for bm in (None, cpuflash.block_mask(hide_row_7, 1, 1, 40, 40, block=8)):
        out, lse = cpuflash.flex_attention(q, k, v, mask_mod=hide_row_7, block_mask=bm,
                                           return_lse=True)
        assert np.all(out[0, 0, 7] == 0) and lse[0, 0, 7] == -np.inf
        assert np.all(np.isfinite(lse[0, 0, :7]))


def test_bits_do_not_depend_on_the_thread_count(case):
    q, k, v, table, doc = case
    b, hq, n, _ = q.shape
    bm = cpuflash.block_mask(same_doc, b, 1, n, n, args=(doc,))
    kwargs = dict(score_mod=tanh_cap, block_mask=bm, causal=True)
    before = numba.get_num_threads()
    try:
        results = []
        for threads in sorted({1, before}):
            numba.set_num_threads(threads)
            out, lse = cpuflash.flex_attention(q, k, v, return_lse=True, **kwargs)
            dout = np.random.default_rng(0).standard_normal(out.shape).astype(np.float32)
            grads = cpuflash.flex_attention_backward(dout, q, k, v, out, lse, **kwargs)
            results.append((out,) + grads)
    finally:
        numba.set_num_threads(before)
    for got in results[1:]:
        for x, y in zip(got, results[0]):
            assert_same_bits(x, y)


def test_a_mask_mod_alone_gives_the_bool_masks_bits_for_any_thread_count(case):
    """Without a block mask every tile is partial: the forward asks `mask_mod` once per pair
    and visits only the rows and key panels that hold a visible pair, whatever the tiles (they
    change with the thread count), with the bits of the built-in boolean mask, a value that is
    inf and a query with NaN included."""
    q, k, v, table, doc = case
    b, hq, n, _ = q.shape
    v = v.copy()
    v[0, 0, 3, 5] = np.inf  # in document 0 of batch entry 0: the other documents never read it
    q = q.copy()
    q[1, 2, n - 1, 0] = np.nan
    mask = dense_doc_mask(doc, n, n)
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, before}):
            numba.set_num_threads(threads)
            for causal in (False, True):
                got = cpuflash.flex_attention(q, k, v, mask_mod=same_doc, mask_args=(doc,),
                                              causal=causal, return_lse=True)
                expected = cpuflash.attention(q, k, v, mask=mask, causal=causal,
                                              return_lse=True)
                for x, y in zip(got, expected):
                    assert_same_bits(x, y, f"threads {threads} causal {causal}")
    finally:
        numba.set_num_threads(before)
    assert np.isfinite(got[0][0][:, doc[0] != doc[0, 3]]).all()


# -- gradients ------------------------------------------------------------------------------

def flex_gradients(rng, q, k, v, **kwargs):
    out, lse = cpuflash.flex_attention(q, k, v, return_lse=True, **kwargs)
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    return dout, cpuflash.flex_attention_backward(dout, q, k, v, out, lse, **kwargs)


def builtin_gradients(dout, q, k, v, **kwargs):
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **kwargs)
    return cpuflash.attention_backward(dout, q, k, v, out, lse, **kwargs)


def assert_gradients_like_builtin(got, dout, q, k, v, **kwargs):
    """Each gradient within the accuracy rule, with the built-in float32 backward (tested against
    the dense oracle elsewhere) as the plain implementation and its float64 run as the oracle."""
    wide = [x.astype(np.float64) for x in (dout, q, k, v)]
    wide_kwargs = {key: (x.astype(np.float64) if isinstance(x, np.ndarray) and x.dtype.kind == "f"
                         else x) for key, x in kwargs.items()}
    oracle = builtin_gradients(*wide, **wide_kwargs)
    plain = builtin_gradients(dout, q, k, v, **kwargs)
    for name, g, r, p in zip(("dq", "dk", "dv"), got, oracle, plain):
        assert g.shape == r.shape and g.dtype == q.dtype
        plain_error = float(np.abs(p - r).max())
        assert_within_rule(np.abs(g - r), plain_error,
                           tolerance(np.float32) * float(np.abs(r).max()), name)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_of_a_bias_mod_are_the_bias_gradients(rng, case, causal):
    q, k, v, table, doc = case
    n = q.shape[2]
    dout, got = flex_gradients(rng, q, k, v, score_mod=rel_bias, score_args=(table,),
                               mask_mod=same_doc, mask_args=(doc,), causal=causal)
    expected = builtin_gradients(dout, q, k, v, bias=dense_bias(table, n, n),
                                 mask=dense_doc_mask(doc, n, n), causal=causal)
    for g, e in zip(got, expected):
        assert_same_bits(g, e)


def test_gradients_through_a_nonlinear_mod(rng, case):
    """d(score_mod)/d(score) by dual numbers: a softcap written by hand, against the built-in
    softcap's gradients."""
    q, k, v, _, doc = case
    b, hq, n, _ = q.shape
    bm = cpuflash.block_mask(same_doc, b, 1, n, n, args=(doc,), block=32)
    dout, got = flex_gradients(rng, q, k, v, score_mod=tanh_cap, block_mask=bm, causal=True)
    assert_gradients_like_builtin(got, dout, q, k, v, softcap=30.0, causal=True,
                                  mask=dense_doc_mask(doc, n, n))


def test_gradients_of_every_differentiable_operation(rng):
    """A mod using each rule of the dual numbers, against central differences in float64."""
    def mixed(score, b, h, q_idx, kv_idx, w):
        x = abs(score) ** 1.5 / (1.0 + math.exp(-score)) - min(score, 0.3) * max(score, -0.2)
        return (x + math.log1p(score * score) - math.sqrt(2.0 + math.sin(score))
                + math.cos(score) * math.tanh(score) + w[h] * -score)

    q, k, v = random_qkv(rng, (1, 2, 20, 8), (1, 2, 24, 8), dtype=np.float64)
    w = np.array([0.5, -1.5])
    kwargs = dict(score_mod=mixed, score_args=(w,))
    dout, (dq, dk, dv) = flex_gradients(rng, q, k, v, **kwargs)

    def loss(q_):
        return float(np.sum(cpuflash.flex_attention(q_, k, v, **kwargs) * dout))

    eps = 1e-6
    for index in [(0, 0, 0, 0), (0, 1, 5, 3), (0, 1, 19, 7)]:
        plus, minus = q.copy(), q.copy()
        plus[index] += eps
        minus[index] -= eps
        numeric = (loss(plus) - loss(minus)) / (2 * eps)
        assert dq[index] == pytest.approx(numeric, rel=1e-5, abs=1e-8)


# -- errors ---------------------------------------------------------------------------------

def test_a_function_numba_cannot_compile_is_named(case):
    q, k, v, _, _ = case

    def python_only(x):  # not compiled: Numba cannot call it
        return x

    def calls_python(score, b, h, q_idx, kv_idx):
        return score + python_only(h)

    with pytest.raises(TypeError, match="score_mod.*calls_python.*cannot be compiled"):
        cpuflash.flex_attention(q, k, v, score_mod=calls_python)


def test_a_function_that_can_raise_is_refused_before_any_work(case):
    """An exception cannot leave a parallel kernel: on a worker thread it was lost (the call
    returned, its output wrong), on the calling thread it came back as a SystemError."""
    q, k, v, _, _ = case

    def far(score, b, h, q_idx, kv_idx):
        if q_idx - kv_idx > 5:
            raise ValueError("too far")
        return score

    def checked(b, h, q_idx, kv_idx):
        assert q_idx >= 0
        return kv_idx <= q_idx

    @numba.njit
    def helper(h):
        if h > 1:
            raise IndexError(h)
        return h

    def calls_a_raising_helper(score, b, h, q_idx, kv_idx):
        return score + helper(h)

    out = np.full(q.shape, 7.0, q.dtype)
    with pytest.raises(TypeError, match=r"`score_mod` \(.*far\) must not raise"):
        cpuflash.flex_attention(q, k, v, score_mod=far, out=out)
    assert (out == 7.0).all()
    with pytest.raises(TypeError, match=r"`mask_mod` \(.*checked\) must not raise"):
        cpuflash.flex_attention(q, k, v, mask_mod=checked)
    with pytest.raises(TypeError, match="must not raise: .*helper has a `raise`"):
        cpuflash.flex_attention(q, k, v, score_mod=calls_a_raising_helper)


BIAS = np.zeros(4, np.float32)  # read by `global_bias` as a global: refused
SHIFT = 0.5  # read by `global_shift`: a constant, rebound by the test


def global_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[h] * (kv_idx == 0)


def global_shift(score, b, h, q_idx, kv_idx):
    return score + SHIFT * (kv_idx == 0)


def test_a_global_that_can_change_is_refused_and_a_rebound_one_is_read_again(case):
    """Numba compiles a global's value into the function: a user function must not compute
    with what the call does not give it, however the global changes between calls."""
    global BIAS, SHIFT
    q, k, v, _, _ = case

    def expected(shift):
        bias = np.zeros(q.shape[:2] + (q.shape[2], k.shape[2]), np.float32)
        bias[..., 0] = shift
        return cpuflash.attention(q, k, v, bias=bias)

    with pytest.raises(TypeError, match=r"`score_mod` \(global_bias\) reads the global `BIAS`, "
                                        r"a numpy.ndarray.*Pass it in `score_args`"):
        cpuflash.flex_attention(q, k, v, score_mod=global_bias)
    saved_bias, saved_shift = BIAS, SHIFT
    try:
        BIAS = BIAS + 100  # rebound to another array: refused all the same
        with pytest.raises(TypeError, match="reads the global `BIAS`"):
            cpuflash.flex_attention(q, k, v, score_mod=global_bias)
        first = cpuflash.flex_attention(q, k, v, score_mod=global_shift)
        assert_same_bits(first, expected(0.5))
        SHIFT = 3.0  # after a first call: the next call computes with the new value
        assert_same_bits(cpuflash.flex_attention(q, k, v, score_mod=global_shift),
                         expected(3.0))
    finally:
        BIAS, SHIFT = saved_bias, saved_shift

    table = [0.0, 1.0]

    def closes_over_a_list(b, h, q_idx, kv_idx):
        return table[0] == 0.0

    with pytest.raises(TypeError, match=r"`mask_mod` .* reads `table` from its closure, a "
                                        r"builtins.list.*Pass it in `mask_args`"):
        cpuflash.flex_attention(q, k, v, mask_mod=closes_over_a_list)


def test_a_closure_over_a_torch_tensor_is_refused_with_the_fix(case):
    torch = pytest.importorskip("torch")
    q, k, v, _, _ = case
    table = torch.zeros(4)

    def closes_over_a_tensor(score, b, h, q_idx, kv_idx):
        return score + table[h]

    with pytest.raises(TypeError, match=r"reads `table` from its closure, a torch.Tensor.*"
                                        r"Pass it in `score_args`"):
        cpuflash.flex_attention(q, k, v, score_mod=closes_over_a_tensor)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_score_args_are_read_widened(case, dtype):
    """torch's FlexAttention code keeps its tables in the model's dtype."""
    q, k, v, table, _ = case
    if dtype == "bfloat16":
        half = table.astype(pytest.importorskip("ml_dtypes").bfloat16)
    else:
        half = table.astype(np.float16)
    out = cpuflash.flex_attention(q, k, v, score_mod=rel_bias, score_args=(half,))
    widened = half.astype(np.float32)
    assert_same_bits(out, cpuflash.flex_attention(q, k, v, score_mod=rel_bias,
                                                  score_args=(widened,)))


def test_mask_mod_must_return_a_bool(case):
    q, k, v, _, _ = case

    def returns_an_int(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    with pytest.raises(TypeError, match="mask_mod.*returns_an_int.*must return a bool"):
        cpuflash.flex_attention(q, k, v, mask_mod=returns_an_int)
    with pytest.raises(TypeError, match="must return a bool"):
        cpuflash.block_mask(returns_an_int, 1, 1, 8, 8)


def test_a_mask_mod_may_return_a_constant():
    def everything(b, h, q_idx, kv_idx):
        return True  # typed by Numba as the literal True, a kind of bool

    def nothing(b, h, q_idx, kv_idx):
        return False

    assert (cpuflash.block_mask(everything, 1, 1, 8, 8, block=4).states
            == cpuflash.BlockMask.FULL).all()
    assert (cpuflash.block_mask(nothing, 1, 1, 8, 8, block=4).states
            == cpuflash.BlockMask.EMPTY).all()


def test_block_mask_must_fit_the_call(case):
    q, k, v, _, doc = case
    b, hq, n, _ = q.shape
    bm = cpuflash.block_mask(same_doc, b, 1, n - 1, n, args=(doc,))
    with pytest.raises(ValueError, match="block_mask.*Nq = 150"):
        cpuflash.flex_attention(q, k, v, block_mask=bm)
    bm = cpuflash.block_mask(same_doc, b, 1, n, n, args=(doc,))

    def other(b, h, q_idx, kv_idx, doc):
        return q_idx >= kv_idx

    with pytest.raises(ValueError, match="mask_mod.*the function `block_mask` was built from"):
        cpuflash.flex_attention(q, k, v, block_mask=bm, mask_mod=other, mask_args=(doc,))
    with pytest.raises(TypeError, match="block_mask.*BlockMask"):
        cpuflash.flex_attention(q, k, v, block_mask=np.ones((1, 1, n, n), bool))


def test_arguments_without_their_function(case):
    q, k, v, table, _ = case
    with pytest.raises(ValueError, match="score_args.*without a `score_mod`"):
        cpuflash.flex_attention(q, k, v, score_args=(table,))
    with pytest.raises(TypeError, match="score_args.*tuple"):
        cpuflash.flex_attention(q, k, v, score_mod=rel_bias, score_args=table)


def test_a_mod_that_cannot_be_differentiated(rng, case):
    q, k, v, _, _ = case

    def rounds(score, b, h, q_idx, kv_idx):
        return float(int(score * 4.0)) / 4.0

    out, lse = cpuflash.flex_attention(q, k, v, score_mod=rounds, return_lse=True)
    with pytest.raises(TypeError, match="score_mod.*rounds.*cannot be differentiated"):
        cpuflash.flex_attention_backward(out, q, k, v, out, lse, score_mod=rounds)


# -- gradients of score_args ----------------------------------------------------------------

def rel_bias_grad(dscore, score, b, h, q_idx, kv_idx, table, dtable):
    dtable[h, q_idx - kv_idx + N_REL] += dscore
    return dscore


def dense_table_gradient(dout, q, k, v, table, **kwargs):
    """dtable from the dense float64 attention: dS = P (dO V^T - rowsum(dO O)) summed along
    each distance."""
    b, hq, n_q, _ = q.shape
    n_k = k.shape[2]
    wide = [x.astype(np.float64) for x in (dout, q, k, v)]
    bias = dense_bias(table.astype(np.float64), n_q, n_k)
    out, lse = cpuflash.attention(*wide[1:], bias=bias, return_lse=True, **kwargs)
    group = hq // k.shape[1]
    kk, vv = (np.repeat(x, group, axis=1) for x in wide[2:])
    s = np.einsum("bhqd,bhkd->bhqk", wide[1], kk) / math.sqrt(q.shape[-1]) + bias
    if kwargs.get("causal"):
        s = np.where(np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + n_k - n_q, s, -np.inf)
    p = np.exp(s - lse[..., None])
    ds = p * (np.einsum("bhqd,bhkd->bhqk", wide[0], vv)
              - np.sum(wide[0] * out, axis=-1, keepdims=True))
    dtable = np.zeros(table.shape)
    distance = np.arange(n_q)[:, None] - np.arange(n_k)[None, :] + N_REL
    for h in range(hq):
        np.add.at(dtable[h], distance, ds[:, h].sum(axis=0))
    return dtable


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_of_a_learned_table(rng, case, causal):
    q, k, v, table, _ = case
    kwargs = dict(score_mod=rel_bias, score_args=(table,), causal=causal)
    out, lse = cpuflash.flex_attention(q, k, v, return_lse=True, **kwargs)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    *grads, (dtable,) = cpuflash.flex_attention_backward(dout, q, k, v, out, lse,
                                                         score_mod_grad=rel_bias_grad, **kwargs)
    assert len(grads) == 3 and dtable.dtype == np.float32 and dtable.shape == table.shape
    expected = dense_table_gradient(dout, q, k, v, table, causal=causal)
    # float32 tiles summed into float32: a few roundings of each entry's sum of |dS|
    assert np.abs(dtable - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        *_, (again,) = cpuflash.flex_attention_backward(dout, q, k, v, out, lse,
                                                        score_mod_grad=rel_bias_grad, **kwargs)
    finally:
        numba.set_num_threads(before)
    assert_same_bits(again, dtable)


def test_score_mod_grad_needs_a_float_array(case):
    q, k, v, table, _ = case
    out, lse = cpuflash.flex_attention(q, k, v, score_mod=tanh_cap, return_lse=True)
    with pytest.raises(ValueError, match="score_args.*no float array"):
        cpuflash.flex_attention_backward(out, q, k, v, out, lse, score_mod=tanh_cap,
                                         score_mod_grad=rel_bias_grad)


# -- decoding -------------------------------------------------------------------------------

@pytest.mark.parametrize("n_new,paged", [(1, False), (5, False), (1, True)])
def test_kv_cache_calls_see_positions(rng, n_new, paged):
    """With a KV cache, q_idx is the query's position in its sequence: the mods of training
    work unchanged when decoding."""
    b, hq, hk, n_max, d = 2, 4, 2, 200, 32
    k_cache, v_cache = (rng.standard_normal((b, hk, n_max, d)).astype(np.float32)
                        for _ in range(2))
    q = rng.standard_normal((b, hq, n_new, d)).astype(np.float32)
    new_k, new_v = (rng.standard_normal((b, hk, n_new, d)).astype(np.float32) for _ in range(2))
    seqlens = np.array([150, 37])
    table = (rng.standard_normal((hq, 2 * N_REL)) * 0.5).astype(np.float32)
    doc = documents(rng, b, n_max)
    kwargs = dict(score_mod=rel_bias, score_args=(table,), mask_mod=same_doc, mask_args=(doc,))
    caches = (k_cache.copy(), v_cache.copy())
    if paged:  # pages of 16 rows, in reverse order
        pages = n_max // 16
        table_ = np.arange(b * pages)[::-1].reshape(b, pages)
        paged_caches = [np.empty((b * pages, hk, 16, d), np.float32) for _ in range(2)]
        for cache, dense in zip(paged_caches, caches):
            for e in range(b):
                for p in range(pages):
                    cache[table_[e, p]] = dense[e, :, p * 16:(p + 1) * 16]
        out = cpuflash.attention_with_kvcache(q, *paged_caches, k=new_k, v=new_v,
                                              cache_seqlens=seqlens, block_table=table_, **kwargs)
    else:
        out = cpuflash.attention_with_kvcache(q, *caches, k=new_k, v=new_v,
                                              cache_seqlens=seqlens, **kwargs)
    for e in range(b):
        n_k = seqlens[e] + n_new
        keys = np.concatenate([k_cache[e:e + 1, :, :seqlens[e]], new_k[e:e + 1]], axis=2)
        values = np.concatenate([v_cache[e:e + 1, :, :seqlens[e]], new_v[e:e + 1]], axis=2)
        positions = np.arange(n_k - n_new, n_k)
        qi, ki = positions[:, None], np.arange(n_k)[None, :]
        bias = table[:, qi - ki + N_REL][None]
        mask = (doc[e, qi] == doc[e, ki])[None, None]
        assert_close_to_reference(out[e:e + 1], q[e:e + 1], keys, values, bias=bias, mask=mask,
                                  causal=True)


@pytest.mark.parametrize("fmt", [None, "int8"])
def test_decoding_runs_the_functions_in_the_split_kv_kernel_with_every_modifier(rng, fmt):
    """One query row per head goes to the split-KV decode kernel, which applies the functions
    after softcap and ALiBi and within the window, on float and 8-bit caches, in splits."""
    from cpuflash import _call
    from cpuflash.kernels.decode import decode

    b, hq, hk, n_max, d = 2, 6, 2, 300, 32
    k_cache, v_cache = (rng.standard_normal((b, hk, n_max, d)).astype(np.float32)
                        for _ in range(2))
    if fmt is not None:
        k_cache, v_cache = (cpuflash.quantize_kv(x, fmt) for x in (k_cache, v_cache))
        keys, values = (cpuflash.dequantize_kv(x) for x in (k_cache, v_cache))
    else:
        keys, values = k_cache, v_cache
    q = rng.standard_normal((b, hq, 1, d)).astype(np.float32)
    seqlens = np.array([290, 77])
    table = (rng.standard_normal((hq, 2 * N_REL)) * 0.5).astype(np.float32)
    doc = documents(rng, b, n_max)
    slopes = rng.uniform(0.01, 0.1, hq)
    builtin = dict(softcap=20.0, alibi_slopes=slopes, window=(100, 0))
    out = cpuflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=3, score_mod=rel_bias,
        score_args=(table,), mask_mod=same_doc, mask_args=(doc,), **builtin)
    assert any(key[3] is not _call._NO_USER_TYPES for key in decode._calls)
    for e in range(b):
        n_k = seqlens[e]
        qi, ki = np.array([[n_k - 1]]), np.arange(n_k)[None, :]
        bias = table[:, qi - ki + N_REL][None]
        mask = (doc[e, qi] == doc[e, ki])[None, None]
        assert_close_to_reference(out[e:e + 1], q[e:e + 1], keys[e:e + 1, :, :n_k],
                                  values[e:e + 1, :, :n_k], bias=bias, mask=mask, causal=True,
                                  **dict(builtin, alibi_slopes=slopes[None]))


def test_decoding_a_value_row_that_mask_mod_hides_is_not_read(rng):
    """A NaN value row hidden by `mask_mod` adds nothing to the rows it is hidden from (0 *
    NaN would be NaN), and reaches those that see it."""
    def hides(b, h, q_idx, kv_idx, hidden):
        return kv_idx != hidden[h]

    k_cache, v_cache = (rng.standard_normal((1, 2, 64, 32)).astype(np.float32) for _ in range(2))
    v_cache[0, 0, 9] = np.nan  # kv head 0: query heads 0 and 1
    q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
    out = cpuflash.attention_with_kvcache(q, k_cache, v_cache, mask_mod=hides,
                                          mask_args=(np.full(4, 9),))
    mask = np.arange(64) != 9
    assert_close_to_reference(out, q, k_cache, np.nan_to_num(v_cache), mask=mask, causal=True)
    seen = cpuflash.attention_with_kvcache(q, k_cache, v_cache, mask_mod=hides,
                                           mask_args=(np.full(4, 30),))
    assert np.isnan(seen[0, :2]).all() and np.isfinite(seen[0, 2:]).all()


def test_branches_that_return_different_types(rng):
    """float32 scores minus a Python float are float64: a branch returning the score itself
    meets the other in float64, for floats in the forward and for duals in the backward."""
    def below_diagonal_minus_one(score, b, h, q_idx, kv_idx):
        if q_idx < kv_idx:
            return score - 1.0
        return score

    q, k, v = random_qkv(rng, (1, 2, 50, 16), (1, 2, 50, 16))
    bias = np.where(np.arange(50)[:, None] < np.arange(50)[None, :], -1.0, 0.0)
    bias = bias.astype(np.float32)[None, None]
    dout, got = flex_gradients(rng, q, k, v, score_mod=below_diagonal_minus_one)
    assert_gradients_like_builtin(got, dout, q, k, v, bias=bias)


@pytest.mark.slow
def test_a_new_process_loads_the_kernel_of_a_known_function():
    """The kernel with a user's function inlined is cached on disk under the function's
    digest: the same function in a new interpreter loads it, compiling nothing."""
    code = f"""
        import sys
        import numpy as np
        import cpuflash

        def shifted(score, b, h, q_idx, kv_idx):
            return score + {uuid.uuid4().int % 1000 / 1e6!r}  # new in every run of this test

        q = np.ones((1, 1, 30, 8), np.float32)
        cpuflash.flex_attention(q, q, q, score_mod=shifted)
        print(cpuflash.flex_attention(q, q, q, score_mod=shifted).sum())
    """
    first, second = run_python(code), run_python(code)
    assert first.returncode == 0 and "compiling" in first.stderr, explain(first)
    assert second.returncode == 0 and second.stdout == first.stdout, explain(second)
    assert "compiling" not in second.stderr, explain(second)
