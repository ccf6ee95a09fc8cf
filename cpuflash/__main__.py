"""Command line of cpuflash: what this machine gives it, and how fast it is here.

Usage
-----
``python -m cpuflash info``
    The CPU, its SIMD features and caches, the tiles cpuflash chooses from them, the thread
    count and threading layer, versions, and where Numba keeps cpuflash's compiled kernels.
``python -m cpuflash bench [--quick] [--out DIR] [--repeats N]``
    Compare cpuflash with torch SDPA, FlashAttention-1 and naive numpy, side by side in one
    process; print a markdown table and write ``bench.json``, ``bench.md`` and ``bench.png``
    to ``DIR``. Needs a source checkout: the runner is the repository's ``bench/runner.py``.
``python -m cpuflash warmup [--dtype DTYPE ...]``
    Compile and cache the kernels (forward, backward, decoding; the decoding of quantized KV
    caches with ``--dtype int8``, ``float8_e4m3`` or ``int4``) ahead of the first call; print
    what and where.
"""

import argparse
import os
import sys

KiB = 1024
MiB = 1024 * KiB
_CACHE_NAMES = {"l1d": "L1d", "l2": "L2", "l3": "L3"}


def _size(n_bytes):
    if n_bytes >= MiB and n_bytes % MiB == 0:
        return f"{n_bytes // MiB} MiB"
    if n_bytes >= MiB:
        return f"{n_bytes / MiB:.1f} MiB"
    return f"{n_bytes // KiB} KiB" if n_bytes % KiB == 0 else f"{n_bytes / KiB:.1f} KiB"


def jit_cache_location():
    """(folder, why): where cpuflash's compiled kernels are cached (`cpuflash._jit` decides);
    folder is None when no folder is fit and they compile in memory."""
    from cpuflash import _jit

    return _jit.cache_location()


def _cache_contents(path):
    """(number of Numba cache files, their total bytes) in `path`."""
    count = total = 0
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0, 0
    for entry in entries:
        if entry.name.endswith((".nbi", ".nbc")) and entry.is_file():
            count += 1
            total += entry.stat().st_size
    return count, total


def _family(features, prefix):
    found = [name for name in features if name.startswith(prefix)]
    return ("yes (" + " ".join(found) + ")") if found else "no"


def _no_bf16_dot_reason():
    from cpuflash import _simd

    if not _simd.BF16_ISA:
        return "the compile target has no AVX512-BF16"
    if os.environ.get("CPUFLASH_BF16_DOT") == "0":
        return "CPUFLASH_BF16_DOT=0"
    return ("this CPU has AVX512-BF16, but its vdpbf16ps does fewer multiply-adds per cycle "
            "than fma; CPUFLASH_BF16_DOT=1 takes it anyway")


def _bf16_route():
    from cpuflash import _amx, _simd

    if _amx.TILES is not None:
        return ("products on AMX tiles (tdpbf16ps), float32 accumulation and softmax, P (and "
                "the backward's dS) rounded to bfloat16; decode: widened")
    if _simd.BF16_DOT:
        return ("AVX512-BF16 dot products (vdpbf16ps), float32 accumulation and softmax, P (and "
                "the backward's dS) rounded to bfloat16; decode: widened")
    return "widened to float32 (" + _no_bf16_dot_reason() + ")"


def info_lines():
    """The lines `python -m cpuflash info` prints."""
    import llvmlite
    import numba
    import numpy as np

    import cpuflash
    from cpuflash import _amx, _codegen, _simd, tiling
    from cpuflash._threads import threading_layer

    machine = cpuflash.cpu_info()
    simd = machine["simd"]
    caches = machine["caches"]
    lines = [
        f"cpuflash {cpuflash.__version__}",
        f"CPU:            {machine['model']} (LLVM target: {machine['llvm_cpu']})",
        f"logical CPUs:   {machine['cores']} usable by this process",
        f"AVX2:           {'yes' if 'avx2' in simd else 'no'}",
        f"AVX-512:        {_family(simd, 'avx512')}",
        f"AMX:            {_family(simd, 'amx')}",
        f"SIMD features:  {' '.join(simd) if simd else 'none reported'}",
        "caches:         " + ", ".join(f"{name} {_size(caches[level])}"
                                       for level, name in _CACHE_NAMES.items() if level in caches)
        + f" (from {machine['cache_source']})",
        f"vector width:   {_simd.LANES_F32} float32 lanes ({_simd.LANES_F32 * 32}-bit)",
        "bfloat16:       " + _bf16_route(),
        f"AMX tiles:      {_amx.TILES or 'not used'} ({_amx.REASON})",
        "tiles (float32, cpuflash.choose_tiles; L1/L2 bytes of the tiling model):",
    ]
    for head_dim in (64, 128, 256):
        tiles = cpuflash.choose_tiles(head_dim, np.float32)
        l1, l2 = tiling.working_set_bytes(tiles, head_dim, np.float32)
        lines.append(f"  D={head_dim:<4d} block_q={tiles.block_q:<4d} block_k={tiles.block_k:<4d}"
                     f" L1 {_size(l1)} of {_size(caches['l1d'])},"
                     f" L2 {_size(l2)} of {_size(caches['l2'])}")
    cache_path, how = jit_cache_location()
    count, total = _cache_contents(cache_path) if cache_path else (0, 0)
    cache_dir_env = os.environ.get("NUMBA_CACHE_DIR")
    lines += [
        f"threads:        {numba.get_num_threads()} (numba.get_num_threads())",
        f"threading:      {threading_layer()}",
        f"versions:       numba {numba.__version__}, llvmlite {llvmlite.__version__}, "
        f"numpy {np.__version__}, python {sys.version.split()[0]}",
        "compiling:      " + (
            "each kernel's call chain optimized and emitted once, in the kernel (cpuflash's "
            "code library)" if _codegen.SUPPORTED else
            f"Numba's own way (each function emitted on its own: 1.6-2x as long), as numba "
            f"{numba.__version__} is not among the releases checked "
            f"({', '.join('%d.%d' % release for release in _codegen.CHECKED_RELEASES)})"),
        f"JIT cache:      {cache_path or 'none (kernels compile in memory)'}",
        f"                chosen by: {how}; NUMBA_CACHE_DIR "
        + (f"= {cache_dir_env}" if cache_dir_env else "not set"),
        f"                holds {count} Numba cache files, {_size(total)}",
    ]
    return lines


