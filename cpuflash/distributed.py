"""Ring attention over MPI: one attention spread over many processes along the sequence.

``import cpuflash.distributed`` needs mpi4py and an MPI library (``pip install -e ".[mpi]"`` in
a clone); ``import cpuflash`` alone never imports them.

Sequence parallelism on a ring: each of the P ranks keeps its part of the queries, and the
key/value parts travel around the ring, one hop per step. At step ``s`` rank ``r`` holds the
keys and values of rank ``(r - s) mod P``; it attends its queries to them with
`cpuflash.attention` and merges the partial result into a running ``(out, lse)`` with
`cpuflash.merge_states`, which is exact (softmax over disjoint key sets combined through their
log-sum-exps). While one part is computed the next is in flight (non-blocking, on contiguous
buffers): a rank holds its own part and at most two more.

Positions are global. A (query chunk, key chunk) pair is one call of the single-node API, whose
rules align the diagonal bottom-right within that call; `pair_call` turns the global rule
(causal, window, ALiBi) into that call's arguments: a pair wholly past the rule is skipped, a
band that misses the call's own diagonal is sliced until it touches it, and ALiBi off the
diagonal becomes a Toeplitz `bias` view of O(N) memory. With `chunk_size` a pair is first cut
at the edges of the whole sequence's local chunks (`local_pieces`; a call's own chunks would
start at its first key), and a pair that shares no local chunk is skipped.

The backward moves the dK/dV accumulators around the ring behind their K/V: each rank adds its
contribution (`cpuflash.attention_backward` on that key part, with the global `out` and `lse`,
is that part's exact share) and passes them on; after P hops they are home. The sums run in a
fixed order, so results are bitwise reproducible for a given P.

``balance="zigzag"`` cuts the sequence into 2P chunks and gives rank r chunks r and 2P-1-r, so
that every rank does the same causal work; ``"contiguous"`` gives rank r the r-th of P chunks.
"""

import dataclasses
import time

import numpy as np

import cpuflash
from cpuflash import _extras, _validate

try:
    from mpi4py import MPI
except ImportError as exc:
    raise _extras.missing("cpuflash.distributed", "mpi4py and an MPI library", "mpi") from exc

__all__ = ["ring_attention", "ring_attention_backward", "shard", "unshard", "pair_call"]

BALANCES = ("zigzag", "contiguous")
LAYOUTS = ("bhsd", "bshd")

# one tag per array that travels, so the messages of different arrays never match each other
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 11, 12, 13, 14


# -- the global rule as the arguments of one call ---------------------------------------------

@dataclasses.dataclass(frozen=True)
class PairCall:
    """How one (query chunk, key chunk) pair is computed by a single-node call.

    The call reads the first `n_q` rows of the query chunk and the first `n_k` rows of the key
    chunk (the rows cut off see nothing of the other chunk) with `causal` and `window`; for a
    key ``j`` and query ``i`` of the call, the global offset ``j_g - i_g - (Nk - Nq)`` (the
    whole sequence's own bottom-right alignment) is the call's ``j - i - (n_k - n_q)`` plus
    `shift`, which is what ALiBi needs.
    """

    n_q: int
    n_k: int
    causal: bool
    window: tuple  # or None
    shift: int  # None for a call that joins chunks (no positions: no ALiBi)

    @property
    def plain(self):
        """Every query of the chunk sees every key of the chunk, with no position rule."""
        return not self.causal and self.window is None


def pair_call(q_start, n_q, k_start, n_k, *, offset=0, causal=False, window=None):
    """The call that computes queries ``q_start + [0, n_q)`` against keys ``k_start + [0, n_k)``
    of a whole sequence whose keys sit `offset` (``Nk - Nq``) past its queries; None when no
    query of the chunk sees a key of the other.

    Visibility of the whole sequence, in the global offset ``d = j_g - i_g - offset``: causal
    means ``d <= 0``, a window ``-left <= d <= right``. A call sees ``d_call = j - i - (n_k -
    n_q)``, which is ``d - shift``. When the band of allowed ``d_call`` misses 0 it is not a
    window the call can take (both sides must be ``>= -1``); then the rows on the far side of
    it see nothing, and dropping them shifts ``d_call`` back onto the band: the last ``m``
    queries (``d_call`` falls by ``m``) or the last ``m`` keys (it rises by ``m``).
    """
    if n_q <= 0 or n_k <= 0:
        return None
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    shift = (n_k - n_q) + k_start - q_start - offset
    low = None if left < 0 else -left - shift  # the band of d_call, None: unbounded
    high = None if right < 0 else right - shift
    # d_call of the chunk pair spans [1 - n_k, n_q - 1]
    if (low is not None and low > n_q - 1) or (high is not None and high < 1 - n_k):
        return None
    if low is not None and low > 0:  # the last `low` queries see nothing
        n_q, shift = n_q - low, shift + low
        high, low = high - low if high is not None else None, 0
    elif high is not None and high < 0:  # the last `-high` keys are seen by no query
        n_k, shift = n_k + high, shift + high
        low, high = low - high if low is not None else None, 0
    if low is not None and low <= 1 - n_k:  # the band covers that side of the pair
        low = None
    if high is not None and high >= n_q - 1:
        high = None
    left, right = -1 if low is None else -low, -1 if high is None else high
    if (left, right) == (-1, -1):
        return PairCall(n_q, n_k, False, None, shift)
    if (left, right) == (-1, 0):
        return PairCall(n_q, n_k, True, None, shift)
    return PairCall(n_q, n_k, False, (left, right), shift)


