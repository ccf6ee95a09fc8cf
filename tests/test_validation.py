"""Bad input raises a clear TypeError or ValueError before any work starts, and changes nothing.

One table per public function. An entry names the arguments it changes in a valid call, the
exception and a pattern of its message; the test also checks that nothing was partly written:
the inputs, `out` (filled with 7s in every `attention` call) and the caches (every
`attention_with_kvcache` call brings new keys to write) keep their bits. Every `raise` of the
argument checks has an entry; the messages for other libraries' keywords, the `layout="bshd"`
hint and torch tensors that require grad are in test_first_contact.py.
"""

import types

import numpy as np
import pytest

import cpuflash
from cpuflash.reference import attention_fa1

from helpers import assert_unchanged, readonly, snapshot

f32 = np.float32


def case(name, exc, match, **changes):
    """A table entry. A change that is a function (a lambda) is called with the valid
    arguments, to derive the argument from them."""
    return pytest.param(changes, exc, match, id=name)


def arguments(valid, changes):
    args = valid()
    args.update({name: change(args) if isinstance(change, types.FunctionType) else change
                 for name, change in changes.items()})
    return args


def check_rejected(function, args, exc, match):
    taken = snapshot(args)
    with pytest.raises(exc, match=match):
        function(**args)
    assert_unchanged(taken, "an argument changed on error")


class Unviewable:
    """An object whose conversion to an array fails."""

    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("no array here")


# -- cpuflash.attention ---------------------------------------------------------------------------

def attention_valid():
    rng = np.random.default_rng(0)
    return {"q": rng.standard_normal((2, 4, 10, 8)).astype(f32),
            "k": rng.standard_normal((2, 2, 12, 8)).astype(f32),
            "v": rng.standard_normal((2, 2, 12, 6)).astype(f32),
            "out": np.full((2, 4, 10, 6), 7.0, f32)}


def qkv(shape, dtype, **more):
    return {name: np.ones(shape, dtype) for name in "qkv"} | dict(out=None, **more)


