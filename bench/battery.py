"""Every kernel's outputs at two revisions, compared bit for bit (a restructuring changes none).

    python bench/battery.py 9822206 WORKTREE         # every case, both revisions
    python bench/battery.py HEAD WORKTREE --cases forward,decode

Each revision's `cpuflash/` is copied (``git archive``; ``WORKTREE`` copies the working tree)
into ``bench_out/battery/`` as a package of its own, and a child interpreter per revision computes
the battery's outputs and saves them (the two run side by side, one a core). The battery covers
the forward of every dtype with each score modifier alone and all together, GQA, ``Dv != D``,
awkward sizes, both layouts, set tiles and the decoding route of one-row calls; varlen; the KV
cache contiguous, paged, written into, split, chunked, in float16, int8/float8_e4m3 and int4
(int8 and int4 with `integer_dot` too); the backward of every dtype with the modifiers, and
varlen's; user functions with a block mask, their gradients and decoding; `merge_states`,
`quantize_kv`. A copy keeps its compiled kernels between runs (Numba's cache lives in the copy,
keyed by its sources), so a base revision compiles once. Prints each output that differs and
exits 1 when any does; outputs only the second revision makes (cases added since the first) are
listed, not compared.
"""

import argparse
import hashlib
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
STORE = REPO / "bench_out" / "battery"
GROUPS = ("forward", "varlen", "decode", "backward", "flex", "misc")


# -- the user functions the flex cases compile (module-level: one digest per function) ------

N_REL = 256


def rel_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, q_idx - kv_idx + N_REL]


def rel_bias_grad(dscore, score, b, h, q_idx, kv_idx, table, dtable):
    dtable[h, q_idx - kv_idx + N_REL] += dscore
    return dscore