def chunks(rank, n_rows, size, balance):
    """The chunks of `rank`'s part of `n_rows` rows: ``[(row in the part, rows, row in the
    whole sequence)]``."""
    if balance == "zigzag":
        c = n_rows // 2
        return [(0, c, rank * c), (c, c, (2 * size - 1 - rank) * c)]
    return [(0, n_rows, rank * n_rows)]


def local_pieces(g_q, n_q, g_k, n_k, chunk_size, offset=0):
    """Queries ``g_q + [0, n_q)`` and keys ``g_k + [0, n_k)`` cut at the edges of the local
    chunks of `chunk_size` positions (a query's position is its row plus `offset`, the rule's
    bottom-right alignment): ``[(q_lo, n_q, k_lo, n_k)]`` counted from the pair's first rows,
    one piece per local chunk that both meet, in order; the pieces' rows are disjoint. The
    whole pair when `chunk_size` is None.

    A call's own `chunk_size` would cut its keys from its first one, not at the global edges,
    so a pair is computed as its pieces, each without `chunk_size`.
    """
    if chunk_size is None:
        return [(0, n_q, 0, n_k)]
    if n_q <= 0 or n_k <= 0:
        return []
    q_pos = g_q + offset
    first = max(q_pos, g_k) // chunk_size
    last = (min(q_pos + n_q, g_k + n_k) - 1) // chunk_size
    pieces = []
    for c in range(first, last + 1):
        lo, hi = c * chunk_size, (c + 1) * chunk_size
        q_lo, k_lo = max(q_pos, lo), max(g_k, lo)
        pieces.append((q_lo - q_pos, min(q_pos + n_q, hi) - q_lo,
                       k_lo - g_k, min(g_k + n_k, hi) - k_lo))
    return pieces


def _pair_calls(g_q, n_q, g_k, n_k, *, offset, causal, window, chunk_size):
    """The calls of one (query chunk, key chunk) pair: ``[(q_lo, k_lo, PairCall)]`` counted
    from the pair's first rows."""
    calls = []
    for q_lo, m_q, k_lo, m_k in local_pieces(g_q, n_q, g_k, n_k, chunk_size, offset):
        p = pair_call(g_q + q_lo, m_q, g_k + k_lo, m_k, offset=offset, causal=causal,
                      window=window)
        if p is not None:
            calls.append((q_lo, k_lo, p))
    return calls


def step_calls(q_chunks, k_chunks, *, offset=0, causal=False, window=None, chunk_size=None,
               fuse=True):
    """The calls of one ring step: ``[(q_lo, k_lo, PairCall)]`` with rows counted in the parts.

    With `chunk_size`, each pair is cut into its `local_pieces` first. With `fuse`, pairs
    without a position rule are joined: one call for a query chunk that sees every key chunk
    whole, one call for the parts when every pair is so. ALiBi needs positions, so it is
    computed pair by pair (``fuse=False``).
    """
    pairs = [[_pair_calls(g_q, n_q, g_k, n_k, offset=offset, causal=causal, window=window,
                          chunk_size=chunk_size)
              for _, n_k, g_k in k_chunks] for _, n_q, g_q in q_chunks]
    n_q_all = sum(n for _, n, _ in q_chunks)
    n_k_all = sum(n for _, n, _ in k_chunks)

    def whole(calls, n_q, n_k):
        # joined only where the one call is both chunks whole: beside a one-key (or one-query)
        # chunk a plain call may have dropped the rows that see nothing
        p = calls[0][2] if len(calls) == 1 else None
        return p is not None and p.plain and (p.n_q, p.n_k) == (n_q, n_k)

    plain = [all(whole(calls, n_q, n_k) for calls, (_, n_k, _) in zip(row, k_chunks))
             for row, (_, n_q, _) in zip(pairs, q_chunks)]
    if fuse and all(plain) and n_q_all and n_k_all:
        return [(0, 0, PairCall(n_q_all, n_k_all, False, None, None))]
    calls = []
    for (q_lo, n_q, _), row, joined in zip(q_chunks, pairs, plain):
        if fuse and joined and n_k_all:
            calls.append((q_lo, 0, PairCall(n_q, n_k_all, False, None, None)))
            continue
        calls.extend((q_lo + q_in, k_lo + k_in, p)
                     for (k_lo, _, _), pieces in zip(k_chunks, row) for q_in, k_in, p in pieces)
    return calls