ATTENTION = [
    # arrays and dtypes
    case("q list", TypeError, r"`q` must be an array, got list", q=[[1.0]]),
    case("k None", TypeError, r"`k` must be an array, got NoneType", k=None),
    case("v not viewable", TypeError, r"`v` must be an array \(numpy, or viewable by "
         r"numpy\.asarray\), got Unviewable: no array here", v=Unviewable()),
    case("int dtype", TypeError, r"share one dtype.*int32", q=np.ones((2, 4, 10, 8), np.int32)),
    case("all int", TypeError, r"must be float32, float64, float16 or bfloat16, got int64",
         **qkv((2, 2, 3, 4), np.int64)),
    case("complex", TypeError, r"`q` is complex64: complex attention is not supported",
         **qkv((2, 2, 3, 4), np.complex64)),
    case("complex q alone", TypeError, r"`q` is complex128: complex attention is not supported",
         q=np.ones((2, 4, 10, 8), np.complex128)),
    case("object", TypeError, r"object", **qkv((2, 2, 3, 4), object)),
    case("strings", TypeError, r"<U1", q=np.full((2, 2, 3, 4), "a"), k=np.full((2, 2, 3, 4), "a"),
         v=np.full((2, 2, 3, 4), "a")),
    case("mixed", TypeError, r"float32, float32 and float64", v=np.ones((2, 2, 12, 6))),
    # shapes
    case("1-D q", ValueError, r"`q` must have at least 2 dims", q=np.ones(8, f32)),
    case("ndim differ", ValueError, r"same number of dims", q=np.ones((4, 10, 8), f32)),
    case("batch differ", ValueError, r"equal leading \(batch\) axes",
         k=np.ones((3, 2, 12, 8), f32), v=np.ones((3, 2, 12, 6), f32)),
    case("head dim", ValueError, r"`k` has head dim 7 but `q` has 8",
         k=np.ones((2, 2, 12, 7), f32)),
    case("zero head dim", ValueError, r"head dims must be >= 1, got 0 for `q` and 2 for `v`",
         q=np.ones((1, 1, 3, 0), f32), k=np.ones((1, 1, 3, 0), f32), v=np.ones((1, 1, 3, 2), f32),
         out=None),
    case("v keys", ValueError, r"`v` has 11 keys but `k` has 12", v=np.ones((2, 2, 11, 6), f32)),
    case("v heads", ValueError, r"`v` has 1 heads but `k` has 2", v=np.ones((2, 1, 12, 6), f32)),
    case("no kv heads", ValueError, r"`k` must have at least one head, got 0",
         k=np.ones((2, 0, 12, 8), f32), v=np.ones((2, 0, 12, 6), f32)),
    case("heads", ValueError,
         r"query heads \(4\) must be a multiple of the number of key/value heads \(3\)",
         k=np.ones((2, 3, 12, 8), f32), v=np.ones((2, 3, 12, 6), f32)),
    case("layout", ValueError, r"`layout` must be one of", layout="sbhd"),
    case("bshd 3-D", ValueError, r"`q` must be 4-D \(batch, seqlen, heads, dim\)",
         **qkv((2, 3, 4), f32, layout="bshd")),
    case("bshd batch differ", ValueError,
         r"`q`, `k`, `v` must have the same batch size, got 2, 3, 3",
         q=np.ones((2, 10, 4, 8), f32), k=np.ones((3, 12, 2, 8), f32),
         v=np.ones((3, 12, 2, 6), f32), layout="bshd", out=None),
    case("bshd arrays", ValueError,
         r"query heads \(10\) .* key/value heads \(12\); if these are flash-attn's \(batch, "
         r"seqlen, heads, dim\) arrays, pass `layout=\"bshd\"`",
         q=np.ones((2, 10, 4, 8), f32), k=np.ones((2, 12, 2, 8), f32),
         v=np.ones((2, 12, 2, 6), f32), out=None),
    # flags and scalars
    case("causal", TypeError, r"`causal` must be True or False", causal="yes"),
    case("return_lse", TypeError, r"`return_lse` must be True or False", return_lse=1),
    case("scale nan", ValueError, r"`scale` must be finite, got nan", scale=float("nan")),
    case("scale inf", ValueError, r"`scale` must be finite, got inf", scale=float("inf")),
    case("scale str", TypeError, r"`scale` must be a real number", scale="1"),
    case("scale bool", TypeError, r"`scale` must be a real number or None, got bool", scale=True),
    case("window int", ValueError, r"`window` must be a pair of ints", window=3),
    case("window triple", ValueError, r"`window` must be a pair of ints", window=(1, 2, 3)),
    case("window float", ValueError, r"`window` must be a pair of ints", window=(1.5, 2)),
    case("window -2", ValueError, r"`window` sides must be >= -1", window=(-2, 0)),
    case("softcap<0", ValueError, r"`softcap` must be finite and >= 0", softcap=-1.0),
    case("softcap nan", ValueError, r"`softcap` must be finite", softcap=float("nan")),
    case("softcap str", TypeError, r"`softcap` must be a real number", softcap="1"),
    # score modifiers
    case("slopes shape", ValueError,
         r"`alibi_slopes` must have shape \(4,\) or \(2, 4\), got \(3,\)",
         alibi_slopes=np.ones(3, f32)),
    case("slopes dtype", TypeError, r"`alibi_slopes` must be a float array, got dtype int32",
         alibi_slopes=np.ones(4, np.int32)),
    case("slopes two leading axes", ValueError,
         r"`alibi_slopes` must have shape \(4,\) or \(1, 2, 4\), got \(2, 4\)",
         q=lambda a: a["q"][None], k=lambda a: a["k"][None], v=lambda a: a["v"][None],
         out=None, alibi_slopes=np.ones((2, 4), f32)),
    case("bias shape", ValueError,
         r"`bias` must be broadcastable to \(2, 4, 10, 12\), got shape \(10, 11\)",
         bias=np.ones((10, 11), f32)),
    case("bias ndim", ValueError, r"`bias` must be broadcastable",
         bias=np.ones((1, 2, 4, 10, 12), f32)),
    case("bias bool", TypeError, r"`bias` must be a float array", bias=np.ones((10, 12), bool)),
    case("bias None list", TypeError, r"`bias` must be a float array, got dtype object",
         bias=[None, None]),
    case("mask dtype", TypeError, r"`mask` must be a boolean array .*got dtype int8",
         mask=np.ones((10, 12), np.int8)),
    case("mask shape", ValueError, r"`mask` must be broadcastable to \(2, 4, 10, 12\)",
         mask=np.ones((3, 10, 12), bool)),
    case("mask str", TypeError, r"`mask` must be an array, got str", mask="causal"),
    case("sinks shape", ValueError, r"`sinks` must have shape \(4,\)", sinks=np.ones(2, f32)),
    case("sinks dtype", TypeError, r"`sinks` must be a float", sinks=np.ones(4, np.int64)),
    # out
    case("out shape", ValueError, r"`out` must have shape \(2, 4, 10, 6\), got \(2, 4, 10, 8\)",
         out=np.full((2, 4, 10, 8), 7.0, f32)),
    case("out dtype", TypeError, r"`out` must have dtype float32",
         out=np.full((2, 4, 10, 6), 7.0)),
    case("out list", TypeError, r"`out` must be an array, got list", out=[]),
    case("out readonly", ValueError, r"`out` must be writeable",
         out=readonly(np.full((2, 4, 10, 6), 7.0, f32))),
    case("out bshd shape", ValueError, r"`out` must have shape \(2, 10, 4, 6\)",
         q=lambda a: np.swapaxes(a["q"], 1, 2), k=lambda a: np.swapaxes(a["k"], 1, 2),
         v=lambda a: np.swapaxes(a["v"], 1, 2), layout="bshd"),
    # an error after the out check: the window
    case("window with out", ValueError, r"`window` sides must be >= -1", window=(-3, 0)),
    # tiles
    case("tiles zero", ValueError, r"`block_q` must be >= 1, got 0", tiles=(0, 16)),
    case("tiles negative", ValueError, r"`block_k` must be >= 1, got -1", tiles=(16, -1)),
    case("tiles triple", TypeError, r"`tiles` must be a TileConfig", tiles=(16, 16, 16)),
    case("tiles float", TypeError, r"`block_k` must be an int, got float", tiles=(16, 2.5)),
    case("tiles str", TypeError, r"`tiles` must be a TileConfig", tiles="big"),
    # keywords
    case("unknown keyword", TypeError,
         r"unexpected keyword argument 'dropout': cpuflash has no attention dropout",
         dropout=0.1),
    case("misspelt keyword", TypeError,
         r"unexpected keyword argument 'casual': did you mean `causal`\?", casual=True),
    case("torch keyword", TypeError, r"unexpected keyword argument 'is_causal'", is_causal=True),
]