def same_doc(b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


def capped(score, b, h, q_idx, kv_idx):
    return 20.0 * math.tanh(score / 20.0)


# -- the battery -----------------------------------------------------------------------------

def _dtypes():
    import ml_dtypes

    return {"float32": np.float32, "float64": np.float64, "float16": np.float16,
            "bfloat16": ml_dtypes.bfloat16}


def _normal(rng, shape, dtype):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def _awkward(rng, dtype):
    """q, k, v of awkward sizes (GQA 4:2, Nq != Nk, Dv != D) in `dtype`, and the options of
    every modifier: {name: keywords}."""
    b, hq, hk, n_q, n_k, d, d_v = 2, 4, 2, 113, 127, 40, 24
    q = _normal(rng, (b, hq, n_q, d), dtype)
    k = _normal(rng, (b, hk, n_k, d), dtype)
    v = _normal(rng, (b, hk, n_k, d_v), dtype)
    slopes = np.linspace(0.05, 0.4, hq).astype(np.float32)
    bias = _normal(rng, (1, hq, n_q, n_k), np.float64 if dtype == np.float64 else np.float32)
    mask = rng.random((b, 1, n_q, n_k)) > 0.2
    sinks = np.linspace(-1, 1, hq).astype(np.float32)
    options = {"plain": {}, "causal": dict(causal=True), "window": dict(window=(17, 3)),
               "everything": dict(causal=True, softcap=15.0, alibi_slopes=slopes, bias=bias,
                                  mask=mask, sinks=sinks),
               "softcap": dict(softcap=10.0), "alibi": dict(alibi_slopes=slopes),
               "bias": dict(bias=bias), "mask": dict(mask=mask), "sinks": dict(sinks=sinks),
               "scale": dict(scale=0.3, causal=True), "tiles": dict(tiles=(24, 32)),
               "causal_window": dict(causal=True, window=(40, -1))}
    return q, k, v, options


def forward_cases(cf, rng, out):
    for name, dtype in _dtypes().items():
        q, k, v, options = _awkward(rng, dtype)
        if name != "float32":  # each modifier alone in float32, together in every dtype
            options = {key: options[key] for key in
                       ("plain", "causal", "window", "causal_window", "everything")}
        for option, kw in options.items():
            o, lse = cf.attention(q, k, v, return_lse=True, **kw)
            out[f"forward/{name}/{option}"], out[f"forward/{name}/{option}/lse"] = o, lse
        out[f"forward/{name}/bshd"] = cf.attention(*(x.swapaxes(1, 2) for x in (q, k, v)),
                                                   causal=True, layout="bshd")
        out[f"forward/{name}/one_row"] = cf.attention(q[:, :, -1:], k, v, causal=True)
    q = _normal(rng, (3, 8, 1024, 64), np.float32)  # a shape with several tiles a thread
    out["forward/float32/long"] = cf.attention(q, q, q, causal=True)


def varlen_cases(cf, rng, out):
    cu_q = np.array([0, 5, 5, 130, 200], np.int32)
    cu_k = np.array([0, 9, 40, 170, 250], np.int32)
    slopes = np.linspace(0.05, 0.4, 4).astype(np.float32)
    for name, dtype in _dtypes().items():
        q, k, v = (_normal(rng, (n, h, 40), dtype) for n, h in ((200, 4), (250, 2), (250, 2)))
        for option, kw in {"plain": {}, "causal": dict(causal=True),
                           "modified": dict(causal=True, window=(30, 0), softcap=12.0,
                                            alibi_slopes=slopes)}.items():
            o, lse = cf.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
            out[f"varlen/{name}/{option}"], out[f"varlen/{name}/{option}/lse"] = o, lse


def decode_cases(cf, rng, out):
    b, hq, hk, n_max, d = 3, 8, 2, 300, 64
    lengths = np.array([0, 170, 297], np.int32)
    slopes = np.linspace(0.05, 0.4, hq).astype(np.float32)
    sinks = np.linspace(-1, 1, hq).astype(np.float32)
    for name, dtype in (("float32", np.float32), ("float16", np.float16),
                        ("float64", np.float64)):
        for n_q in (1, 3):
            q = _normal(rng, (b, hq, n_q, d), dtype)
            new = [_normal(rng, (b, hk, 3, d), dtype) for _ in range(2)]
            for option, kw in {"plain": {}, "splits": dict(num_splits=3),
                               "modified": dict(window=(100, 0), softcap=20.0,
                                                alibi_slopes=slopes, sinks=sinks)}.items():
                k_cache, v_cache = (_normal(rng, (b, hk, n_max, d), dtype) for _ in range(2))
                o, lse = cf.attention_with_kvcache(q, k_cache, v_cache, k=new[0], v=new[1],
                                                   cache_seqlens=lengths, return_lse=True, **kw)
                key = f"decode/{name}/nq{n_q}/{option}"
                out[key], out[key + "/lse"], out[key + "/k_cache"] = o, lse, k_cache
    # paged: pages of 16 rows in a shuffled order
    q = _normal(rng, (2, hq, 1, d), np.float32)
    pages = rng.permutation(2 * 20).astype(np.int32).reshape(2, 20)
    k_pages, v_pages = (_normal(rng, (40, hk, 16, d), np.float32) for _ in range(2))
    out["decode/paged"] = cf.attention_with_kvcache(q, k_pages, v_pages, block_table=pages,
                                                    cache_seqlens=np.array([150, 301], np.int32))
    # chunked prefill: enough rows for the FA-2 kernel
    q = _normal(rng, (1, hq, 64, d), np.float32)
    k_cache, v_cache = (_normal(rng, (1, hk, 512, d), np.float32) for _ in range(2))
    out["decode/chunked"] = cf.attention_with_kvcache(q, k_cache, v_cache,
                                                      cache_seqlens=np.array([400], np.int32))
    for fmt in ("int8", "float8_e4m3"):
        k_cache, v_cache = (cf.quantize_kv(_normal(rng, (b, hk, n_max, d), np.float32), fmt)
                            for _ in range(2))
        q = _normal(rng, (b, hq, 1, d), np.float32)
        new = [_normal(rng, (b, hk, 2, d), np.float32) for _ in range(2)]
        o, lse = cf.attention_with_kvcache(q, k_cache, v_cache, k=new[0], v=new[1],
                                           cache_seqlens=lengths, return_lse=True,
                                           softcap=20.0, num_splits=2)
        out[f"decode/{fmt}"], out[f"decode/{fmt}/lse"] = o, lse
        out[f"decode/{fmt}/k_data"], out[f"decode/{fmt}/k_scale"] = k_cache.data, k_cache.scale
    for size in (32, 16):  # int4 read in place (whole units), and through float32 copies
        try:
            k_cache, v_cache = (cf.quantize_kv(_normal(rng, (b, hk, n_max, d), np.float32),
                                               "int4", group_size=size) for _ in range(2))
        except (TypeError, ValueError):  # a revision before int4 caches
            break
        q = _normal(rng, (b, hq, 1, d), np.float32)
        new = [_normal(rng, (b, hk, 2, d), np.float32) for _ in range(2)]
        o, lse = cf.attention_with_kvcache(q, k_cache, v_cache, k=new[0], v=new[1],
                                           cache_seqlens=lengths, return_lse=True,
                                           softcap=20.0, window=(100, 0), num_splits=2)
        key = f"decode/int4-{size}"
        out[key], out[key + "/lse"], out[key + "/k_data"] = o, lse, k_cache.data
    for fmt in ("int8", "int4"):  # the opt-in integer Q K^T (CPUs with AVX512-VNNI; else exact)
        k_cache, v_cache = (cf.quantize_kv(_normal(rng, (b, hk, n_max, d), np.float32), fmt)
                            for _ in range(2))
        q = _normal(rng, (b, hq, 1, d), np.float32)
        try:
            o = cf.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                          integer_dot=True, softcap=20.0, num_splits=2)
        except TypeError:  # a revision before integer_dot (the last group's last draws)
            break
        out[f"decode/{fmt}-integer"] = o