def alibi_bias(slopes, n_q, n_k, shift, dtype):
    """ALiBi at a shifted diagonal as a bias: ``-slope * |j - i - (n_k - n_q) + shift|``, shape
    ``slopes.shape + (n_q, n_k)``, a Toeplitz view of one row of ``n_q + n_k - 1`` values per
    head (no ``n_q x n_k`` array)."""
    slopes = np.asarray(slopes, dtype=np.float64)
    t = np.arange(n_q + n_k - 1)  # t = j - i + n_q - 1
    distance = np.abs(t - (n_k - 1) + shift)
    base = np.ascontiguousarray((-slopes[..., None] * distance).astype(dtype))
    start = base[..., n_q - 1:]  # (i, j) reads base[..., n_q - 1 - i + j]
    item = base.itemsize
    return np.lib.stride_tricks.as_strided(start, shape=slopes.shape + (n_q, n_k),
                                           strides=base.strides[:-1] + (-item, item),
                                           writeable=False)


# -- arguments: checked on each rank, agreed by all ---------------------------------------------

def _communicator(comm):
    if comm is None:
        return MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"`comm` must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD) or "
                        f"None, got {type(comm).__name__}")
    return comm


def _agree(comm, check, signature_of):
    """Run `check` (this rank's validation, returning what the call needs) and agree with
    every rank: the same error is raised on all of them when any rank's check failed or when
    the ranks' signatures (a dict of what must match) differ; otherwise `check`'s result."""
    error, result, signature = None, None, None
    try:
        result = check()
        signature = signature_of(result)
    except (ValueError, TypeError) as exc:
        error = (type(exc).__name__, str(exc))
    gathered = comm.allgather((error, signature))
    size = comm.Get_size()
    for rank, (err, _) in enumerate(gathered):
        if err is not None:
            kind = TypeError if err[0] == "TypeError" else ValueError
            where = f" (on rank {rank} of {size})" if size > 1 else ""
            raise kind(err[1] + where) from None
    first = gathered[0][1]
    for rank, (_, sig) in enumerate(gathered[1:], 1):
        for name, value in sig.items():
            if value != first[name]:
                raise ValueError(f"{name} must be the same on every rank, got {first[name]} on "
                                 f"rank 0 and {value} on rank {rank}") from None
    return result


def _array(name, x):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"`{name}` must be a numpy array, got {type(x).__name__}")
    return x


def _choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, choices))}, got "
                         f"{value!r}")


def _seq_axis(x, layout):
    """The sequence axis of a q/k/v-shaped array in `layout`."""
    return 1 if layout == "bshd" else x.ndim - 2


def _rows(x, axis, start, stop):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def _heads_first(x, layout):
    """`x` as (..., heads, rows, dim), the view `cpuflash.attention` takes with "bhsd"."""
    return np.swapaxes(x, 1, 2) if layout == "bshd" else x


def _lse_shape(q, layout):
    if layout == "bshd":
        return (q.shape[0], q.shape[2], q.shape[1])
    return q.shape[:-1]


def _divides(name, n_rows, size, balance):
    """A part's length must let the whole sequence cut into the balance's equal chunks."""
    if balance == "zigzag" and n_rows % 2:
        raise ValueError(f"`{name}` has {n_rows} rows of the sequence on this rank; with "
                         f"balance='zigzag' a rank holds two equal chunks, so the part's length "
                         f"must be even (the sequence length a multiple of 2P = {2 * size})")