@pytest.mark.parametrize("changes,exc,match", ATTENTION)
def test_attention_rejects(changes, exc, match):
    check_rejected(cpuflash.attention, arguments(attention_valid, changes), exc, match)


# -- cpuflash.attention_varlen --------------------------------------------------------------------

def varlen_valid():
    """Sequences of 4, 0 and 6 queries over 5, 7 and 3 keys; 4 query heads, 2 kv heads."""
    rng = np.random.default_rng(1)
    return {"q": rng.standard_normal((10, 4, 8)).astype(f32),
            "k": rng.standard_normal((15, 2, 8)).astype(f32),
            "v": rng.standard_normal((15, 2, 6)).astype(f32),
            "cu_seqlens_q": np.array([0, 4, 4, 10], np.int32),
            "cu_seqlens_k": np.array([0, 5, 12, 15], np.int32)}


def cast(dtype_q, dtype_k, dtype_v):
    return dict(q=lambda a: a["q"].astype(dtype_q), k=lambda a: a["k"].astype(dtype_k),
                v=lambda a: a["v"].astype(dtype_v))


VARLEN = [
    # arrays and dtypes
    case("q list", TypeError, r"`q` must be an array, got list", q=[[[1.0]]]),
    case("int", TypeError, r"`q`, `k` and `v` must be float32.*got int64", **cast(int, int, int)),
    case("complex", TypeError, r"`q` is complex64: complex attention is not supported",
         **cast(np.complex64, np.complex64, np.complex64)),
    case("mixed", TypeError,
         r"`q`, `k` and `v` must share one dtype, got float32, float32 and float64",
         **cast(f32, f32, np.float64)),
    case("half and single", TypeError,
         r"`q`, `k` and `v` must share one dtype, got float16, float32 and float32",
         **cast(np.float16, f32, f32)),
    # shapes
    case("q 4-D", ValueError, r"`q` must be 3-D \(total_tokens, heads, dim\)",
         q=lambda a: a["q"][None]),
    case("k 2-D", ValueError, r"`k` must be 3-D \(total_tokens, heads, dim\)",
         k=lambda a: a["k"][:, 0]),
    case("v rows", ValueError, r"`v` has 14 keys but `k` has 15", v=lambda a: a["v"][:-1]),
    case("head dim", ValueError, r"`k` has head dim 7 but `q` has 8",
         k=lambda a: a["k"][..., :7]),
    case("heads", ValueError, r"query heads \(3\) must be a multiple .* key/value heads \(2\)",
         q=lambda a: a["q"][:, :3]),
    # cu_seqlens
    case("cu None", TypeError, r"`cu_seqlens_q` must be an array", cu_seqlens_q=None),
    case("cu bool", TypeError, r"`cu_seqlens_k` must be an integer array, got dtype bool",
         cu_seqlens_k=np.ones(4, bool)),
    case("cu float", TypeError, r"`cu_seqlens_q` must be an integer array, got dtype float64",
         cu_seqlens_q=np.array([0.0, 4.0, 4.0, 10.0])),
    case("cu 2-D", ValueError, r"`cu_seqlens_q` must be 1-D", cu_seqlens_q=np.zeros((2, 2), int)),
    case("cu empty", ValueError,
         r"`cu_seqlens_q` must be 1-D with batch \+ 1 entries, got shape \(0,\)",
         cu_seqlens_q=np.zeros(0, np.int32)),
    case("cu start", ValueError, r"`cu_seqlens_q` must start at 0, got 1",
         cu_seqlens_q=np.array([1, 4, 4, 10])),
    case("cu decreasing", ValueError,
         r"`cu_seqlens_q` must be non-decreasing, got 6 then 5 at index 1",
         cu_seqlens_q=np.array([0, 6, 5, 10])),
    case("cu_q end", ValueError, r"`cu_seqlens_q` must end at the number of rows \(10\), got 9",
         cu_seqlens_q=np.array([0, 4, 4, 9])),
    case("cu_k end", ValueError, r"`cu_seqlens_k` must end at the number of rows \(15\), got 14",
         cu_seqlens_k=np.array([0, 5, 12, 14])),
    case("cu entries", ValueError, r"`cu_seqlens_k` has 2 entries but `cu_seqlens_q` has 4",
         cu_seqlens_k=np.array([0, 15])),
    case("cu uint64", ValueError,
         r"`cu_seqlens_q` values must be at most the number of rows \(10\), got 1844",
         cu_seqlens_q=np.array([0, 2**64 - 1, 4, 10], np.uint64)),
    # flags, scalars, slopes
    case("window side", ValueError, r"`window` sides must be >= -1", window=(0, -2)),
    case("window str", ValueError, r"`window` must be a pair of ints", window="ab"),
    case("window bool", ValueError, r"`window` must be a pair of ints", window=(True, 2)),
    case("softcap", ValueError, r"`softcap` must be finite and >= 0", softcap=-0.5),
    case("softcap inf", ValueError, r"`softcap` must be finite", softcap=float("inf")),
    case("softcap None", TypeError, r"`softcap` must be a real number", softcap=None),
    case("scale nan", ValueError, r"`scale` must be finite, got nan", scale=float("nan")),
    case("scale array", TypeError, r"`scale` must be a real number", scale=np.ones(2)),
    case("slopes (B, Hq) wrong", ValueError,
         r"`alibi_slopes` must have shape \(4,\) or \(3, 4\), got \(2, 4\)",
         alibi_slopes=np.ones((2, 4), f32)),
    case("slopes heads", ValueError,
         r"`alibi_slopes` must have shape \(4,\) or \(3, 4\), got \(2,\)",
         alibi_slopes=np.ones(2, f32)),
    case("slopes dtype", TypeError, r"`alibi_slopes` must be a float array, got dtype int32",
         alibi_slopes=np.ones(4, np.int32)),
    case("causal", TypeError, r"`causal` must be True or False", causal=1),
    case("return_lse", TypeError, r"`return_lse` must be True or False", return_lse="yes"),
    # keywords
    case("bias keyword", TypeError, r"unexpected keyword argument 'bias'",
         bias=np.zeros((10, 15), f32)),
    case("max_seqlen keyword", TypeError, r"unexpected keyword argument 'max_seqlen_q'",
         max_seqlen_q=6),
]


