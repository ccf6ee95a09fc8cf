"""Reliability: Python threads, fork, determinism, NaN/inf, bad input, odd strides, long
sequences, memory and a read-only install.

Everything that forks, measures the peak memory or installs the package runs in a fresh
interpreter (`subprocess`), so the pytest process itself never forks with live TBB threads and
its own allocations do not blur the measurement.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numba
import numpy as np
import pytest

import cpuflash

from accuracy import assert_close_to_reference, random_qkv

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent


# -- helpers --------------------------------------------------------------------------------------

def as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


def assert_same_bits(got, expected, what=""):
    """Every array of two results has the same dtype, shape and bytes (NaNs included)."""
    got, expected = as_tuple(got), as_tuple(expected)
    assert len(got) == len(expected), what
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]: {a.dtype}{a.shape} " \
                                                          f"vs {b.dtype}{b.shape}"
        if a.tobytes() != b.tobytes():
            bits = f"u{a.itemsize}"
            diff = np.flatnonzero(a.reshape(-1).view(bits) != b.reshape(-1).view(bits))
            pytest.fail(f"{what}[{i}]: {diff.size} of {a.size} elements differ in their bits, "
                        f"first at flat index {diff[0]}: {a.reshape(-1)[diff[0]]!r} vs "
                        f"{b.reshape(-1)[diff[0]]!r}")


def heads_first(x):
    return np.swapaxes(x, 0, 1)


def packed(rng, lens_q, lens_k, hq=4, hk=2, d=40, d_v=24, dtype=np.float32):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, k, v = random_qkv(rng, (cu_q[-1], hq, d), (cu_k[-1], hk, d), d_v=d_v, dtype=dtype)
    return q, k, v, cu_q, cu_k


def check_varlen(out, lse, q, k, v, cu_q, cu_k, alibi_slopes=None, **kwargs):
    """Each packed sequence against the reference."""
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        slopes = None if alibi_slopes is None else (
            alibi_slopes if alibi_slopes.ndim == 1 else alibi_slopes[b])
        assert_close_to_reference(heads_first(out[rows]), heads_first(q[rows]),
                                  heads_first(k[keys]), heads_first(v[keys]),
                                  lse=None if lse is None else lse[:, rows],
                                  alibi_slopes=slopes, **kwargs)


def check_kvcache(out, lse, q, k_cache, v_cache, n_keys, **kwargs):
    """Each batch entry against the reference over its first n_keys[b] cached keys."""
    for b in range(q.shape[0]):
        n = n_keys[b]
        assert_close_to_reference(out[b], q[b], k_cache[b, :, :n], v_cache[b, :, :n],
                                  lse=None if lse is None else lse[b], **kwargs)


def run_python(code, *, env=None, timeout=240, cwd=None, prefix=()):
    """Run `code` in a fresh interpreter; returns the CompletedProcess (never raises on rc)."""
    return subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def explain(result):
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


# -- the calls that threads, fork and thread counts must not change -------------------------------

def workload(seed=7):
    """name -> zero-argument call of a public entry point, on fixed random inputs.

    Sizes are small but span several work items and query/key blocks. Calls that write new
    keys into a cache write into a fresh copy and return it, so they can be repeated.
    """
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, (2, 4, 150, 40), (2, 2, 170, 40), d_v=24)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    bias = rng.standard_normal((150, 170)).astype(np.float32)
    slopes = rng.uniform(0.01, 0.2, 4).astype(np.float32)
    vq, vk, vv, cu_q, cu_k = packed(rng, [3, 0, 100, 47], [10, 5, 100, 120])
    dq = rng.standard_normal((2, 4, 1, 40)).astype(np.float32)
    pq = rng.standard_normal((2, 4, 20, 40)).astype(np.float32)
    k_cache = rng.standard_normal((2, 2, 300, 40)).astype(np.float32)
    v_cache = rng.standard_normal((2, 2, 300, 24)).astype(np.float32)
    new_k = rng.standard_normal((2, 2, 1, 40)).astype(np.float32)
    new_v = rng.standard_normal((2, 2, 1, 24)).astype(np.float32)
    seqlens = np.array([50, 299], np.int32)

    def with_new_keys():
        kc, vc = k_cache.copy(), v_cache.copy()
        out, lse = cpuflash.attention_with_kvcache(dq, kc, vc, k=new_k, v=new_v,
                                                   cache_seqlens=seqlens - 1, num_splits=2,
                                                   return_lse=True)
        return out, lse, kc, vc

    return {
        "attention": lambda: cpuflash.attention(q, k, v, causal=True, window=(60, -1),
                                                bias=bias, alibi_slopes=slopes,
                                                return_lse=True),
        "attention_f64": lambda: cpuflash.attention(q64, k64, v64, softcap=5.0, return_lse=True),
        "varlen": lambda: cpuflash.attention_varlen(vq, vk, vv, cu_q, cu_k, causal=True,
                                                    return_lse=True),
        "kvcache_decode": lambda: cpuflash.attention_with_kvcache(
            dq, k_cache, v_cache, cache_seqlens=seqlens, num_splits=3, return_lse=True),
        "kvcache_prefill": lambda: cpuflash.attention_with_kvcache(
            pq, k_cache, v_cache, cache_seqlens=seqlens, num_splits=1, return_lse=True),
        "kvcache_new_keys": with_new_keys,
    }


def digest(result):
    h = hashlib.sha256()
    for x in as_tuple(result):
        h.update(str((x.dtype, x.shape)).encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


# -- Python threads -------------------------------------------------------------------------------

def test_calls_from_many_python_threads_at_once_give_the_serial_bits():
    calls = workload()
    expected = {name: call() for name, call in calls.items()}
    names = list(calls)
    n_threads, repeats = 8, 3
    barrier = threading.Barrier(n_threads)
    results, errors = {}, []

    def worker(t):
        try:
            barrier.wait(timeout=60)
            for r in range(repeats):
                for i in range(len(names)):
                    name = names[(t + i) % len(names)]  # threads start on different calls
                    results[t, r, name] = calls[name]()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((t, repr(exc)))

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not any(thread.is_alive() for thread in threads), "a thread hangs"
    assert not errors, errors
    assert len(results) == n_threads * repeats * len(names)
    for (t, r, name), got in results.items():
        assert_same_bits(got, expected[name], f"thread {t} repeat {r} {name}")


# -- fork -----------------------------------------------------------------------------------------

FORK_SCRIPT = """
    import os, sys, time
    sys.path.insert(0, {tests_dir!r})
    from test_reliability import workload, digest

    def run_all():
        return {{name: digest(call()) for name, call in workload().items()}}

    parent = run_all()  # the parent's thread pool is up (TBB workers live) before the fork
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.close(read_end)
            child = run_all()
            os.write(write_end, repr(sorted(child.items())).encode())
            code = 0 if child == parent else 4
        finally:
            os._exit(code)
    os.close(write_end)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hangs")
            sys.exit(5)
        time.sleep(0.05)
    reported = os.read(read_end, 1 << 20).decode()
    code = os.waitstatus_to_exitcode(status)
    print("child exit", code)
    if code != 0:
        print("parent", sorted(parent.items()))
        print("child ", reported)
        sys.exit(6)
    print("ok")