def _forward_check(q, k, v, *, causal, scale, window, chunk_size, softcap, alibi_slopes, layout,
                   balance, size):
    """This rank's check of the forward's arguments (the single-node API checks what it can
    on the parts' first zero rows: dtypes, heads, head dims, scalars, slopes)."""
    q, k, v = _array("q", q), _array("k", k), _array("v", v)
    _choice("layout", layout, LAYOUTS)
    _choice("balance", balance, BALANCES)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2 or (layout == "bshd" and x.ndim != 4):
            expected = "4-D (batch, seqlen, heads, dim)" if layout == "bshd" else \
                "at least 2-D (..., seqlen, dim)"
            raise ValueError(f"`{name}` must be {expected} with layout={layout!r}, got shape "
                             f"{x.shape}")
    cpuflash.attention(*(_rows(x, _seq_axis(x, layout), 0, 0) for x in (q, k, v)),
                       causal=causal, scale=scale, window=window, chunk_size=chunk_size,
                       softcap=softcap, alibi_slopes=alibi_slopes, layout=layout)
    axis = _seq_axis(q, layout)
    _divides("q", q.shape[axis], size, balance)
    _divides("k", k.shape[axis], size, balance)
    return q, k, v


def _forward_signature(args, **keywords):
    q, k, v = args
    alibi = keywords.pop("alibi_slopes")
    signature = {f"the shape of `{n}` (each rank holds an equal part)": x.shape
                 for n, x in (("q", q), ("k", k), ("v", v))}
    signature["the dtype of `q`"] = str(q.dtype)
    signature.update({f"`{name}`": tuple(value) if name == "window" and value is not None
                      else value for name, value in keywords.items()})
    signature["`alibi_slopes`"] = None if alibi is None else np.asarray(alibi).tolist()
    return signature


