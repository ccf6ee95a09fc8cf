"""Cache sizes in, tile sizes out: the only place cpuflash decides block sizes.

Pure Python (no Numba), so the decision can be read, tested with fake caches and explained.
Kernels receive `block_q` and `block_k` as arguments and never choose them.
"""

import dataclasses
import glob
import os

import numpy as np

__all__ = ["TileConfig", "choose_tiles", "cpu_info"]

KiB = 1024
MiB = 1024 * KiB

# Used when the cache sizes cannot be read (other OS, restricted containers): small enough that
# the tiles fit on any x86-64 core of the last ten years.
DEFAULT_CACHES = {"l1d": 32 * KiB, "l2": 256 * KiB, "l3": 8 * MiB}

# Key blocks are multiples of it: of the micro-kernels' key panel (two vectors: 32 float32 keys
# with AVX-512, 16 with AVX2), so no panel is left half full except at the end of a sequence
# (asserted in `kernels._layout`).
KEY_PANEL = 32
# Query blocks are multiples of it: of the micro-kernels' 6-row groups (`kernels._layout.ROWS`,
# asserted there) and of 8. The groups then start at the same rows of a sequence for every block_q
# chosen here, so a row is summed the same way for every thread count.
BLOCK_Q_MULTIPLE = 24
# Chosen by measurement (bench/sweep_tiles.py, docs/history.md "Tiles (Zen 5)"): past
# 384 x 256 the speed is flat, while fewer, larger work items feed the threads worse.
MAX_BLOCK_Q = 384
MAX_BLOCK_K = 256
# The widest two-sided window (left + right keys) whose band a query tile takes as one key
# block (`band_tiles`). Chosen by measurement (docs/history.md, "Tiles (Zen 5)"): against
# blocks of 256 keys, one band block is faster for windows of up to 1024 keys, slower at 2048.
MAX_BAND = 1024
# Bytes of a value row that the L1 rule charges per key: the two-vector slice (64-byte vectors)
# of the narrow P V micro-kernel. With AVX-512 the wide one streams four vectors (256 bytes);
# charging those would halve block_k, and the tile sweep measured larger key blocks faster up
# to 256 keys, so the rule keeps the two-vector slice (with AVX2 the slice is half of it).
VALUE_SLICE_BYTES = 128
# The share of L1 the streamed slice may claim; the rest holds the query rows and scores that
# the micro-kernel reads beside it.
L1_SHARE = 0.75
# L2 is private to a core and the tile's state is most of what the core touches.
L2_SHARE = 1.0


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Block sizes of the tiled loop: `block_q` query rows x `block_k` key columns."""

    block_q: int
    block_k: int

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"`{name}` must be >= 1, got {value}")
            object.__setattr__(self, name, int(value))


def choose_tiles(head_dim, dtype=np.float32, *, cache=None, head_dim_v=None):
    """Pick `block_q` and `block_k` for a head dim from the cache sizes.

    The model (`e` bytes per element of the compute dtype, float32 for half precisions):

    * **L1 holds what a micro-kernel streams.** The P V micro-kernel sweeps, for a group of six
      query rows, a slice of every value row of the block (two vectors, 128 bytes, as the rule
      counts it; four with AVX-512, see `VALUE_SLICE_BYTES`); that slice is re-read by every
      row group, so it must stay in L1::

          block_k * VALUE_SLICE_BYTES <= L1_SHARE * L1d

      (the Q K^T micro-kernel streams one packed panel of 32 keys, ``32 * D * e`` bytes, which is
      independent of the tile). `block_k` is rounded down to whole 32-key panels, at most 256,
      and the K and V blocks may take at most half of the L2 budget below.
    * **L2 holds a query tile's state next to the key and value blocks**: the queries, the
      unnormalized accumulator, the score tile, and the K and V blocks::

          (block_q * (D + Dv + block_k) + block_k * (D + Dv)) * e <= L2_SHARE * L2

      `block_q` is the largest multiple of 24 rows that fits, at most 384: every K/V block is
      then re-used by as many rows as possible (one head's K and V at N = 4096, D = 128 are 4 MB,
      more than L2, so they stream from L3 or memory once per query tile).

    Measured with `bench/sweep_tiles.py` (B=1, H=8, N=4096, float32; docs/history.md, "Tiles
    (Zen 5)"): the speed rises with both block sizes up to about 384 x 256 and is flat beyond,
    and this model picks 384 x 256 for that machine's caches (48 KiB L1d, 1 MiB L2).

    A larger cache never gives smaller tiles. ``cache`` is a dict with keys ``"l1d"`` and ``"l2"``
    in bytes; None reads them from this machine (`cpu_info`).
    """
    d = _positive_int("head_dim", head_dim)
    dv = d if head_dim_v is None else _positive_int("head_dim_v", head_dim_v)
    e = _element_bytes(dtype)
    l1, l2 = _cache_pair(cache)

    # the L1 rule, and the K and V blocks in at most half of the L2 budget
    block_k = min(int(L1_SHARE * l1) // VALUE_SLICE_BYTES,
                  int(L2_SHARE * l2) // 2 // ((d + dv) * e))
    block_k = max(KEY_PANEL, min(MAX_BLOCK_K, block_k // KEY_PANEL * KEY_PANEL))

    budget = int(L2_SHARE * l2) // e - block_k * (d + dv)
    block_q = budget // (d + dv + block_k) // BLOCK_Q_MULTIPLE * BLOCK_Q_MULTIPLE
    block_q = max(BLOCK_Q_MULTIPLE, min(MAX_BLOCK_Q, block_q))
    return TileConfig(block_q, block_k)


def band_tiles(tiles, window):
    """Tiles for a two-sided `window` of at most `MAX_BAND` keys, and the alignment of the first
    key block of a query tile: ``(tiles, key_align)``.

    Such a window leaves each query tile a band of ``block_q + left + right`` keys. Cut into
    blocks at multiples of `block_k`, the band crosses several blocks, each with masked edges,
    and each row's band two or more of them, each with its own softmax update per row. Instead
    the band becomes one key block that starts at a multiple of `KEY_PANEL`. Each row still sees
    its whole band in one block, with its columns in the same vector lanes, so a row's result
    does not depend on the tile it falls in (nor on the thread count). Other windows keep
    `tiles` and blocks at multiples of `block_k`.

    Measured for float32 at D = 128 only. The block takes ``(block_q + left + right) * (D + Dv
    + block_q)`` elements per thread, more than the cache model of `choose_tiles` allows.
    """
    left, right = window
    if left < 0 or right < 0 or left + right > MAX_BAND:
        return tiles, tiles.block_k
    block_k = -(-(tiles.block_q + left + right + KEY_PANEL - 1) // KEY_PANEL) * KEY_PANEL
    return TileConfig(tiles.block_q, block_k), KEY_PANEL


# The backward's tiles (`backward_tiles`), in both of its passes. Fixed rather than from the
# cache model: a sweep of block_q and block_k over 48 .. 192 on the 2-core test machine was
# flat within noise, so one middle size, a multiple of BLOCK_Q_MULTIPLE and KEY_PANEL. The
# sums follow the blocks, so the bits depend on these (never on the thread count).
BACKWARD_BLOCK_Q = 96
BACKWARD_BLOCK_K = 96


def backward_tiles(n_q, n_k):
    """The backward's tiles for sequences of at most `n_q` rows and `n_k` keys:
    ``BACKWARD_BLOCK_Q x BACKWARD_BLOCK_K``, no larger than the call needs (`clamp_tiles`)."""
    return clamp_tiles(TileConfig(BACKWARD_BLOCK_Q, BACKWARD_BLOCK_K), n_q, n_k)


def clamp_tiles(tiles, n_q, n_k):
    """`tiles` no larger than the longest sequences need (`n_q` rows, `n_k` keys, rounded up to
    a whole panel): the same blocks, hence the same results, with buffers that fit the call."""
    block_q = max(1, min(tiles.block_q, n_q))
    block_k = max(1, min(tiles.block_k, -(-max(1, n_k) // KEY_PANEL) * KEY_PANEL))
    if (block_q, block_k) == (tiles.block_q, tiles.block_k):
        return tiles
    return TileConfig(block_q, block_k)


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"`{name}` must be >= 1, got {value}")
    return int(value)


def _element_bytes(dtype):
    """Bytes of the compute dtype: float64 computes in float64, every other float in float32."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"`dtype` must be a float dtype, got {dtype!r}") from None
    if dtype.kind != "f" and dtype.name != "bfloat16":
        raise TypeError(f"`dtype` must be float32, float64, float16 or bfloat16, got {dtype}")
    return 8 if dtype == np.float64 else 4


def _cache_pair(cache):
    """(L1d, L2) in bytes from a `cache` dict, or from this machine when None."""
    caches = _cache_sizes() if cache is None else cache
    try:
        l1, l2 = caches["l1d"], caches["l2"]
    except (KeyError, TypeError):
        raise ValueError(f"`cache` must be a dict with keys 'l1d' and 'l2' (bytes), got "
                         f"{cache!r}") from None
    return _positive_int("cache['l1d']", l1), _positive_int("cache['l2']", l2)


def working_set_bytes(tiles, head_dim, dtype=np.float32, head_dim_v=None):
    """Bytes the model above places in (L1, L2) for `tiles`; used by tests and `info`."""
    d = int(head_dim)
    dv = d if head_dim_v is None else int(head_dim_v)
    e = 8 if np.dtype(dtype) == np.float64 else 4
    l1 = tiles.block_k * VALUE_SLICE_BYTES
    l2 = (tiles.block_q * (d + dv + tiles.block_k) + tiles.block_k * (d + dv)) * e
    return l1, l2


def round_rows(rows):
    """`rows` rounded up to a whole query block (`BLOCK_Q_MULTIPLE`)."""
    return -(-rows // BLOCK_Q_MULTIPLE) * BLOCK_Q_MULTIPLE


def split_for_threads(tiles, n_rows, n_heads_total, n_threads):
    """Shrink `block_q` so that a call has at least two work items per thread when it can.

    `n_heads_total` is the number of (batch, head) pairs sharing the rows. A smaller query tile
    re-uses each K/V block less, but an idle core costs more.
    """
    block_q = tiles.block_q
    while block_q > BLOCK_Q_MULTIPLE and n_heads_total * -(-n_rows // block_q) < 2 * n_threads:
        block_q = max(BLOCK_Q_MULTIPLE, (block_q // 2) // BLOCK_Q_MULTIPLE * BLOCK_Q_MULTIPLE)
    return TileConfig(block_q, tiles.block_k) if block_q != tiles.block_q else tiles


# -- reading the machine ------------------------------------------------------------------------

_SIZE_UNITS = {"K": KiB, "M": MiB, "G": 1024 * MiB}
_cached_caches = None


def _parse_size(text):
    text = text.strip().upper()
    if text and text[-1] in _SIZE_UNITS:
        return int(text[:-1]) * _SIZE_UNITS[text[-1]]
    return int(text)


def _read_sysfs_caches(root="/sys/devices/system/cpu/cpu0/cache"):
    """Cache sizes of cpu0 from Linux sysfs, as {"l1d", "l2", "l3"} (missing levels left out)."""
    found = {}
    for index in sorted(glob.glob(os.path.join(root, "index*"))):
        try:
            with open(os.path.join(index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(index, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(index, "size")) as f:
                size = _parse_size(f.read())
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or size <= 0:
            continue
        found["l1d" if level == 1 else f"l{level}"] = size
    return found


def _cache_sizes():
    global _cached_caches
    if _cached_caches is None:
        caches = dict(DEFAULT_CACHES)
        caches.update({k: v for k, v in _read_sysfs_caches().items() if k in caches})
        _cached_caches = caches
    return _cached_caches


def _simd_features():
    """The SIMD features LLVM reports for this host, as a sorted list of names."""
    try:
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features()
        cpu_name = llvm.get_host_cpu_name()
    except Exception:  # no llvmlite or an unknown host: report nothing rather than fail
        return "unknown", []
    wanted = ("sse4.2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512bf16",
              "avx512fp16", "amx-tile", "amx-bf16", "neon", "sve")
    return cpu_name, [name for name in wanted if features.get(name, False)]


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_info():
    """What cpuflash knows about this machine.

    Returns a dict: ``model`` (CPU model string), ``llvm_cpu`` (the CPU name LLVM reports),
    ``caches`` (bytes per level: ``l1d``, ``l2``, ``l3``; sysfs values where Linux gives them,
    conservative defaults otherwise, ``cache_source`` says which), ``simd`` (list of SIMD
    features), ``cores`` (logical CPUs this process may run on) and ``threads`` (Numba's current
    thread count).
    """
    import numba

    sysfs = _read_sysfs_caches()
    llvm_cpu, simd = _simd_features()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return {
        "model": _cpu_model(),
        "llvm_cpu": llvm_cpu,
        "caches": dict(_cache_sizes()),
        "cache_source": "sysfs" if sysfs else "defaults",
        "simd": simd,
        "cores": cores,
        "threads": numba.get_num_threads(),
    }


# -- decoding --------------------------------------------------------------------------------

# Query rows (heads of a GQA group x query rows) up to which the streaming decode kernel beats
# the packed FA-2 kernel: past this a key block is re-used by enough rows to be worth packing.
DECODE_MAX_ROWS = 16
# Query rows per head up to which a KV-cache call streams whatever its group: the FA-2 forward
# takes a head at a time, so it reads every key block once per head for these few rows, where
# the streaming kernel reads it once for the group (Zen 4, and its AVX2 build: 1.2-6.5x at 2-8
# rows for groups of 8-128; at 16 rows from 0.75x to 1.5x: docs/performance.md, "Large groups")
DECODE_MAX_QUERIES = 8
# With AVX-512, in float32 (float16 widened), it streams past that while a kv head's rows stay few:
# up to this many rows a head and WIDE_DECODE_MAX_ROWS a kv head (Zen 4, groups of 2-8 at 9-16
# rows: 1.0-1.9x the FA-2 forward; where the FA-2 tiles multiply bfloat16 pairs streaming lost,
# 0.58-0.76x, as did the AVX2 build at groups of 4-16, 0.63-0.9x: docs/history.md, "Streaming
# 9-16 rows a head")
WIDE_DECODE_MAX_QUERIES = 16
WIDE_DECODE_MAX_ROWS = 128
# A split shorter than this spends more on merging and per-item set-up than it gains.
MIN_SPLIT_KEYS = 512
MAX_SPLITS = 64


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """How `attention_with_kvcache` runs: `n_splits` key ranges of `split_len` keys per
    (batch, kv head), streamed `block_k` keys at a time."""

    n_splits: int
    split_len: int
    block_k: int


def decode_plan(n_keys, n_items, n_threads, head_dim, dtype=np.float32, num_splits=0,
                cache=None):
    """Split-KV plan for `n_items` (batch x kv head) work items over up to `n_keys` keys.

    With ``num_splits=0`` the keys are split only when the items alone cannot keep every thread
    busy twice over, into ranges of at least `MIN_SPLIT_KEYS` keys, aiming at four items per
    thread (measured with an MQA decode over 16384 keys on 2 threads, which gained little
    past four splits: docs/history.md, "Decoding"); a given `num_splits` is used as is
    (capped at one split per key block). `block_k` is `choose_tiles`' key block
    (256 keys at D=128 in float32). 512-key blocks streamed a little faster, but broke the
    accuracy rule when every value row is the same: each block's P V sum is one chain of
    `block_k` terms (`tests/test_decoding.py` has the case).
    """
    block_k = choose_tiles(head_dim, dtype, cache=cache).block_k
    n_keys = max(1, int(n_keys))
    if num_splits:
        n_splits = num_splits
    elif n_items >= 2 * n_threads:
        n_splits = 1
    else:
        wanted = -(-4 * n_threads // max(1, n_items))
        n_splits = max(1, min(wanted, n_keys // MIN_SPLIT_KEYS, MAX_SPLITS))
    n_splits = max(1, min(n_splits, -(-n_keys // block_k)))
    split_len = -(-n_keys // n_splits)
    split_len = -(-split_len // block_k) * block_k
    return DecodePlan(n_splits, split_len, block_k)
