"""cpuflash.distributed: ring attention over MPI.

The planning (which single-node call computes which part of the whole sequence) is checked here,
in one process, exhaustively on small sizes against the dense visibility rule. The ring itself
runs in real MPI jobs (``mpiexec -n 2, 3, 4``, one thread per rank), each running every case of
``mpi_jobs/ring_cases.py`` and the bad calls: each rank checks its part against the oracle,
and every rank must raise the same error for a bad call.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cpuflash
from helpers import clean_env, visible

# mpi4py first: importorskip skips on a missing module, and cpuflash.distributed turns that into
# an ImportError that names the extra (which importorskip reports as an error, not a skip)
pytest.importorskip("mpi4py", reason="cpuflash.distributed needs mpi4py (the mpi extra)")
distributed = pytest.importorskip("cpuflash.distributed",
                                  reason="cpuflash.distributed needs mpi4py (the mpi extra)")

JOB = Path(__file__).resolve().parent / "mpi_jobs" / "ring_cases.py"
JOB_TIMEOUT = 300  # seconds; a hung ring fails the test instead of hanging the suite


# -- planning, without MPI ------------------------------------------------------------------------

WINDOWS = [None, (0, 0), (2, 5), (5, -1), (-1, 3), (1, 0), (0, 4), (9, 2), (40, -1)]


def global_rows(rank, n_rows, size, balance):
    """The positions in the whole sequence of the rows of `rank`'s part."""
    return np.concatenate([np.arange(g, g + n) for _, n, g in
                           distributed.chunks(rank, n_rows, size, balance)])


