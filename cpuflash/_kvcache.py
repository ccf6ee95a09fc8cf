"""The KV cache's pages: where a key position lives, writing new keys in, gathering them out.

`_validate.kvcache_args` leaves every cache as ``(pages, Hk, page_rows, D)`` (an unpaged cache is
one page of ``Nmax`` rows per batch entry, its block table ``[[0], [1], ...]``): position ``p`` of
batch entry ``b`` is row ``p % page_rows`` of page ``block_table[b, p // page_rows]``.
"""

import numpy as np

from ._quantize import quantize_rows
from ._validate import bits_view, kernel_view


def slots(call, b, positions):
    """(pages, rows) of key positions of batch entry b: index the cache as [pages, :, rows]."""
    return call.block_table[b, positions // call.page_rows], positions % call.page_rows


def write_new_keys(call):
    """Write the new keys and values into the caches, in place, after positions `seqlens`
    (quantized first, for a quantized cache); returns (k, v): the caches as the kernels read
    them.

    Called once `_validate.kvcache_args` has checked every argument, so an error leaves the
    caches unchanged.
    """
    if call.new_k is not None:
        _write(call)
    # only now: the kernel's view of an unaligned cache is a copy, which must hold the new keys
    view = kernel_view if call.quantized is None else bits_view
    return view(call.k_cache), view(call.v_cache)


def _write(call):
    # (no new values where they are the keys' first columns: the keys' rows hold them)
    new_k, new_v = call.new_k, call.new_v
    k_scale = v_scale = None
    if call.quantized is not None:  # written as the cache holds them: rows and scales
        new_k, k_scale = quantize_rows(new_k, call.quantized, groups(call.k_scale))
        if new_v is not None:
            new_v, v_scale = quantize_rows(new_v, call.quantized, groups(call.v_scale))
    n_new = new_k.shape[2]
    for b in range(call.batch):
        pages, rows = slots(call, b, call.seqlens[b] + np.arange(n_new))
        # (new, heads, dim) <- (heads, new, dim)
        call.k_cache[pages, :, rows, :] = np.swapaxes(new_k[b], 0, 1)
        if k_scale is not None:
            call.k_scale[pages, :, rows] = np.swapaxes(k_scale[b], 0, 1)
        if new_v is not None:
            call.v_cache[pages, :, rows, :] = np.swapaxes(new_v[b], 0, 1)
            if v_scale is not None:
                call.v_scale[pages, :, rows] = np.swapaxes(v_scale[b], 0, 1)


def groups(scale):
    """Scales a row of a quantized cache's scales (pages, Hk, page_rows[, groups])."""
    return scale.shape[3] if scale.ndim == 4 else 1


def gather_pages(call):
    """The first ``n_keys[b]`` keys and values of each batch entry, copied out of their pages
    into dense ``(B, Hk, max(n_keys), D)`` arrays as the kernels read them."""
    n_max = int(call.n_keys.max())
    gathered = []
    for cache in (call.k_cache, call.v_cache):
        dense = np.zeros((call.batch, cache.shape[1], n_max, cache.shape[3]), dtype=cache.dtype)
        for b in range(call.batch):
            pages, rows = slots(call, b, np.arange(call.n_keys[b]))
            dense[b, :, :call.n_keys[b]] = np.swapaxes(cache[pages, :, rows], 0, 1)
        gathered.append(kernel_view(dense))
    return gathered