@pytest.mark.parametrize("changes,exc,match", VARLEN)
def test_attention_varlen_rejects(changes, exc, match):
    check_rejected(cpuflash.attention_varlen, arguments(varlen_valid, changes), exc, match)


# -- cpuflash.attention_with_kvcache --------------------------------------------------------------

def kvcache_valid():
    """Batch 2, 4 query heads over 2 kv heads, caches of 16 rows filled to 3 and 9, one new key
    each: a check that came after the write would show in the caches."""
    rng = np.random.default_rng(2)
    return {"q": rng.standard_normal((2, 4, 1, 8)).astype(f32),
            "k_cache": rng.standard_normal((2, 2, 16, 8)).astype(f32),
            "v_cache": rng.standard_normal((2, 2, 16, 6)).astype(f32),
            "k": rng.standard_normal((2, 2, 1, 8)).astype(f32),
            "v": rng.standard_normal((2, 2, 1, 6)).astype(f32),
            "cache_seqlens": np.array([3, 9], np.int32)}


def paged(**more):
    """Pages of 8 rows: k_cache (4 pages, 2 heads, 8, 8), two pages per batch entry."""
    pages = np.random.default_rng(3).standard_normal((4, 2, 8, 8)).astype(f32)
    return dict(k_cache=pages, v_cache=pages[..., :6].copy(),
                block_table=np.array([[0, 1], [2, 3]], np.int32)) | more


