"""Your own score and mask functions (`cpuflash.flex_attention`) against the built-ins that mean
the same and against torch's compiled `flex_attention`, in one process (interleaved, best of N).

    python bench/flex_versus.py [--repeats 5] [--quick]

Rows (float32, the same thread count for Numba and torch; each pair of calls is checked to
agree before it is timed):

- document masking (causal within each document of a packed batch) through a block mask,
  against `attention_varlen` on the same documents (target >= 0.8x its speed);
- ALiBi written as a `score_mod`, against the built-in `alibi_slopes` (target >= 0.85x);
- the forward against torch's `torch.compile(flex_attention)` with the same mods: causal, the
  document mask, ALiBi (target >= 1.5x), when torch imports;
- our backward against our forward, document mask and ALiBi (target <= 3x);
- the first call of a new function: a fresh interpreter with an empty ``NUMBA_CACHE_DIR``
  (cpuflash compiles everything it needs), and one whose cache holds cpuflash's built-in
  kernels (only what the function changes compiles), against torch's first compiled call in a
  fresh interpreter with an empty ``TORCHINDUCTOR_CACHE_DIR``; each minus the same call warm.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np

import cpuflash

import runner  # bench/runner.py

SHAPE = (1, 8, 2048, 64)  # B, H, N, D
QUICK = (1, 2, 256, 32)
DOCUMENTS = 8  # per batch entry, of random lengths


# -- the mods, ours (Numba) -----------------------------------------------------------------

def same_doc(b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def alibi(score, b, h, q_idx, kv_idx, slopes):
    return score - slopes[h] * abs(q_idx - kv_idx)


def inputs(shape, seed=0):
    batch, heads, n, d = shape
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    doc = np.zeros((batch, n), dtype=np.int64)
    cu = [0]
    for b in range(batch):
        ends = np.append(np.sort(rng.choice(np.arange(1, n), DOCUMENTS - 1, replace=False)), n)
        doc[b] = np.searchsorted(ends, np.arange(n), side="right")
        cu.extend(b * n + ends)
    slopes = (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)
    return q, k, v, dout, doc, np.asarray(cu, dtype=np.int64), slopes


def packed(x):
    """(B, H, N, D) -> the rows of every batch entry one after the other, (B * N, H, D)."""
    batch, heads, n, d = x.shape
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(batch * n, heads, d))


def agree(name, a, b, limit=1e-4):
    error = float(np.abs(np.asarray(a) - np.asarray(b)).max())
    if not error <= limit:
        raise SystemExit(f"{name}: the two calls differ by {error:.3g} (limit {limit:g})")


def best_of(calls, repeats):
    """Best seconds of each call, timed interleaved after the other pools went quiet."""
    best = {name: float("inf") for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            runner.settle(call, cheap=False)
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def row(what, ours, other, ratio, target):
    print(f"| {what} | {ours * 1e3:.1f} ms | {other * 1e3:.1f} ms | {ratio:.2f}x | {target} |",
          flush=True)


# -- ours against the built-ins, and the backward -------------------------------------------

def ours_calls(shape):
    q, k, v, dout, doc, cu, slopes = inputs(shape)
    batch, heads, n, d = shape
    bm = cpuflash.block_mask(same_doc, batch, 1, n, n, args=(doc,))
    causal_bm = cpuflash.block_mask(causal_mask, 1, 1, n, n)
    doc_kw = dict(block_mask=bm, causal=True)
    alibi_kw = dict(score_mod=alibi, score_args=(slopes,), causal=True)
    pq, pk, pv = packed(q), packed(k), packed(v)
    out_doc, lse_doc = cpuflash.flex_attention(q, k, v, return_lse=True, **doc_kw)
    out_alibi, lse_alibi = cpuflash.flex_attention(q, k, v, return_lse=True, **alibi_kw)
    calls = {
        "doc flex": lambda: cpuflash.flex_attention(q, k, v, **doc_kw),
        "doc varlen": lambda: cpuflash.attention_varlen(pq, pk, pv, cu, cu, causal=True),
        "doc backward": lambda: cpuflash.flex_attention_backward(dout, q, k, v, out_doc,
                                                                 lse_doc, **doc_kw),
        "alibi flex": lambda: cpuflash.flex_attention(q, k, v, **alibi_kw),
        "alibi built-in": lambda: cpuflash.attention(q, k, v, alibi_slopes=slopes,
                                                     causal=True),
        "alibi backward": lambda: cpuflash.flex_attention_backward(dout, q, k, v, out_alibi,
                                                                   lse_alibi, **alibi_kw),
        "causal flex": lambda: cpuflash.flex_attention(q, k, v, block_mask=causal_bm),
    }
    agree("document mask vs attention_varlen", out_doc,
          calls["doc varlen"]().reshape(batch, n, heads, d).transpose(0, 2, 1, 3))
    agree("ALiBi score_mod vs alibi_slopes", out_alibi, calls["alibi built-in"]())
    agree("causal mask_mod vs causal=True", calls["causal flex"](),
          cpuflash.attention(q, k, v, causal=True))
    agree("ALiBi backward vs the built-in's",
          calls["alibi backward"]()[0],
          cpuflash.attention_backward(dout, q, k, v, out_alibi, lse_alibi,
                                      alibi_slopes=slopes, causal=True)[0], 1e-3)
    calls["doc backward"]()
    return calls


# -- torch's compiled flex_attention --------------------------------------------------------

def torch_calls(shape, ours):
    """torch.compile'd flex_attention on the same mods (None without torch)."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    q, k, v, _, doc, _, slopes = inputs(shape)
    batch, heads, n, d = shape
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    tdoc, tslopes = torch.from_numpy(doc), torch.from_numpy(slopes)

    def t_causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def t_doc(b, h, q_idx, kv_idx):
        return (tdoc[b, q_idx] == tdoc[b, kv_idx]) & (q_idx >= kv_idx)

    def t_alibi(score, b, h, q_idx, kv_idx):
        return score - tslopes[h] * (q_idx - kv_idx).abs()

    compiled = torch.compile(flex_attention)
    causal_bm = create_block_mask(t_causal, None, None, n, n, device="cpu")
    doc_bm = create_block_mask(t_doc, batch, None, n, n, device="cpu")

    def call(**kwargs):
        def run():
            with torch.no_grad():
                return compiled(tq, tk, tv, **kwargs)
        return run

    calls = {"causal torch": call(block_mask=causal_bm), "doc torch": call(block_mask=doc_bm),
             "alibi torch": call(score_mod=t_alibi, block_mask=causal_bm)}
    for name in ("causal", "doc", "alibi"):
        agree(f"{name}: torch vs cpuflash", calls[f"{name} torch"]().numpy(),
              ours[f"{name} flex"]())
    return calls