# -- the ring -----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Ring:
    """One call's ring: who is where, the chunk layout and the single-node keywords."""

    comm: object
    size: int
    rank: int
    layout: str
    balance: str
    causal: bool
    window: object
    chunk_size: object  # an int, or None
    alibi: object  # slopes in the compute dtype, or None
    keywords: dict  # scale and softcap
    compute_dtype: object
    n_q: int  # rows of this rank's parts
    n_k: int
    timings: dict

    def __post_init__(self):
        self.offset = self.size * (self.n_k - self.n_q)  # Nk - Nq of the whole sequence
        self.q_chunks = chunks(self.rank, self.n_q, self.size, self.balance)
        self.timings.update(compute_s=0.0, wait_s=0.0, steps=0, skipped_steps=0,
                            bytes_sent=0)
        self.in_flight = []  # the requests `progress` advances

    def calls(self, source):
        """The single-node calls of the step that holds rank `source`'s keys and values:
        ``[(q_lo, k_lo, PairCall, keywords)]``."""
        k_chunks = chunks(source, self.n_k, self.size, self.balance)
        found = step_calls(self.q_chunks, k_chunks, offset=self.offset, causal=self.causal,
                           window=self.window, chunk_size=self.chunk_size,
                           fuse=self.alibi is None)
        result = []
        for q_lo, k_lo, p in found:
            keywords = dict(self.keywords, causal=p.causal, window=p.window)
            if self.alibi is not None:
                if p.shift == 0:
                    keywords["alibi_slopes"] = self.alibi
                else:
                    keywords["bias"] = alibi_bias(self.alibi, p.n_q, p.n_k, p.shift,
                                                  self.compute_dtype)
            result.append((q_lo, k_lo, p, keywords))
        return result

    def neighbours(self):
        return (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def progress(self):
        """Let MPI move the messages in flight: without a progress thread, most transports
        advance a large transfer only inside MPI calls, so the ring calls in between its
        single-node calls."""
        if self.in_flight:
            MPI.Request.Testall(self.in_flight)

    def wait(self, requests):
        if requests:
            start = time.perf_counter()
            MPI.Request.Waitall(requests)
            self.timings["wait_s"] += time.perf_counter() - start

    def exchange(self, send, receive, tags):
        """Post the receives into `receive` and the sends of `send` (contiguous arrays)."""
        to, frm = self.neighbours()
        requests = [self.comm.Irecv([_bytes(b), MPI.BYTE], source=frm, tag=t)
                    for b, t in zip(receive, tags)]
        requests += [self.comm.Isend([_bytes(b), MPI.BYTE], dest=to, tag=t)
                     for b, t in zip(send, tags)]
        self.timings["bytes_sent"] += sum(b.nbytes for b in send)
        return requests


def _bytes(x):
    """The bytes of a C-contiguous array, as MPI sends them (any dtype, bfloat16 included)."""
    return x.reshape(-1).view(np.uint8)


def _make_ring(comm, q, k, layout, balance, causal, window, chunk_size, alibi_slopes, scale,
               softcap, timings):
    compute = np.float64 if q.dtype == np.float64 else np.float32
    axis = _seq_axis(q, layout)
    alibi = None if alibi_slopes is None else np.asarray(alibi_slopes, dtype=compute)
    return _Ring(comm=comm, size=comm.Get_size(), rank=comm.Get_rank(), layout=layout,
                 balance=balance, causal=bool(causal), window=window,
                 chunk_size=_validate.chunk_value(chunk_size) or None, alibi=alibi,
                 keywords=dict(scale=scale, softcap=softcap), compute_dtype=compute,
                 n_q=q.shape[axis], n_k=k.shape[_seq_axis(k, layout)],
                 timings={} if timings is None else timings)


def _widen(x, layout, dtype):
    """`x` heads first, in the compute dtype (a copy only for half precision)."""
    return _heads_first(x, layout).astype(dtype, copy=False)


def _circulate(ring, own, work):
    """Pass the key/value parts around the ring, calling ``work(step, source, parts)`` on each
    while the next is in flight. `own` are this rank's parts (never written); the parts held
    besides are two: the one being sent (and computed) and the one being received."""
    size = ring.size
    current, spare = own, None
    for step in range(size):
        source = (ring.rank - step) % size
        requests = []
        if step < size - 1:
            sending = tuple(np.ascontiguousarray(x) for x in current)
            if spare is None:
                spare = tuple(np.empty(x.shape, x.dtype) for x in own)
            requests = ring.exchange(sending, spare, (_TAG_K, _TAG_V))
        ring.in_flight = list(requests)
        work(step, source, current)
        ring.wait(requests)
        ring.timings["steps"] += 1
        if step < size - 1:
            current, spare = spare, None
            if not any(s is o for s, o in zip(sending, own)):
                spare = sending  # its send is complete: the next part lands there


def ring_attention(q, k, v, *, comm=None, causal=False, scale=None, window=None,
                   chunk_size=None, softcap=0.0, alibi_slopes=None, layout="bhsd",
                   return_lse=False, balance="zigzag", timings=None):
    """Exact attention over a sequence spread across the ranks of `comm`, on a ring.

    Each rank passes its part of q, k, v (see `shard`) and gets its part of what
    `cpuflash.attention` gives over the whole sequence, with positions global (causal,
    `window`, `chunk_size` and ALiBi as for the whole sequence).

    Parameters
    ----------
    q : (..., Hq, nq, D) array, or (B, nq, Hq, D) with ``layout="bshd"``
        This rank's queries: ``nq = Nq / P`` rows of the sequence.
    k : (..., Hk, nk, D) array, or (B, nk, Hk, D)
    v : (..., Hk, nk, Dv) array, or (B, nk, Hk, Dv)
        This rank's keys and values. GQA (``Hq % Hk == 0``) and ``Dv != D`` as in `attention`.
    comm : mpi4py intracommunicator, optional
        The ranks (``MPI.COMM_WORLD`` when None). Every rank calls with the same keywords and
        parts of the same shape.
    causal, scale, window, chunk_size, softcap, alibi_slopes, layout
        As in `cpuflash.attention`, for the whole sequence (``Nq`` by ``Nk`` rows): with
        `chunk_size` a query sees the keys of its own chunk of the whole sequence's positions.
    return_lse : bool
        Also return this rank's part of the log-sum-exp.
    balance : {"zigzag", "contiguous"}
        How the sequence is dealt: ``"zigzag"`` cuts it into 2P equal chunks and rank ``r``
        holds chunks ``r`` and ``2P-1-r`` (every rank does the same causal work);
        ``"contiguous"`` cuts it into P and rank ``r`` holds chunk ``r``.
    timings : dict, optional
        Filled with this rank's ``compute_s`` (seconds in attention and merging), ``wait_s``
        (seconds blocked on the ring), ``steps``, ``skipped_steps`` (steps whose keys no query
        of this rank sees) and ``bytes_sent``. An extension of the API's signature.

    Returns
    -------
    out : this rank's part of the output, the layout and dtype of `q`
    lse : this rank's part of the log-sum-exp (float32; float64 for float64), with
        `return_lse`

    Notes
    -----
    Partial results are merged in float32 (float64 for float64 inputs) in ring order, so the
    result is the same bits for a given number of ranks; half-precision inputs are widened to
    float32 per part and the output rounded once. Memory per rank: its parts, two key/value
    parts in flight, and the running output and log-sum-exp.
    """
    comm = _communicator(comm)
    size = comm.Get_size()
    keywords = dict(causal=causal, scale=scale, window=window, chunk_size=chunk_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, layout=layout, balance=balance)
    q, k, v = _agree(
        comm, lambda: _forward_check(q, k, v, size=size, **keywords),
        lambda args: _forward_signature(args, return_lse=bool(return_lse), **keywords))
    ring = _make_ring(comm, q, k, layout, balance, causal, window, chunk_size, alibi_slopes, scale,
                      softcap, timings)
    out, lse = _forward(ring, q, k, v)
    out = np.swapaxes(out, 1, 2) if layout == "bshd" else out
    out = np.ascontiguousarray(out.astype(q.dtype, copy=False))  # half precision: rounded once
    return (out, lse) if return_lse else out


def _forward(ring, q, k, v):
    """The ring's forward: (out heads first, lse) in the compute dtype."""
    compute = ring.compute_dtype
    qh = _widen(q, ring.layout, compute)
    out = np.zeros(qh.shape[:-1] + (v.shape[-1],), dtype=compute)
    lse = np.full(qh.shape[:-1], -np.inf, dtype=compute)

    def work(step, source, parts):
        calls = ring.calls(source)
        if not calls:
            ring.timings["skipped_steps"] += 1
            return
        start = time.perf_counter()
        kh, vh = (_widen(x, ring.layout, compute) for x in parts)
        for q_lo, k_lo, p, keywords in calls:
            rows = slice(q_lo, q_lo + p.n_q)
            keys = slice(k_lo, k_lo + p.n_k)
            o, s = cpuflash.attention(qh[..., rows, :], kh[..., keys, :], vh[..., keys, :],
                                      return_lse=True, **keywords)
            # -- merge into the running result, in ring order
            _merge_into(out[..., rows, :], lse[..., rows], o, s)
            ring.progress()
        ring.timings["compute_s"] += time.perf_counter() - start

    _circulate(ring, (k, v), work)
    return out, lse


# rows merged per `merge_states` call: its temporaries (a few copies of the rows it merges)
# stay a small fraction of the running output
MERGE_ROWS = 1024


def _merge_into(out, lse, part_out, part_lse):
    """Merge a partial result into the running `out`, `lse` (views, written in place)."""
    for lo in range(0, out.shape[-2], MERGE_ROWS):
        rows = slice(lo, lo + MERGE_ROWS)
        out[..., rows, :], lse[..., rows] = cpuflash.merge_states(
            [out[..., rows, :], part_out[..., rows, :]], [lse[..., rows], part_lse[..., rows]])


def _backward_check(dout, q, k, v, out, lse, **keywords):
    layout = keywords["layout"]
    q, k, v = _forward_check(q, k, v, **keywords)
    dout, out, lse = _array("dout", dout), _array("out", out), _array("lse", lse)
    out_shape = q.shape[:-1] + (v.shape[-1],)
    for name, x in (("dout", dout), ("out", out)):
        if x.shape != out_shape:
            raise ValueError(f"`{name}` must have the shape of this rank's output {out_shape}, "
                             f"got {x.shape}")
    if lse.shape != _lse_shape(q, layout):
        raise ValueError(f"`lse` must have shape {_lse_shape(q, layout)} (this rank's part of "
                         f"the log-sum-exp), got {lse.shape}")
    axis = _seq_axis(q, layout)
    first = [_rows(x, axis, 0, 0) for x in (dout, q)] + [_rows(k, axis, 0, 0),
                                                         _rows(v, axis, 0, 0),
                                                         _rows(out, axis, 0, 0), lse[..., :0]]
    cpuflash.attention_backward(*first, causal=keywords["causal"], scale=keywords["scale"],
                                window=keywords["window"], chunk_size=keywords["chunk_size"],
                                softcap=keywords["softcap"],
                                alibi_slopes=keywords["alibi_slopes"], layout=layout)
    return dout, q, k, v, out, lse


def ring_attention_backward(dout, q, k, v, out, lse, *, comm=None, causal=False, scale=None,
                            window=None, chunk_size=None, softcap=0.0, alibi_slopes=None,
                            layout="bhsd", balance="zigzag", timings=None):
    """Gradients of `ring_attention` with respect to this rank's q, k, v.

    Parameters
    ----------
    dout : array shaped like this rank's `out`
        The gradient of the loss with respect to this rank's part of the output.
    q, k, v : arrays
        This rank's parts, as `ring_attention` took them.
    out, lse : arrays
        This rank's parts of `ring_attention`'s output and log-sum-exp (``return_lse=True``)
        for the same arguments.
    comm, causal, scale, window, chunk_size, softcap, alibi_slopes, layout, balance
        `ring_attention`'s, unchanged (ALiBi is a constant: no gradient).
    timings : dict, optional
        As in `ring_attention`.

    Returns
    -------
    dq, dk, dv : this rank's parts of the gradients, the shapes, layout and dtypes of q, k, v

    Notes
    -----
    With the global ``out`` and ``lse``, `cpuflash.attention_backward` on one key part gives
    that part's exact share of dQ and its dK, dV. dQ is summed on its rank; the dK/dV
    accumulators travel the ring behind their keys and values (each rank adds its share and
    passes them on, P hops home). Sums run in ring order in float32 (float64 for float64):
    the same bits for a given number of ranks. Memory per rank: its parts, two key/value parts
    in flight, dQ, and three dK/dV-sized accumulators (received, sent, this step's share).
    """
    comm = _communicator(comm)
    size = comm.Get_size()
    keywords = dict(causal=causal, scale=scale, window=window, chunk_size=chunk_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, layout=layout, balance=balance)
    checked = _agree(
        comm, lambda: _backward_check(dout, q, k, v, out, lse, size=size, **keywords),
        lambda args: _forward_signature(args[1:4], **keywords))
    dout, q, k, v, out, lse = checked
    ring = _make_ring(comm, q, k, layout, balance, causal, window, chunk_size, alibi_slopes, scale,
                      softcap, timings)
    # the sums are in the caller's layout already; half precision is rounded once, here
    return tuple(grad.astype(like.dtype, copy=False)
                 for grad, like in zip(_backward(ring, dout, q, k, v, out, lse), (q, k, v)))


def _backward(ring, dout, q, k, v, out, lse):
    """The ring's backward: dq, dk, dv in the compute dtype, in the caller's layout."""
    compute, layout = ring.compute_dtype, ring.layout
    qh, douth, outh = (_widen(x, layout, compute) for x in (q, dout, out))
    lse = np.asarray(lse, dtype=compute)
    dq = np.zeros(q.shape, dtype=compute)
    dqh = _heads_first(dq, layout)
    size = ring.size
    to, frm = ring.neighbours()
    # the dK/dV accumulators: the one received (and added to) at a step, and the one whose send
    # from the step before may still be in flight
    accumulators = [tuple(np.zeros(x.shape, dtype=compute) for x in (k, v)) for _ in range(2)]
    sent = []  # the requests of the accumulator in flight

    def work(step, source, parts):
        received = accumulators[step % 2]
        receiving = []
        if step > 0:
            receiving = [ring.comm.Irecv([_bytes(b), MPI.BYTE], source=frm, tag=t)
                         for b, t in zip(received, (_TAG_DK, _TAG_DV))]
        ring.in_flight += receiving + sent
        calls = ring.calls(source)
        share = None
        if calls:
            start = time.perf_counter()
            kh, vh = (_widen(x, layout, compute) for x in parts)
            share = tuple(np.zeros(x.shape, dtype=compute) for x in parts)
            dkh, dvh = (_heads_first(x, layout) for x in share)
            for q_lo, k_lo, p, keywords in calls:
                rows = slice(q_lo, q_lo + p.n_q)
                keys = slice(k_lo, k_lo + p.n_k)
                g_q, g_k, g_v = cpuflash.attention_backward(
                    douth[..., rows, :], qh[..., rows, :], kh[..., keys, :], vh[..., keys, :],
                    outh[..., rows, :], lse[..., rows], **keywords)
                dqh[..., rows, :] += g_q
                dkh[..., keys, :] += g_k
                dvh[..., keys, :] += g_v
                ring.progress()
            ring.timings["compute_s"] += time.perf_counter() - start
        else:
            ring.timings["skipped_steps"] += 1
        ring.wait(receiving)
        # -- the shares of the ranks before, then this rank's: a fixed order
        if share is not None:
            for acc, part in zip(received, share):
                acc += part
        if size > 1:
            ring.wait(sent)  # the other accumulator is free again
            sent[:] = [ring.comm.Isend([_bytes(b), MPI.BYTE], dest=to, tag=t)
                       for b, t in zip(received, (_TAG_DK, _TAG_DV))]
            ring.timings["bytes_sent"] += sum(b.nbytes for b in received)

    _circulate(ring, (k, v), work)
    if size == 1:
        return dq, accumulators[0][0], accumulators[0][1]
    # -- this rank's accumulators come home after their P-th hop
    home = accumulators[size % 2]  # free: its send completed before the last one started
    ring.wait([ring.comm.Irecv([_bytes(b), MPI.BYTE], source=frm, tag=t)
               for b, t in zip(home, (_TAG_DK, _TAG_DV))] + sent)
    return dq, home[0], home[1]


# -- dealing whole arrays out and gathering them back -------------------------------------------

def _part_axis(x, layout, axis):
    if axis is None:
        return _seq_axis(x, layout)
    if not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"`axis` must be an axis of the array (ndim {x.ndim}), got {axis!r}")
    return axis % x.ndim