"""


def test_kernels_work_in_a_forked_child():
    result = run_python(FORK_SCRIPT.format(tests_dir=str(TESTS_DIR)), timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, explain(result)


POOL_SCRIPT = """
    import multiprocessing as mp
    import numpy as np
    import cpuflash

    def call(seed):
        rng = np.random.default_rng(seed)
        q, k, v = (rng.standard_normal((2, 3, 97, 32)).astype(np.float32) for _ in range(3))
        return cpuflash.attention(q, k, v, causal=True).tobytes()

    if __name__ == "__main__":
        expected = [call(seed) for seed in range(4)]  # parent's threads live before the fork
        with mp.get_context("fork").Pool(2) as pool:
            got = pool.map_async(call, range(4)).get(timeout=120)
        assert got == expected, "pool results differ from the parent's"
        print("ok")
"""


def test_multiprocessing_fork_pool(tmp_path):
    script = tmp_path / "pool.py"  # a file, so the pool's workers can find `call`
    script.write_text(textwrap.dedent(POOL_SCRIPT))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, explain(result)


# -- determinism across runs and thread counts ----------------------------------------------------

def determinism_cases():
    """name -> zero-argument call. One head and 300 rows: the tile chooser shrinks `block_q`
    when there are fewer work items than twice the threads (240 rows with 1 thread, 72 with 2),
    so thread counts really change the schedule."""
    rng = np.random.default_rng(11)
    cases = {}
    for dtype in (np.float32, np.float64, np.float16):
        q, k, v = random_qkv(rng, (1, 1, 300, 40), (1, 1, 333, 40), d_v=24, dtype=dtype)
        n = np.dtype(dtype).name
        bias = rng.standard_normal((300, 333)).astype(np.float32)
        mask = rng.random((300, 333)) < 0.8
        slopes = rng.uniform(0.01, 0.3, 1).astype(np.float32)
        sinks = rng.standard_normal(1).astype(np.float32)
        for what, kwargs in {"plain": {}, "causal": dict(causal=True),
                             "window": dict(window=(40, 7)), "alibi": dict(alibi_slopes=slopes),
                             "bias": dict(bias=bias), "mask": dict(mask=mask),
                             "sinks": dict(sinks=sinks, causal=True),
                             "softcap": dict(softcap=3.0)}.items():
            cases[f"attention-{what}-{n}"] = (
                lambda q=q, k=k, v=v, kw=kwargs: cpuflash.attention(q, k, v, return_lse=True,
                                                                    **kw))
    for dtype in (np.float32, np.float16):  # rows of whole vectors: packed and written as such
        q, k, v = random_qkv(rng, (1, 1, 300, 64), (1, 1, 333, 64), d_v=64, dtype=dtype)
        bias = rng.standard_normal((300, 333)).astype(np.float32)
        for what, kwargs in {"causal": dict(causal=True), "window": dict(window=(40, 7)),
                             "bias": dict(bias=bias)}.items():
            cases[f"attention-{what}-{np.dtype(dtype).name}-d64"] = (
                lambda q=q, k=k, v=v, kw=kwargs: cpuflash.attention(q, k, v, return_lse=True,
                                                                    **kw))
    vq, vk, vv, cu_q, cu_k = packed(rng, [290, 3, 0, 17], [300, 5, 9, 200])
    cases["varlen"] = lambda: cpuflash.attention_varlen(vq, vk, vv, cu_q, cu_k, causal=True,
                                                        window=(100, -1), return_lse=True)
    oq, ok, ov, o_cu_q, o_cu_k = packed(rng, [300], [333], hq=1, hk=1)
    cases["varlen-one-sequence"] = lambda: cpuflash.attention_varlen(
        oq, ok, ov, o_cu_q, o_cu_k, causal=True, return_lse=True)
    cases["varlen-one-sequence-window"] = lambda: cpuflash.attention_varlen(
        oq, ok, ov, o_cu_q, o_cu_k, window=(40, 7), return_lse=True)
    dq = rng.standard_normal((1, 4, 1, 40)).astype(np.float32)
    pq = rng.standard_normal((1, 4, 40, 40)).astype(np.float32)
    k_cache = rng.standard_normal((1, 1, 2000, 40)).astype(np.float32)
    v_cache = rng.standard_normal((1, 1, 2000, 24)).astype(np.float32)
    for splits in (1, 3):
        for name, qq in (("decode", dq), ("prefill", pq)):
            cases[f"kvcache-{name}-splits{splits}"] = (
                lambda qq=qq, s=splits: cpuflash.attention_with_kvcache(
                    qq, k_cache, v_cache, cache_seqlens=np.array([1900], np.int32),
                    num_splits=s, return_lse=True))
    # cache rows read in place: GQA groups of 3 rows (the 4-row micro-kernels with a short group)
    gq = rng.standard_normal((1, 6, 1, 64)).astype(np.float32)
    gk = rng.standard_normal((1, 2, 2000, 64)).astype(np.float32)
    gv = rng.standard_normal((1, 2, 2000, 128)).astype(np.float32)
    for splits in (1, 3):
        cases[f"kvcache-in-place-splits{splits}"] = (
            lambda s=splits: cpuflash.attention_with_kvcache(gq, gk, gv, num_splits=s,
                                                             return_lse=True))
    return cases


DETERMINISM_CASES = determinism_cases()


@pytest.fixture
def restore_num_threads():
    before = numba.get_num_threads()
    yield
    numba.set_num_threads(before)


@pytest.mark.parametrize("name", list(DETERMINISM_CASES))
def test_bits_do_not_depend_on_runs_or_thread_count(name, restore_num_threads):
    call = DETERMINISM_CASES[name]
    counts = sorted({1, 2, numba.config.NUMBA_NUM_THREADS} & set(
        range(1, numba.config.NUMBA_NUM_THREADS + 1)))
    numba.set_num_threads(counts[0])
    expected = call()
    for n in counts:
        numba.set_num_threads(n)
        for run in range(2):
            assert_same_bits(call(), expected, f"{name} threads={n} run={run}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("options", [dict(window=(5, 0)), dict(window=(40, 7)),
                                     dict(causal=True, window=(30, -1)), dict(causal=True),
                                     dict(window=(-1, 3))])
def test_bits_do_not_depend_on_the_query_block(monkeypatch, dtype, options):
    """Every `block_q` that the tile chooser picks for some thread count gives the same bits,
    with narrow windows (one band block per tile) and wide ones, and with a value row holding
    inf, which reaches the rows of whichever 6-row groups sum over it."""
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, (1, 2, 230, 40), (1, 1, 250, 40), d_v=24, dtype=dtype)
    v[0, 0, 120, 5] = np.inf
    split = cpuflash.tiling.split_for_threads
    start = cpuflash.choose_tiles(40, dtype)
    block_qs = sorted({split(start, 230, 2, threads).block_q for threads in (1, 2, 3, 5, 16, 64)})
    assert len(block_qs) >= 3, block_qs
    results = []
    for block_q in block_qs:  # each thread count's choice, on whatever threads this machine has
        monkeypatch.setattr(cpuflash.tiling, "split_for_threads",
                            lambda tiles, *args, block_q=block_q: cpuflash.TileConfig(
                                block_q, tiles.block_k))
        results.append(cpuflash.attention(q, k, v, return_lse=True, **options))
    for block_q, result in zip(block_qs[1:], results[1:]):
        assert_same_bits(result, results[0], f"block_q={block_q} vs {block_qs[0]}")
    assert np.isnan(results[0][0]).any() and not np.isnan(results[0][0]).all()


def test_more_threads_than_cores_give_the_same_bits(restore_num_threads):
    """A fresh interpreter with a pool of 16 Numba threads (more than this machine may have),
    run with 3, 5 and 16 of them: `block_q` shrinks down to 24 rows."""
    numba.set_num_threads(1)
    expected = {name: digest(call()) for name, call in DETERMINISM_CASES.items()}
    env = dict(os.environ, NUMBA_NUM_THREADS="16")
    result = run_python(f"""
        import json, sys
        sys.path.insert(0, {str(TESTS_DIR)!r})
        import numba
        from test_reliability import DETERMINISM_CASES, digest
        digests = {{}}
        for n in (3, 5, 16):
            numba.set_num_threads(n)
            digests[n] = {{name: digest(call()) for name, call in DETERMINISM_CASES.items()}}
        print(json.dumps(digests))
    """, env=env)
    assert result.returncode == 0, explain(result)
    got = json.loads(result.stdout.strip().splitlines()[-1])
    differ = {n: [name for name in expected if digests[name] != expected[name]]
              for n, digests in got.items()}
    assert not any(differ.values()), f"bits that differ from 1 thread's, by thread count: {differ}"


# -- NaN and inf ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_in_one_query_row_stays_in_that_row(rng, dtype):
    q, k, v = random_qkv(rng, (2, 4, 70, 40), (2, 2, 90, 40), dtype=dtype)
    clean, clean_lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    bad = q.copy()
    bad[1, 2, 33, 5] = np.nan
    out, lse = cpuflash.attention(bad, k, v, causal=True, return_lse=True)
    assert np.isnan(out[1, 2, 33]).all() and np.isnan(lse[1, 2, 33])
    others = np.ones(out.shape[:-1], dtype=bool)
    others[1, 2, 33] = False
    assert_same_bits(out[others], clean[others], "other rows")
    assert_same_bits(lse[others], clean_lse[others], "other lse")


def test_nan_in_one_key_reaches_exactly_the_rows_that_see_it(rng):
    q, k, v = random_qkv(rng, (1, 2, 80, 32), (1, 1, 80, 32))
    bad = k.copy()
    bad[0, 0, 50, 3] = np.nan
    # causal: rows i >= 50 see key 50, rows i < 50 do not
    clean, clean_lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    out, lse = cpuflash.attention(q, bad, v, causal=True, return_lse=True)
    assert np.isnan(out[:, :, 50:]).all() and np.isnan(lse[:, :, 50:]).all()
    assert_same_bits((out[:, :, :50], lse[:, :, :50]), (clean[:, :, :50], clean_lse[:, :, :50]),
                     "rows before the NaN key")
    # a window that excludes the key from some rows does the same
    clean = cpuflash.attention(q, k, v, window=(5, 5))
    out = cpuflash.attention(q, bad, v, window=(5, 5))
    sees = np.abs(np.arange(80) - 50) <= 5
    assert np.isnan(out[:, :, sees]).all()
    assert_same_bits(out[:, :, ~sees], clean[:, :, ~sees], "rows outside the window")
    # without a mask, every row sees it
    out = cpuflash.attention(q, bad, v)
    assert np.isnan(out).all()


@pytest.mark.parametrize("value", [np.inf, -np.inf])
def test_infinite_query_does_not_crash(rng, value):
    q, k, v = random_qkv(rng, (1, 2, 40, 16), (1, 2, 50, 16))
    clean = cpuflash.attention(q, k, v, causal=True)
    bad = q.copy()
    bad[0, 1, 20, 0] = value
    out, lse = cpuflash.attention(bad, k, v, causal=True, return_lse=True)
    assert out.shape == clean.shape
    others = np.ones(out.shape[:-1], dtype=bool)
    others[0, 1, 20] = False
    assert_same_bits(out[others], clean[others], "other rows")
    # all of q infinite: still returns, whatever the values
    cpuflash.attention(np.full_like(q, value), k, v, causal=True)
    cpuflash.attention_with_kvcache(np.full((1, 2, 1, 16), value, np.float32), k, v,
                                    num_splits=2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_finite_logits_give_the_reference(rng, dtype):
    q, k, v = random_qkv(rng, (1, 2, 60, 32), (1, 2, 75, 32), dtype=dtype)
    q = q * dtype(1e4)
    out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert_close_to_reference(out, q, k, v, lse=lse, causal=True)
    out = cpuflash.attention_with_kvcache(q[:, :, -1:], k, v, num_splits=3)
    assert np.isfinite(out).all()
    assert_close_to_reference(out, q[:, :, -1:], k, v, causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", [4, 17])
def test_large_logits_keep_the_accuracy_rule(seed, dtype):
    """scale = 6 with D = 45: scores of a few tens, a peaked but not one-hot softmax (the
    property tests found float64 cases with scale 1.5 already)."""
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, (1, 2, 20, 45), (1, 2, 37, 45), d_v=8, dtype=dtype)
    out, lse = cpuflash.attention(q, k, v, scale=6.0, return_lse=True)
    assert_close_to_reference(out, q, k, v, lse=lse, scale=6.0)


def test_minus_inf_bias_everywhere_gives_zero_and_minus_inf(rng):
    q, k, v = random_qkv(rng, (2, 2, 30, 16), (2, 1, 40, 16))
    bias = np.full((30, 40), -np.inf, np.float32)
    slopes = np.array([0.1, 0.3], np.float32)
    for kwargs in ({}, dict(causal=True), dict(softcap=5.0, alibi_slopes=slopes),
                   dict(window=(3, 3), scale=10.0)):
        out, lse = cpuflash.attention(q, k, v, bias=bias, return_lse=True, **kwargs)
        assert np.all(out == 0) and np.all(lse == -np.inf), kwargs
    sinks = np.array([0.5, -1.5], np.float32)
    out, lse = cpuflash.attention(q, k, v, bias=bias, sinks=sinks, return_lse=True)
    assert np.all(out == 0)
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks[None, :, None], lse.shape))


# -- every entry point rejects bad input before any work ------------------------------------------

def validation_cases():
    """(name, function, positional args, keyword args, exception, match). Cases that
    test_validation.py and test_decoding.py already cover are left out."""
    rng = np.random.default_rng(3)
    f32 = np.float32
    vq, vk, vv, cu_q, cu_k = packed(rng, [4, 0, 6], [5, 7, 3], hq=4, hk=2, d=8, d_v=6)
    varlen = (vq, vk, vv, cu_q, cu_k)
    q = rng.standard_normal((2, 4, 1, 8)).astype(f32)
    k_cache = rng.standard_normal((2, 2, 16, 8)).astype(f32)
    v_cache = rng.standard_normal((2, 2, 16, 6)).astype(f32)
    new = dict(k=rng.standard_normal((2, 2, 1, 8)).astype(f32),
               v=rng.standard_normal((2, 2, 1, 6)).astype(f32), cache_seqlens=[3, 9])
    cache = (q, k_cache, v_cache)
    outs = rng.standard_normal((2, 3, 5)).astype(f32)
    lses = rng.standard_normal((2, 3)).astype(f32)

    def cast(args, *dtypes):
        return tuple(a.astype(d) for a, d in zip(args, dtypes)) + args[len(dtypes):]

    V, C = cpuflash.attention_varlen, cpuflash.attention_with_kvcache
    return [
        # attention_varlen: dtypes
        ("varlen int", V, cast(varlen, int, int, int), {}, TypeError,
         r"`q`, `k` and `v` must be float32.*got int64"),
        ("varlen complex", V, cast(varlen, np.complex64, np.complex64, np.complex64), {},
         TypeError, r"`q`, `k` and `v` .*complex64"),
        ("varlen mixed", V, cast(varlen, f32, f32, np.float64), {}, TypeError,
         r"`q`, `k` and `v` must share one dtype, got float32, float32 and float64"),
        ("varlen half and single", V, cast(varlen, np.float16, f32, f32), {}, TypeError,
         r"`q`, `k` and `v` must share one dtype, got float16, float32 and float32"),
        # attention_varlen: shapes
        ("varlen v rows", V, (vq, vk, vv[:-1], cu_q, cu_k), {}, ValueError,
         r"`v` has 14 keys but `k` has 15"),
        ("varlen head dim", V, (vq, vk[..., :7], vv, cu_q, cu_k), {}, ValueError,
         r"`k` has head dim 7 but `q` has 8"),
        ("varlen heads", V, (vq[:, :3], vk, vv, cu_q, cu_k), {}, ValueError,
         r"query heads \(3\) must be a multiple .* key/value heads \(2\)"),
        ("varlen cu None", V, (vq, vk, vv, None, cu_k), {}, TypeError,
         r"`cu_seqlens_q` must be an array"),
        ("varlen cu bool", V, (vq, vk, vv, cu_q, np.ones(4, bool)), {}, TypeError,
         r"`cu_seqlens_k` must be an integer array, got dtype bool"),
        ("varlen cu_k ends", V, (vq, vk, vv, cu_q, cu_k - np.array([0, 0, 0, 1])), {},
         ValueError, r"`cu_seqlens_k` must end at the number of rows \(15\), got 14"),
        # attention_varlen: scalars and modifiers
        ("varlen window side", V, varlen, dict(window=(0, -2)), ValueError,
         r"`window` sides must be >= -1"),
        ("varlen window str", V, varlen, dict(window="ab"), ValueError,
         r"`window` must be a pair of ints"),
        ("varlen window bool", V, varlen, dict(window=(True, 2)), ValueError,
         r"`window` must be a pair of ints"),
        ("varlen softcap", V, varlen, dict(softcap=-0.5), ValueError,
         r"`softcap` must be finite and >= 0"),
        ("varlen softcap inf", V, varlen, dict(softcap=float("inf")), ValueError,
         r"`softcap` must be finite"),
        ("varlen softcap None", V, varlen, dict(softcap=None), TypeError,
         r"`softcap` must be a real number"),
        ("varlen scale nan", V, varlen, dict(scale=float("nan")), ValueError,
         r"`scale` must be finite, got nan"),
        ("varlen scale array", V, varlen, dict(scale=np.ones(2)), TypeError,
         r"`scale` must be a real number"),
        ("varlen slopes (B, Hq) wrong", V, varlen,
         dict(alibi_slopes=np.ones((2, 4), f32)), ValueError,
         r"`alibi_slopes` must have shape \(4,\) or \(3, 4\), got \(2, 4\)"),
        ("varlen slopes heads", V, varlen, dict(alibi_slopes=np.ones(2, f32)), ValueError,
         r"`alibi_slopes` must have shape \(4,\) or \(3, 4\), got \(2,\)"),
        ("varlen slopes dtype", V, varlen, dict(alibi_slopes=np.ones(4, np.int32)), TypeError,
         r"`alibi_slopes` must be a float array, got dtype int32"),
        ("varlen causal", V, varlen, dict(causal=1), TypeError,
         r"`causal` must be True or False"),
        ("varlen return_lse", V, varlen, dict(return_lse="yes"), TypeError,
         r"`return_lse` must be True or False"),
        # attention_with_kvcache (new keys given: a premature write would show in the cache)
        ("cache window", C, cache, dict(new, window=(1,)), ValueError,
         r"`window` must be a pair of ints"),
        ("cache window side", C, cache, dict(new, window=(-3, 0)), ValueError,
         r"`window` sides must be >= -1"),
        ("cache softcap", C, cache, dict(new, softcap=-1.0), ValueError,
         r"`softcap` must be finite and >= 0"),
        ("cache softcap str", C, cache, dict(new, softcap="2"), TypeError,
         r"`softcap` must be a real number"),
        ("cache scale inf", C, cache, dict(new, scale=float("-inf")), ValueError,
         r"`scale` must be finite"),
        ("cache sinks shape", C, cache, dict(new, sinks=np.ones(2, f32)), ValueError,
         r"`sinks` must have shape \(4,\), got \(2,\)"),
        ("cache sinks 2-D", C, cache, dict(new, sinks=np.ones((4, 1), f32)), ValueError,
         r"`sinks` must have shape \(4,\), got \(4, 1\)"),
        ("cache sinks dtype", C, cache, dict(new, sinks=np.ones(4, int)), TypeError,
         r"`sinks` must be a float array"),
        ("cache slopes shape", C, cache, dict(new, alibi_slopes=np.ones((1, 4), f32)),
         ValueError, r"`alibi_slopes` must have shape \(4,\) or \(2, 4\), got \(1, 4\)"),
        ("cache slopes dtype", C, cache, dict(new, alibi_slopes=np.ones(4, np.int32)),
         TypeError, r"`alibi_slopes` must be a float array"),
        ("cache causal", C, cache, dict(new, causal=None), TypeError,
         r"`causal` must be True or False"),
        ("cache return_lse", C, cache, dict(new, return_lse="y"), TypeError,
         r"`return_lse` must be True or False"),
        ("cache num_splits bool", C, cache, dict(new, num_splits=True), TypeError,
         r"`num_splits` must be an int \(0 = automatic\)"),
        ("cache seqlens bool", C, cache, dict(new, cache_seqlens=True), TypeError,
         r"`cache_seqlens`"),
        ("cache int dtype", C, cast(cache, int, int, int), {}, TypeError,
         r"`q`, `k_cache` and `v_cache` must be float32.*got int64"),
        ("cache q dtype", C, cast(cache, np.float64), {}, TypeError,
         r"`q`, `k_cache` and `v_cache` must share one dtype, got float64, float32"),
        ("cache complex", C, cast(cache, f32, f32, np.complex64), {}, TypeError,
         r"`v_cache` must share one dtype, got float32, float32 and complex64"),
        ("cache new v dtype", C, cache, dict(new, v=new["v"].astype(np.float16)), TypeError,
         r"`k` and `v` must have the dtype of the cache"),
        ("cache q heads", C, (q[:, :3], k_cache, v_cache), new, ValueError,
         r"query heads \(3\) must be a multiple .* key/value heads \(2\)"),
        # merge_states
        ("merge lses dtype", cpuflash.merge_states, (outs, lses.astype(np.int64)), {}, TypeError,
         r"`lses` must be float32 or float64, got int64"),
        ("merge outs None", cpuflash.merge_states, (None, lses), {}, TypeError,
         r"`outs` must be an array"),
        ("merge lses shape", cpuflash.merge_states, (outs, lses[:, :2]), {}, ValueError,
         r"`outs` must be \(S, \.\.\., Dv\) and `lses` \(S, \.\.\.\)"),
        ("merge 1-D outs", cpuflash.merge_states, (outs[0, 0], lses[0]), {}, ValueError,
         r"`outs` must be \(S, \.\.\., Dv\)"),
        # unknown keywords, on all four (attention's own is in test_validation.py)
        ("attention torch keyword", cpuflash.attention, varlen[:3], dict(is_causal=True),
         TypeError, r"unexpected keyword argument 'is_causal'"),
        ("varlen bias keyword", V, varlen, dict(bias=np.zeros((15, 15), f32)), TypeError,
         r"unexpected keyword argument 'bias'"),
        ("varlen max_seqlen keyword", V, varlen, dict(max_seqlen_q=6), TypeError,
         r"unexpected keyword argument 'max_seqlen_q'"),
        ("cache mask keyword", C, cache, dict(new, mask=np.ones((1, 16), bool)), TypeError,
         r"unexpected keyword argument 'mask'"),
        ("cache rotary keyword", C, cache, dict(new, rotary_cos=np.ones(4, f32)), TypeError,
         r"unexpected keyword argument 'rotary_cos'"),
        ("merge keyword", cpuflash.merge_states, (outs, lses), dict(axis=0), TypeError,
         r"unexpected keyword argument 'axis'"),
    ]


VALIDATION_CASES = validation_cases()


def snapshot(args, kwargs):
    arrays = [x for x in (*args, *kwargs.values()) if isinstance(x, np.ndarray)]
    return arrays, [x.copy() for x in arrays]


@pytest.mark.parametrize("case", range(len(VALIDATION_CASES)),
                         ids=[c[0] for c in VALIDATION_CASES])
def test_bad_input_is_rejected_before_any_work(case):
    _, func, args, kwargs, exc, match = VALIDATION_CASES[case]
    arrays, before = snapshot(args, kwargs)
    with pytest.raises(exc, match=match):
        func(*args, **kwargs)
    for x, b in zip(arrays, before):  # inputs and caches untouched
        assert_same_bits(x, b, "an input changed")


def merge_mismatch_cases():
    f32 = np.float32
    o, l = np.ones((3, 5), f32), np.zeros(3, f32)
    return [
        ("outs shapes", [o, np.ones((4, 5), f32)], [l, np.zeros(4, f32)], r"`outs`"),
        ("lses shapes", [o, o], [l, np.zeros(4, f32)], r"`lses`"),
        ("empty lists", [], [], r"`outs`"),
    ]


@pytest.mark.parametrize("name,outs,lses,match", merge_mismatch_cases(),
                         ids=[c[0] for c in merge_mismatch_cases()])
def test_merge_states_names_the_argument_of_mismatched_parts(name, outs, lses, match):
    before = [x.copy() for x in (*outs, *lses)]
    with pytest.raises(ValueError, match=match):
        cpuflash.merge_states(outs, lses)
    for x, b in zip((*outs, *lses), before):
        assert_same_bits(x, b)


@pytest.mark.parametrize("which,match", [
    ("v_cache rows", r"`v_cache` has 15 .*`k_cache` has 16"),
    ("v_cache heads", r"`v_cache` has 1 heads? but `k_cache` has 2"),
    ("k_cache head dim", r"`k_cache` has head dim 7 but `q` has 8"),
])
def test_kvcache_shape_errors_name_the_cache_arguments(which, match):
    """`k` and `v` are the *new* keys of attention_with_kvcache: a message about the caches
    must say `k_cache` / `v_cache`."""
    q = np.ones((2, 4, 1, 8), np.float32)
    k_cache, v_cache = np.ones((2, 2, 16, 8), np.float32), np.ones((2, 2, 16, 6), np.float32)
    caches = {"v_cache rows": (k_cache, v_cache[:, :, :15]),
              "v_cache heads": (k_cache, v_cache[:, :1]),
              "k_cache head dim": (k_cache[..., :7], v_cache)}[which]
    with pytest.raises(ValueError, match=match):
        cpuflash.attention_with_kvcache(q, *caches)


# -- odd but valid input --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_head_dim_one(rng, dtype):
    q, k, v = random_qkv(rng, (2, 2, 37, 1), (2, 1, 41, 1), d_v=1, dtype=dtype)
    for kwargs in ({}, dict(causal=True), dict(window=(3, 0), alibi_slopes=np.ones(2, np.float32))):
        out, lse = cpuflash.attention(q, k, v, return_lse=True, **kwargs)
        assert_close_to_reference(out, q, k, v, lse=lse, **kwargs)
    vq, vk, vv, cu_q, cu_k = packed(rng, [5, 1, 30], [7, 1, 30], hq=2, hk=1, d=1, d_v=1,
                                    dtype=dtype)
    out, lse = cpuflash.attention_varlen(vq, vk, vv, cu_q, cu_k, causal=True, return_lse=True)
    check_varlen(out, lse, vq, vk, vv, cu_q, cu_k, causal=True)
    out, lse = cpuflash.attention_with_kvcache(q[:, :, :1], k, v, cache_seqlens=[9, 41],
                                               num_splits=2, return_lse=True)
    check_kvcache(out, lse, q[:, :, :1], k, v, [9, 41], causal=True)


def test_one_query_one_key(rng):
    q, k, v = random_qkv(rng, (1, 3, 1, 16), (1, 3, 1, 16), d_v=4)
    for causal in (False, True):
        out, lse = cpuflash.attention(q, k, v, causal=causal, return_lse=True)
        assert_close_to_reference(out, q, k, v, lse=lse, causal=causal)
        np.testing.assert_allclose(out, v, rtol=1e-6)  # the one key gets all the weight
    flat = [heads_first(x[0]) for x in (q, k, v)]
    cu = np.array([0, 1], np.int32)
    out, lse = cpuflash.attention_varlen(*flat, cu, cu, causal=True, return_lse=True)
    check_varlen(out, lse, *flat, cu, cu, causal=True)
    for n_new in (0, 1):  # the one key in the cache, or the one new key into an empty cache
        k_cache, v_cache = k.copy(), v.copy()
        new = dict(k=k, v=v, cache_seqlens=[0]) if n_new else {}
        out, lse = cpuflash.attention_with_kvcache(q, k_cache, v_cache, return_lse=True, **new)
        check_kvcache(out, lse, q, k, v, [1], causal=True)


def fortran(x):
    return np.asfortranarray(x)


def negative(x):
    """The same values, read through negative strides on every axis."""
    flip = (slice(None, None, -1),) * x.ndim
    return np.ascontiguousarray(x[flip])[flip]


def readonly(x):
    x = x.copy()
    x.flags.writeable = False
    return x


@pytest.mark.parametrize("view", [fortran, negative, readonly])
def test_varlen_any_strides(rng, view):
    q, k, v, cu_q, cu_k = packed(rng, [30, 0, 71], [45, 3, 60])
    expected = cpuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    vq, vk, vv = view(q), view(k), view(v)
    assert not vq.flags.c_contiguous or not vq.flags.writeable
    got = cpuflash.attention_varlen(vq, vk, vv, view(cu_q), view(cu_k), causal=True,
                                    return_lse=True)
    assert_same_bits(got, expected, view.__name__)
    check_varlen(*got, q, k, v, cu_q, cu_k, causal=True)
    got = cpuflash.attention_varlen(vq, k, v, cu_q, cu_k, causal=True, return_lse=True)
    assert_same_bits(got, expected, f"{view.__name__} q only")


@pytest.mark.parametrize("view", [fortran, negative, readonly])
@pytest.mark.parametrize("n_q", [1, 24])  # the decode kernel, and chunked prefill
def test_kvcache_any_strides(rng, view, n_q):
    q = rng.standard_normal((2, 4, n_q, 32)).astype(np.float32)
    k_cache = rng.standard_normal((2, 2, 100, 32)).astype(np.float32)
    v_cache = rng.standard_normal((2, 2, 100, 16)).astype(np.float32)
    seqlens = np.array([30, 100], np.int32)
    kw = dict(cache_seqlens=seqlens, num_splits=2, return_lse=True)
    expected = cpuflash.attention_with_kvcache(q, k_cache, v_cache, **kw)
    got = cpuflash.attention_with_kvcache(view(q), view(k_cache), view(v_cache), **kw)
    assert_same_bits(got, expected, view.__name__)
    check_kvcache(*got, q, k_cache, v_cache, seqlens, causal=True)
    # new keys: read-only or strided `k`/`v`, written into a strided (writeable) cache
    new_k = rng.standard_normal((2, 2, n_q, 32)).astype(np.float32)
    new_v = rng.standard_normal((2, 2, n_q, 16)).astype(np.float32)
    seqlens = np.array([10, 100 - n_q], np.int32)
    kc, vc = k_cache.copy(), v_cache.copy()
    expected = cpuflash.attention_with_kvcache(q, kc, vc, k=new_k, v=new_v, **dict(
        kw, cache_seqlens=seqlens))
    cache_view = fortran if view is readonly else view
    kc2, vc2 = cache_view(k_cache), cache_view(v_cache)
    got = cpuflash.attention_with_kvcache(view(q), kc2, vc2, k=view(new_k), v=view(new_v),
                                          **dict(kw, cache_seqlens=seqlens))
    assert_same_bits(got, expected, f"{view.__name__} with new keys")
    np.testing.assert_array_equal(kc2, kc)
    np.testing.assert_array_equal(vc2, vc)


def test_readonly_inputs_everywhere(rng):
    q, k, v = (readonly(x) for x in random_qkv(rng, (2, 4, 50, 16), (2, 2, 60, 16)))
    bias, mask = readonly(rng.standard_normal((50, 60)).astype(np.float32)), \
        readonly(rng.random((50, 60)) < 0.9)
    slopes, sinks = readonly(np.full(4, 0.1, np.float32)), readonly(np.zeros(4, np.float32))
    kwargs = dict(bias=bias, mask=mask, alibi_slopes=slopes, sinks=sinks, causal=True)
    out, lse = cpuflash.attention(q, k, v, return_lse=True, **kwargs)
    assert_close_to_reference(out, q, k, v, lse=lse, **kwargs)
    out, lse = cpuflash.attention_with_kvcache(q[:, :, :1], k, v, cache_seqlens=readonly(
        np.array([10, 60], np.int32)), alibi_slopes=slopes, sinks=sinks, return_lse=True)
    for b, n in enumerate((10, 60)):
        assert_close_to_reference(out[b], q[b, :, :1], k[b, :, :n], v[b, :, :n], lse=lse[b],
                                  causal=True, alibi_slopes=slopes, sinks=sinks)
    parts = [cpuflash.attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True)
             for a, b in ((0, 25), (25, 60))]
    merged, merged_lse = cpuflash.merge_states([readonly(p[0]) for p in parts],
                                               readonly(np.stack([p[1] for p in parts])))
    assert_close_to_reference(merged, q, k, v, lse=merged_lse)


# -- long sequences -------------------------------------------------------------------------------

def test_long_causal_sequence(rng):
    """N = 65536, one head, D = 64 (about 550 GFLOP, a few seconds on 2 cores): checked on its
    last rows, which bottom-right alignment makes a small (8 x 65536) reference problem."""
    n, d = 65536, 64
    q, k, v = (rng.standard_normal((1, 1, n, d), dtype=np.float32) for _ in range(3))
    out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (1, 1, n, d) and np.isfinite(out).all() and np.isfinite(lse).all()
    assert_close_to_reference(out[:, :, -8:], q[:, :, -8:], k, v, lse=lse[:, :, -8:],
                              causal=True)
    # the first rows see few keys: row 0 sees only key 0
    np.testing.assert_allclose(out[0, 0, 0], v[0, 0, 0], rtol=1e-6)


# -- memory ---------------------------------------------------------------------------------------

MEMORY_SCRIPT = """
    import json, resource, sys
    import numpy as np
    import cpuflash

    n, d, heads = 16384, 128, int(sys.argv[1])
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, heads, n, d), dtype=np.float32) for _ in range(3))
    tiny = np.ones((1, 1, 4, d), np.float32)
    cpuflash.attention(tiny, tiny, tiny, causal=True)  # compile or load the kernel first
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = cpuflash.attention(q, k, v, causal=True)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(dict(before_kib=before, after_kib=after, out_bytes=out.nbytes,
                          finite=bool(np.isfinite(out).all()))))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss is KiB on Linux")