def backward_cases(cf, rng, out):
    for name, dtype in _dtypes().items():
        q, k, v, options = _awkward(rng, dtype)
        for option in ("plain", "causal", "window", "everything"):
            kw = options[option]
            o, lse = cf.attention(q, k, v, return_lse=True, **kw)
            dout = _normal(rng, o.shape, dtype)
            grads = cf.attention_backward(dout, q, k, v, o, lse, **kw)
            for i, g in enumerate(grads):
                out[f"backward/{name}/{option}/{i}"] = g
    cu_q = np.array([0, 5, 130, 200], np.int32)
    cu_k = np.array([0, 9, 170, 250], np.int32)
    q, k, v = (_normal(rng, (n, h, 40), np.float32) for n, h in ((200, 4), (250, 2), (250, 2)))
    o, lse = cf.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    grads = cf.attention_varlen_backward(_normal(rng, o.shape, np.float32), q, k, v, o, lse,
                                         cu_q, cu_k, causal=True)
    for i, g in enumerate(grads):
        out[f"backward/varlen/{i}"] = g


def flex_cases(cf, rng, out):
    b, h, n, d = 2, 4, 150, 40
    q, k, v = (_normal(rng, (b, h, n, d), np.float32) for _ in range(3))
    table = (rng.standard_normal((h, 2 * N_REL)) * 0.5).astype(np.float32)
    doc = np.sort(rng.integers(0, 4, size=(b, n)), axis=1)
    bm = cf.block_mask(same_doc, b, 1, n, n, args=(doc,))
    kw = dict(score_mod=rel_bias, score_args=(table,), block_mask=bm, causal=True)
    o, lse = cf.flex_attention(q, k, v, return_lse=True, **kw)
    out["flex/forward"], out["flex/lse"] = o, lse
    out["flex/block_states"] = bm.states
    grads = cf.flex_attention_backward(_normal(rng, o.shape, np.float32), q, k, v, o, lse,
                                       score_mod_grad=rel_bias_grad, **kw)
    for i, g in enumerate(grads[:3]):
        out[f"flex/grad/{i}"] = g
    out["flex/grad/table"] = grads[-1][0]
    out["flex/mask_mod_alone"] = cf.flex_attention(q, k, v, mask_mod=same_doc, mask_args=(doc,))
    o, lse = cf.flex_attention(q, k, v, score_mod=capped, return_lse=True)
    grads = cf.flex_attention_backward(_normal(rng, o.shape, np.float32), q, k, v, o, lse,
                                       score_mod=capped)
    out["flex/capped"] = o
    for i, g in enumerate(grads):
        out[f"flex/capped/grad/{i}"] = g
    k_cache, v_cache = (_normal(rng, (b, 2, 200, d), np.float32) for _ in range(2))
    out["flex/decode"] = cf.attention_with_kvcache(
        _normal(rng, (b, h, 1, d), np.float32), k_cache, v_cache,
        cache_seqlens=np.array([77, 200], np.int32), score_mod=rel_bias, score_args=(table,))


