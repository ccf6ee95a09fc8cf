"""The register-blocked micro-kernels of the tile products, one source for every shape and layout:
``Q K^T`` (`qk_micro`), ``P V`` (`pv_micro`) and the backward's ``A^T B`` (`tn_micro`).

Each keeps a tile of ``rows x 2 * panels`` sums in vector registers for a whole run of the sum:
`ROWS` rows (or 1, the remainder rows of a tile) by one panel of two vectors (the width of a key
panel), or two panels where the CPU has the 32 vector registers of AVX-512 (`WIDE`: 24
accumulators). The operands are float tiles (`_products`), whose terms are `vfma` multiply-adds,
or bfloat16 pairs (uint16 bits, `_pairs`), whose terms are `vdot_pairs`, two multiply-adds a
lane (`per_term`).

A hand-unrolled micro-kernel names each accumulator; these keep the tile in a tuple of tuples of
vectors, and its shape is a compile-time constant: the callers pass `rows` and `panels` as
constants, which Numba types as literals, so each shape is a specialization of its own. In it
`zeros_tile` and `fma_tile` emit, unrolled, the loads, broadcasts and multiply-adds of a
hand-written kernel of that shape; LLVM keeps each vector of the tuple in a register through the
loop, and unrolls the loops over the tile's rows and panels that end a kernel (constant ranges).
So the inner loops compile to the instructions of hand-unrolled kernels (``inspect_asm``), and
the multiply-adds are the same, in the same order: the same bits.
"""

from llvmlite import ir
from numba import types
from numba.core import errors
from numba.extending import intrinsic, overload
from numba.np.numpy_support import as_dtype

from .. import _simd
from .._jit import STRICT_OPTIONS, jit
from .._simd import vadd, vbroadcast, vbroadcast_pair, vdot_pairs, vfma, vload, vload_pairs, \
    vmul, vsplat, vstore, vzeros
from ._layout import DOT_CHUNK, ROWS, lanes, rescale_add


# -- the register tile

def _step_ops(arr, name):
    """(load, broadcast, multiply-add, elements of `arr` in one vector) of a tile step that reads
    `arr`: a float array's vectors and numbers, or a uint16 array's bfloat16 pairs."""
    if isinstance(arr, types.Array) and arr.dtype == types.uint16:
        return vload_pairs, vbroadcast_pair, vdot_pairs, 2 * _simd.LANES_F32
    if isinstance(arr, types.Array) and arr.dtype in (types.float32, types.float64):
        return vload, vbroadcast, vfma, _simd.lanes_for(as_dtype(arr.dtype))
    raise errors.TypingError("`%s` must be a float32, float64 or uint16 array, got %s"
                             % (name, arr))


def _typed(typingctx, op, *argtys):
    """(Numba type of the intrinsic `op`, its signature for `argtys`): typed when the tile step
    is, so that operands of the wrong kind fail there."""
    fnty = typingctx.resolve_value_type(op)
    return fnty, typingctx.resolve_function_type(fnty, argtys, {})


@intrinsic(prefer_literal=True)
def zeros_tile(typingctx, like, rows, panels):
    """A tile of zeros for `fma_tile`: a tuple of `rows` tuples of ``2 * panels`` vectors of
    `like`'s dtype (a float array). `rows` and `panels` are constants: they give the type."""
    if not all(isinstance(x, types.IntegerLiteral) and x.literal_value > 0
               for x in (rows, panels)):
        raise errors.TypingError("`rows` and `panels` must be constant positive integers, got "
                                 "%s, %s" % (rows, panels))
    vec = _typed(typingctx, vzeros, like)[1].return_type
    tile = types.UniTuple(types.UniTuple(vec, 2 * panels.literal_value), rows.literal_value)

    def codegen(context, builder, sig, args):
        return context.get_constant_null(tile)

    return tile(like, rows, panels), codegen


