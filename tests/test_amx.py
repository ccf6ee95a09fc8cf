"""AMX tiles (`cpuflash._amx`, `kernels/_tiles.py`): the choice of the route from the compile
target, ``CPUFLASH_AMX`` and Linux's answer; the tile functions against numpy, emulated; the
machine code the kernels' tile steps compile to for a CPU with AMX (on any x86 host: compiled,
not run); and the bfloat16 tests of `test_bf16.py` on the tiles, emulated everywhere and on
the hardware where the host grants it."""

import os
import platform
import subprocess
import sys

import numba
import numpy as np
import pytest

from cpuflash import _amx, _simd
from cpuflash._amx import tile_config, tile_dot, tile_file, tile_load, tile_release, \
    tile_store, tile_zero
from helpers import explain, run_python

X86 = platform.machine().lower() in ("x86_64", "amd64")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the choice

@pytest.mark.parametrize("features, expected", [
    ("+avx512f,+amx-tile,+amx-bf16", True),
    ("+avx512f,+amx-tile,-amx-bf16", False),
    ("+amx-bf16", False),
    ("", False),
])
def test_target_rule(features, expected):
    assert _amx._target_has_amx(features) is expected


def test_host_rule_reads_the_features_numba_compiles_with():
    from numba.core import codegen
    features = numba.config.CPU_FEATURES or codegen.get_host_cpu_features()
    flags = features.split(",")
    assert _amx._target_has_amx(numba.config.CPU_FEATURES) == (
        "+amx-tile" in flags and "+amx-bf16" in flags)


def _granted():
    return True, ""


def _refused():
    return False, "arch_prctl(ARCH_REQ_XCOMP_PERM) refused: EINVAL"


def _not_asked():
    raise AssertionError("asked Linux for tile state where it is not needed")


@pytest.mark.parametrize("isa, forced, ask, expected, words", [
    (False, None, _not_asked, None, "no AMX-BF16"),
    (False, "1", _not_asked, None, "no AMX-BF16"),
    (True, None, _granted, "hardware", "AMX-BF16"),
    (True, "1", _granted, "hardware", "AMX-BF16"),
    (True, "0", _not_asked, None, "CPUFLASH_AMX=0"),
    (True, None, _refused, None, "EINVAL"),
    (False, "emulate", _not_asked, "emulated", "emulated"),
    (True, "emulate", _not_asked, "emulated", "emulated"),
])
def test_choice(isa, forced, ask, expected, words):
    tiles, reason = _amx._choose(isa, forced, ask)
    assert tiles == expected and words in reason


def test_info_names_the_route():
    from cpuflash.__main__ import info_lines
    line = [x for x in info_lines() if x.startswith("AMX tiles:")][0]
    assert _amx.REASON in line and (_amx.TILES or "not used") in line


@numba.njit
def _config(out, m0, m1):
    _amx.config_bytes(out, m0, m1)


@pytest.mark.parametrize("m0, m1", [(16, 16), (16, 7), (5, 0), (1, 0)])
def test_tile_configuration_bytes(m0, m1):
    """The 64 bytes `ldtilecfg` loads (Intel SDM, LDTILECFG): palette 1 in byte 0, start row 0,
    tile t's bytes per row as a little-endian u16 at byte 16 + 2 t and its rows at byte 48 + t,
    everything else 0. C tiles 0-3 (m0, m0, m1, m1 rows), A tiles 4-5 (m0, m1), B tiles 6-7
    (16), each 64 bytes a row; a tile of 0 rows has 0 bytes a row (unconfigured)."""
    expected = np.zeros(64, np.uint8)
    expected[0] = 1
    for t, rows in enumerate([m0, m0, m1, m1, m0, m1, 16, 16]):
        expected[16 + 2 * t] = 64 if rows else 0
        expected[48 + t] = rows
    got = np.full(64, 0xAB, np.uint8)
    _config(got, m0, m1)
    np.testing.assert_array_equal(got, expected)


# -- the tile functions (emulated in this process unless it runs on AMX hardware)