def check_plan(size, balance, part_q, part_k, causal, window, fuse, chunk_size=None):
    """Over all ranks and ring steps, the planned calls cover each visible (query, key) pair of
    the whole sequence exactly once and no other, and their shift gives the global distance;
    with `chunk_size`, no call spans two local chunks (its rows are never computed against
    another chunk's keys)."""
    n_q, n_k = part_q * size, part_k * size
    offset = n_k - n_q
    expected = visible(n_q, n_k, causal, window)
    if chunk_size is not None:
        expected &= ((np.arange(n_q)[:, None] + offset) // chunk_size
                     == np.arange(n_k)[None, :] // chunk_size)
    covered = np.zeros((n_q, n_k), dtype=int)
    for rank in range(size):
        rows_q = global_rows(rank, part_q, size, balance)
        q_chunks = distributed.chunks(rank, part_q, size, balance)
        for source in range(size):
            rows_k = global_rows(source, part_k, size, balance)
            k_chunks = distributed.chunks(source, part_k, size, balance)
            for q_lo, k_lo, p in distributed.step_calls(
                    q_chunks, k_chunks, offset=offset, causal=causal, window=window,
                    chunk_size=chunk_size, fuse=fuse):
                i = rows_q[q_lo:q_lo + p.n_q]
                j = rows_k[k_lo:k_lo + p.n_k]
                sees = visible(p.n_q, p.n_k, p.causal, p.window)
                covered[np.ix_(i, j)] += sees
                # ALiBi reads the call's own distance plus the shift
                own = (np.arange(p.n_k)[None, :] - np.arange(p.n_q)[:, None]
                       - (p.n_k - p.n_q))
                whole = j[None, :] - i[:, None] - offset
                if p.shift is not None:
                    assert np.array_equal((own + p.shift)[sees], whole[sees])
                if chunk_size is not None:
                    local = np.concatenate([(i + offset) // chunk_size, j // chunk_size])
                    assert len(set(local.tolist())) == 1, (i, j)
    assert np.array_equal(covered, expected.astype(int)), (n_q, n_k, causal, window)


@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("fuse", [True, False])
def test_steps_compute_every_visible_pair_once(balance, size, fuse):
    # (4, 2) and (2, 4): zigzag chunks of one key (query) beside chunks of two
    for part_q, part_k in [(2, 2), (6, 6), (4, 8), (8, 4), (10, 10), (4, 2), (2, 4)]:
        for causal in (False, True):
            for window in WINDOWS:
                check_plan(size, balance, part_q, part_k, causal, window, fuse)


@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("fuse", [True, False])
def test_chunked_steps_compute_every_visible_pair_once(balance, size, fuse):
    """Local chunks of 1 position, of sizes that do not divide a part's chunks, of the parts'
    own chunks, and longer than the sequence; Nq != Nk moves the queries' positions."""
    for part_q, part_k in [(6, 6), (4, 8), (8, 4), (10, 10), (4, 2)]:
        for chunk_size in (1, 3, 5, part_k // 2, 10 * part_k):
            for causal in (False, True):
                for window in (None, (2, 5), (5, -1), (-1, 3), (0, 0)):
                    check_plan(size, balance, part_q, part_k, causal, window, fuse, chunk_size)


def test_local_pieces_cut_a_pair_at_the_chunk_edges():
    # queries at positions 5..14 against keys 2..11 in chunks of 4: chunks 1 and 2 are shared
    assert distributed.local_pieces(5, 10, 2, 10, 4) == [(0, 3, 2, 4), (3, 4, 6, 4)]
    # Nk - Nq = 8 moves the queries to positions 13..22, chunks 3..5: none is shared
    assert distributed.local_pieces(5, 10, 2, 10, 4, offset=8) == []
    assert distributed.local_pieces(5, 10, 2, 10, None) == [(0, 10, 0, 10)]


def test_pair_call_slices_a_band_off_the_diagonal():
    """A band wholly on one side of the call's diagonal: the queries that see nothing (or the
    keys no query sees) are dropped, which moves the diagonal onto the band."""
    # queries 8..15 over keys 0..7, window (3, 0): queries 11..15 see none of these keys
    assert distributed.pair_call(8, 8, 0, 8, window=(3, 0)) == distributed.PairCall(
        3, 8, False, (0, -1), -3)
    # queries 0..7 over keys 8..15, window (-1, 3): keys 11..15 are seen by no query
    assert distributed.pair_call(0, 8, 8, 8, window=(-1, 3)) == distributed.PairCall(
        8, 3, True, None, 3)
    # causal: keys after the queries are never seen, keys before them all are
    assert distributed.pair_call(0, 8, 8, 8, causal=True) is None
    assert distributed.pair_call(8, 8, 0, 8, causal=True) == distributed.PairCall(
        8, 8, False, None, -8)
    assert distributed.pair_call(8, 8, 0, 4, window=(2, 0)) is None


def test_alibi_bias_is_the_global_distance_without_an_n_squared_array():
    slopes = np.array([[0.5, 0.25, 0.125]], np.float32)  # (B, Hq)
    n_q, n_k, shift = 5, 7, -9
    bias = distributed.alibi_bias(slopes, n_q, n_k, shift, np.float32)
    own = np.arange(n_k)[None, :] - np.arange(n_q)[:, None] - (n_k - n_q)
    expected = -slopes[..., None, None] * np.abs(own + shift)
    assert bias.shape == (1, 3, n_q, n_k) and bias.dtype == np.float32
    np.testing.assert_allclose(bias, expected, rtol=1e-7)
    # a Toeplitz view: one row of n_q + n_k - 1 values per head, read backwards down the rows
    assert bias.strides[-2:] == (-4, 4) and not bias.flags.writeable


def test_chunks_deal_the_sequence_out_once():
    for size in (1, 2, 3, 5):
        for balance in ("zigzag", "contiguous"):
            rows = np.concatenate([global_rows(r, 6, size, balance) for r in range(size)])
            assert np.array_equal(np.sort(rows), np.arange(6 * size))
    assert [g for _, _, g in distributed.chunks(1, 4, 3, "zigzag")] == [2, 8]


# -- real MPI jobs ---------------------------------------------------------------------------------

def _mpiexec():
    """The mpiexec beside this interpreter (the mpich wheel puts it there), or on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec beside the interpreter or on PATH (the mpich wheel brings one)")
    return found


@pytest.fixture(scope="module")
def warm_kernels():
    """Compile (or load) every kernel the jobs use, once, before several ranks would each
    compile it at the same time on a cold cache."""
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        q, k, v = (rng.standard_normal((1, 2, 8, 4)).astype(dtype) for _ in range(3))
        for options in (dict(causal=True), dict(window=(2, 1)), dict(causal=True, chunk_size=3),
                        dict(bias=np.zeros((2, 8, 8), dtype)),
                        dict(alibi_slopes=np.ones(2, np.float32))):
            out, lse = cpuflash.attention(q, k, v, return_lse=True, **options)
            cpuflash.attention_backward(out, q, k, v, out, lse, **options)


def _run_job(n_ranks, tmp_path, *modes):
    """Launch the job on `n_ranks` ranks; returns each rank's records (rank -> list).

    A hung job is stopped: by mpiexec itself (MPIEXEC_TIMEOUT), else by SIGTERM to mpiexec,
    which takes its ranks down with it, and last by SIGKILL to its whole process group, so
    that no rank is left spinning in MPI after the test.
    """
    env = clean_env(NUMBA_NUM_THREADS="1", CPUFLASH_QUIET="1",
                    MPIEXEC_TIMEOUT=str(JOB_TIMEOUT - 30))
    command = [_mpiexec(), "-n", str(n_ranks), sys.executable, str(JOB), str(tmp_path), *modes]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env, cwd=JOB.parent, start_new_session=True)
    try:
        stdout, stderr = job.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        job.terminate()
        try:
            stdout, stderr = job.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", ""
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:  # all gone already
            pass
        if not stdout and not stderr:
            stdout, stderr = job.communicate()
        pytest.fail(f"the {n_ranks}-rank job did not finish in {JOB_TIMEOUT} s (a rank hung?)"
                    f"\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-4000:]}")
    records = {}
    for rank in range(n_ranks):
        path = tmp_path / f"rank{rank}.jsonl"
        records[rank] = ([json.loads(line) for line in path.read_text().splitlines()]
                         if path.exists() else [])
    failed = [r for lines in records.values() for r in lines if r.get("ok") is False]
    assert job.returncode == 0 and not failed, (
        f"{n_ranks} ranks: exit {job.returncode}\n"
        + "\n".join(f"rank {r['rank']} {r['case']}: {r['message']}" for r in failed)
        + f"\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-4000:]}")
    for rank, lines in records.items():
        assert lines and lines[-1] == {"rank": rank, "done": 0}, f"rank {rank} did not finish"
    return records


# what each bad call's message must say (every rank raises the same)
ERRORS = {
    "shard length": ("ValueError", "must be a multiple of"),
    "odd part": ("ValueError", "must be even"),
    "contiguous shard": ("ValueError", "must be a multiple of"),
    "shapes differ": ("ValueError", "shape of `q`"),
    "head dims differ": ("ValueError", "shape of `v`"),
    "dtype on one rank": ("TypeError", "on rank"),
    "keywords differ": ("ValueError", "`causal` must be the same on every rank"),
    "bad window": ("ValueError", "`window`"),
    "bad chunk_size": ("ValueError", "`chunk_size` must be >= 1"),
    "chunk_size differs": ("ValueError", "`chunk_size` must be the same on every rank"),
    "bad balance": ("ValueError", "`balance`"),
    "lse shape": ("ValueError", "`lse`"),
    "unshard shapes differ": ("ValueError", "shape of `part`"),
}


@pytest.mark.slow
@pytest.mark.parametrize("n_ranks", [2, 3, 4])
def test_ring_matches_one_process(n_ranks, tmp_path, warm_kernels):
    """Forward and backward, every case and both balances, on real ranks; then the bad calls:
    the same error on every rank, nobody hangs, and the ring works after them."""
    records = _run_job(n_ranks, tmp_path, "correct", "errors")
    by_case = {}
    for lines in records.values():
        for record in lines[:-1]:
            by_case.setdefault(record["case"], []).append(record["message"])
    assert len(by_case["zigzag: plain"]) == n_ranks
    assert "ring works after the errors" in by_case
    for case, (kind, words) in ERRORS.items():
        messages = by_case[case]
        assert len(messages) == n_ranks and len(set(messages)) == 1, messages
        assert messages[0].startswith(kind + ":") and words in messages[0], messages[0]


def test_import_cpuflash_does_not_import_mpi4py():
    code = "import sys, cpuflash; print('mpi4py' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=clean_env(), timeout=120)
    assert result.stdout.strip() == "False", result.stderr


def test_one_rank_is_the_single_node_call(rng):
    """With one rank (this process) and one chunk the ring is one call: the same bits as
    `attention` (merging into the empty running result is exact)."""
    q, k, v = (rng.standard_normal((1, 2, 24, 8)).astype(np.float32) for _ in range(3))
    one = dict(causal=True, balance="contiguous")
    out, lse = distributed.ring_attention(q, k, v, return_lse=True, **one)
    expected, expected_lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(lse, expected_lse)
    timings = {}
    grads = distributed.ring_attention_backward(out, q, k, v, out, lse, timings=timings, **one)
    for got, want in zip(grads, cpuflash.attention_backward(out, q, k, v, out, lse,
                                                            causal=True)):
        np.testing.assert_array_equal(got, want)
    assert timings["steps"] == 1 and timings["bytes_sent"] == 0


@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
def test_one_rank_chunked_is_the_single_node_call(rng, balance):
    """One rank (this process): the pieces of the parts, cut at the local chunks' edges (7
    divides neither 24 rows nor 12), give `attention` and `attention_backward` with
    `chunk_size`; Nk > Nq moves the queries' positions."""
    q = rng.standard_normal((1, 4, 24, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 30, 8)).astype(np.float32) for _ in range(2))
    options = dict(causal=True, chunk_size=7)
    out, lse = distributed.ring_attention(q, k, v, return_lse=True, balance=balance, **options)
    expected, expected_lse = cpuflash.attention(q, k, v, return_lse=True, **options)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5, atol=1e-6)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads = distributed.ring_attention_backward(dout, q, k, v, out, lse, balance=balance,
                                                **options)
    for got, want in zip(grads, cpuflash.attention_backward(dout, q, k, v, out, lse,
                                                            **options)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [(0, 4), (0, -1)])
def test_one_key_chunks_are_not_joined_when_some_rows_see_nothing(rng, window):
    """One rank, zigzag: keys in chunks of one, queries in chunks of two. The last query
    (position 3 + Nk - Nq = 1) sees only the second key, so the call of the second query
    chunk with the first key is a plain call of one row, and the chunk must not be joined into
    one plain call over both keys."""
    q = rng.standard_normal((1, 1, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, 2, 8)).astype(np.float32) for _ in range(2))
    out, lse = distributed.ring_attention(q, k, v, window=window, return_lse=True)
    expected, expected_lse = cpuflash.attention(q, k, v, window=window, return_lse=True)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call, exc, match", [
    (lambda q: distributed.ring_attention(q, q, q, comm=object()), TypeError, "`comm`"),
    (lambda q: distributed.ring_attention(q.tolist(), q, q), TypeError, "`q` must be a numpy"),
    (lambda q: distributed.ring_attention(q[..., :5, :], q, q), ValueError, "must be even"),
    (lambda q: distributed.shard(q, axis=7), ValueError, "`axis`"),
    (lambda q: distributed.ring_attention(q[0], q[0], q[0], layout="bshd"), ValueError,
     "`q` must be 4-D"),
    (lambda q: distributed.unshard(q, layout="thd"), ValueError, "`layout`"),
    (lambda q: distributed.ring_attention(q, q, q, chunk_size="8"), TypeError, "`chunk_size`"),
    (lambda q: distributed.ring_attention_backward(q, q, q, q, q, q[..., 0], chunk_size=0),
     ValueError, "`chunk_size` must be >= 1"),
])
def test_bad_input_on_one_rank(rng, call, exc, match):
    q = rng.standard_normal((1, 2, 6, 4)).astype(np.float32)
    with pytest.raises(exc, match=match):
        call(q)