KVCACHE = [
    # arrays and dtypes
    case("q None", TypeError, r"`q` must be an array, got NoneType", q=None),
    case("int dtype", TypeError, r"`q`, `k_cache` and `v_cache` must be float32.*got int64",
         q=lambda a: a["q"].astype(int), k_cache=lambda a: a["k_cache"].astype(int),
         v_cache=lambda a: a["v_cache"].astype(int)),
    case("q dtype", TypeError,
         r"`q`, `k_cache` and `v_cache` must share one dtype, got float64, float32",
         q=lambda a: a["q"].astype(np.float64)),
    case("complex", TypeError, r"`v_cache` is complex64: complex attention is not supported",
         v_cache=lambda a: a["v_cache"].astype(np.complex64)),
    case("new v dtype", TypeError, r"`k` and `v` must have the dtype of the cache",
         v=lambda a: a["v"].astype(np.float16)),
    case("new k dtype", TypeError, r"`k` and `v` must have the dtype of the cache \(float32\), "
         r"got float64 and float32", k=lambda a: a["k"].astype(np.float64)),
    case("k without v", ValueError, r"`k` and `v` must be given together", v=None),
    # shapes
    case("q 3-D", ValueError, r"`q` must be 4-D", q=lambda a: a["q"][0]),
    case("k_cache 3-D", ValueError, r"`k_cache` must be 4-D", k_cache=lambda a: a["k_cache"][0]),
    case("new k 3-D", ValueError, r"`k` must be 4-D", k=lambda a: a["k"][0]),
    case("new k dim", ValueError, r"`k` and `v` must be \(batch, kv heads, new, dim\)",
         k=lambda a: a["k"][..., :5]),
    case("new v rows", ValueError, r"`k` and `v` must be \(batch, kv heads, new, dim\)",
         v=lambda a: np.concatenate([a["v"], a["v"]], axis=2)),
    case("q heads", ValueError, r"query heads \(3\) must be a multiple .* key/value heads \(2\)",
         q=lambda a: a["q"][:, :3]),
    case("v_cache rows", ValueError, r"`v_cache` has 15 .*`k_cache` has 16",
         v_cache=lambda a: a["v_cache"][:, :, :15]),
    case("v_cache heads", ValueError, r"`v_cache` has 1 heads? but `k_cache` has 2",
         v_cache=lambda a: a["v_cache"][:, :1]),
    case("k_cache head dim", ValueError, r"`k_cache` has head dim 7 but `q` has 8",
         k_cache=lambda a: a["k_cache"][..., :7]),
    case("v_cache batch", ValueError, r"`v_cache` has 1 batch entries but `k_cache` has 2",
         v_cache=lambda a: a["v_cache"][:1]),
    case("k_cache batch", ValueError, r"`k_cache` has batch 3 but `q` has 2",
         k_cache=np.zeros((3, 2, 16, 8), f32), v_cache=np.zeros((3, 2, 16, 6), f32)),
    case("layout", ValueError, r"`layout` must be one of", layout="x"),
    # read-only caches
    case("k_cache readonly", ValueError, r"`k_cache` is read-only",
         k_cache=lambda a: readonly(a["k_cache"])),
    case("v_cache readonly", ValueError, r"`v_cache` is read-only",
         v_cache=lambda a: readonly(a["v_cache"])),
    # cache_seqlens
    case("seqlens past the end", ValueError,
         r"`cache_seqlens` must lie in \[0, 15\] \(cache length 16 minus 1 new keys\), "
         r"got \[3, 16\]", cache_seqlens=[3, 16]),
    case("seqlens negative", ValueError, r"`cache_seqlens` must lie in", cache_seqlens=[-1, 0]),
    case("seqlens int too large", ValueError, r"`cache_seqlens` must lie in .*got \[16, 16\]",
         cache_seqlens=16),
    case("seqlens None", ValueError,
         r"`cache_seqlens` must lie in \[0, 15\] .*got None \(a full cache\)", cache_seqlens=None),
    case("seqlens shape", ValueError, r"`cache_seqlens` must have shape \(2,\)",
         cache_seqlens=[1, 2, 3]),
    case("seqlens float", TypeError, r"`cache_seqlens` must be an integer array",
         cache_seqlens=np.array([1.0, 2.0])),
    case("seqlens bool", TypeError, r"`cache_seqlens` must be an array, got bool",
         cache_seqlens=True),
    # pages
    case("pages differ", ValueError, r"`v_cache` has 2 pages but `k_cache` has 4",
         **paged(v_cache=np.zeros((2, 2, 8, 6), f32))),
    case("table rows", ValueError, r"`block_table` must have shape \(batch=2, max_pages\)",
         **paged(block_table=np.array([[0, 1]], np.int32))),
    case("table 1-D", ValueError, r"`block_table` must have shape \(batch=2, max_pages\), got "
         r"\(2,\)", **paged(block_table=np.array([0, 1], np.int32))),
    case("table entries", ValueError,
         r"`block_table` entries for the keys in use must lie in \[0, 4\) \(the number of "
         r"pages\)", **paged(block_table=np.array([[2, 3], [4, 5]], np.int32),
                            cache_seqlens=[12, 3])),
    case("table negative", ValueError, r"`block_table` entries .* \[0, 4\)",
         **paged(block_table=np.array([[0, -1], [2, 3]], np.int32), cache_seqlens=[12, 3])),
    case("table float", TypeError, r"`block_table` must be an integer array",
         **paged(block_table=np.array([[0.0, 1.0], [2.0, 3.0]]))),
    # flags, scalars, slopes, sinks
    case("num_splits negative", ValueError, r"`num_splits` must be >= 0 \(0 = automatic\), "
         r"got -1", num_splits=-1),
    case("num_splits float", TypeError, r"`num_splits` must be an int \(0 = automatic\)",
         num_splits=1.5),
    case("num_splits bool", TypeError, r"`num_splits` must be an int \(0 = automatic\)",
         num_splits=True),
    case("window", ValueError, r"`window` must be a pair of ints", window=(1,)),
    case("window side", ValueError, r"`window` sides must be >= -1", window=(-3, 0)),
    case("softcap", ValueError, r"`softcap` must be finite and >= 0", softcap=-1.0),
    case("softcap str", TypeError, r"`softcap` must be a real number", softcap="2"),
    case("scale inf", ValueError, r"`scale` must be finite", scale=float("-inf")),
    case("sinks shape", ValueError, r"`sinks` must have shape \(4,\), got \(2,\)",
         sinks=np.ones(2, f32)),
    case("sinks 2-D", ValueError, r"`sinks` must have shape \(4,\), got \(4, 1\)",
         sinks=np.ones((4, 1), f32)),
    case("sinks dtype", TypeError, r"`sinks` must be a float array", sinks=np.ones(4, int)),
    case("slopes shape", ValueError,
         r"`alibi_slopes` must have shape \(4,\) or \(2, 4\), got \(1, 4\)",
         alibi_slopes=np.ones((1, 4), f32)),
    case("slopes dtype", TypeError, r"`alibi_slopes` must be a float array",
         alibi_slopes=np.ones(4, np.int32)),
    case("causal", TypeError, r"`causal` must be True or False", causal=None),
    case("return_lse", TypeError, r"`return_lse` must be True or False", return_lse="y"),
    # keywords
    case("mask keyword", TypeError, r"unexpected keyword argument 'mask'",
         mask=np.ones((1, 16), bool)),
    case("rotary keyword", TypeError, r"unexpected keyword argument 'rotary_cos'",
         rotary_cos=np.ones(4, f32)),
]