def misc_cases(cf, rng, out):
    outs = _normal(rng, (3, 2, 4, 9, 24), np.float32)
    lses = _normal(rng, (3, 2, 4, 9), np.float32)
    lses[1, 0, 0] = -np.inf
    out["misc/merge"], out["misc/merge/lse"] = cf.merge_states(outs, lses)
    x = _normal(rng, (2, 3, 50, 64), np.float32)
    for fmt in ("int8", "float8_e4m3"):
        kq = cf.quantize_kv(x, fmt)
        out[f"misc/{fmt}/data"], out[f"misc/{fmt}/scale"] = kq.data, kq.scale
        out[f"misc/{fmt}/dequantized"] = cf.dequantize_kv(kq)


CASES = {"forward": forward_cases, "varlen": varlen_cases, "decode": decode_cases,
         "backward": backward_cases, "flex": flex_cases, "misc": misc_cases}


def compute(package_dir, package_name, groups, into):
    """The child: import the copy, run the groups, save every output's bytes in `into`."""
    import importlib

    sys.path.insert(0, package_dir)
    cf = importlib.import_module(package_name)
    out = {}
    for group in groups:
        CASES[group](cf, np.random.default_rng(sorted(CASES).index(group)), out)
    saved = {name: np.ascontiguousarray(x).view(np.uint8).reshape(-1) for name, x in out.items()}
    meta = {name: f"{np.asarray(x).dtype} {np.asarray(x).shape}" for name, x in out.items()}
    np.savez(into, **saved, __meta__=np.array([f"{k}|{v}" for k, v in meta.items()]))


def snapshot(revision):
    """(folder, package name) of a copy of `revision`'s cpuflash, made once per commit."""
    if revision == "WORKTREE":
        source = REPO / "cpuflash"
        digest = hashlib.sha256()
        for path in sorted(source.rglob("*.py")):
            digest.update(str(path.relative_to(source)).encode() + path.read_bytes())
        tag = "worktree_" + digest.hexdigest()[:12]
    else:
        tag = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", revision],
                             check=True, capture_output=True, text=True).stdout.strip()
    name = f"cpuflash_{tag}"
    folder = STORE / tag
    if not (folder / name / "__init__.py").exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        if revision == "WORKTREE":
            shutil.copytree(REPO / "cpuflash", folder / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "cpuflash"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
            (folder / "cpuflash").rename(folder / name)
    return folder, name


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs=2, help="git revisions, or WORKTREE")
    parser.add_argument("--cases", default=",".join(GROUPS),
                        help="comma-separated, of: " + ", ".join(GROUPS))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    groups = args.cases.split(",")
    if args.child:
        compute(*args.child[:2], groups, args.child[2])
        return 0
    unknown = [g for g in groups if g not in CASES]
    if unknown:
        parser.error(f"unknown case group(s) {unknown}; choose from {list(CASES)}")
    runs = []
    for i, revision in enumerate(args.revisions):
        folder, name = snapshot(revision)
        into = folder / f"outputs_{i}.npz"
        child = [sys.executable, __file__, *args.revisions, "--cases", args.cases,
                 "--child", str(folder), name, str(into)]
        runs.append((revision, into, subprocess.Popen(child, env=_quiet_env())))
    for revision, _, process in runs:
        if process.wait() != 0:
            raise SystemExit(f"the battery failed at {revision}")
    (_, first, _), (_, second, _) = runs
    a, b = np.load(first), np.load(second)
    names = [n for n in a.files if n != "__meta__"]
    differ = [n for n in names if n not in b.files or a[n].tobytes() != b[n].tobytes()]
    added = [n for n in b.files if n not in a.files]  # (a later revision's new cases)
    meta = dict(line.split("|") for line in a["__meta__"])
    for n in differ:
        print(f"differs: {n} ({meta[n]})")
    for n in added:
        print(f"only in {args.revisions[1]} (not compared): {n}")
    print(f"{len(names) - len(differ)} of {len(names)} outputs bit-identical "
          f"({args.revisions[0]} against {args.revisions[1]}; groups {args.cases})")
    return 1 if differ else 0


def _quiet_env():
    import os

    return dict(os.environ, CPUFLASH_QUIET="1", NUMBA_NUM_THREADS=os.environ.get(
        "NUMBA_NUM_THREADS", "1"))


if __name__ == "__main__":
    sys.exit(main())
