"""Side-by-side speed comparison of cpuflash and its competitors.

This is the runner behind ``python -m cpuflash bench`` (which finds it in the repository's
``bench/`` folder: the benchmark tooling is not part of the installed package) and the helpers
that the pytest-benchmark suite and the scripts beside it share (FLOP counting, input making,
the competing implementations), so all of them count the same work and call the competitors the
same way. They import it as ``runner``: ``bench/`` is on ``sys.path`` for a script run from it
and for pytest's files in it.

How a case is measured (`measure`), following what makes numbers on a shared, noisy machine
comparable:

1. Every implementation gets the same inputs, in one process.
2. Each one is called once (compiling or loading its Numba code), and that result is checked
   against the float64 `cpuflash.reference.attention_reference` on the first and the last head
   before anything is timed, as llm.c does: a fast wrong kernel is reported as wrong, not timed.
3. The implementations are then timed interleaved (A, B, C, A, B, C, ...), and the best of the
   repeats is kept, so a burst of load from a neighbour hits all of them alike. Each sample
   starts after a short pause, so the thread pool of the previous implementation has stopped
   spinning (see `SETTLE_SECONDS`).

Speed is quoted in GFLOP/s of ``4 * B * Hq * (visible query-key pairs) * D`` (`flops`), the count
flash-attn's benchmarks use, so a causal case is not credited with the masked half.

The sgemm ceiling (`SgemmCeiling`) is sampled once per round of every case, in between the
competitors, and its best sample kept, so a busy moment hits it as it hits them. Where a
competitor still beats it, the report says the ceiling is not one (`sgemm_ceiling`) and gives no
"% of sgemm".

torch and matplotlib are optional: without torch the "torch" column is skipped and the sgemm
ceiling falls back to numpy's matmul; without matplotlib no plot is drawn.
"""

import datetime
import json
import math
import os
import platform
import sys
import time

import numpy as np

import cpuflash
from cpuflash.reference import attention_fa1, attention_reference, naive_attention

__all__ = [
    "IMPLEMENTATIONS", "cases", "case_label", "visible_pairs", "flops", "case_flops",
    "random_inputs", "skip_reason", "prepare", "reference_heads", "compare_with_references",
    "check_against_reference", "measure", "SgemmCeiling", "sgemm_ceiling",
    "measure_sgemm", "match_torch_threads", "run", "run_steps", "markdown_table", "write_markdown",
    "write_json", "write_plot", "machine_record", "command",
]

GiB = 1024 ** 3

# Competitors in the order of the table's columns.
IMPLEMENTATIONS = ("cpuflash", "torch", "fa1", "naive")

# naive_attention materializes the float32 scores of every head at once; past this it would
# compete with whatever else runs for memory (or swap) rather than measure anything.
NAIVE_SCORES_LIMIT_BYTES = 2 * GiB

# A timed sample shorter than this is dominated by timer and dispatch noise, so tiny cases
# repeat the call inside one sample.
MIN_SAMPLE_SECONDS = 0.02

# The competitors bring three thread pools (Numba's, torch's OpenMP, numpy's OpenBLAS), and
# each keeps its threads spinning for a while after a call (OpenBLAS for up to ~0.1 s). With as
# many threads as cores, the spinning threads of the previous implementation steal cores from
# the next one, which then waits on descheduled threads at every barrier (a small call slows
# down 10-100x on 2 cores). So each timed sample starts after a pause that outlasts the
# spinning. After the pause the cores have clocked down and the pool is asleep, so a call that
# is cheap is then called untimed for `WARM_SECONDS`, long enough to bring both back to what a
# user's loop of calls sees (a single untimed call is not: a small decode still runs 2x slower).
SETTLE_SECONDS = 0.15
CHEAP_CALL_SECONDS = 0.05
WARM_SECONDS = 0.03

# The matmul size of the sgemm ceiling: large enough for any BLAS to reach its peak.
SGEMM_SIZE = 4096

_CASE_KEYS = ("B", "Hq", "Hk", "Nq", "Nk", "D", "causal")


# -- the cases ----------------------------------------------------------------------------------

def _case(B, Hq, Hk, Nq, Nk, D, causal):
    return dict(zip(_CASE_KEYS, (B, Hq, Hk, Nq, Nk, D, bool(causal))))


