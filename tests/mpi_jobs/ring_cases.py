"""Run under ``mpiexec -n P``: ring attention against one process, case by case.

``python ring_cases.py DIR correct errors``: ``correct`` runs every case of `CASES` through
`ring_attention` and `ring_attention_backward` and checks each rank's result, gathered whole
with `unshard`, against the float64 oracle by the accuracy rule (the gradients against a dense
chain rule of the reference, the rule of test_backward.py); ``errors`` makes bad calls and
records what each rank raised, then makes one good call (the ring still works after them).

Each rank writes one JSON line per case, ``{"rank", "case", "ok", "message"}``, and a final
``{"rank", "done": failures}`` to ``DIR/rank<R>.jsonl`` (the failures to stdout too); the exit
status is 1 when a check failed on this rank.
"""

import json
import sys
import tracemalloc
import traceback
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the accuracy rule

import cpuflash  # noqa: E402
from cpuflash import distributed  # noqa: E402
from cpuflash.reference import attention_reference  # noqa: E402
from mpi4py import MPI  # noqa: E402

from accuracy import assert_close_to_reference, assert_within_rule, tolerance  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


LOG = None  # this rank's JSON-lines file


def report(case, ok, message=""):
    line = json.dumps({"rank": RANK, "case": case, "ok": ok, "message": message})
    LOG.write(line + "\n")
    LOG.flush()
    if not ok:
        print(line, flush=True)