# -- first calls, each in a fresh interpreter with an empty cache ---------------------------

FIRST_CALL = {
    "cpuflash": """
        import time, numpy as np, cpuflash
        def alibi(score, b, h, q_idx, kv_idx, slopes):
            return score - slopes[h] * abs(q_idx - kv_idx)
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal({shape}, dtype=np.float32) for _ in range(3))
        slopes = np.linspace(0.5, 0.01, {shape}[1]).astype(np.float32)
        def call():
            cpuflash.flex_attention(q, k, v, score_mod=alibi, score_args=(slopes,), causal=True)
    """,
    "torch": """
        import time, torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        slopes = torch.linspace(0.5, 0.01, {shape}[1])
        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).abs()
        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
        q, k, v = (torch.randn({shape}) for _ in range(3))
        bm = create_block_mask(causal, None, None, {shape}[2], {shape}[2], device="cpu")
        compiled = torch.compile(flex_attention)
        def call():
            with torch.no_grad():
                compiled(q, k, v, score_mod=alibi, block_mask=bm)
    """,
}
TIME_FIRST_CALL = """
    start = time.perf_counter(); call(); first = time.perf_counter() - start
    start = time.perf_counter(); call(); warm = time.perf_counter() - start
    print(first - warm)
"""


def first_call_seconds(name, shape, warm_builtins=False):
    """Seconds the first call of a new function spends compiling, in a fresh interpreter with
    an empty cache; with `warm_builtins`, after another interpreter ran a built-in call of the
    same kind in that cache (cpuflash's own helpers compiled, as on a machine that has used
    it), so that only what the function changes compiles."""
    code = textwrap.dedent(FIRST_CALL[name].format(shape=shape)) + textwrap.dedent(
        TIME_FIRST_CALL)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=cache,
                   CPUFLASH_QUIET="1")
        if warm_builtins:
            _run([sys.executable, "-c", WARM_BUILTINS.format(shape=shape)], env, name)
        result = _run([sys.executable, "-c", code], env, name)
    return float(result.stdout.split()[-1])