def cases(quick=False):
    """The shapes to compare, as dicts with keys ``B, Hq, Hk, Nq, Nk, D, causal``.

    Parameters
    ----------
    quick : bool
        A few small shapes that run in well under a minute (a smoke run, not a measurement).

    Returns
    -------
    list of dict
        The full set is the project's targets: ``B1 H8 D128`` square at N = 1024, 2048, 4096,
        causal and not; ``D64`` at N = 2048; 32 heads at N = 1024; a batch of 4 short
        sequences; GQA with 32 query and 8 key/value heads; and a prefill chunk of 256 queries
        over 4096 keys (causal, bottom-right aligned).
    """
    if quick:
        return [
            _case(1, 8, 8, 512, 512, 128, False),
            _case(1, 8, 8, 1024, 1024, 128, False),
            _case(1, 8, 8, 1024, 1024, 128, True),
            _case(1, 8, 2, 256, 1024, 64, True),
        ]
    full = []
    for n in (1024, 2048, 4096):
        full.append(_case(1, 8, 8, n, n, 128, False))
        full.append(_case(1, 8, 8, n, n, 128, True))
    full += [
        _case(1, 8, 8, 2048, 2048, 64, False),
        _case(1, 32, 32, 1024, 1024, 128, False),
        _case(4, 8, 8, 512, 512, 64, False),
        _case(1, 32, 8, 2048, 2048, 128, True),  # GQA, 4 query heads per key/value head
        _case(1, 16, 16, 256, 4096, 128, True),  # a prefill chunk over a longer cache
    ]
    return full


def case_label(case):
    """A short name such as ``B1 H32/8 N2048 D128 causal`` or ``B1 H16 Nq256 Nk4096 D128``."""
    heads = f"H{case['Hq']}" if case["Hq"] == case["Hk"] else f"H{case['Hq']}/{case['Hk']}"
    if case["Nq"] == case["Nk"]:
        lengths = f"N{case['Nq']}"
    else:
        lengths = f"Nq{case['Nq']} Nk{case['Nk']}"
    label = f"B{case['B']} {heads} {lengths} D{case['D']}"
    return label + " causal" if case["causal"] else label


# -- counting work ------------------------------------------------------------------------------

def visible_pairs(n_q, n_k, causal=False, window=None):
    """Number of (query, key) pairs the visibility rules of `cpuflash.attention` leave.

    Query ``i`` sits over key column ``i + n_k - n_q`` (bottom-right alignment). ``causal``
    hides keys right of that column; ``window=(left, right)`` keeps the keys from ``left``
    before to ``right`` after it, ``-1`` meaning unbounded; with ``causal``, ``right`` is 0.
    Counted row by row, so every combination of ``n_q > n_k``, ``n_q < n_k`` and window is exact.
    """
    n_q, n_k = int(n_q), int(n_k)
    if n_q <= 0 or n_k <= 0:
        return 0
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if causal:
        right = 0
    diagonal = np.arange(n_q, dtype=np.int64) + (n_k - n_q)
    first = np.maximum(0, diagonal - left) if left >= 0 else np.zeros(n_q, dtype=np.int64)
    last = np.minimum(n_k - 1, diagonal + right) if right >= 0 else np.full(n_q, n_k - 1)
    return int(np.maximum(0, last - first + 1).sum())


def flops(B, Hq, Nq, Nk, D, causal=False, window=None):
    """FLOPs of an attention forward: ``4 * B * Hq * visible_pairs * D``.

    Two multiply-adds per visible pair and head-dim element: one for ``Q K^T``, one for ``P V``
    (the softmax is not counted, as in flash-attn's benchmarks). See `visible_pairs`.
    """
    return 4 * int(B) * int(Hq) * visible_pairs(Nq, Nk, causal, window) * int(D)


def case_flops(case):
    """`flops` of a case dict (see `cases`)."""
    return flops(case["B"], case["Hq"], case["Nq"], case["Nk"], case["D"], case["causal"])


# -- the implementations ------------------------------------------------------------------------

def random_inputs(case, seed=0, dtype=np.float32):
    """Standard-normal ``q (B, Hq, Nq, D)``, ``k`` and ``v (B, Hk, Nk, D)`` for a case."""
    rng = np.random.default_rng(seed)
    shape_q = (case["B"], case["Hq"], case["Nq"], case["D"])
    shape_k = (case["B"], case["Hk"], case["Nk"], case["D"])
    q = rng.standard_normal(shape_q, dtype=np.float32).astype(dtype, copy=False)
    k = rng.standard_normal(shape_k, dtype=np.float32).astype(dtype, copy=False)
    v = rng.standard_normal(shape_k, dtype=np.float32).astype(dtype, copy=False)
    return q, k, v


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def skip_reason(name, case):
    """Why implementation `name` cannot run `case` here, or None when it can."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {name!r}; expected one of {IMPLEMENTATIONS}")
    if name == "torch" and _torch() is None:
        return "torch is not installed"
    if name == "naive":
        scores = case["B"] * case["Hq"] * case["Nq"] * case["Nk"] * 4
        if scores > NAIVE_SCORES_LIMIT_BYTES:
            return f"its score matrices would take {scores / GiB:.1f} GiB"
    return None


def _torch_causal_mask(torch, n_q, n_k):
    """Boolean mask (True = visible) of bottom-right causal alignment.

    torch's ``is_causal`` aligns the diagonal top-left, which differs from cpuflash (and
    flash-attn) whenever ``n_q != n_k``; an explicit mask makes torch compute the same thing.
    """
    rows = torch.arange(n_q).unsqueeze(1) + (n_k - n_q)
    return torch.arange(n_k).unsqueeze(0) <= rows


def _torch_sdpa_arguments(torch, q, k, v, case):
    """Tensors (zero-copy views of the numpy inputs) and keywords for torch's SDPA."""
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    options = {}
    if case["Hq"] != case["Hk"]:
        if _version_tuple(torch.__version__) >= (2, 5):
            options["enable_gqa"] = True
        else:  # no GQA in this torch: give it full key/value heads, outside the timed call
            group = case["Hq"] // case["Hk"]
            tk, tv = (x.repeat_interleave(group, dim=1) for x in (tk, tv))
    if case["causal"] and case["Nq"] == case["Nk"]:
        options["is_causal"] = True
    elif case["causal"]:
        options["attn_mask"] = _torch_causal_mask(torch, case["Nq"], case["Nk"])
    return (tq, tk, tv), options


