"""Your own score and mask functions in the kernels: document masking, a prefix-LM mask and a
learned relative-position bias, each checked against the built-in call that means the same.

    python examples/flex_attention.py           # B=2, H=8, N=1024, D=64
    python examples/flex_attention.py --small   # B=2, H=4, N=256, D=32, used by the tests

Each new function compiles a kernel with it inlined (5-20 s a kernel on 2 cores, by CPU; once:
the kernel is cached on disk, so a second run starts at once).
"""

import argparse
import time

import numpy as np

import cpuflash


# -- the user's functions: plain Python, compiled by Numba into the kernels' tiles ----------

def same_doc(b, h, q_idx, kv_idx, doc):
    """A query sees the keys of its own document (`doc[b, i]`: the document of row i)."""
    return doc[b, q_idx] == doc[b, kv_idx]


def prefix_lm(b, h, q_idx, kv_idx, prefix):
    """The first `prefix[b]` rows see each other both ways; the rest is causal."""
    return kv_idx <= q_idx or kv_idx < prefix[b]


def rel_bias(score, b, h, q_idx, kv_idx, table):
    """A per-head bias by distance: ``table[h, q_idx - kv_idx + N - 1]``."""
    return score + table[h, q_idx - kv_idx + table.shape[1] // 2]


def rel_bias_grad(dscore, score, b, h, q_idx, kv_idx, table, dtable):
    """The gradient of `rel_bias` by its table: every score adds its gradient to its entry."""
    dtable[h, q_idx - kv_idx + table.shape[1] // 2] += dscore
    return dscore  # d(score + t)/d(score) = 1


def check(name, got, expected, limit):
    error = float(np.abs(got - expected).max())
    print(f"  {name}: max difference {error:.2e} (limit {limit:.0e})")
    if not error <= limit:
        raise SystemExit(f"FAILED: {name}")


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


# -- (a) a packed batch of documents, through a block mask ----------------------------------

def document_masking(q, k, v, rng):
    batch, heads, n, d = q.shape
    # each batch entry packs documents of random lengths, one after the other
    doc = np.zeros((batch, n), dtype=np.int64)
    cu = [0]
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, n), size=4, replace=False))
        ends = np.append(cuts, n)
        doc[b] = np.searchsorted(ends, np.arange(n), side="right")
        cu.extend(b * n + ends)
    bm = cpuflash.block_mask(same_doc, batch, 1, n, n, args=(doc,))  # found once, reusable
    print(f"(a) document masking, {len(cu) - 1} documents: {bm}, "
          f"{bm.sparsity():.0f}% of the tiles skipped")
    out, seconds = timed(lambda: cpuflash.flex_attention(q, k, v, block_mask=bm, causal=True))
    print(f"  flex_attention first call {seconds:.1f} s (compile or cache load)")

    # the same documents as variable-length sequences: rows (b, i) -> b * n + i
    def packed(x):
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(batch * n, heads, d))

    cu = np.asarray(cu, dtype=np.int64)
    varlen = cpuflash.attention_varlen(packed(q), packed(k), packed(v), cu, cu, causal=True)
    check("flex_attention vs attention_varlen", out,
          varlen.reshape(batch, n, heads, d).transpose(0, 2, 1, 3), 1e-5)


# -- (b) prefix-LM: a bidirectional prefix, causal after ------------------------------------

def prefix_lm_mask(q, k, v, rng):
    batch, _, n, _ = q.shape
    prefix = rng.integers(n // 8, n // 2, size=batch)
    print(f"(b) prefix-LM, prefixes {prefix.tolist()} of {n} rows")
    bm = cpuflash.block_mask(prefix_lm, batch, 1, n, n, args=(prefix,))
    out = cpuflash.flex_attention(q, k, v, block_mask=bm)
    rows, cols = np.arange(n)[:, None], np.arange(n)[None, :]
    dense = (cols <= rows) | (cols < prefix[:, None, None, None])  # (B, 1, N, N)
    check("flex_attention vs attention(mask=dense)", out,
          cpuflash.attention(q, k, v, mask=dense), 1e-5)


# -- (c) a relative-position table as score_mod, and training it ----------------------------

def relative_bias(q, k, v, rng, steps):
    batch, heads, n, d = q.shape
    true_table = (rng.standard_normal((heads, 2 * n - 1)) * 0.5).astype(np.float32)
    print(f"(c) relative-position bias, table ({heads}, {2 * n - 1})")
    target = cpuflash.flex_attention(q, k, v, score_mod=rel_bias, score_args=(true_table,),
                                     causal=True)
    rows, cols = np.arange(n)[:, None], np.arange(n)[None, :]
    dense = true_table[:, rows - cols + n - 1][None]  # (1, H, N, N)
    check("flex_attention vs attention(bias=dense)", target,
          cpuflash.attention(q, k, v, bias=dense, causal=True), 1e-5)

    # learn the table back from the outputs: loss = 0.5 * |out - target|^2, Adam steps (an
    # entry's gradient sums over every pair at its distance: Adam's step does not depend on it)
    table = np.zeros_like(true_table)
    mean, square = np.zeros_like(table), np.zeros_like(table)
    kwargs = dict(score_mod=rel_bias, causal=True, score_mod_grad=rel_bias_grad)
    losses = []
    for step in range(steps):
        out, lse = cpuflash.flex_attention(q, k, v, score_mod=rel_bias, score_args=(table,),
                                           causal=True, return_lse=True)
        dout = out - target
        losses.append(0.5 * float(np.sum(dout * dout)))
        try:
            *_, (dtable,) = cpuflash.flex_attention_backward(dout, q, k, v, out, lse,
                                                            score_args=(table,), **kwargs)
        except NotImplementedError:
            print("  training the table needs `score_mod_grad` (gradients of score_args), "
                  "which this cpuflash does not have: skipped")
            return
        mean = 0.9 * mean + 0.1 * dtable
        square = 0.999 * square + 0.001 * dtable * dtable
        table -= 0.1 * (mean / (1 - 0.9 ** (step + 1))) / (
            np.sqrt(square / (1 - 0.999 ** (step + 1))) + 1e-8)
        print(f"  step {step}: loss {losses[-1]:.4g}")
    if not losses[-1] < 0.5 * losses[0]:
        raise SystemExit(f"FAILED: the loss did not halve ({losses[0]:.4g} -> {losses[-1]:.4g})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes (for CI)")
    args = parser.parse_args(argv)
    batch, heads, n, d = (2, 4, 256, 32) if args.small else (2, 8, 1024, 64)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((batch, heads, n, d), dtype=np.float32) for _ in range(3))
    print(f"B={batch} H={heads} N={n} D={d} float32")
    document_masking(q, k, v, rng)
    prefix_lm_mask(q, k, v, rng)
    relative_bias(q, k, v, rng, steps=5 if args.small else 8)
    print("OK")


if __name__ == "__main__":
    main()