def dtype_named(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# -- the oracle of the gradients ----------------------------------------------------------------

def backward_reference(dout, q, k, v, *, dtype, causal=False, scale=None, window=None,
                       chunk_size=None, softcap=0.0, alibi_slopes=None, layout="bhsd"):
    """dq, dk, dv of `attention_reference` by the chain rule, densely, in `dtype`."""
    if layout == "bshd":
        dout, q, k, v = (np.swapaxes(x, 1, 2) for x in (dout, q, k, v))
    dout, q, k, v = (np.asarray(x).astype(dtype) for x in (dout, q, k, v))
    n_k, d = k.shape[-2:]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    identity = np.broadcast_to(np.eye(n_k, dtype=dtype), k.shape[:-1] + (n_k,))
    p = attention_reference(q, k, identity, causal=causal, scale=scale, window=window,
                            chunk_size=chunk_size, softcap=softcap, alibi_slopes=alibi_slopes,
                            dtype=dtype)
    group = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    k_rep, v_rep = (np.repeat(x, group, axis=-3) if group > 1 else x for x in (k, v))

    def t(x):
        return np.swapaxes(x, -1, -2)

    chain = 1
    if softcap > 0:
        tanh = np.tanh(q @ t(k_rep) * dtype.type(scale) / dtype.type(softcap))
        chain = 1 - tanh * tanh
    out = p @ v_rep
    delta = (dout * out).sum(axis=-1, keepdims=True)
    ds = p * (dout @ t(v_rep) - delta) * chain
    dq, dk, dv = dtype.type(scale) * (ds @ k_rep), dtype.type(scale) * (t(ds) @ q), t(p) @ dout
    if group > 1:
        dk, dv = (x.reshape(x.shape[:-3] + (k.shape[-3], group) + x.shape[-2:]).sum(axis=-3)
                  for x in (dk, dv))
    if layout == "bshd":
        dq, dk, dv = (np.swapaxes(x, 1, 2) for x in (dq, dk, dv))
    return dq, dk, dv


def assert_gradients_close(got, dout, q, k, v, plain_dtype, **kwargs):
    oracle = np.longdouble if plain_dtype == np.float64 else np.float64
    ref = backward_reference(dout, q, k, v, dtype=np.dtype(oracle), **kwargs)
    plain = backward_reference(dout, q, k, v, dtype=np.dtype(plain_dtype), **kwargs)
    for name, g, r, p, like in zip(("dq", "dk", "dv"), got, ref, plain, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype, \
            f"{name}: {g.dtype}{g.shape}, expected {like.dtype}{like.shape}"
        errors = np.abs(g.astype(oracle) - r)
        plain_error = float(np.abs(p.astype(oracle) - r).max())
        assert_within_rule(errors, plain_error, tolerance(like.dtype) * float(np.abs(r).max()),
                           name)


# -- the cases ----------------------------------------------------------------------------------

N = 48  # a multiple of 2P for P = 2, 3, 4
SLOPES = np.array([0.3, 0.1, 0.05, 0.02], np.float32)

CASES = [
    # name, shapes (q, k, v) with the sequence as "n" / "nk", dtype, layout, keywords
    ("plain", ((2, 4, "n", 16), (2, 4, "n", 16), (2, 4, "n", 16)), "float32", "bhsd", {}),
    ("causal gqa dv", ((1, 4, "n", 24), (1, 2, "n", 24), (1, 2, "n", 40)), "float32", "bhsd",
     dict(causal=True)),
    ("window", ((1, 2, "n", 16),) * 3, "float32", "bhsd", dict(window=(5, 9))),
    ("causal window", ((1, 2, "n", 16),) * 3, "float32", "bhsd",
     dict(causal=True, window=(13, -1))),
    ("one-sided window", ((1, 2, "n", 16),) * 3, "float32", "bhsd", dict(window=(-1, 3))),
    ("alibi causal", ((1, 4, "n", 16), (1, 2, "n", 16), (1, 2, "n", 16)), "float32", "bhsd",
     dict(causal=True, alibi_slopes=SLOPES)),
    ("alibi window softcap", ((1, 4, "n", 16),) * 3, "float32", "bhsd",
     dict(window=(7, 4), alibi_slopes=SLOPES, softcap=3.0, scale=0.4)),
    ("bshd causal gqa", ((2, "n", 4, 16), (2, "n", 1, 16), (2, "n", 1, 16)), "float32", "bshd",
     dict(causal=True)),
    ("bshd window", ((1, "n", 2, 16),) * 3, "float32", "bshd", dict(window=(3, 3))),
    ("bshd alibi per batch", ((2, "n", 4, 8), (2, "n", 2, 8), (2, "n", 2, 8)), "float32",
     "bshd", dict(causal=True, window=(11, 0), alibi_slopes=np.stack([SLOPES, SLOPES[::-1]]))),
    ("two leading axes", ((2, 2, 2, "n", 8),) * 3, "float32", "bhsd", dict(causal=True)),
    ("one head 2-D", (("n", 16),) * 3, "float32", "bhsd", dict(causal=True)),
    ("float64 causal", ((1, 2, "n", 16),) * 3, "float64", "bhsd", dict(causal=True)),
    ("float16 causal", ((1, 2, "n", 16),) * 3, "float16", "bhsd", dict(causal=True)),
    ("bfloat16", ((1, 2, "n", 16),) * 3, "bfloat16", "bhsd", dict(window=(9, 0))),
    ("longer keys causal", ((1, 2, "n", 16), (1, 2, "nk", 16), (1, 2, "nk", 16)), "float32",
     "bhsd", dict(causal=True)),
    # local chunks that divide no part (parts of 12 to 24 rows, zigzag halves of 6 to 12)
    ("chunked causal gqa", ((1, 4, "n", 16), (1, 2, "n", 16), (1, 2, "n", 16)), "float32",
     "bhsd", dict(causal=True, chunk_size=7)),
    ("chunked", ((1, 2, "n", 16),) * 3, "float32", "bhsd", dict(chunk_size=10)),
    ("chunked window longer keys", ((1, 2, "n", 16), (1, 2, "nk", 16), (1, 2, "nk", 16)),
     "float32", "bhsd", dict(causal=True, window=(9, -1), chunk_size=20)),
    ("bshd chunked alibi", ((2, "n", 4, 8), (2, "n", 2, 8), (2, "n", 2, 8)), "float32", "bshd",
     dict(causal=True, chunk_size=5, alibi_slopes=SLOPES)),
    ("float64 chunked causal", ((1, 2, "n", 16),) * 3, "float64", "bhsd",
     dict(causal=True, chunk_size=11)),
]


def build(rng, shapes, dtype):
    sizes = {"n": N, "nk": 2 * N}
    arrays = []
    for shape in shapes:
        shape = tuple(sizes.get(s, s) for s in shape)
        arrays.append(rng.standard_normal(shape).astype(dtype))
    return arrays


def run_case(case, balance):
    name, shapes, dtype_name, layout, keywords = case
    dtype = dtype_named(dtype_name)
    rng = np.random.default_rng(zlib.crc32(f"{name} {balance}".encode()))  # same on all ranks
    q, k, v = build(rng, shapes, dtype)
    options = dict(keywords, layout=layout)
    common = dict(balance=balance, layout=layout)
    parts = [distributed.shard(x, **common) for x in (q, k, v)]
    out, lse = distributed.ring_attention(*parts, return_lse=True, balance=balance, **options)
    whole_out = distributed.unshard(out, **common)
    whole_lse = distributed.unshard(lse, axis=-1, **common)
    half = dtype.itemsize == 2
    plain = dtype if half else None
    if half:  # a half-precision output is compared as the rule compares half precision
        assert_close_to_reference(whole_out, q, k, v, plain_dtype=plain, **options)
    else:
        assert_close_to_reference(whole_out, q, k, v, lse=whole_lse, **options)
    dout = rng.standard_normal(whole_out.shape).astype(dtype)
    grads = distributed.ring_attention_backward(distributed.shard(dout, **common), *parts, out,
                                                lse, balance=balance, **options)
    whole = [distributed.unshard(g, **common) for g in grads]
    # the gradients of the ring's own output (the rule's oracle recomputes it)
    plain_dtype = dtype if half else (np.float64 if dtype == np.float64 else np.float32)
    assert_gradients_close(whole, dout, q, k, v, plain_dtype, **options)
    # ... and the single-process result, for the message when they differ
    single = cpuflash.attention(q, k, v, **options)
    return float(np.abs(single.astype(np.float64) - whole_out.astype(np.float64)).max())


def same_bits_again():
    """The ring gives the same bits when run again, and from parts in other memory orders."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, N, 16)).astype(np.float32) for _ in range(3))
    parts = [distributed.shard(x) for x in (q, k, v)]
    results = []
    for inputs in (parts, parts, [np.asfortranarray(x) for x in parts]):
        out, lse = distributed.ring_attention(*inputs, causal=True, return_lse=True)
        dout = np.asfortranarray(np.cos(out))
        results.append((out, lse) + distributed.ring_attention_backward(
            dout, *inputs, out, lse, causal=True))
    for again in results[1:]:
        for a, b in zip(results[0], again):
            np.testing.assert_array_equal(a, b)


def skipped_steps():
    """Steps whose keys no query of the rank sees are skipped, and the ring still turns."""
    q = np.ones((1, 1, N, 8), np.float32)
    for balance, keywords, expected in (("contiguous", {}, SIZE - 1 - RANK),
                                        ("zigzag", {}, 0),
                                        # each rank sees its own part and the one before
                                        ("contiguous", dict(window=(N // SIZE - 1, 0)),
                                         SIZE - 1 if RANK == 0 else SIZE - 2),
                                        # local chunks of a part's chunks: only its own
                                        ("contiguous", dict(chunk_size=N // SIZE), SIZE - 1),
                                        ("zigzag", dict(chunk_size=N // (2 * SIZE)),
                                         SIZE - 1)):
        part = distributed.shard(q, balance=balance)
        timings = {}
        distributed.ring_attention(part, part, part, causal=True, balance=balance,
                                   timings=timings, **keywords)
        assert timings["steps"] == SIZE and timings["skipped_steps"] == expected, \
            (balance, keywords, timings)


def peak_bytes(call):
    """The most memory numpy held at once during `call` (after a first, untraced call)."""
    call()
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def memory_bound():
    """A rank holds its own key/value part plus two in flight, whatever P: the ring's peak
    is one single-node call's on the same parts plus two parts (the backward: plus its three
    float32 dK/dV accumulators and dQ), and a few percent of a part for the running output.
    Large K (D = 256) and a small output (Dv = 8) make the parts the bulk of it."""
    rng = np.random.default_rng(5)
    q, k = (rng.standard_normal((1, 1, 256 * SIZE, 256)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, 1, 256 * SIZE, 8)).astype(np.float32)
    parts = [distributed.shard(x) for x in (q, k, v)]
    part = parts[1].nbytes + parts[2].nbytes
    out, lse = cpuflash.attention(*parts, return_lse=True)
    ring_out, ring_lse = distributed.ring_attention(*parts, return_lse=True)
    single = peak_bytes(lambda: cpuflash.attention(*parts, return_lse=True))
    ring = peak_bytes(lambda: distributed.ring_attention(*parts, return_lse=True))
    assert ring <= single + 2.25 * part, \
        f"forward: {ring / part:.2f} parts at the peak, one call takes {single / part:.2f}"
    single = peak_bytes(lambda: cpuflash.attention_backward(out, *parts, out, lse))
    ring = peak_bytes(lambda: distributed.ring_attention_backward(ring_out, *parts, ring_out,
                                                                  ring_lse))
    assert ring <= single + 5.25 * part + parts[0].nbytes, \
        f"backward: {ring / part:.2f} parts at the peak, one call takes {single / part:.2f}"


def correct():
    failures = 0
    for label, check in (("same bits again", same_bits_again), ("skipped steps", skipped_steps),
                         ("memory bound", memory_bound)):
        try:
            check()
            report(label, True)
        except Exception:
            failures += 1
            report(label, False, traceback.format_exc(limit=3))
    for balance in distributed.BALANCES:
        for case in CASES:
            label = f"{balance}: {case[0]}"
            try:
                difference = run_case(case, balance)
                report(label, True, f"largest difference from one process {difference:.3g}")
            except Exception:
                failures += 1
                report(label, False, traceback.format_exc(limit=3))
    return failures


def errors():
    """Bad calls: every rank must raise the same error, and the ring still works after."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, N, 16)).astype(np.float32) for _ in range(3))
    parts = [distributed.shard(x) for x in (q, k, v)]
    last = SIZE - 1
    bad = {
        "shard length": lambda: distributed.shard(np.zeros((1, 2, 2 * SIZE * 3 + 2, 4))),
        "odd part": lambda: distributed.ring_attention(*(p[..., :-1, :] for p in parts)),
        "contiguous shard": lambda: distributed.shard(np.zeros((1, 2, SIZE * 5 + 1, 4)),
                                                      balance="contiguous"),
        "shapes differ": lambda: distributed.ring_attention(
            *((p[..., :-2, :] if RANK == last else p) for p in parts)),
        "head dims differ": lambda: distributed.ring_attention(
            parts[0], parts[1], parts[2][..., :8] if RANK == last else parts[2]),
        "dtype on one rank": lambda: distributed.ring_attention(
            parts[0], parts[1].astype(np.int32) if RANK == last else parts[1], parts[2]),
        "keywords differ": lambda: distributed.ring_attention(*parts, causal=RANK == last),
        "bad window": lambda: distributed.ring_attention(*parts, window=(-2, 3)),
        "bad chunk_size": lambda: distributed.ring_attention_backward(
            parts[0], *parts, parts[0], np.zeros((1, 2, N // SIZE), np.float32), chunk_size=0),
        "chunk_size differs": lambda: distributed.ring_attention(
            *parts, chunk_size=8 if RANK == last else None),
        "bad balance": lambda: distributed.ring_attention(*parts, balance="round robin"),
        "lse shape": lambda: distributed.ring_attention_backward(
            parts[0], *parts, parts[0], np.zeros((1, 2, 3), np.float32)),
        "unshard shapes differ": lambda: distributed.unshard(
            parts[0][..., :-2, :] if RANK == 0 else parts[0]),
    }
    for case, call in bad.items():
        try:
            call()
            report(case, False, "no error")
        except (ValueError, TypeError) as exc:
            report(case, True, f"{type(exc).__name__}: {exc}")
    out = distributed.unshard(distributed.ring_attention(*parts, causal=True))
    ok = np.allclose(out, cpuflash.attention(q, k, v, causal=True), atol=1e-5)
    report("ring works after the errors", bool(ok))
    return int(not ok)


if __name__ == "__main__":
    LOG = open(Path(sys.argv[1]) / f"rank{RANK}.jsonl", "w")
    failures = sum({"correct": correct, "errors": errors}[mode]() for mode in sys.argv[2:])
    LOG.write(json.dumps({"rank": RANK, "done": failures}) + "\n")
    LOG.close()
    sys.exit(1 if failures else 0)
