"""One validated call as the kernels read it (`AttentionCall`), frozen, and the rules of how
the kernels read an input's dtype (`half_kind`, `kernel_view`).

`_validate` builds calls, `_user_functions` a copy with the user's functions; the runners
(`_run`, `_run_backward`) read them and never change them.
"""

import collections
import copy
import dataclasses
import functools

import numba
import numpy as np

from ._quantize import hadamard
from .kernels import _user
from .kernels._convert import BFLOAT16, FLOAT16, FLOAT8_E4M3, INT8
from .kernels._pipeline import Pipeline, kernel_args
from .tiling import TileConfig

# How the kernels read an input (`half_kind`): natively, or as the uint16 bits of float16 or
# bfloat16, or (a quantized cache) as int8 or the uint8 bits of float8_e4m3fn, whose codes the
# kernels define. An int4 cache's kernel turns its rows into float32 ones as it reads them
# (`kernels.decode.INT4`), which it then reads natively.
NATIVE = 0
assert NATIVE not in (FLOAT16, BFLOAT16), "NATIVE must differ from the kernels' half kinds"
QUANT_KINDS = {"int8": INT8, "float8_e4m3": FLOAT8_E4M3, "int4": NATIVE}


def _is_bfloat16(dtype):
    # ml_dtypes' bfloat16 is a void-kind dtype; the kind test spares the (slow) name lookup
    return dtype.kind == "V" and dtype.name == "bfloat16"


def compute_dtype(dtype):
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def kernel_view(x):
    """The array the kernels read: uint16 bits for half precision, aligned memory."""
    if x.dtype == np.float16 or _is_bfloat16(x.dtype):
        x = x.view(np.uint16)
    if not x.flags.aligned:
        x = x.copy()
    return x


def half_kind(dtype):
    """How the kernels read arrays of `dtype`: NATIVE, FLOAT16 or BFLOAT16."""
    if dtype == np.float16:
        return FLOAT16
    return BFLOAT16 if _is_bfloat16(dtype) else NATIVE


# the caller's own functions (`cpuflash.flex`): the fields of the pipeline's score_mod and
# visibility steps that they fill (`kernels._pipeline.STEPS` says what each holds)
UserFunctions = collections.namedtuple(
    "UserFunctions", "functions score_args mask_args block_states block_q block_k positions")
NO_USER_FUNCTIONS = UserFunctions(_user.NONE, _user.with_end(()), _user.with_end(()),
                                  np.zeros((0, 0, 0, 0), dtype=np.int8), 1, 1, False)


def user_types(user):
    """The Numba types of the user's functions and of their argument tuples: what a kernel is
    specialized by besides its dtypes (`_pipeline.pipeline_type`)."""
    return tuple(numba.typeof(x) for x in (user.functions, user.score_args, user.mask_args))


_NO_USER_TYPES = user_types(NO_USER_FUNCTIONS)