# cpuflash's built-in forward and backward, compiled into the cache (what a user who has
# called cpuflash before has)
WARM_BUILTINS = """
import numpy as np, cpuflash
q = np.ones({shape}, np.float32)
out, lse = cpuflash.attention(q, q, q, causal=True, return_lse=True)
cpuflash.attention_backward(out, q, q, q, out, lse, causal=True)
"""


def _run(command, env, name):
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"the {name} first call failed:\n{result.stderr[-3000:]}")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a small shape, one repeat")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else SHAPE
    repeats = 1 if args.quick else args.repeats
    threads = runner.match_torch_threads()
    import numba

    print(f"{cpuflash.cpu_info()['model']}, {numba.get_num_threads()} threads"
          f"{f' (torch {threads})' if threads else ''}; B{shape[0]} H{shape[1]} N{shape[2]} "
          f"D{shape[3]} float32, best of {repeats} interleaved rounds")
    ours = ours_calls(shape)
    theirs = torch_calls(shape, ours)
    calls = dict(ours, **(theirs or {}))
    best = best_of(calls, repeats)

    print("| comparison | cpuflash | other | ratio | target |")
    print("| --- | --- | --- | --- | --- |")
    row("document mask (block mask) vs attention_varlen: speed", best["doc flex"],
        best["doc varlen"], best["doc varlen"] / best["doc flex"], ">= 0.8x")
    row("ALiBi score_mod vs alibi_slopes: speed", best["alibi flex"], best["alibi built-in"],
        best["alibi built-in"] / best["alibi flex"], ">= 0.85x")
    for name in ("causal", "doc", "alibi"):
        if theirs is None:
            print(f"| {name} vs torch compiled flex_attention | skipped: no torch | | | |")
            continue
        row(f"{name} vs torch compiled flex_attention: speed", best[f"{name} flex"],
            best[f"{name} torch"], best[f"{name} torch"] / best[f"{name} flex"], ">= 1.5x")
    for name in ("doc", "alibi"):
        row(f"{name} backward vs forward: time", best[f"{name} backward"], best[f"{name} flex"],
            best[f"{name} backward"] / best[f"{name} flex"], "<= 3x")

    torch_first = None if theirs is None else first_call_seconds("torch", shape)
    for what, warm in (("nothing cached", False), ("cpuflash's own kernels cached", True)):
        ours_first = first_call_seconds("cpuflash", shape, warm_builtins=warm)
        line = f"| first call of a new function ({what}), compile seconds | {ours_first:.1f} s |"
        if torch_first is None:
            print(line + " skipped: no torch | | |")
        else:
            print(line + f" {torch_first:.1f} s | {torch_first / ours_first:.2f}x (torch / ours)"
                  " | > 1x |")


if __name__ == "__main__":
    main()
