"""The per-call plans (`cpuflash._plans`): a call with the shapes, dtypes and options of an
earlier valid one skips to the kernel, and gives exactly what the full path gives; anything that
differs, or a value that is an error, takes the full path (and its error)."""

import gc
import threading
import weakref

import numba
import numpy as np
import pytest

import cpuflash
from cpuflash import _combine, _plans, _validate

from accuracy import assert_close_to_reference
from helpers import (assert_same_bits, check_kvcache, fortran, low_precision_dtype, random_qkv,
                     strided, unaligned)


@pytest.fixture(autouse=True)
def fresh_plans():
    _plans.clear()
    before = numba.get_num_threads()
    yield
    numba.set_num_threads(before)
    _plans.clear()


@pytest.fixture
def validations(monkeypatch):
    """How many calls went through the full argument checks."""
    count = {"kvcache": 0, "attention": 0}
    for name, attr in (("kvcache", "kvcache_args"), ("attention", "attention_args")):
        full = getattr(_validate, attr)

        def counted(*args, name=name, full=full, **kwargs):
            count[name] += 1
            return full(*args, **kwargs)
        monkeypatch.setattr(_validate, attr, counted)
    return count


def uncached(call):
    """What `call` gives through the full path (no stored plan)."""
    _plans.clear()
    return call()


def decode_inputs(rng, batch=1, n_keys=64, dtype=np.float32):
    return random_qkv(rng, (batch, 9, 1, 64), (batch, 3, n_keys, 64), dtype=dtype)


def test_a_repeated_decode_call_skips_the_checks_and_gives_the_same_bits(rng, validations):
    q, k, v = decode_inputs(rng, n_keys=1024)  # 2 key splits on 2 threads: the merge runs
    first = uncached(lambda: cpuflash.attention_with_kvcache(q, k, v, return_lse=True))
    assert validations["kvcache"] == 1
    for _ in range(3):
        assert_same_bits(cpuflash.attention_with_kvcache(q, k, v, return_lse=True), first)
    assert validations["kvcache"] == 1  # the plan served the later calls
    out, lse = first
    check_kvcache(out, lse, q, k, v, [1024], causal=True)


def varied_calls(rng):
    """name -> call: decode calls that differ from the first in one keyed thing each."""
    q, k, v = decode_inputs(rng, batch=2, n_keys=300)
    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    lengths = np.array([300, 170], dtype=np.int32)
    bshd = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k, v)]
    calls = {
        "plain": lambda: cpuflash.attention_with_kvcache(q, k, v, return_lse=True),
        "float16": lambda: cpuflash.attention_with_kvcache(q16, k16, v16, return_lse=True),
        "float64": lambda: cpuflash.attention_with_kvcache(
            *(x.astype(np.float64) for x in (q, k, v)), return_lse=True),
        "fewer keys": lambda: cpuflash.attention_with_kvcache(q, k[:, :, :299], v[:, :, :299],
                                                              return_lse=True),
        "fortran": lambda: cpuflash.attention_with_kvcache(fortran(q), fortran(k), fortran(v),
                                                           return_lse=True),
        "bshd": lambda: cpuflash.attention_with_kvcache(*bshd, layout="bshd", return_lse=True),
        "not causal": lambda: cpuflash.attention_with_kvcache(q, k, v, causal=False,
                                                              return_lse=True),
        "window": lambda: cpuflash.attention_with_kvcache(q, k, v, window=(100, 0),
                                                          return_lse=True),
        "scale": lambda: cpuflash.attention_with_kvcache(q, k, v, scale=0.3, return_lse=True),
        "softcap": lambda: cpuflash.attention_with_kvcache(q, k, v, softcap=2.0,
                                                           return_lse=True),
        "splits": lambda: cpuflash.attention_with_kvcache(q, k, v, num_splits=3,
                                                          return_lse=True),
        "lengths": lambda: cpuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths,
                                                           return_lse=True),
        "length int": lambda: cpuflash.attention_with_kvcache(q, k, v, cache_seqlens=77,
                                                              return_lse=True),
        "attention": lambda: cpuflash.attention(q, k, v, causal=True, return_lse=True),
        "attention window": lambda: cpuflash.attention(q, k, v, window=(5, 5),
                                                       return_lse=True),
        "attention bshd": lambda: cpuflash.attention(*bshd, layout="bshd", causal=True,
                                                     return_lse=True),
        "attention float16": lambda: cpuflash.attention(q16, k16, v16, return_lse=True),
    }
    return calls


