"""Command line of cpuflash: what this machine gives it, and how fast it is here.

Usage
-----
``python -m cpuflash info``
    The CPU, its SIMD features and caches, the tiles cpuflash chooses from them, the thread
    count and threading layer, versions, and where Numba keeps cpuflash's compiled kernels.
``python -m cpuflash bench [--quick] [--out DIR] [--repeats N]``
    Compare cpuflash with torch SDPA, FlashAttention-1 and naive numpy, side by side in one
    process; print a markdown table and write ``bench.json``, ``bench.md`` and ``bench.png``
    to ``DIR``. See `cpuflash.benchmark`.
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
    """Where Numba reads and writes cpuflash's compiled kernels.

    Numba picks the folder per source file with the first of its cache locators that accepts
    it (by default: ``NUMBA_CACHE_DIR`` when set, else the ``__pycache__`` next to the source
    when it is writable, else a user-wide cache folder; a package may put its own locator
    first). Rather than re-implement that order, this asks Numba: a probe function whose code
    claims to come from ``cpuflash/kernels/forward.py`` goes through Numba's own cache
    machinery, which looks at the file's path only.

    Returns
    -------
    path : str
    how : str
        Why that folder, in words, with the name of the locator that chose it.
    """
    import numba
    import cpuflash.kernels

    kernel_dir = os.path.dirname(os.path.abspath(cpuflash.kernels.__file__))
    source = os.path.join(kernel_dir, "forward.py")
    try:
        from numba.core.caching import FunctionCache

        namespace = {}
        exec(compile("def probe():\n    pass\n", source, "exec"), namespace)
        cache = FunctionCache(namespace["probe"])
        path = cache._cache_path
        locator = type(cache._impl.locator).__name__
    except Exception as error:  # Numba's cache internals moved: say so rather than guess
        return (os.path.join(kernel_dir, "__pycache__"),
                f"Numba's default, unverified ({type(error).__name__} asking Numba)")
    path = os.path.abspath(path)
    cache_dir = numba.config.CACHE_DIR
    if cache_dir and path.startswith(os.path.abspath(cache_dir) + os.sep):
        why = "NUMBA_CACHE_DIR"
    elif path == os.path.join(kernel_dir, "__pycache__"):
        why = "next to the source, in the package's __pycache__"
    elif path.startswith(os.path.abspath(_numba_user_cache_dir()) + os.sep):
        why = "Numba's user-wide cache dir, as the package's __pycache__ is not writable"
    else:
        why = "chosen by the locator"
    return path, f"{why} ({locator})"


def _numba_user_cache_dir():
    try:
        from numba.misc.appdirs import AppDirs

        return AppDirs(appname="numba", appauthor=False).user_cache_dir
    except Exception:  # only used to describe a path, never to choose one
        return os.path.expanduser("~/.cache/numba")


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


def info_lines():
    """The lines `python -m cpuflash info` prints."""
    import llvmlite
    import numba
    import numpy as np

    import cpuflash
    from cpuflash import _simd, tiling
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
        "tiles (float32, cpuflash.choose_tiles; L1/L2 bytes of the tiling model):",
    ]
    for head_dim in (64, 128, 256):
        tiles = cpuflash.choose_tiles(head_dim, np.float32)
        l1, l2 = tiling.working_set_bytes(tiles, head_dim, np.float32)
        lines.append(f"  D={head_dim:<4d} block_q={tiles.block_q:<4d} block_k={tiles.block_k:<4d}"
                     f" L1 {_size(l1)} of {_size(caches['l1d'])},"
                     f" L2 {_size(l2)} of {_size(caches['l2'])}")
    cache_path, how = jit_cache_location()
    count, total = _cache_contents(cache_path)
    cache_dir_env = os.environ.get("NUMBA_CACHE_DIR")
    lines += [
        f"threads:        {numba.get_num_threads()} (numba.get_num_threads())",
        f"threading:      {threading_layer()}",
        f"versions:       numba {numba.__version__}, llvmlite {llvmlite.__version__}, "
        f"numpy {np.__version__}, python {sys.version.split()[0]}",
        f"JIT cache:      {cache_path}",
        f"                chosen by: {how}; NUMBA_CACHE_DIR "
        + (f"= {cache_dir_env}" if cache_dir_env else "not set"),
        f"                holds {count} Numba cache files, {_size(total)}",
    ]
    return lines


def _info(arguments):
    print("\n".join(info_lines()))
    return 0


def _progress_reporter(total):
    """A callback for `cpuflash.benchmark.run`: a tqdm bar, or one line per step without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None

    if tqdm is not None:
        bar = tqdm(total=total, desc="bench", unit="step", file=sys.stderr, ascii=True)

        def advance_bar(what):
            if advance_bar.started:
                bar.update(1)
            advance_bar.started = True
            if what is None:
                bar.close()
            else:
                bar.set_postfix_str(what)

        advance_bar.started = False
        return advance_bar

    done = [0]

    def print_line(what):
        if what is not None:
            done[0] += 1
            print(f"[{done[0]}/{total}] {what}", file=sys.stderr, flush=True)

    return print_line


def _bench(arguments):
    from cpuflash import benchmark

    case_list = benchmark.cases(quick=arguments.quick)
    repeats = arguments.repeats or (3 if arguments.quick else 5)
    report = benchmark.run(case_list, benchmark.IMPLEMENTATIONS, repeats,
                           progress=_progress_reporter(benchmark.run_steps(case_list)))
    report["command"] = "python -m cpuflash " + " ".join(sys.argv[1:])

    os.makedirs(arguments.out, exist_ok=True)
    print(benchmark.markdown_table(report))
    benchmark.write_json(report, os.path.join(arguments.out, "bench.json"))
    benchmark.write_markdown(report, os.path.join(arguments.out, "bench.md"))
    _, plot_message = benchmark.write_plot(report, os.path.join(arguments.out, "bench.png"))
    print(f"wrote {os.path.join(arguments.out, 'bench.json')} and bench.md; {plot_message}")
    failed = [(record["label"], name, result) for record in report["cases"]
              for name, result in record["results"].items()
              if result["status"] in ("wrong", "error")]
    for label, name, result in failed:
        print(f"error: {name} on {label}: {result['status']}, {result['reason']}",
              file=sys.stderr)
    return 1 if failed else 0


def _repeats(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser():
    """The argument parser of ``python -m cpuflash``."""
    parser = argparse.ArgumentParser(
        prog="python -m cpuflash",
        description="cpuflash: exact FlashAttention-2 for CPUs. Inspect the machine or "
                    "benchmark against other implementations.",
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
    return parser


def main(argv=None):
    """Run the command line; returns the exit status."""
    arguments = build_parser().parse_args(argv)
    return arguments.handler(arguments)


if __name__ == "__main__":
    sys.exit(main())