def _order(size, balance):
    """``[(rank, chunk of that rank)]`` in sequence order."""
    if balance == "contiguous":
        return [(r, 0) for r in range(size)]
    return [(r, 0) for r in range(size)] + [(r, 1) for r in reversed(range(size))]


def shard(x, *, comm=None, layout="bhsd", balance="zigzag", axis=None):
    """This rank's part of the whole array `x` (present on every rank), along the sequence.

    Parameters
    ----------
    x : array
        q, k, v, dout (or anything with their sequence axis) for the whole sequence.
    comm, layout, balance
        As in `ring_attention`.
    axis : int, optional
        The sequence axis, when not the layout's (-2 for "bhsd", 1 for "bshd"): -1 for a
        log-sum-exp. An extension of the API's signature.

    Returns
    -------
    A new C-contiguous array: rank ``r``'s chunks of the sequence, in order (``r`` and
    ``2P-1-r`` for "zigzag", ``r`` for "contiguous"). The length must be a multiple of 2P
    ("zigzag") or P ("contiguous").
    """
    comm = _communicator(comm)
    size, rank = comm.Get_size(), comm.Get_rank()

    def check():
        arr = _array("x", x)
        _choice("layout", layout, LAYOUTS)
        _choice("balance", balance, BALANCES)
        if arr.ndim < 2 and axis is None:
            raise ValueError(f"`x` must have at least 2 dims (..., seqlen, dim), got shape "
                             f"{arr.shape}")
        ax = _part_axis(arr, layout, axis)
        n_chunks = 2 * size if balance == "zigzag" else size
        if arr.shape[ax] % n_chunks:
            raise ValueError(f"the sequence length of `x` ({arr.shape[ax]}, axis {ax}) must be a "
                             f"multiple of {n_chunks} (P = {size} ranks, balance={balance!r})")
        return arr, ax

    arr, ax = _agree(comm, check, lambda r: {"the shape of `x`": r[0].shape})
    n_chunks = 2 * size if balance == "zigzag" else size
    c = arr.shape[ax] // n_chunks
    mine = [rank] + ([2 * size - 1 - rank] if balance == "zigzag" else [])
    return np.ascontiguousarray(np.concatenate([_rows(arr, ax, g * c, (g + 1) * c)
                                                for g in mine], axis=ax))