def _info(arguments):
    print("\n".join(info_lines()))
    return 0


# The benchmark tooling lives in the repository, next to the package, not inside it.
BENCH_FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def bench_runner():
    """The benchmark runner, ``bench/runner.py`` of the repository cpuflash runs from.

    Returns the module (imported as ``runner``, with `BENCH_FOLDER` on ``sys.path``, as the
    scripts and pytest files in that folder import it), or None when cpuflash was installed
    without its repository.
    """
    path = os.path.join(BENCH_FOLDER, "runner.py")
    if not os.path.isfile(path):
        return None
    if BENCH_FOLDER not in sys.path:
        sys.path.insert(0, BENCH_FOLDER)
    import runner

    if os.path.realpath(runner.__file__) != os.path.realpath(path):
        raise ImportError(f"a module `runner` from {runner.__file__} was imported before "
                          f"the benchmark runner {path}")
    return runner


def _bench(arguments):
    runner = bench_runner()
    if runner is None:
        print("python -m cpuflash bench: error: the benchmark lives in the bench/ folder of "
              "cpuflash's repository, which this installation lacks; run it from a clone "
              "(pip install -e <clone>)", file=sys.stderr)
        return 2
    return runner.command(quick=arguments.quick, out=arguments.out, repeats=arguments.repeats,
                          command_line="python -m cpuflash " + " ".join(sys.argv[1:]))


WARMUP_DTYPES = ("float32", "float64", "float16", "bfloat16")
# the formats of a quantized KV cache (`cpuflash.quantize_kv`): one decode kernel each, whatever
# the dtype of the queries (int4 has one kernel for every modifier)
WARMUP_CACHE_FORMATS = ("int8", "float8_e4m3", "int4")


def _warmup_calls(name):
    """(what, call) for each kernel that `name` needs: a dtype's attention, backward and
    decoding, or a quantized cache format's decoding."""
    import numpy as np

    import cpuflash

    if name in WARMUP_CACHE_FORMATS:
        q = np.zeros((1, 1, 1, 8), np.float32)
        extra = {"group_size": 8} if name == "int4" else {}
        cache = cpuflash.quantize_kv(np.zeros((1, 1, 4, 8), np.float32), name, **extra)
        calls = [("KV-cache decoding", lambda: cpuflash.attention_with_kvcache(q, cache, cache))]
        if name != "int4":
            calls.append(("decoding modified",
                          lambda: cpuflash.attention_with_kvcache(q, cache, cache, softcap=30.0)))
        return calls
    try:
        dtype = np.dtype(name)
    except TypeError:
        if name != "bfloat16":
            raise
        import ml_dtypes  # numpy knows bfloat16 by name only once ml_dtypes is imported

        dtype = np.dtype(ml_dtypes.bfloat16)
    x = np.zeros((1, 1, 4, 8), dtype)
    lse = np.zeros(x.shape[:-1], np.float64 if dtype == np.float64 else np.float32)
    # a call with no modifier but a causal mask or a window runs kernels of its own
    # (`kernels.forward.PLAIN`), any other call the general ones
    return [("attention", lambda: cpuflash.attention(x, x, x)),
            ("attention modified", lambda: cpuflash.attention(x, x, x, softcap=30.0)),
            ("attention backward", lambda: cpuflash.attention_backward(x, x, x, x, x, lse)),
            ("backward modified",
             lambda: cpuflash.attention_backward(x, x, x, x, x, lse, softcap=30.0)),
            ("KV-cache decoding", lambda: cpuflash.attention_with_kvcache(x[:, :, :1], x, x)),
            ("decoding modified",
             lambda: cpuflash.attention_with_kvcache(x[:, :, :1], x, x, softcap=30.0))]