@dataclasses.dataclass(slots=True, kw_only=True, eq=False, frozen=True)
class AttentionCall:
    """One validated call: its arrays as the kernels read them, and how to hand back the result.

    `attention_args`, `varlen_args` and `kvcache_args` build it, `_user_functions` a copy with
    the user's functions; `__post_init__` derives the fields marked "derived". Frozen: what
    runs a call (`_run`, `_run_backward`) reads it and never changes it. The kernels read 4-D
    ``(batch, heads, rows, dim)`` arrays of any strides, float16 and bfloat16 as their uint16
    bits.
    """

    # -- inputs, as the kernels read them
    q: np.ndarray  # (batch, Hq, Nq, D)
    k: np.ndarray  # (batch, Hk, Nk, D); with a KV cache: its pages (see `_kvcache`)
    v: np.ndarray  # (batch, Hk, Nk, Dv), like `k`
    dtype: np.dtype  # of the inputs and of the result
    compute_dtype: np.dtype = dataclasses.field(init=False)  # derived: float64 or float32
    half_kind: int = dataclasses.field(init=False)  # derived: NATIVE, FLOAT16 or BFLOAT16

    # -- sizes
    batch: int  # batch entries (packed sequences: how many sequences)
    n_heads: int
    n_kv_heads: int
    n_q: int  # query rows of each batch entry (packed: of all sequences)
    n_k: int  # key rows of each batch entry (packed: of all; cache: the most of any entry)
    head_dim: int
    head_dim_v: int

    # -- score modifiers, in the order of the score pipeline
    qk_scale: float
    softcap: float  # 0 = off
    alibi: np.ndarray  # (batch, Hq) slopes in the compute dtype; (batch, 0) without
    bias: np.ndarray = None  # (Bx, Hq, Nq, Nk), broadcast, never expanded; derived: size 0
    bias_map: np.ndarray = None  # (batch,) the row of `bias` each batch entry reads
    causal: bool
    window: tuple  # (left, right), -1 = unbounded; `causal` made right 0
    chunk: int = 0  # chunked attention's chunk size; 0 = off
    mask: np.ndarray = None  # bool, like `bias`
    mask_map: np.ndarray = None
    sinks: np.ndarray = None  # (Hq,) in the compute dtype; derived: size 0 without
    user: tuple = None  # the caller's own functions (`cpuflash.flex`); derived: none
    tiles: TileConfig | None = None  # the caller's tiles; None = chosen for this machine

    # -- output
    out_user: np.ndarray  # the result, in the caller's shape and dtype
    out_bhsd: np.ndarray  # a (batch, Hq, Nq, Dv) view of `out_user`
    out_kernel: np.ndarray = dataclasses.field(init=False)  # derived: `out_bhsd` for kernels
    copy_back: np.ndarray | None = None  # the caller's `out`, when `out_user` stands in for it
    lse: np.ndarray = dataclasses.field(init=False)  # derived: (q's first 3 axes) compute dtype
    lse_shape: tuple  # the shape the caller gets `lse` in

    # -- packed sequences (`varlen_args`): sequence b is rows cu[b]:cu[b + 1], int64
    cu_q: np.ndarray | None = None
    cu_k: np.ndarray | None = None

    # -- KV cache (`kvcache_args`); where each position lives: see `_kvcache`
    k_cache: np.ndarray | None = None  # (pages, Hk, page_rows, D), the caller's dtype, written
    v_cache: np.ndarray | None = None
    quantized: str | None = None  # a quantized cache's format (`_quantize.QUANT_MAX`), or None
    rotated: bool = False  # its rows turned by the Walsh-Hadamard matrix: the output is turned back
    integer_dot: bool = False  # Q K^T of the decoding kernel in integers (`kernels._idot`)
    k_scale: np.ndarray | None = None  # its (pages, Hk, page_rows[, groups]) scales, written
    v_scale: np.ndarray | None = None
    new_k: np.ndarray | None = None  # (batch, Hk, Nnew, D) keys to write into `k_cache`
    new_v: np.ndarray | None = None
    block_table: np.ndarray | None = None  # (batch, max_pages) int64
    page_rows: int = 0
    paged: bool = False  # the caller gave a block table
    seqlens: np.ndarray | None = None  # (batch,) int64 filled positions, before the new keys
    n_keys: np.ndarray | None = None  # (batch,) int64 keys attended to: seqlens + Nnew
    num_splits: int = 0  # 0 = automatic

    def __post_init__(self):
        derive = functools.partial(object.__setattr__, self)  # (a frozen instance's fields)
        cdtype = compute_dtype(self.dtype)
        derive("compute_dtype", cdtype)
        derive("half_kind", half_kind(self.dtype) if self.quantized is None
               else QUANT_KINDS[self.quantized])
        derive("lse", np.empty(self.q.shape[:3], dtype=cdtype))
        derive("out_kernel", kernel_view(self.out_bhsd))
        no_batch = np.zeros(self.batch, dtype=np.int64)
        if self.bias is None:  # size 0: the kernels skip it
            derive("bias", np.zeros((0, 0, 0, 0), dtype=cdtype))
            derive("bias_map", no_batch)
        if self.mask is None:
            derive("mask", np.zeros((0, 0, 0, 0), dtype=np.bool_))
            derive("mask_map", no_batch)
        if self.sinks is None:
            derive("sinks", np.zeros(0, dtype=cdtype))
        if self.user is None:
            derive("user", NO_USER_FUNCTIONS)

    def pipeline(self):
        """The score pipeline as the kernels take it (`kernels._pipeline.Pipeline`)."""
        left, right = self.window
        return Pipeline(scale=float(self.qk_scale), softcap=float(self.softcap),
                        alibi=self.alibi, bias=self.bias, bias_map=self.bias_map,
                        left=left, right=right, chunk=self.chunk, mask=self.mask,
                        mask_map=self.mask_map, sinks=self.sinks, **self.user._asdict())

    def kernel_pipeline(self):
        """The score pipeline as the kernels' last arguments take it (`_pipeline.kernel_args`)."""
        return kernel_args(self.pipeline())

    def plain(self):
        """Whether the call has no modifier but a causal mask or a window: its kernels are then
        builds compiled without the others' steps (`kernels.forward.PLAIN`)."""
        return (self.softcap == 0 and self.chunk == 0 and self.alibi.shape[1] == 0
                and self.bias.shape[0] == 0 and self.mask.shape[0] == 0
                and self.sinks.shape[0] == 0 and self.user is NO_USER_FUNCTIONS)

    def without_arrays(self):
        """A copy that keeps none of the caller's arrays, for a stored plan (`_plans`): what a
        later call with the same key needs besides its own arrays. The kernels' key reads q's
        dtype, from an empty array; the empty operands of a call without modifiers, shared by
        every such call, are made read-only."""
        kept = copy.copy(self)
        strip = functools.partial(object.__setattr__, kept)  # (a frozen copy's fields)
        strip("q", np.empty((0, 0, 0, 0), dtype=self.q.dtype))
        for name in ("k", "v", "out_user", "out_bhsd", "out_kernel", "lse"):
            strip(name, None)
        for array in (self.alibi, self.bias, self.bias_map, self.mask, self.mask_map,
                      self.sinks):
            array.flags.writeable = False
        return kept

    def kernel_key(self):
        """The key the FA-2 kernels are specialized by: dtypes, and the user's functions."""
        user = _NO_USER_TYPES if self.user is NO_USER_FUNCTIONS else user_types(self.user)
        return self.q.dtype, self.compute_dtype, user

    def result(self, return_lse):
        """What the public function returns: ``out``, or ``(out, lse)``."""
        if self.rotated:  # values read turned: the output back (H is its own inverse)
            self.out_bhsd[...] = hadamard(self.out_bhsd)
        if self.copy_back is not None:
            np.copyto(self.copy_back, self.out_user)
            out = self.copy_back
        else:
            out = self.out_user
        if not return_lse:
            return out
        return out, self.lse.reshape(self.lse_shape)