def _version_tuple(text):
    parts = []
    for part in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def prepare(name, q, k, v, case):
    """A zero-argument callable that runs implementation `name` on ``q, k, v``.

    All set-up that is not part of the attention itself (tensor views, masks, repeating
    key/value heads for implementations without GQA) happens here, outside the timed call. The
    callable returns the output as a numpy array ``(B, Hq, Nq, D)``.
    """
    causal = case["causal"]
    if name == "cpuflash":
        return lambda: cpuflash.attention(q, k, v, causal=causal)
    if name == "fa1":
        return lambda: attention_fa1(q, k, v, causal=causal)
    if name == "naive":
        group = case["Hq"] // case["Hk"]
        k_full = np.repeat(k, group, axis=1) if group > 1 else k
        v_full = np.repeat(v, group, axis=1) if group > 1 else v
        return lambda: naive_attention(q, k_full, v_full, causal=causal)
    if name == "torch":
        torch = _torch()
        import torch.nn.functional as functional

        tensors, options = _torch_sdpa_arguments(torch, q, k, v, case)

        def run_torch():
            with torch.no_grad():
                return functional.scaled_dot_product_attention(*tensors, **options).numpy()

        return run_torch
    raise ValueError(f"unknown implementation {name!r}; expected one of {IMPLEMENTATIONS}")


def _torch_backend(q, k, v, case):
    """The SDPA backend torch picks for a case (FLASH_ATTENTION, MATH, ...), or None.

    Recorded so that a slow torch number can be told apart from torch falling back to its
    unfused path. Uses a private torch function, hence the broad guard.
    """
    torch = _torch()
    if torch is None:
        return None
    try:
        from torch.nn.attention import SDPBackend

        tensors, options = _torch_sdpa_arguments(torch, q, k, v, case)
        choice = int(torch._fused_sdp_choice(*tensors, **options))
        for backend_name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
            if int(getattr(SDPBackend, backend_name)) == choice:
                return backend_name
        return str(choice)
    except Exception:
        return None


def _head_options(options, shape, b, h):
    """The `cpuflash.attention` options of head ``(b, h)`` alone, for a 2-D reference call."""
    selected = dict(options)
    slopes = options.get("alibi_slopes")
    if slopes is not None:
        slopes = np.asarray(slopes)
        selected["alibi_slopes"] = slopes[h] if slopes.ndim == 1 else slopes[b, h]
    for name in ("bias", "mask"):
        if options.get(name) is not None:
            selected[name] = np.broadcast_to(options[name], shape)[b, h]
    return selected