def _warmup(arguments):
    """Compile (or load from the cache) the attention, backward and decoding kernels of each
    dtype, and the decoding kernel of each quantized cache format."""
    import time

    import numpy as np

    dtypes = WARMUP_DTYPES + WARMUP_CACHE_FORMATS if "all" in arguments.dtype \
        else arguments.dtype
    os.environ["CPUFLASH_QUIET"] = "1"  # this command says what it compiles itself
    for name in dict.fromkeys(dtypes):
        for what, call in _warmup_calls(name):
            start = time.perf_counter()
            call()
            print(f"{name:9s} {what:18s} ready in {time.perf_counter() - start:5.1f} s",
                  flush=True)
    # the merge of a decoding call's key splits runs in the compute dtype: float64 for float64,
    # float32 for the others (quantized caches included)
    from cpuflash import _combine

    merges = {"float64" if name == "float64" else "float32": None for name in dtypes}
    for name in sorted(merges, key=("float32", "float64").index):
        start = time.perf_counter()
        _combine._merge_kernel.specialize(np.dtype(name))
        print(f"{name:9s} {'split merge':18s} ready in {time.perf_counter() - start:5.1f} s",
              flush=True)
    path, how = jit_cache_location()
    print(f"kernel cache: {path or 'none (kernels compile in memory)'} ({how})")
    return 0


def _dtype_name(text):
    if text != "all" and text not in WARMUP_DTYPES + WARMUP_CACHE_FORMATS:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(WARMUP_DTYPES + WARMUP_CACHE_FORMATS)} or all, got "
            f"{text!r}")
    return text


def _repeats(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser():
    """The argument parser of ``python -m cpuflash``."""
    parser = argparse.ArgumentParser(
        prog="python -m cpuflash",
        description="cpuflash: exact FlashAttention-2 for CPUs. Inspect the machine, "
                    "benchmark against other implementations, or compile the kernels ahead.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    info = commands.add_parser(
        "info", help="show the CPU, caches, chosen tiles, threads and JIT cache location",
        description="Show what cpuflash sees on this machine: CPU model, SIMD features "
                    "(AVX2, AVX-512, AMX), cache sizes, the tiles chosen for head dims 64, "
                    "128 and 256, threads and threading layer, versions, and where Numba "
                    "keeps cpuflash's compiled kernels.")
    info.set_defaults(handler=_info)

    bench = commands.add_parser(
        "bench", help="compare cpuflash with torch SDPA, FA-1 and naive numpy",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compare cpuflash with torch SDPA, FlashAttention-1 and naive numpy on\n"
                    "float32 inputs, side by side in one process: each implementation is\n"
                    "checked against a float64 reference, then timed in interleaved rounds,\n"
                    "best round kept. Speed is GFLOP/s of 4 * B * Hq * visible pairs * D.\n"
                    "torch, tqdm and matplotlib are used when installed.",
        epilog="Outputs\n-------\nbench.json  every number, with machine, versions and "
               "threads\nbench.md    the markdown table\nbench.png   GFLOP/s against N "
               "(needs matplotlib)\n\nThe exit status is 1 when an implementation gave a "
               "wrong result or raised an exception.")
    bench.add_argument("--quick", action="store_true",
                       help="a few small shapes, under a minute: a smoke run, not a measurement")
    bench.add_argument("--out", default="cpuflash-bench", metavar="DIR",
                       help="folder for bench.json, bench.md and bench.png "
                            "(default: ./cpuflash-bench)")
    bench.add_argument("--repeats", type=_repeats, default=None, metavar="N",
                       help="timed rounds per case, best kept (default: 5, or 3 with --quick)")
    bench.set_defaults(handler=_bench)

    warmup = commands.add_parser(
        "warmup", help="compile and cache the kernels ahead of the first call",
        description="Compile the attention, attention backward and KV-cache decoding kernels "
                    "for the given dtypes, and the decoding kernels of quantized KV caches "
                    "(int8, float8_e4m3, int4), or load them from the cache, so that the "
                    "first call of a later process does not wait for Numba, e.g. in a "
                    "container build step. Prints what it compiled and where the cache is.")
    warmup.add_argument("--dtype", nargs="+", type=_dtype_name, default=["float32"],
                        metavar="DTYPE",
                        help=f"{', '.join(WARMUP_DTYPES)}; {', '.join(WARMUP_CACHE_FORMATS)} "
                             "(the decoding kernel of a quantized KV cache, "
                             "cpuflash.quantize_kv); "
                             "or all (default: float32; bfloat16 and float8_e4m3 need "
                             "ml_dtypes)")
    warmup.set_defaults(handler=_warmup)
    return parser


def main(argv=None):
    """Run the command line; returns the exit status."""
    arguments = build_parser().parse_args(argv)
    return arguments.handler(arguments)


if __name__ == "__main__":
    sys.exit(main())