@pytest.mark.parametrize("heads", [1, 4])
def test_peak_memory_is_the_output_and_a_little_more(heads):
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(MEMORY_SCRIPT), str(heads)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, explain(result)
    m = json.loads(result.stdout.strip().splitlines()[-1])
    assert m["finite"]
    increase = (m["after_kib"] - m["before_kib"]) * 1024
    allowed = m["out_bytes"] + 64 * 2**20
    assert increase <= allowed, (
        f"peak RSS grew by {increase / 2**20:.1f} MiB during the call (before "
        f"{m['before_kib'] / 1024:.1f} MiB, after {m['after_kib'] / 1024:.1f} MiB); allowed: "
        f"output {m['out_bytes'] / 2**20:.1f} MiB + 64 MiB")


# -- read-only install ----------------------------------------------------------------------------

CHECK_SCRIPT = """
    import json, sys
    import numpy as np
    import cpuflash
    from cpuflash.reference import attention_reference

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 37, 24)).astype(np.float32) for _ in range(3))
    out = cpuflash.attention(q, k, v, causal=True)
    err = float(np.abs(out - attention_reference(q, k, v, causal=True)).max())
    print(json.dumps(dict(file=cpuflash.__file__, err=err)))
"""


def file_states(root):
    """{path: (size, mtime_ns)} of every file under `root`."""
    states = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            st = os.stat(path)
            states[path] = (st.st_size, st.st_mtime_ns)
    return states