@pytest.mark.parametrize("changes,exc,match", KVCACHE)
def test_attention_with_kvcache_rejects_and_writes_nothing(changes, exc, match):
    check_rejected(cpuflash.attention_with_kvcache, arguments(kvcache_valid, changes), exc,
                   match)


# -- cpuflash.merge_states ------------------------------------------------------------------------

def merge_valid():
    rng = np.random.default_rng(4)
    return {"outs": rng.standard_normal((2, 3, 5)).astype(f32),
            "lses": rng.standard_normal((2, 3)).astype(f32)}


MERGE = [
    case("outs None", TypeError, r"`outs` must be an array", outs=None),
    case("outs int", TypeError, r"`outs` must be float32 or float64, got int32",
         outs=lambda a: a["outs"].astype(np.int32)),
    case("lses int", TypeError, r"`lses` must be float32 or float64, got int64",
         lses=lambda a: a["lses"].astype(np.int64)),
    case("lses shape", ValueError, r"`outs` must be \(S, \.\.\., Dv\) and `lses` \(S, \.\.\.\) "
         r"with the same leading shape, got \(2, 3, 5\) and \(2, 2\)",
         lses=lambda a: a["lses"][:, :2]),
    case("lses for Dv", ValueError, r"`outs` must be \(S, \.\.\., Dv\)",
         lses=np.ones((2, 5), f32)),
    case("1-D outs", ValueError, r"`outs` must be \(S, \.\.\., Dv\)",
         outs=lambda a: a["outs"][0, 0], lses=lambda a: a["lses"][0]),
    case("no parts", ValueError, r"`outs` must hold at least one partial result, got 0",
         outs=np.ones((0, 3, 4), f32), lses=np.ones((0, 3), f32)),
    case("empty lists", ValueError, r"`outs` must hold at least one partial result, got 0",
         outs=[], lses=[]),
    case("outs parts differ", ValueError, r"the parts of `outs` must share one shape",
         outs=[np.ones((3, 5), f32), np.ones((4, 5), f32)],
         lses=[np.zeros(3, f32), np.zeros(4, f32)]),
    case("lses parts differ", ValueError, r"the parts of `lses` must share one shape",
         outs=[np.ones((3, 5), f32)] * 2, lses=[np.zeros(3, f32), np.zeros(4, f32)]),
    case("unknown keyword", TypeError, r"unexpected keyword argument 'axis'", axis=0),
]


