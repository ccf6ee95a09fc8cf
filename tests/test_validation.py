"""Bad input raises a clear TypeError/ValueError before any work, and changes nothing."""

import numpy as np
import pytest

import cpuflash
from cpuflash.reference import attention_fa1

f32 = np.float32


def good():
    rng = np.random.default_rng(0)
    return {
        "q": rng.standard_normal((2, 4, 10, 8)).astype(f32),
        "k": rng.standard_normal((2, 2, 12, 8)).astype(f32),
        "v": rng.standard_normal((2, 2, 12, 6)).astype(f32),
    }


def with_(**changes):
    args = good()
    args.update(changes)
    return args


def readonly(x):
    x = x.copy()
    x.flags.writeable = False
    return x


CASES = [
    # (name, keyword arguments, exception, message pattern)
    ("q list", with_(q=[[1.0]]), TypeError, r"`q` must be an array, got list"),
    ("k None", with_(k=None), TypeError, r"`k` must be an array, got NoneType"),
    ("int dtype", with_(q=np.ones((2, 4, 10, 8), np.int32)), TypeError, r"share one dtype.*int32"),
    ("all int", {k: np.ones((2, 2, 3, 4), np.int64) for k in "qkv"}, TypeError,
     r"must be float32, float64, float16 or bfloat16, got int64"),
    ("complex", {k: np.ones((2, 2, 3, 4), np.complex64) for k in "qkv"}, TypeError, r"complex64"),
    ("object", {k: np.ones((2, 2, 3, 4), object) for k in "qkv"}, TypeError, r"object"),
    ("strings", {k: np.full((2, 2, 3, 4), "a") for k in "qkv"}, TypeError, r"<U1"),
    ("mixed", with_(v=np.ones((2, 2, 12, 6), np.float64)), TypeError,
     r"float32, float32 and float64"),
    ("1-D q", with_(q=np.ones(8, f32)), ValueError, r"`q` must have at least 2 dims"),
    ("ndim differ", with_(q=np.ones((4, 10, 8), f32)), ValueError, r"same number of dims"),
    ("batch differ", with_(k=np.ones((3, 2, 12, 8), f32), v=np.ones((3, 2, 12, 6), f32)),
     ValueError, r"equal leading \(batch\) axes"),
    ("head dim", with_(k=np.ones((2, 2, 12, 7), f32)), ValueError,
     r"`k` has head dim 7 but `q` has 8"),
    ("zero head dim", {"q": np.ones((1, 1, 3, 0), f32), "k": np.ones((1, 1, 3, 0), f32),
                       "v": np.ones((1, 1, 3, 2), f32)}, ValueError, r"head dims must be >= 1"),
    ("v keys", with_(v=np.ones((2, 2, 11, 6), f32)), ValueError, r"`v` has 11 keys but `k` has 12"),
    ("v heads", with_(v=np.ones((2, 1, 12, 6), f32)), ValueError, r"`v` has 1 heads but `k` has 2"),
    ("heads", with_(k=np.ones((2, 3, 12, 8), f32), v=np.ones((2, 3, 12, 6), f32)), ValueError,
     r"query heads \(4\) must be a multiple of the number of key/value heads \(3\)"),
    ("layout", with_(layout="sbhd"), ValueError, r"`layout` must be one of"),
    ("bshd 3-D", {k: np.ones((2, 3, 4), f32) for k in "qkv"} | {"layout": "bshd"}, ValueError,
     r"must be 4-D \(batch, seqlen, heads, dim\)"),
    ("causal", with_(causal="yes"), TypeError, r"`causal` must be True or False"),
    ("return_lse", with_(return_lse=1), TypeError, r"`return_lse` must be True or False"),
    ("scale nan", with_(scale=float("nan")), ValueError, r"`scale` must be finite, got nan"),
    ("scale inf", with_(scale=float("inf")), ValueError, r"`scale` must be finite, got inf"),
    ("scale str", with_(scale="1"), TypeError, r"`scale` must be a real number"),
    ("window int", with_(window=3), ValueError, r"`window` must be a pair of ints"),
    ("window triple", with_(window=(1, 2, 3)), ValueError, r"`window` must be a pair of ints"),
    ("window float", with_(window=(1.5, 2)), ValueError, r"`window` must be a pair of ints"),
    ("window -2", with_(window=(-2, 0)), ValueError, r"`window` sides must be >= -1"),
    ("softcap<0", with_(softcap=-1.0), ValueError, r"`softcap` must be finite and >= 0"),
    ("softcap nan", with_(softcap=float("nan")), ValueError, r"`softcap` must be finite"),
    ("softcap str", with_(softcap="1"), TypeError, r"`softcap` must be a real number"),
    ("slopes shape", with_(alibi_slopes=np.ones(3, f32)), ValueError,
     r"`alibi_slopes` must have shape \(4,\) or \(2, 4\), got \(3,\)"),
    ("slopes dtype", with_(alibi_slopes=np.ones(4, np.int32)), TypeError,
     r"`alibi_slopes` must be a float array, got dtype int32"),
    ("bias shape", with_(bias=np.ones((10, 11), f32)), ValueError,
     r"`bias` must be broadcastable to \(2, 4, 10, 12\), got shape \(10, 11\)"),
    ("bias ndim", with_(bias=np.ones((1, 2, 4, 10, 12), f32)), ValueError,
     r"`bias` must be broadcastable"),
    ("bias bool", with_(bias=np.ones((10, 12), bool)), TypeError, r"`bias` must be a float array"),
    ("mask dtype", with_(mask=np.ones((10, 12), np.int8)), TypeError,
     r"`mask` must be a boolean array .*got dtype int8"),
    ("mask shape", with_(mask=np.ones((3, 10, 12), bool)), ValueError,
     r"`mask` must be broadcastable to \(2, 4, 10, 12\)"),
    ("sinks shape", with_(sinks=np.ones(2, f32)), ValueError, r"`sinks` must have shape \(4,\)"),
    ("sinks dtype", with_(sinks=np.ones(4, np.int64)), TypeError, r"`sinks` must be a float"),
    ("out shape", with_(out=np.empty((2, 4, 10, 8), f32)), ValueError,
     r"`out` must have shape \(2, 4, 10, 6\), got \(2, 4, 10, 8\)"),
    ("out dtype", with_(out=np.empty((2, 4, 10, 6), np.float64)), TypeError,
     r"`out` must have dtype float32"),
    ("out list", with_(out=[]), TypeError, r"`out` must be an array, got list"),
    ("out readonly", with_(out=readonly(np.empty((2, 4, 10, 6), f32))), ValueError,
     r"`out` must be writeable"),
    ("tiles zero", with_(tiles=(0, 16)), ValueError, r"`block_q` must be >= 1, got 0"),
    ("tiles negative", with_(tiles=(16, -1)), ValueError, r"`block_k` must be >= 1, got -1"),
    ("tiles triple", with_(tiles=(16, 16, 16)), TypeError, r"`tiles` must be a TileConfig"),
    ("tiles float", with_(tiles=(16, 2.5)), TypeError, r"`block_k` must be an int, got float"),
    ("tiles str", with_(tiles="big"), TypeError, r"`tiles` must be a TileConfig"),
    ("unknown keyword", with_(dropout=0.1), TypeError,
     r"unexpected keyword argument 'dropout': cpuflash has no attention dropout"),
    ("misspelt keyword", with_(casual=True), TypeError,
     r"unexpected keyword argument 'casual': did you mean `causal`\?"),
    ("bshd arrays", {"q": np.ones((2, 10, 4, 8), f32), "k": np.ones((2, 12, 2, 8), f32),
                     "v": np.ones((2, 12, 2, 6), f32)}, ValueError,
     r"query heads \(10\) .* key/value heads \(12\); if these are flash-attn's \(batch, seqlen, "
     r"heads, dim\) arrays, pass `layout=\"bshd\"`"),
]