def set_writable(root, writable):
    for base, dirs, files in os.walk(root):
        for name in [*dirs, *files, None]:
            path = base if name is None else os.path.join(base, name)
            mode = os.stat(path).st_mode
            os.chmod(path, mode | 0o200 if writable else mode & ~0o222)


def test_read_only_install_caches_elsewhere(tmp_path):
    """A non-editable install into a read-only directory: kernels compile, their cache goes to
    Numba's user-wide cache directory (then to the temporary directory), never next to the
    package, and the second interpreter reuses it."""
    prefix = []
    if os.geteuid() == 0:  # root ignores file permissions unless it drops CAP_DAC_OVERRIDE
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: a read-only directory is writable")
        caps = "-dac_override,-dac_read_search"
        prefix = [setpriv, "--bounding-set", caps, f"--inh-caps={caps}"]
    source, target = tmp_path / "src", tmp_path / "site"
    ignore = shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc", "*.pyc", "*.egg-info")
    shutil.copytree(REPO_DIR / "cpuflash", source / "cpuflash", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_DIR / name, source / name)
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
           "--disable-pip-version-check", "--target", str(target), str(source)]
    result = subprocess.run([*pip[:5], "--no-build-isolation", *pip[5:]], capture_output=True,
                            text=True, timeout=300)
    if result.returncode != 0:
        result = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and "setuptools" in result.stdout + result.stderr:
        # no build backend offline (a bare virtual environment): cpuflash is pure Python, so
        # an install is its package folder on the path
        shutil.copytree(source / "cpuflash", target / "cpuflash")
    elif result.returncode != 0:
        pytest.fail(explain(result))
    assert (target / "cpuflash" / "__init__.py").exists()

    home, tmp, locked = tmp_path / "home", tmp_path / "tmp", tmp_path / "locked"
    for path in (home, tmp, locked):
        path.mkdir()
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("NUMBA_") and name not in ("XDG_CACHE_HOME", "PYTHONPATH")}
    env.update(PYTHONPATH=str(target), HOME=str(home), TMPDIR=str(tmp))
    installed = file_states(target)
    set_writable(target, False)
    set_writable(locked, False)
    try:
        runs = []
        for run in range(3):
            # third run: HOME is read-only too, so the cache must go to TMPDIR
            run_env = dict(env, HOME=str(locked)) if run == 2 else env
            result = run_python(CHECK_SCRIPT, env=run_env, prefix=prefix, cwd=str(tmp),
                                timeout=300)
            assert result.returncode == 0, f"run {run}: {explain(result)}"
            runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
            if run == 0:
                home_cache = file_states(home)
        assert file_states(target) == installed, "files were created or changed in the install"
        assert file_states(locked) == {}
    finally:
        set_writable(target, True)
        set_writable(locked, True)
    for run, info in enumerate(runs):
        assert Path(info["file"]).resolve().is_relative_to(target.resolve()), info
        assert info["err"] < 1e-5, info
    cached = [p for p in home_cache if p.endswith((".nbi", ".nbc"))]
    assert cached, f"no Numba cache under HOME: {sorted(home_cache)}"
    assert file_states(home) == home_cache, "the second run did not reuse the cache under HOME"
    assert any(p.endswith(".nbc") for p in file_states(tmp)), \
        f"with HOME read-only, no cache under TMPDIR: {sorted(file_states(tmp))}"