def forward_inputs(rng, dtype=np.float32, layout="bhsd"):
    """Several query rows: the FA-2 forward (`_run.Forward` plans)."""
    q, k, v = random_qkv(rng, (2, 6, 37, 64), (2, 3, 53, 64), d_v=48, dtype=dtype)
    if layout == "bshd":
        q, k, v = (np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k, v))
    return q, k, v


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_a_repeated_forward_call_skips_the_checks_and_gives_the_same_bits(
        rng, validations, dtype, layout):
    dtype = low_precision_dtype(dtype) if dtype in ("float16", "bfloat16") else np.dtype(dtype)
    q, k, v = forward_inputs(rng, dtype, layout)

    def call(q=q, **options):
        return cpuflash.attention(q, k, v, causal=True, layout=layout, **options)

    first = uncached(lambda: call(return_lse=True))
    assert validations["attention"] == 1
    out = np.empty_like(first[0])
    for _ in range(2):
        assert_same_bits(call(return_lse=True), first)
        assert_same_bits(call(), first[0])
        assert call(out=out) is out  # a caller's `out`, as the torch adapter passes it
        assert_same_bits(out, first[0])
    assert validations["attention"] == 1
    q2 = (q.astype(np.float32) * 3).astype(dtype)  # other values, the same key
    assert_same_bits(call(q2, return_lse=True), uncached(lambda: call(q2, return_lse=True)))
    if layout == "bhsd":
        lse = first[1]
        plain = None if dtype.itemsize > 2 else dtype
        for b in range(2):
            assert_close_to_reference(first[0][b], q[b], k[b], v[b], lse=lse[b], causal=True,
                                      plain_dtype=plain)


def test_forward_calls_that_do_not_fit_the_plan_take_the_full_path(rng):
    q, k, v = forward_inputs(rng)

    def both(make):  # after the plan, and without one
        cpuflash.attention(q, k, v, causal=True)
        got = make()
        return got, uncached(make)

    # fewer keys (not in the key), unaligned keys, strided queries
    k_unaligned, q_strided = unaligned(k), strided(q)
    for make in (lambda: cpuflash.attention(q, k[:, :, :40], v[:, :, :40], causal=True),
                 lambda: cpuflash.attention(q, k_unaligned, v, causal=True),
                 lambda: cpuflash.attention(q_strided, k, v, causal=True)):
        assert_same_bits(*both(make))
    # an `out` over the values, which two query heads read each (the full path writes a
    # copy, then copies it over them)
    q53 = rng.standard_normal((2, 6, 53, 64)).astype(np.float32)
    out = np.zeros((2, 6, 53, 48), dtype=np.float32)
    out[:, :3] = v
    values = out[:, :3]
    expected = cpuflash.attention(q53, k, v.copy(), causal=True)
    cpuflash.attention(q53, k, values, causal=True)
    assert cpuflash.attention(q53, k, values, causal=True, out=out) is out
    assert_same_bits(out, expected)
    # an `out` of another dtype, or read-only: the full path's errors
    with pytest.raises(TypeError, match="`out` must have dtype float32"):
        cpuflash.attention(q, k, v, causal=True, out=np.empty((2, 6, 37, 48)))
    frozen = np.empty((2, 6, 37, 48), dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="`out` must be writeable"):
        cpuflash.attention(q, k, v, causal=True, out=frozen)


def test_a_forward_plan_keeps_no_array_of_the_call_alive(rng):
    q, k, v = forward_inputs(rng)
    out = np.empty((2, 6, 37, 48), dtype=np.float32)
    cpuflash.attention(q, k, v, causal=True, out=out, return_lse=True)
    refs = [weakref.ref(x) for x in (q, k, v, out)]
    del q, k, v, out
    gc.collect()
    assert len(_plans._entries) == 1
    assert all(ref() is None for ref in refs)