@intrinsic
def fma_tile(typingctx, tile, a, i, step, b, j, gap):
    """One term of the sums of a tile, for every row r and vector c of it::

        tile[r][c] + a[i + r * step] * b[j + c // 2 * gap + c % 2 * n :][:n]

    with `n` the elements of `b` in one vector: `b`'s vectors come in panels of two, panel p at
    ``j + p * gap``. Float arrays: `a`'s number broadcast, one `vfma` each. uint16 arrays
    (bfloat16 pairs): the pair ``a[i + r * step :][:2]`` broadcast, `b`'s vectors of pairs, one
    `vdot_pairs` each (the tile is float32). Emitted unrolled, as `_simd`'s own loads,
    broadcasts and multiply-adds: `b`'s vectors, then row by row a broadcast and its products.
    """
    if not (isinstance(tile, types.UniTuple) and isinstance(tile.dtype, types.UniTuple)
            and isinstance(tile.dtype.dtype, _simd.Vec) and tile.dtype.count % 2 == 0):
        raise errors.TypingError("`tile` must be a tile of `zeros_tile`, got %s" % tile)
    load, broadcast, madd, n = _step_ops(b, "b")
    if _step_ops(a, "a")[2] is not madd:
        raise errors.TypingError("`a` and `b` must both be float arrays or both uint16, got "
                                 "%s, %s" % (a, b))
    for index, name in ((i, "i"), (step, "step"), (j, "j"), (gap, "gap")):
        if not isinstance(index, types.Integer):
            raise errors.TypingError("`%s` must be an integer, got %s" % (name, index))
    intp, vec = types.intp, tile.dtype.dtype
    load_fn, load_sig = _typed(typingctx, load, b, intp)
    broadcast_fn, broadcast_sig = _typed(typingctx, broadcast, a, intp)
    pairs = madd is vdot_pairs  # (its operands: the sum first)
    madd_types = ((vec, broadcast_sig.return_type, load_sig.return_type) if pairs
                  else (broadcast_sig.return_type, load_sig.return_type, vec))
    madd_fn, madd_sig = _typed(typingctx, madd, *madd_types)
    rows, width = tile.count, tile.dtype.count

    def codegen(context, builder, sig, args):
        tile_v, a_v, b_v = args[0], args[1], args[4]
        i_v, step_v, j_v, gap_v = (context.cast(builder, args[k], sig.args[k], intp)
                                   for k in (2, 3, 5, 6))
        ll_intp = context.get_value_type(intp)

        def at(start, stride, k):  # start + k * stride
            return builder.add(start, builder.mul(stride, ir.Constant(ll_intp, k)))

        load_v, broadcast_v, multiply_add = (context.get_function(fn, fn_sig) for fn, fn_sig in (
            (load_fn, load_sig), (broadcast_fn, broadcast_sig), (madd_fn, madd_sig)))
        vectors = []
        for panel in range(width // 2):
            start = at(j_v, gap_v, panel)
            for half in range(2):
                offset = builder.add(start, ir.Constant(ll_intp, half * n))
                vectors.append(load_v(builder, (b_v, offset)))
        for r in range(rows):
            s = broadcast_v(builder, (a_v, at(i_v, step_v, r)))
            row = builder.extract_value(tile_v, r)
            for c in range(width):
                total = builder.extract_value(row, c)
                operands = (total, s, vectors[c]) if pairs else (s, vectors[c], total)
                row = builder.insert_value(row, multiply_add(builder, operands), c)
            tile_v = builder.insert_value(tile_v, row, r)
        return tile_v

    return tile(tile, a, i, step, b, j, gap), codegen


def per_term(arr):
    """Elements of `arr` that one term of a product's sum takes: 2 for bfloat16 pairs (a uint16
    array), else 1 (a compile-time constant in kernels)."""


@overload(per_term, jit_options=STRICT_OPTIONS)
def _per_term(arr):
    per = 2 if arr.dtype == types.uint16 else 1
    return lambda arr: per


def rows_at(tile, r):
    """``(offset, column_step, row_step)`` of row r in the queries a Q K^T micro-kernel
    broadcasts: element (r + i, x), for the rows r + i of r's micro-tile group, is at
    ``offset + i * row_step + x * column_step``.

    Row groups (``(groups, columns, ROWS)``, the forward's queries: `tile_buffers`) keep the
    ``ROWS`` elements broadcast for one column in one cache line; a plain ``(rows, columns)``
    tile (the backward's Q and dO, and pairs of bfloat16) is read ``ROWS`` rows apart. A 6 x 16
    micro-kernel ran closer to the FMA peak on groups than on rows. P is not grouped: a scalar
    regrouping pass cost more than the P V step gained (both measured on AVX2:
    docs/history.md, "The forward on AVX2 (AMD EPYC Zen 3)").
    """


@overload(rows_at, jit_options=STRICT_OPTIONS)
def _rows_at(tile, r):
    if tile.ndim == 3:
        def groups(tile, r):
            return (r // ROWS * tile.shape[1] * ROWS + r % ROWS, ROWS, 1)
        return groups

    def rows(tile, r):
        return (r * tile.shape[1], 1, tile.shape[1])
    return rows


# -- the micro-kernels

@jit
def qk_micro(q_tile, r, k_panels, panel, scores, mult, rows, panels):
    """Rows r .. r + rows - 1 x key panels panel .. panel + panels - 1 of the scores: mult *
    (Q K^T), the queries where `rows_at` finds them, the keys in panels (as
    `_products.pack_key_panels` packs them, or as pairs: `_pairs`).

    The sum over D runs in chunks of `DOT_CHUNK` terms that start from zero and are added to the
    stored scores: a two-level sum, so the rounding error does not grow with D (float64 at
    D = 512 needs it to stay within twice the error of BLAS).
    """
    per = per_term(k_panels)
    d, w = k_panels.shape[1], k_panels.shape[2]  # (w: elements in a panel's row)
    sw = scores.shape[1]
    out = r * sw + panel * (w // per)
    q, step, rs = rows_at(q_tile, r)
    kp = panel * d * w
    chunk = DOT_CHUNK // per
    for x0 in range(0, d, chunk):
        tile = zeros_tile(scores, rows, panels)
        for x in range(x0, min(d, x0 + chunk)):
            tile = fma_tile(tile, q_tile, q + per * x * step, rs, k_panels, kp + x * w, d * w)
        first, last = x0 == 0, x0 + chunk >= d
        for i in range(rows):
            row = tile[i]  # (taken once: indexed per vector, LLVM leaves the 6 x 4 loop rolled)
            for p in range(panels):
                _store_or_add(scores, out + i * sw + p * (w // per), row[2 * p], row[2 * p + 1],
                              first, last, mult)


@jit
def pv_micro(p, r, v, x0, acc, alpha, key0, key1, rows, panels):
    """acc[r + i] = alpha[r + i] * acc[r + i] + sum_c P[r + i, c] * v[c] for i < rows, over the
    output columns x0 .. x0 + panels * 2 vectors and the keys key0 .. key1 - 1 (pairs of keys
    for bfloat16 pairs: `p` and `v` as `_pairs` lays them out). A block's sum starts from zero
    and joins `acc` once (`_layout.rescale_add`)."""
    per = per_term(v)
    n = lanes(acc)
    dvp, pw, vw = acc.shape[1], p.shape[1], v.shape[1]
    tile = zeros_tile(acc, rows, panels)
    for c in range(key0, key1):
        tile = fma_tile(tile, p, r * pw + per * c, pw, v, c * vw + per * x0, per * 2 * n)
    for i in range(rows):
        row = tile[i]
        for j in range(panels):
            _rescale_add(acc, (r + i) * dvp + x0 + j * 2 * n, alpha[r + i], row[2 * j],
                         row[2 * j + 1])


@jit
def tn_micro(a, c, b_rows, x0, acc, row0, row1, cols, panels):
    """acc[c + i] += sum_r a[r, c + i] * b_rows[r] for i < cols, over the output columns x0 ..
    x0 + panels * 2 vectors and the rows row0 .. row1 - 1: `pv_micro` with the roles of the
    rows and columns of `a` swapped (the broadcasts read neighbours in a row of `a`)."""
    n = lanes(acc)
    bw, aw = acc.shape[1], a.shape[1]
    tile = zeros_tile(acc, cols, panels)
    for r in range(row0, row1):
        tile = fma_tile(tile, a, r * aw + c, 1, b_rows, r * bw + x0, 2 * n)
    for i in range(cols):
        row = tile[i]
        for j in range(panels):
            _add_two(acc, (c + i) * bw + x0 + j * 2 * n, row[2 * j], row[2 * j + 1])


# -- how a micro-kernel's sums join a tile

@jit
def _store_or_add(scores, o, s0, s1, first, last, mult):
    """scores[o : o + 2 vectors] = (s0, s1), or += (s0, s1) after the first chunk; the sum of
    the last chunk is multiplied by `mult` before it is stored."""
    n = lanes(scores)
    if not first:
        s0 = vadd(s0, vload(scores, o))
        s1 = vadd(s1, vload(scores, o + n))
    if last:
        scale = vsplat(mult, scores)
        s0, s1 = vmul(scale, s0), vmul(scale, s1)
    vstore(scores, o, s0)
    vstore(scores, o + n, s1)


@jit
def _rescale_add(acc, o, alpha, t0, t1):
    """`rescale_add` of two vectors: acc[o : o + 2 vectors]."""
    rescale_add(acc, o, alpha, t0)
    rescale_add(acc, o + lanes(acc), alpha, t1)


@jit
def _add_two(acc, o, t0, t1):
    """acc[o : o + 2 vectors] += (t0, t1): a tile's sum joins the running sum once."""
    n = lanes(acc)
    vstore(acc, o, vadd(vload(acc, o), t0))
    vstore(acc, o + n, vadd(vload(acc, o + n), t1))