def bf16_bits(x):
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_values(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def as_pairs(b_bits):
    """(K, N) bfloat16 bits as a B tile's layout: row k // 2, column 2 n + k % 2."""
    k, n = b_bits.shape
    pairs = np.zeros((k // 2, 2 * n), np.uint16)
    pairs[:, 0::2], pairs[:, 1::2] = b_bits[0::2], b_bits[1::2]
    return pairs


@numba.njit
def _product(a_bits, b_pairs, c, m):
    """c[:m, :32] += a[:m] @ b over K = a's width, two C tiles per A tile, in place; rows
    16.. of columns 16..31 from zero instead."""
    tiles = tile_file()
    m0, m1 = min(m, 16), max(0, m - 16)
    tile_config(tiles, m0, m1)
    aw, bw, cw = a_bits.shape[1], b_pairs.shape[1], c.shape[1]
    tile_load(tiles, 0, c, 0, cw)
    tile_load(tiles, 1, c, 16, cw)
    if m1:
        tile_load(tiles, 2, c, 16 * cw, cw)
        tile_zero(tiles, 3)
    for k0 in range(0, aw, 32):
        tile_load(tiles, 4, a_bits, k0, aw)
        tile_load(tiles, 6, b_pairs, k0 // 2 * bw, bw)
        tile_load(tiles, 7, b_pairs, k0 // 2 * bw + 32, bw)
        tile_dot(tiles, 0, 4, 6)
        tile_dot(tiles, 1, 4, 7)
        if m1:
            tile_load(tiles, 5, a_bits, 16 * aw + k0, aw)
            tile_dot(tiles, 2, 5, 6)
            tile_dot(tiles, 3, 5, 7)
    tile_store(tiles, 0, c, 0, cw)
    tile_store(tiles, 1, c, 16, cw)
    if m1:
        tile_store(tiles, 2, c, 16 * cw, cw)
        tile_store(tiles, 3, c, 16 * cw + 16, cw)
    tile_release(tiles)


@pytest.mark.parametrize("m", [1, 16, 23, 32])
def test_tiles_multiply_as_numpy(rng, m):
    k = 96
    a = bf16_bits(rng.standard_normal((m, k)))
    b = bf16_bits(rng.standard_normal((k, 32)))
    c = rng.standard_normal((m, 40)).astype(np.float32)
    c[16:, 16:32] = 0  # (the fourth C tile starts from tilezero)
    expected = c.astype(np.float64)
    expected[:, :32] += bf16_values(a).astype(np.float64) @ bf16_values(b)
    c[16:, 16:32] = np.nan
    _product(a, as_pairs(b), c, m)
    # float32 sums of 96 exact products: a few units of the last place of the sum's terms
    scale = np.abs(bf16_values(a)) @ np.abs(bf16_values(b))
    assert np.all(np.abs(c[:, :32] - expected[:, :32]) <= 1e-6 * (scale + 1))
    np.testing.assert_array_equal(c[:, 32:], expected[:, 32:].astype(np.float32))


@pytest.mark.skipif(_amx.TILES == "hardware", reason="the hardware faults instead")
def test_emulated_unconfigured_tile_raises():
    @numba.njit
    def use_second_rows():
        tiles = tile_file()
        tile_config(tiles, 16, 0)
        tile_zero(tiles, 2)

    with pytest.raises(ValueError, match="unconfigured"):
        use_second_rows()


# -- machine code for a CPU with AMX, compiled on any x86 host

CODEGEN_SCRIPT = """
import numpy as np
from numba import types
from cpuflash import _amx
from cpuflash.kernels import _tiles

_amx._EMULATED = False  # the intrinsics, whatever this host grants: compiled here, never run
u16 = lambda nd: types.Array(types.uint16, nd, "C")
f32 = lambda nd: types.Array(types.float32, nd, "C")
i8, f = types.int64, types.float32
found = set()
for fn, sig in ((_tiles.qk_tiles, (u16(2), u16(3), f32(2), i8, i8, f, i8, i8)),
                (_tiles.pv_tiles, (f32(2), u16(2), u16(2), f32(2), f32(1), i8, i8, i8, i8))):
    fn.compile(sig)
    asm = fn.inspect_asm(sig)
    for op in ("ldtilecfg", "tilezero", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease"):
        if op in asm:
            found.add(op)
print(" ".join(sorted(found)))
"""


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="x86 CPU names")
def test_tile_steps_compile_to_amx_instructions(tmp_path):
    env = dict(os.environ, NUMBA_CPU_NAME="sapphirerapids",
               NUMBA_CPU_FEATURES="+avx512f,+avx512bw,+avx512vl,+avx512bf16,+amx-tile,+amx-bf16",
               NUMBA_CACHE_DIR=str(tmp_path), CPUFLASH_QUIET="1")
    env.pop("CPUFLASH_AMX", None)
    result = run_python(CODEGEN_SCRIPT, env=env, timeout=600)
    assert result.returncode == 0, explain(result)
    assert result.stdout.split() == sorted(
        ["ldtilecfg", "tilezero", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease"]), \
        explain(result)


# -- the bfloat16 kernels on tiles

def _bf16_tests_with(amx, tmp_path):
    env = dict(os.environ, CPUFLASH_AMX=amx, NUMBA_CACHE_DIR=str(tmp_path), CPUFLASH_QUIET="1")
    tests = os.path.join(ROOT, "tests", "test_bf16.py")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-m", "not slow", tests], capture_output=True, text=True,
                            env=env, timeout=900, cwd=ROOT)
    assert result.returncode == 0, explain(result)
    assert " passed" in result.stdout and " failed" not in result.stdout, explain(result)


@pytest.mark.slow
def test_bf16_tests_on_emulated_tiles(tmp_path):
    """`test_bf16.py` with every forward product on tiles, emulated: the steps' indexing,
    padding and masking, on whatever CPU runs the suite."""
    _bf16_tests_with("emulate", tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not (_amx._target_has_amx(numba.config.CPU_FEATURES) and _simd.BF16_ISA),
                    reason="no AMX-BF16 on this CPU")
def test_bf16_tests_on_amx(tmp_path):
    """The same on the hardware's tiles, where the CPU has them (Linux must grant the tile
    state: the subprocess reports it in `info` otherwise)."""
    granted, why = _amx._request_tile_state()
    if not granted:
        pytest.skip(why)
    _bf16_tests_with("1", tmp_path)