def backward_inputs(rng, dtype=np.float32, layout="bhsd", **options):
    """q, k, v as `forward_inputs`, and the forward's out and lse with a random dout."""
    q, k, v = forward_inputs(rng, dtype, layout)
    out, lse = cpuflash.attention(q, k, v, layout=layout, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(dtype)
    return dout, q, k, v, out, lse


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_a_repeated_backward_call_skips_the_checks_and_gives_the_same_bits(
        rng, validations, dtype, layout):
    dtype = low_precision_dtype(dtype) if dtype in ("float16", "bfloat16") else np.dtype(dtype)
    dout, q, k, v, out, lse = backward_inputs(rng, dtype, layout, causal=True)

    def call(dout=dout, **grads):
        return cpuflash.attention_backward(dout, q, k, v, out, lse, causal=True, layout=layout,
                                           **grads)

    first = uncached(call)
    checked = validations["attention"]
    given = {name: np.empty_like(x) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    for _ in range(2):
        assert_same_bits(call(), first)
        got = call(**given)  # the caller's gradients, as the torch adapter passes them
        assert all(g is x for g, x in zip(got, given.values()))
        assert_same_bits(got, first)
    assert validations["attention"] == checked  # the plan served the later calls
    dout2 = (dout.astype(np.float32) * 3).astype(dtype)  # other values, the same key
    assert_same_bits(call(dout2), uncached(lambda: call(dout2)))


def test_backward_calls_that_do_not_fit_the_plan_take_the_full_path(rng):
    dout, q, k, v, out, lse = backward_inputs(rng)

    def both(make):  # after the plan, and without one
        cpuflash.attention_backward(dout, q, k, v, out, lse)
        got = make()
        return got, uncached(make)

    q_unaligned, q_strided = unaligned(q), strided(q)
    for name, make in (
            ("unaligned q", lambda: cpuflash.attention_backward(dout, q_unaligned, k, v, out,
                                                                lse)),
            ("strided q", lambda: cpuflash.attention_backward(dout, q_strided, k, v, out, lse)),
            ("lse float64", lambda: cpuflash.attention_backward(dout, q, k, v, out,
                                                                lse.astype(np.float64)))):
        assert_same_bits(*both(make), name)
    # gradients the kernel cannot write in place: over an input it reads (dq=q), unaligned,
    # dk and dv sharing one buffer (the full path writes copies, then copies them over)
    expected = cpuflash.attention_backward(dout, q, k, v, out, lse)
    q_copy = q.copy()
    assert cpuflash.attention_backward(dout, q_copy, k, v, out, lse, dq=q_copy)[0] is q_copy
    assert_same_bits(q_copy, expected[0], "dq over q")
    numba.set_num_threads(1)  # (the fixture restores the count)
    q_copy = q.copy()  # dk of the first kv head over the last query rows, read after it
    dk = q_copy.reshape(-1)[::-1][:k.size].reshape(k.shape)
    cpuflash.attention_backward(dout, q_copy, k, v, out, lse)
    assert cpuflash.attention_backward(dout, q_copy, k, v, out, lse, dk=dk)[1] is dk
    assert_same_bits(dk, expected[1], "dk over q")
    assert_same_bits(cpuflash.attention_backward(dout, q, k, v, out, lse, dq=q_unaligned)[0],
                     expected[0], "unaligned dq")
    both_kv = np.full((2, 3, 53, 112), np.nan, dtype=np.float32)
    got = cpuflash.attention_backward(dout, q, k, v, out, lse, dk=both_kv[..., :64],
                                      dv=both_kv[..., 64:])
    assert_same_bits(got, expected, "dk and dv in one buffer")
    assert_same_bits((both_kv[..., :64], both_kv[..., 64:]), expected[1:])
    # a gradient of another dtype, or read-only: the full path's errors
    with pytest.raises(TypeError, match="`dq` must have dtype float32"):
        cpuflash.attention_backward(dout, q, k, v, out, lse, dq=np.empty(q.shape))
    frozen = np.empty_like(k)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="`dk` must be writeable"):
        cpuflash.attention_backward(dout, q, k, v, out, lse, dk=frozen)


def test_a_backward_plan_keeps_no_array_of_the_call_alive(rng):
    arrays = list(backward_inputs(rng))
    grads = [np.empty_like(x) for x in arrays[1:4]]
    cpuflash.attention_backward(*arrays, dq=grads[0], dk=grads[1], dv=grads[2])
    refs = [weakref.ref(x) for x in arrays + grads]
    del arrays, grads
    gc.collect()
    assert [key[0] for key in _plans._entries] == ["attention", "backward"]
    assert all(ref() is None for ref in refs)


def test_backward_calls_from_several_python_threads_share_a_plan(rng):
    dout, q, k, v, out, lse = backward_inputs(rng)
    douts = [(dout * (i + 1)).astype(np.float32) for i in range(4)]
    expected = [cpuflash.attention_backward(x, q, k, v, out, lse) for x in douts]
    _plans.clear()
    results = in_threads(lambda i: cpuflash.attention_backward(douts[i], q, k, v, out, lse))
    assert len(_plans._entries) == 1
    for i in range(4):
        assert_same_bits(results[i], expected[i], f"thread {i}")


def test_a_plans_launch_follows_the_thread_count(rng):
    """A stored plan keeps its kernel's launch (work items dealt to the threads) for the thread
    count it was made for, and makes a new one when the count changes."""
    dout, q, k, v, out, lse = backward_inputs(rng, causal=True)
    expected = {}
    for i, threads in enumerate((2, 1, 2)):  # (a backward's first call stores its plan)
        numba.set_num_threads(threads)
        got = (cpuflash.attention(q, k, v, causal=True, return_lse=True)
               + cpuflash.attention_backward(dout, q, k, v, out, lse, causal=True))
        assert_same_bits(got, expected.setdefault("bits", got), f"threads={threads}")
        for plan in _plans._entries.values():
            if i == 0 and plan.launch is None:
                continue
            (count, *_), launch = plan.launch
            assert count == threads
            chunk_ptr = launch[2] if plan.__class__.__name__ == "Forward" else launch[1][2]
            assert len(chunk_ptr) - 1 <= threads


def test_a_plan_is_never_reused_for_a_call_that_differs(rng):
    calls = varied_calls(rng)
    expected = {}
    for threads in (1, 2):
        numba.set_num_threads(threads)
        expected[threads] = {name: uncached(call) for name, call in calls.items()}
    _plans.clear()
    order = list(calls) * 2
    rng.shuffle(order)
    for i, name in enumerate(order):  # every call, warm, among the others, on both counts
        threads = 1 + i % 2
        numba.set_num_threads(threads)
        assert_same_bits(calls[name](), expected[threads][name], f"{name} threads={threads}")
    # each got a plan of its own (so the cached path was taken), but for "fortran": strides
    # decide nothing before the kernel, which reads them itself, and "fewer keys": the length
    # of a cache that is attended to whole is the call's; both share "plain"'s
    assert len(_plans._entries) == len(calls) - 2


@pytest.mark.parametrize("kind", ["kvcache", "attention"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_a_cache_that_grows_a_key_a_step_keeps_its_plan(rng, validations, kind, layout):
    """As transformers decodes: every step attends to all keys of a cache one key longer, read
    as views of a larger buffer."""
    q, k_all, v_all = decode_inputs(rng, batch=2, n_keys=80)
    if layout == "bshd":
        q, k_all, v_all = (np.swapaxes(x, 1, 2) for x in (q, k_all, v_all))
    axis = 1 if layout == "bshd" else 2

    def step(n):
        k, v = (np.take(x, np.arange(n), axis=axis) if n % 2 else
                x[:, :n] if layout == "bshd" else x[:, :, :n] for x in (k_all, v_all))
        if kind == "kvcache":
            return cpuflash.attention_with_kvcache(q, k, v, layout=layout, return_lse=True)
        return cpuflash.attention(q, k, v, layout=layout, causal=True, return_lse=True)

    got = [step(n) for n in range(60, 80)]
    assert validations[kind] == 1  # one full check, then the plan, whatever the length
    for n, result in zip(range(60, 80), got):
        assert_same_bits(result, uncached(lambda: step(n)), f"{n} keys")
    k, v = (x[:, :70] if layout == "bshd" else x[:, :, :70] for x in (k_all, v_all))
    v_short = v[:, :69] if layout == "bshd" else v[:, :, :69]
    step(60)
    with pytest.raises(ValueError, match="has 69 keys but"):  # the full path names it
        if kind == "kvcache":
            cpuflash.attention_with_kvcache(q, k, v_short, layout=layout)
        else:
            cpuflash.attention(q, k, v_short, layout=layout, causal=True)


def test_a_changed_length_of_the_same_shapes_is_still_checked_and_used(rng):
    q, k, v = decode_inputs(rng, batch=2, n_keys=200)
    lengths = np.array([200, 50], dtype=np.int32)
    cpuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths)
    shorter = np.array([30, 199], dtype=np.int64)
    out, lse = cpuflash.attention_with_kvcache(q, k, v, cache_seqlens=shorter, return_lse=True)
    check_kvcache(out, lse, q, k, v, shorter, causal=True)
    assert_same_bits((out, lse), uncached(lambda: cpuflash.attention_with_kvcache(
        q, k, v, cache_seqlens=shorter, return_lse=True)))


@pytest.mark.parametrize("bad, exc, match", [
    (dict(cache_seqlens=np.array([201, 3])), ValueError, r"`cache_seqlens` must lie in \[0, 200\]"),
    (dict(cache_seqlens=np.array([-1, 3])), ValueError, r"`cache_seqlens` must lie in"),
    (dict(cache_seqlens=201), ValueError, r"`cache_seqlens` must lie in \[0, 200\]"),
    (dict(cache_seqlens=np.array([1.0, 3.0])), TypeError, r"`cache_seqlens` must be an integer"),
    (dict(cache_seqlens=np.array([1, 2, 3])), ValueError, r"`cache_seqlens` must have shape"),
    (dict(cache_seqlens=True), TypeError, r"`cache_seqlens` must be an array, got bool"),
    (dict(scale=float("nan")), ValueError, r"`scale` must be finite"),
    (dict(scale=True), TypeError, r"`scale` must be a real number"),
    (dict(causal=1), TypeError, r"`causal` must be True or False"),
    (dict(return_lse=0), TypeError, r"`return_lse` must be True or False"),
    (dict(window=(True, 0)), ValueError, r"`window` must be a pair of ints"),
    (dict(window=(-2, 0)), ValueError, r"`window` sides must be >= -1"),
    (dict(softcap=-1.0), ValueError, r"`softcap` must be finite and >= 0"),
    (dict(num_splits=-1), ValueError, r"`num_splits` must be >= 0"),
    (dict(layout="BHSD"), ValueError, r"`layout` must be one of"),
])
def test_errors_are_raised_after_a_valid_call_with_the_same_shapes(rng, bad, exc, match):
    q, k, v = decode_inputs(rng, batch=2, n_keys=200)
    valid = dict(cache_seqlens=np.array([200, 3]), scale=1, causal=True, return_lse=False,
                 window=(1, 0), softcap=0.0, num_splits=0, layout="bhsd")
    for name, value in bad.items():  # the valid call has the same types where they are valid
        if name == "cache_seqlens" and np.ndim(value) == 0 and value is not True:
            valid[name] = 7
    with pytest.raises(exc, match=match) as fresh:  # no plan stored
        cpuflash.attention_with_kvcache(q, k, v, **dict(valid, **bad))
    cpuflash.attention_with_kvcache(q, k, v, **valid)
    cpuflash.attention_with_kvcache(q, k, v, **valid)  # served by the plan
    for _ in range(2):
        with pytest.raises(exc) as after_plan:
            cpuflash.attention_with_kvcache(q, k, v, **dict(valid, **bad))
        assert str(after_plan.value) == str(fresh.value)


def test_attention_errors_after_a_valid_call(rng):
    q, k, v = decode_inputs(rng)
    cpuflash.attention(q, k, v, causal=True)
    cpuflash.attention(q, k, v, causal=True)
    with pytest.raises(TypeError, match=r"`causal` must be True or False"):
        cpuflash.attention(q, k, v, causal=np.float32(1))
    with pytest.raises(ValueError, match=r"`scale` must be finite"):
        cpuflash.attention(q, k, v, causal=True, scale=float("inf"))
    with pytest.raises(TypeError, match=r"must share one dtype"):
        cpuflash.attention(q, k, v.astype(np.float64), causal=True)


def test_unaligned_and_strided_inputs_after_a_plan(rng):
    """The same shapes with other strides or unaligned memory give the full path's bits."""
    q, k, v = decode_inputs(rng, n_keys=100)
    cpuflash.attention_with_kvcache(q, k, v)
    for kk, vv in [(unaligned(k), v), (k, strided(v)), (k[..., ::-1, :][..., ::-1, :], v)]:
        got = cpuflash.attention_with_kvcache(q, kk, vv, return_lse=True)
        assert_same_bits(got, uncached(lambda: cpuflash.attention_with_kvcache(
            q, kk, vv, return_lse=True)))
        assert_same_bits(got[0], cpuflash.attention_with_kvcache(q, k, v))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n_keys", [1, 64, 1024])
def test_attention_with_few_query_rows_is_exact_and_independent_of_threads(rng, dtype, n_keys):
    dtype = np.float32 if dtype == "float32" else low_precision_dtype(dtype)
    q, k, v = decode_inputs(rng, batch=2, n_keys=n_keys, dtype=dtype)
    results = []
    for threads in (1, 2, 1):
        numba.set_num_threads(threads)
        results.append(cpuflash.attention(q, k, v, causal=True, return_lse=True))
    for result in results[1:]:
        assert_same_bits(result, results[0])
    out, lse = results[0]
    assert out.dtype == dtype and lse.dtype == np.float32
    plain = None if dtype == np.float32 else dtype
    for b in range(2):
        assert_close_to_reference(out[b], q[b], k[b], v[b], lse=lse[b], causal=True,
                                  plain_dtype=plain)


def in_threads(call, n_threads=4, repeats=20):
    """``call(i)`` `repeats` times on each of `n_threads` Python threads at once (thread i);
    the last result of each thread, after checking that none raised."""
    results, errors = {}, []

    def work(i):
        try:
            for _ in range(repeats):
                results[i] = call(i)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return [results[i] for i in range(n_threads)]


def test_calls_from_several_python_threads_share_the_plans(rng):
    q, k, v = decode_inputs(rng, batch=4, n_keys=700)
    lengths = [np.array([700, 3, 500, 699 - i], dtype=np.int32) for i in range(4)]
    expected = [cpuflash.attention_with_kvcache(q, k, v, cache_seqlens=s, return_lse=True)
                for s in lengths]
    _plans.clear()
    results = in_threads(lambda i: cpuflash.attention_with_kvcache(
        q, k, v, cache_seqlens=lengths[i], return_lse=True))
    for i in range(4):
        assert_same_bits(results[i], expected[i], f"thread {i}")


def test_forward_calls_from_several_python_threads_share_a_plan(rng):
    q, k, v = forward_inputs(rng)
    queries = [(q * (i + 1)).astype(np.float32) for i in range(4)]
    expected = [cpuflash.attention(x, k, v, causal=True, return_lse=True) for x in queries]
    _plans.clear()
    outs = [np.empty((2, 6, 37, 48), dtype=np.float32) for _ in queries]
    results = in_threads(lambda i: cpuflash.attention(queries[i], k, v, causal=True,
                                                      return_lse=True, out=outs[i]))
    assert len(_plans._entries) == 1
    for i in range(4):
        assert_same_bits(results[i], expected[i], f"thread {i}")


def test_torch_tensors_take_the_plan_and_grad_is_still_refused(rng, validations):
    torch = pytest.importorskip("torch", reason="torch tensors are optional inputs")
    q, k, v = decode_inputs(rng, n_keys=80)
    expected = cpuflash.attention_with_kvcache(q, k, v)
    tensors = [torch.from_numpy(x) for x in (q, k, v)]
    for _ in range(2):
        assert_same_bits(cpuflash.attention_with_kvcache(*tensors), expected)
    assert validations["kvcache"] == 1
    with pytest.raises(TypeError, match=r"`q` is a torch tensor that requires grad"):
        cpuflash.attention_with_kvcache(tensors[0].clone().requires_grad_(), *tensors[1:])


def test_stored_plans_are_read_only_and_bounded(rng):
    q, k, v = decode_inputs(rng)
    cpuflash.attention_with_kvcache(q, k, v)
    (setup,) = _plans._entries.values()
    flat = setup.flat  # the pipeline's arrays (`_pipeline.kernel_args`)
    for array in (setup.block_table, setup.full_keys, flat.alibi, flat.bias, flat.bias_map,
                  flat.mask, flat.mask_map, flat.sinks):
        assert not array.flags.writeable
    for i in range(_plans.MAX_ENTRIES + 10):
        _plans.put(("test", i), None)
    assert len(_plans._entries) <= _plans.MAX_ENTRIES
    assert ("test", _plans.MAX_ENTRIES + 9) in _plans._entries


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_compiled_merge_agrees_with_merge_states(rng, dtype):
    outs = rng.standard_normal((3, 2, 4, 5, 16)).astype(dtype)
    lses = rng.standard_normal((3, 2, 4, 5)).astype(dtype) * 20
    lses[:, 0, 0, 0] = -np.inf  # no part saw a key
    lses[1, 0, 0, 1] = -np.inf  # one part saw none, its output is ignored...
    outs[1, 0, 0, 1] = np.nan  # ...even where it is NaN
    lses[0, 0, 0, 2] = np.nan  # NaN propagates
    outs[2, 0, 0, 3, 0] = np.inf  # inf in one part's output
    out, lse = np.empty_like(outs[0]), np.empty_like(lses[0])
    _combine.merge_into(outs, lses, out, lse)
    want_out, want_lse = _combine.merge(outs, lses)
    np.testing.assert_allclose(out, want_out, rtol=1e-5 if dtype == np.float32 else 1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5 if dtype == np.float32 else 1e-12)
    assert np.all(out[0, 0, 0] == 0) and lse[0, 0, 0] == -np.inf
    assert np.isnan(lse[0, 0, 2]) and np.isnan(out[0, 0, 2]).all()
    assert np.isfinite(out[0, 0, 1]).all()


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("lengths", ["array", "int"])
def test_decoding_steps_with_new_keys_write_and_attend_as_the_full_path(
        rng, layout, lengths, validations):
    """flash-attn's decoding loop: each step writes one new key into a preallocated cache and
    attends to it; the plan serves every step after the first."""
    batch, n_max = 2, 40
    q, k_cache, v_cache = decode_inputs(rng, batch=batch, n_keys=n_max)
    new = rng.standard_normal((6, 2, batch, 3, 1, 64)).astype(np.float32)  # step, k/v, ...
    start = np.array([5, 17], dtype=np.int32) if lengths == "array" else 11

    def steps(k_cache, v_cache, fresh):
        results = []
        for step in range(6):
            if fresh:
                _plans.clear()
            seqlens = start + step
            args = [q, k_cache, v_cache, new[step, 0], new[step, 1]]
            if layout == "bshd":
                args = [np.swapaxes(x, 1, 2) for x in args]
            results.append(cpuflash.attention_with_kvcache(
                *args[:3], k=args[3], v=args[4], cache_seqlens=seqlens, layout=layout,
                return_lse=True))
        return results

    caches = [x.copy() for x in (k_cache, v_cache)]
    expected = steps(*caches, fresh=True)
    assert validations["kvcache"] == 6
    got_caches = [x.copy() for x in (k_cache, v_cache)]
    _plans.clear()
    got = steps(*got_caches, fresh=False)
    assert validations["kvcache"] == 7  # one full check, then the plan
    for step in range(6):
        assert_same_bits(got[step], expected[step], f"step {step}")
    assert_same_bits(tuple(got_caches), tuple(caches), "the caches")
    written = np.broadcast_to(np.asarray(start) + 6, (batch,))
    if layout == "bhsd":
        out, lse = got[-1]
        check_kvcache(out, lse, q, *got_caches, written, causal=True)


def test_new_keys_errors_after_a_plan_leave_the_cache_unchanged(rng):
    q, k_cache, v_cache = decode_inputs(rng, batch=2, n_keys=30)
    k_new, v_new = rng.standard_normal((2, 2, 3, 1, 64)).astype(np.float32)
    lengths = np.array([3, 4], dtype=np.int32)
    for _ in range(2):
        cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                        cache_seqlens=lengths)
    before = k_cache.copy(), v_cache.copy()
    with pytest.raises(ValueError, match=r"`cache_seqlens` must lie in \[0, 29\]"):
        cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                        cache_seqlens=np.array([3, 30]))
    with pytest.raises(ValueError, match=r"`cache_seqlens` must lie in \[0, 29\]"):
        cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new)
    readonly_cache = k_cache.copy()
    readonly_cache.flags.writeable = False
    with pytest.raises(ValueError, match=r"`k_cache` is read-only"):
        cpuflash.attention_with_kvcache(q, readonly_cache, v_cache, k=k_new, v=v_new,
                                        cache_seqlens=lengths)
    with pytest.raises(TypeError, match=r"`k` and `v` must have the dtype of the cache"):
        cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new.astype(np.float64),
                                        v=v_new, cache_seqlens=lengths)
    with pytest.raises(ValueError, match=r"`k` and `v` must be given together"):
        cpuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, cache_seqlens=lengths)
    assert_same_bits((k_cache, v_cache), before, "the caches after the errors")