@pytest.mark.parametrize("kwargs,exc,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_before_any_work(kwargs, exc, match):
    before = {name: np.array(x, copy=True) if isinstance(x, np.ndarray) else x
              for name, x in kwargs.items()}
    with pytest.raises(exc, match=match):
        cpuflash.attention(**kwargs)
    for name, x in kwargs.items():
        if isinstance(x, np.ndarray) and x.dtype.kind == "f":
            np.testing.assert_array_equal(x, before[name])  # out and inputs untouched


def test_out_is_untouched_on_error():
    args = good()
    out = np.full((2, 4, 10, 6), 7.0, dtype=f32)
    with pytest.raises(ValueError, match="`window`"):
        cpuflash.attention(**args, out=out, window=(-3, 0))
    assert np.all(out == 7.0)


def test_tile_config_rejects_nonsense():
    with pytest.raises(ValueError, match=r"`block_k` must be >= 1, got -4"):
        cpuflash.TileConfig(8, -4)
    with pytest.raises(TypeError, match=r"`block_q` must be an int, got bool"):
        cpuflash.TileConfig(True, 8)


def test_fa1_rejects_half_precision():
    x = np.ones((1, 1, 4, 8), np.float16)
    with pytest.raises(TypeError, match="attention_fa1 takes float32 or float64, got float16"):
        attention_fa1(x, x, x)