def unshard(part, *, comm=None, layout="bhsd", balance="zigzag", axis=None):
    """The whole array gathered from every rank's `part` (the inverse of `shard`), on every rank.

    Parameters
    ----------
    part : array
        This rank's part (e.g. `ring_attention`'s output), the same shape on every rank.
    comm, layout, balance, axis
        As in `shard`.

    Returns
    -------
    A new C-contiguous array with the sequence whole, in order.
    """
    comm = _communicator(comm)
    size = comm.Get_size()

    def check():
        arr = _array("part", part)
        _choice("layout", layout, LAYOUTS)
        _choice("balance", balance, BALANCES)
        if arr.ndim < 2 and axis is None:
            raise ValueError(f"`part` must have at least 2 dims (..., seqlen, dim), got shape "
                             f"{arr.shape}")
        ax = _part_axis(arr, layout, axis)
        _divides("part", arr.shape[ax], size, balance)
        return arr, ax

    arr, ax = _agree(comm, check, lambda r: {"the shape of `part` (each rank holds an equal "
                                             "part)": r[0].shape,
                                             "the dtype of `part`": str(r[0].dtype)})
    mine = np.ascontiguousarray(arr)
    gathered = np.empty((size,) + mine.shape, dtype=mine.dtype)
    comm.Allgather([_bytes(mine), MPI.BYTE], [_bytes(gathered), MPI.BYTE])
    halves = 2 if balance == "zigzag" else 1
    c = mine.shape[ax] // halves
    pieces = [_rows(gathered[r], ax, h * c, (h + 1) * c) for r, h in _order(size, balance)]
    return np.ascontiguousarray(np.concatenate(pieces, axis=ax))