@pytest.mark.parametrize("changes,exc,match", MERGE)
def test_merge_states_rejects(changes, exc, match):
    check_rejected(cpuflash.merge_states, arguments(merge_valid, changes), exc, match)


# -- cpuflash.choose_tiles and cpuflash.TileConfig ------------------------------------------------

def tiles_valid():
    return {"head_dim": 64}


CHOOSE_TILES = [
    case("head_dim 0", ValueError, r"`head_dim` must be >= 1, got 0", head_dim=0),
    case("head_dim negative", ValueError, r"`head_dim` must be >= 1, got -4", head_dim=-4),
    case("head_dim str", TypeError, r"`head_dim` must be an int, got str", head_dim="x"),
    case("head_dim bool", TypeError, r"`head_dim` must be an int, got bool", head_dim=True),
    case("head_dim_v 0", ValueError, r"`head_dim_v` must be >= 1, got 0", head_dim_v=0),
    case("head_dim_v float", TypeError, r"`head_dim_v` must be an int, got float",
         head_dim_v=2.5),
    case("dtype int", TypeError, r"`dtype` must be float32, float64, float16 or bfloat16",
         dtype=np.int32),
    case("dtype nonsense", TypeError, r"`dtype` must be a float dtype", dtype="nonsense"),
    case("cache keys", ValueError, r"`cache` must be a dict with keys", cache={"l1d": 32768}),
    case("cache not a dict", ValueError, r"`cache` must be a dict with keys 'l1d' and 'l2' "
         r"\(bytes\), got 5", cache=5),
    case("cache l1d 0", ValueError, r"`cache\['l1d'\]` must be >= 1",
         cache={"l1d": 0, "l2": 1}),
    case("cache l2 float", TypeError, r"`cache\['l2'\]` must be an int, got float",
         cache={"l1d": 32768, "l2": 1.5e6}),
]


@pytest.mark.parametrize("changes,exc,match", CHOOSE_TILES)
def test_choose_tiles_rejects(changes, exc, match):
    check_rejected(cpuflash.choose_tiles, arguments(tiles_valid, changes), exc, match)


@pytest.mark.parametrize("block_q,block_k,exc,match", [
    (8, -4, ValueError, r"`block_k` must be >= 1, got -4"),
    (0, 8, ValueError, r"`block_q` must be >= 1, got 0"),
    (True, 8, TypeError, r"`block_q` must be an int, got bool"),
    (8, 2.5, TypeError, r"`block_k` must be an int, got float"),
    (8, None, TypeError, r"`block_k` must be an int, got NoneType"),
])
def test_tile_config_rejects(block_q, block_k, exc, match):
    with pytest.raises(exc, match=match):
        cpuflash.TileConfig(block_q, block_k)


# -- cpuflash.reference.attention_fa1 -------------------------------------------------------------

def test_fa1_rejects_half_precision():
    x = np.ones((1, 1, 4, 8), np.float16)
    with pytest.raises(TypeError, match="attention_fa1 takes float32 or float64, got float16"):
        attention_fa1(x, x, x)