def reference_heads(q, k, v, causal=False, heads=None, **options):
    """The float64 reference of a few heads, and the error each result may have there.

    Parameters
    ----------
    q, k, v : (B, Hq, Nq, D), (B, Hk, Nk, D), (B, Hk, Nk, Dv) arrays
    causal : bool
    heads : list of (batch, query head), optional
        The heads to check; default the first and the last, which also catches a wrong
        query-to-key/value head mapping under GQA. One head keeps the dense reference small
        (128 MiB of float64 scores at N = 4096).
    **options
        Other `cpuflash.attention` arguments: ``scale``, ``window``, ``softcap``, and
        ``alibi_slopes``, ``bias`` and ``mask`` as given to `cpuflash.attention` (the checked
        head's part is taken out of them).

    Returns
    -------
    list of (b, h, reference, limit)
        `limit` is 4x the error of a plain float32 dense implementation plus a small floor: a
        gate against wrong results, looser than the accuracy tests.
    """
    batch, n_heads_q, n_q = q.shape[:3]
    group = n_heads_q // k.shape[1]
    scores_shape = (batch, n_heads_q, n_q, k.shape[2])
    if heads is None:
        heads = sorted({(0, 0), (batch - 1, n_heads_q - 1)})
    references = []
    for b, h in heads:
        args = (q[b, h], k[b, h // group], v[b, h // group])
        head_options = _head_options(options, scores_shape, b, h)
        ref = attention_reference(*args, causal=causal, **head_options)
        plain = attention_reference(*args, causal=causal, dtype=np.float32, **head_options)
        floor = 64 * float(np.finfo(np.float32).eps) * max(1.0, float(np.abs(ref).max(initial=0)))
        limit = 4 * float(np.abs(plain - ref).max(initial=0)) + floor
        references.append((b, h, ref, limit))
    return references


def compare_with_references(out, references):
    """Check `out` (B, Hq, Nq, Dv) against `reference_heads`; returns (ok, max_error, limit)."""
    ok, max_error, max_limit = True, 0.0, 0.0
    for b, h, ref, limit in references:
        error = float(np.abs(np.asarray(out[b, h], dtype=np.float64) - ref).max(initial=0))
        if not np.isfinite(error):  # NaN compares False with everything: make it fail
            error = math.inf
        ok = ok and error <= limit
        max_error, max_limit = max(max_error, error), max(max_limit, limit)
    return ok, max_error, max_limit


def check_against_reference(out, q, k, v, causal=False, heads=None, **options):
    """Compare `out` with the float64 reference on a few heads (see `reference_heads`).

    Returns
    -------
    ok : bool
    max_error : float
    limit : float
        The largest error allowed on the checked heads.
    """
    return compare_with_references(out, reference_heads(q, k, v, causal, heads, **options))


# -- timing -------------------------------------------------------------------------------------

def _time_once(fn, number):
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def settle(fn, cheap=True):
    """Wait until the other thread pools went quiet, then, for a `cheap` `fn`, call it untimed
    for `WARM_SECONDS` (see the comment at `SETTLE_SECONDS`)."""
    time.sleep(SETTLE_SECONDS)
    start = time.perf_counter()
    while cheap and time.perf_counter() - start < WARM_SECONDS:
        fn()


def _settled_sample(fn, number, call_seconds):
    """Seconds per call of `fn` over `number` calls, after `settle`."""
    settle(fn, call_seconds < CHEAP_CALL_SECONDS)
    return _time_once(fn, number)


def measure(case, implementations=IMPLEMENTATIONS, repeats=5, *, seed=0, between_rounds=None):
    """Time several implementations on one case, side by side in this process.

    Parameters
    ----------
    case : dict
        A shape from `cases`.
    implementations : sequence of str
        Names from `IMPLEMENTATIONS`.
    repeats : int
        Timed rounds; each round calls every implementation once, in turn, and the best round
        of each is kept.
    seed : int
        Seed of the random inputs.
    between_rounds : callable, optional
        Called after each timed round (`run` samples the sgemm ceiling there).

    Returns
    -------
    dict
        ``case``, ``label``, ``flops`` and ``results``: for each implementation a dict with
        ``status`` (``"ok"``, ``"skipped"``, ``"wrong"`` or ``"error"`` when it raised),
        ``seconds`` and ``gflops`` (best round; None unless ok), ``max_error`` and
        ``error_limit`` of the correctness check, ``calls_per_sample`` and ``reason`` (why not
        ok). ``torch_backend`` names the SDPA backend torch chose, when torch ran.

    Notes
    -----
    Each timed sample waits `SETTLE_SECONDS` first, and calls shorter than
    `CHEAP_CALL_SECONDS` are then called untimed for `WARM_SECONDS`: see the comment at
    `SETTLE_SECONDS`.
    """
    repeats = max(1, int(repeats))
    work = case_flops(case)
    q, k, v = random_inputs(case, seed)
    results, runners = {}, {}
    for name in implementations:
        reason = skip_reason(name, case)
        if reason is not None:
            results[name] = _result("skipped", reason=reason)
        else:
            runners[name] = prepare(name, q, k, v, case)

    # -- warm-up (compile or load from cache) and check before any timing
    calls_per_sample, call_seconds = {}, {}
    references = reference_heads(q, k, v, causal=case["causal"]) if runners else []
    for name in list(runners):
        try:
            out = runners[name]()
        except Exception as failure:  # one broken competitor must not end the whole run
            results[name] = _result("error", reason=f"{type(failure).__name__}: {failure}")
            del runners[name]
            continue
        ok, error, limit = compare_with_references(out, references)
        del out
        if not ok:
            results[name] = _result("wrong", max_error=error, error_limit=limit,
                                    reason=f"max error {error:.3g} > allowed {limit:.3g}")
            del runners[name]
            continue
        results[name] = _result("ok", max_error=error, error_limit=limit)
        call_seconds[name] = _settled_sample(runners[name], 1, 0.0)
        calls_per_sample[name] = max(1, math.ceil(MIN_SAMPLE_SECONDS /
                                                  max(call_seconds[name], 1e-9)))

    # -- interleaved rounds, best of `repeats`
    best = {name: math.inf for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            sample = _settled_sample(fn, calls_per_sample[name], call_seconds[name])
            best[name] = min(best[name], sample)
        if between_rounds is not None:
            between_rounds()
    for name, seconds in best.items():
        results[name].update(seconds=seconds, gflops=work / seconds / 1e9,
                             calls_per_sample=calls_per_sample[name])

    record = {"case": dict(case), "label": case_label(case), "flops": work,
              "results": {name: results[name] for name in implementations}}
    if "torch" in runners:
        record["torch_backend"] = _torch_backend(q, k, v, case)
    return record


def _result(status, seconds=None, gflops=None, max_error=None, error_limit=None, reason=None):
    return {"status": status, "seconds": seconds, "gflops": gflops, "max_error": max_error,
            "error_limit": error_limit, "calls_per_sample": None, "reason": reason}


class SgemmCeiling:
    """The practical ceiling: best GFLOP/s of a ``size^3`` float32 matmul (``2 * size^3`` FLOPs).

    Times ``numpy.matmul`` (the BLAS numpy was built with) and, when torch is installed,
    ``torch.matmul``, and keeps the faster: on some machines one of them runs a slow kernel
    (MKL on AMD CPUs, or OpenBLAS told a CPU type by ``OPENBLAS_CORETYPE``). Each `sample` times
    the next of them in turn, once, so `run` can sample it in between the competitors' rounds.
    """

    def __init__(self, size=SGEMM_SIZE):
        self.size = int(size)
        rng = np.random.default_rng(1)
        a = rng.standard_normal((self.size, self.size), dtype=np.float32)
        b = rng.standard_normal((self.size, self.size), dtype=np.float32)
        c = np.empty((self.size, self.size), dtype=np.float32)
        self.candidates = {f"numpy.matmul ({_numpy_blas()})": lambda: np.matmul(a, b, out=c)}
        torch = _torch()
        if torch is not None:
            ta, tb, tc = (torch.from_numpy(x) for x in (a, b, c))
            self.candidates["torch.matmul"] = lambda: torch.matmul(ta, tb, out=tc)
        self.seconds = {backend: [] for backend in self.candidates}
        self._turn = 0

    def sample(self):
        """Time the next candidate once (warmed up on its first turn: thread pool start, page
        faults of the output)."""
        backend = list(self.candidates)[self._turn % len(self.candidates)]
        self._turn += 1
        matmul = self.candidates[backend]
        if not self.seconds[backend]:
            matmul()
        self.seconds[backend].append(_settled_sample(matmul, 1, math.inf))

    def result(self):
        """``backend``, ``size``, ``seconds`` and ``gflops`` of the best sample,
        ``gflops_runs``: every sample of that backend, in order, and ``openblas_coretype``:
        that variable of the environment (None when unset; set, it can slow OpenBLAS down)."""
        sampled = {backend: times for backend, times in self.seconds.items() if times}
        if not sampled:
            raise ValueError("the sgemm ceiling was not sampled")
        backend = min(sampled, key=lambda name: min(sampled[name]))
        flops = 2 * self.size ** 3
        return {"backend": backend, "size": self.size, "seconds": min(sampled[backend]),
                "gflops": flops / min(sampled[backend]) / 1e9,
                "gflops_runs": [flops / seconds / 1e9 for seconds in sampled[backend]],
                "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE")}


def measure_sgemm(repeats=3, size=SGEMM_SIZE):
    """`SgemmCeiling` on its own: each candidate sampled `repeats` times, interleaved.

    Returns a dict with ``backend``, ``size``, ``seconds``, ``gflops`` and ``gflops_runs``.
    """
    ceiling = SgemmCeiling(size)
    for _ in range(max(1, int(repeats)) * len(ceiling.candidates)):
        ceiling.sample()
    return ceiling.result()


def sgemm_ceiling(report):
    """The report's sgemm ceiling if it is one, and otherwise why not.

    Returns
    -------
    ceiling : dict or None
        ``report["sgemm"]``, or None when there is none or some competitor ran faster than it.
    note : str or None
        Why the ceiling is not used, for the table.

    Notes
    -----
    Attention's FLOPs are matmul FLOPs, so no competitor can really beat a good sgemm; one that
    does means the ceiling came out low, because the machine was busy whenever sgemm was
    sampled, or because this BLAS is slow on this CPU. Printing such a share (above 100%)
    or capping it at 100% would both show a number that was not measured; taking the CPU's FMA
    peak instead would need its clock under load and its FMA units, which Python cannot read
    reliably (turbo, AVX-512 clocks, double-pumped units). So the ceiling is reported as
    unreliable, and the table leaves out the "% of sgemm" column.
    """
    sgemm = report.get("sgemm")
    if not sgemm:
        return None, None
    above = [(result["gflops"], name, record["label"]) for record in report["cases"]
             for name, result in record["results"].items()
             if result["status"] == "ok" and result["gflops"] > sgemm["gflops"]]
    if not above:
        return sgemm, None
    gflops, name, label = max(above)
    coretype = sgemm.get("openblas_coretype")
    slow_blas = f", OPENBLAS_CORETYPE={coretype} is set" if coretype else ""
    return None, (f"{name} reached {gflops:.1f} GFLOP/s on {label}, more than sgemm: the machine "
                  "was busy while sgemm was measured (or its BLAS is slow on this "
                  f"CPU{slow_blas}), so no % of sgemm is given")


def _numpy_blas():
    try:
        config = np.show_config(mode="dicts")
        return config["Build Dependencies"]["blas"]["name"]
    except Exception:  # older numpy or an unusual build: the name is only informative
        return "BLAS"


def match_torch_threads():
    """Give torch as many threads as Numba has, so neither side gets more cores.

    Returns torch's thread count afterwards, or None without torch.
    """
    import numba

    torch = _torch()
    if torch is None:
        return None
    torch.set_num_threads(numba.get_num_threads())
    return torch.get_num_threads()


def machine_record():
    """Machine, versions and threads, for the JSON report."""
    import llvmlite
    import numba

    from cpuflash._threads import threading_layer

    torch = _torch()
    versions = {"python": platform.python_version(), "cpuflash": cpuflash.__version__,
                "numpy": np.__version__, "numba": numba.__version__,
                "llvmlite": llvmlite.__version__,
                "torch": torch.__version__ if torch is not None else None}
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": cpuflash.cpu_info(),
        "platform": platform.platform(),
        "versions": versions,
        "threads": {"numba": numba.get_num_threads(), "threading_layer": threading_layer(),
                    "torch": torch.get_num_threads() if torch is not None else None},
    }


def run(case_list, implementations=IMPLEMENTATIONS, repeats=5, *, sgemm_size=SGEMM_SIZE,
        progress=None):
    """Measure every case and the sgemm ceiling; the report the writers below take.

    Parameters
    ----------
    case_list : list of dict
        Shapes from `cases`.
    implementations : sequence of str
    repeats : int
    sgemm_size : int
    progress : callable, optional
        Called with a short description before each of the ``run_steps(case_list)`` steps, and
        with None when all are done (for a progress bar).

    Returns
    -------
    dict
        `machine_record` plus ``implementations``, ``repeats``, ``cases`` (one `measure` record
        per case) and ``sgemm``: `SgemmCeiling.result` over a sample of each candidate before
        the cases and one after every round of every case, with ``reliable`` (False when a
        competitor beat it, see `sgemm_ceiling`) and ``note``.
    """
    def step(what):
        if progress is not None:
            progress(what)

    match_torch_threads()
    report = machine_record()
    report.update(implementations=list(implementations), repeats=int(repeats), cases=[])
    # The ceiling is sampled after every round of every case, so a neighbour's burst that slows
    # the competitors down slows some of its samples down too, and its best sample is taken
    # while the machine is as quiet as the competitors' best rounds were.
    step("sgemm ceiling")
    ceiling = SgemmCeiling(sgemm_size)
    for _ in ceiling.candidates:
        ceiling.sample()
    for case in case_list:
        step(case_label(case))
        report["cases"].append(measure(case, implementations, repeats,
                                       between_rounds=ceiling.sample))
    step(None)
    report["sgemm"] = ceiling.result()
    usable, note = sgemm_ceiling(report)
    report["sgemm"].update(reliable=usable is not None, note=note)
    return report


def run_steps(case_list):
    """How many times `run` reports progress for `case_list` (before the final None)."""
    return len(case_list) + 1


# -- writing the report -------------------------------------------------------------------------

def _gflops_of(record, name):
    result = record["results"].get(name)
    return result["gflops"] if result and result["status"] == "ok" else None


def _cell(result):
    if result is None or result["status"] == "skipped":
        return "-"
    if result["status"] in ("wrong", "error"):
        return result["status"].upper()
    return f"{result['gflops']:.1f}"


# The CPU classes the project measured, by their row of the README's table "Performance: what
# speed to expect", whose first column of ratios (the forward over torch SDPA with the full
# `python -m cpuflash bench`, lowest and highest over the cases) is read from the README itself:
# one place for those figures. `expectation` sets a user's run beside them.
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
CPU_CLASSES = (
    # (the README's row, test on cpu_info())
    ("AMD EPYC Zen 3 (AVX2)", lambda m: m["llvm_cpu"] in ("znver2", "znver3")),
    ("AMD EPYC Zen 4 (AVX-512)", lambda m: m["llvm_cpu"] == "znver4"),
    ("AMD EPYC Zen 5 (AVX-512)", lambda m: m["llvm_cpu"] == "znver5"),
    ("Intel Xeon, Sapphire Rapids class (AMX)", lambda m: "amx-tile" in m["simd"]),
)


def readme_ratios(name, readme=README):
    """(lowest, highest) cpuflash/torch of the README's row `name`: the cell ``a-bx`` after it."""
    with open(readme, encoding="utf-8") as f:
        for line in f:
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if cells[0] == name and len(cells) > 1:
                low, high = cells[1].rstrip("x").split("-")
                return float(low), float(high)
    raise ValueError(f"the README has no row {name!r} in its speed table")


def cpu_class(machine):
    """``(name, (lowest, highest))`` of the first of `CPU_CLASSES` that `machine` (a
    `cpuflash.cpu_info` dict) belongs to, or None for a class the project has not measured."""
    for name, belongs in CPU_CLASSES:
        if belongs(machine):
            return name, readme_ratios(name)
    return None


def expectation(report):
    """A line setting this run's cpuflash/torch ratios beside the project's figures for the
    machine's class (`CPU_CLASSES`), or saying that there are none."""
    ratios = [ours / theirs for record in report["cases"]
              for ours, theirs in [(_gflops_of(record, "cpuflash"), _gflops_of(record, "torch"))]
              if ours and theirs]
    machine = report["machine"]
    found = cpu_class(machine)
    mine = (f"this run: cpuflash at {min(ratios):.2f}-{max(ratios):.2f}x torch SDPA"
            if ratios else "this run measured no cpuflash/torch ratio")
    if found is None:
        return (f"{mine}. The project has no figures for this CPU ({machine['llvm_cpu']}, "
                f"{' '.join(machine['simd']) or 'no SIMD features read'}); see the README.")
    name, (low, high) = found
    return (f"{mine}. On {name} the project measured {low:.2f}-{high:.2f}x with the full "
            f"benchmark (README, 'What speed to expect').")


def markdown_table(report):
    """The report as a markdown table, with notes on the ceiling, skips and wrong results.

    Columns: the case, GFLOP/s of each implementation, the ratio cpuflash / torch, and
    cpuflash's share of the sgemm ceiling (left out when the ceiling is unreliable, see
    `sgemm_ceiling`).
    """
    names = list(report["implementations"])
    sgemm, ceiling_note = sgemm_ceiling(report)
    header = ["case"] + [f"{name} GFLOP/s" for name in names] + ["cpuflash/torch"]
    header += ["% of sgemm"] if sgemm else []
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    notes = []
    for record in report["cases"]:
        row = [record["label"]] + [_cell(record["results"].get(name)) for name in names]
        ours, theirs = _gflops_of(record, "cpuflash"), _gflops_of(record, "torch")
        row.append(f"{ours / theirs:.2f}x" if ours and theirs else "-")
        if sgemm:
            row.append(f"{100 * ours / sgemm['gflops']:.0f}%" if ours else "-")
        lines.append("| " + " | ".join(row) + " |")
        for name in names:
            result = record["results"].get(name)
            if result is not None and result["status"] != "ok":
                notes.append(f"{record['label']}: {name} {result['status']} ({result['reason']})")
        backend = record.get("torch_backend")
        if backend and backend != "FLASH_ATTENTION":
            notes.append(f"{record['label']}: torch used its {backend} backend")
    threads = report.get("threads", {})
    text = "\n".join(lines) + "\n\n"
    measured = report.get("sgemm")
    if measured:
        samples = len(measured.get("gflops_runs") or [])
        text += (f"sgemm ceiling: {measured['gflops']:.1f} GFLOP/s ({measured['backend']}, "
                 f"{measured['size']}^3 float32)"
                 + (f", the best of {samples} samples taken between the rounds" if samples > 1
                    else "") + ".\n")
    if ceiling_note:
        text += f"The sgemm ceiling is unreliable: {ceiling_note}.\n"
    text += (f"float32, {threads.get('numba', '?')} threads "
             f"({threads.get('threading_layer', '?')}), best of {report.get('repeats', '?')} "
             "interleaved rounds; FLOPs = 4 * B * Hq * visible pairs * D.\n")
    if notes:
        text += "\n" + "\n".join(f"- {note}" for note in notes) + "\n"
    return text


def write_markdown(report, path):
    """Write `markdown_table` with a one-line header naming the machine and date."""
    machine = report.get("machine", {})
    title = (f"# cpuflash benchmark\n\n{machine.get('model', 'unknown CPU')}, "
             f"{report.get('date', '')}\n\n")
    with open(path, "w", encoding="ascii", errors="replace") as f:
        f.write(title + markdown_table(report))
    return path


def _json_ready(value):
    """Turn numpy scalars and infinities into what `json` writes as standard JSON."""
    if isinstance(value, dict):
        return {str(key): _json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(item) for item in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def write_json(report, path):
    """Write the report as JSON (machine info, versions, threads, date, every number)."""
    with open(path, "w", encoding="ascii") as f:
        json.dump(_json_ready(report), f, indent=2)
        f.write("\n")
    return path


def _plot_series(report):
    """The square, non-causal, D = 128 cases of the largest (B, Hq, Hk) group, by N."""
    groups = {}
    for record in report["cases"]:
        case = record["case"]
        if case["Nq"] == case["Nk"] and not case["causal"] and case["D"] == 128:
            groups.setdefault((case["B"], case["Hq"], case["Hk"]), []).append(record)
    if not groups:
        return None, []
    key = max(groups, key=lambda g: len(groups[g]))
    return key, sorted(groups[key], key=lambda record: record["case"]["Nq"])


def write_plot(report, path):
    """Plot GFLOP/s against N per implementation, with the sgemm ceiling as a line.

    Uses the square non-causal ``D = 128`` cases. Returns ``(written, message)``: the plot
    is skipped, with the reason in `message`, when matplotlib is not importable or no case fits.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False, "matplotlib is not installed (pip install matplotlib); plot skipped"
    group, records = _plot_series(report)
    if not records:
        return False, "no square non-causal D=128 case to plot; plot skipped"
    # A Figure with its own Agg canvas: no pyplot global state, no display backend needed.
    figure = Figure(figsize=(8.4, 4.2))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    lengths = [record["case"]["Nq"] for record in records]
    for name in report["implementations"]:
        points = [(n, _gflops_of(record, name)) for n, record in zip(lengths, records)]
        points = [(n, g) for n, g in points if g is not None]
        if points:
            axes.plot(*zip(*points), marker="o", label=name)
    sgemm, _ = sgemm_ceiling(report)  # no line where it is not a ceiling
    if sgemm:
        axes.axhline(sgemm["gflops"], color="gray", linestyle="--",
                     label=f"sgemm {sgemm['size']}^3 ({sgemm['backend'].split()[0]})")
    batch, heads_q, _ = group
    threads = report.get("threads", {}).get("numba", "?")
    axes.set_xscale("log", base=2)
    axes.set_xticks(lengths, [str(n) for n in lengths])
    axes.set_xlabel("sequence length N")
    axes.set_ylabel("GFLOP/s")
    axes.set_ylim(bottom=0)
    axes.set_title(f"float32 attention forward, B{batch} H{heads_q} D128, {threads} threads")
    axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside the lines, not on them
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True, f"wrote {path}"


# -- the command line ---------------------------------------------------------------------------

def _progress_reporter(total):
    """A callback for `run`: a tqdm bar, or one line per step without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None

    if tqdm is not None:
        bar = tqdm(total=total, desc="bench", unit="step", file=sys.stderr, ascii=True)

        def advance_bar(what):
            if advance_bar.started:
                bar.update(1)
            advance_bar.started = True
            if what is None:
                bar.close()
            else:
                bar.set_postfix_str(what)

        advance_bar.started = False
        return advance_bar

    done = [0]

    def print_line(what):
        if what is not None:
            done[0] += 1
            print(f"[{done[0]}/{total}] {what}", file=sys.stderr, flush=True)

    return print_line


def command(quick=False, out="cpuflash-bench", repeats=None, command_line=None):
    """``python -m cpuflash bench``: measure, print the table, write the report to `out`.

    Returns the exit status: 1 when an implementation gave a wrong result or raised, else 0.
    """
    case_list = cases(quick=quick)
    repeats = repeats or (3 if quick else 5)
    report = run(case_list, IMPLEMENTATIONS, repeats,
                 progress=_progress_reporter(run_steps(case_list)))
    if command_line is not None:
        report["command"] = command_line

    os.makedirs(out, exist_ok=True)
    print(markdown_table(report))
    print(expectation(report))
    write_json(report, os.path.join(out, "bench.json"))
    write_markdown(report, os.path.join(out, "bench.md"))
    _, plot_message = write_plot(report, os.path.join(out, "bench.png"))
    print(f"wrote {os.path.join(out, 'bench.json')} and bench.md; {plot_message}")
    failed = [(record["label"], name, result) for record in report["cases"]
              for name, result in record["results"].items()
              if result["status"] in ("wrong", "error")]
    for label, name, result in failed:
        print(f"error: {name} on {label}: {result['status']}, {result['reason']}",
              file=sys.stderr)
    return 1 if failed else 0
