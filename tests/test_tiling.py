"""The tile chooser against fake caches, and the machine reader against a fake sysfs. (What
choose_tiles and TileConfig reject: test_validation.py.)"""

import numpy as np
import pytest

import cpuflash
from cpuflash import tiling

KiB, MiB = 1024, 1024 * 1024
CACHES = {
    "xeon": {"l1d": 48 * KiB, "l2": 2 * MiB},
    "epyc9654": {"l1d": 32 * KiB, "l2": 1 * MiB},
    "laptop": {"l1d": 32 * KiB, "l2": 256 * KiB},
}
HEAD_DIMS = [1, 40, 59, 64, 111, 128, 256, 512]


@pytest.mark.parametrize("machine", CACHES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_working_set_fits(machine, d, dtype):
    cache = CACHES[machine]
    tiles = cpuflash.choose_tiles(d, dtype, cache=cache)
    l1, l2 = tiling.working_set_bytes(tiles, d, dtype)
    assert tiles.block_k % tiling.KEY_PANEL == 0 and tiles.block_q % tiling.BLOCK_Q_MULTIPLE == 0
    at_minimum = tiles.block_k == tiling.KEY_PANEL
    assert l1 <= tiling.L1_SHARE * cache["l1d"] or at_minimum
    assert l2 <= tiling.L2_SHARE * cache["l2"] or (
        at_minimum and tiles.block_q == tiling.BLOCK_Q_MULTIPLE)


@pytest.mark.parametrize("machine", CACHES)
@pytest.mark.parametrize("d,d_v", [(64, 16), (64, 512), (40, 128), (128, 32), (1, 256)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_working_set_fits_with_another_value_head_dim(machine, d, d_v, dtype):
    """`head_dim_v` enters the model as Dv: the value rows and the accumulator fit with it."""
    cache = CACHES[machine]
    tiles = cpuflash.choose_tiles(d, dtype, cache=cache, head_dim_v=d_v)
    l1, l2 = tiling.working_set_bytes(tiles, d, dtype, head_dim_v=d_v)
    assert tiles.block_k % tiling.KEY_PANEL == 0 and tiles.block_q % tiling.BLOCK_Q_MULTIPLE == 0
    at_minimum = tiles.block_k == tiling.KEY_PANEL
    assert l1 <= tiling.L1_SHARE * cache["l1d"] or at_minimum
    assert l2 <= tiling.L2_SHARE * cache["l2"] or (
        at_minimum and tiles.block_q == tiling.BLOCK_Q_MULTIPLE)
    # Dv = D is the default; a larger Dv never gives larger tiles
    assert cpuflash.choose_tiles(d, dtype, cache=cache, head_dim_v=d) == \
        cpuflash.choose_tiles(d, dtype, cache=cache)
    wider = cpuflash.choose_tiles(d, dtype, cache=cache, head_dim_v=4 * d_v)
    assert wider.block_q <= tiles.block_q and wider.block_k <= tiles.block_k


def test_the_value_head_dim_changes_the_tiles():
    laptop = CACHES["laptop"]
    assert cpuflash.choose_tiles(64, cache=laptop, head_dim_v=512) == cpuflash.TileConfig(72, 32)
    assert cpuflash.choose_tiles(64, cache=laptop, head_dim_v=16) == cpuflash.TileConfig(168, 192)
    assert cpuflash.choose_tiles(64, cache=laptop) == cpuflash.TileConfig(120, 192)


SIZES = [16 * KiB, 32 * KiB, 48 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB, 32 * MiB]


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_larger_cache_never_gives_smaller_tiles(d):
    seen = set()
    for l1 in SIZES[:4]:
        for l2 in SIZES[3:]:
            tiles = cpuflash.choose_tiles(d, cache={"l1d": l1, "l2": l2})
            bigger_l2 = cpuflash.choose_tiles(d, cache={"l1d": l1, "l2": 2 * l2})
            bigger_l1 = cpuflash.choose_tiles(d, cache={"l1d": 2 * l1, "l2": l2})
            assert bigger_l2.block_q >= tiles.block_q and bigger_l2.block_k >= tiles.block_k
            assert bigger_l1.block_k >= tiles.block_k
            seen.add(tiles)
    # the caches really steer the choice (a constant would pass the checks above)
    assert len(seen) >= 5, seen


def test_measured_region_on_the_test_machine():
    """bench/sweep_tiles.py on the 2-core EPYC (48 KiB L1d, 1 MiB L2) found the speed flat from
    384 x 256 on, for D = 64 and 128 (see the choose_tiles docstring)."""
    zen5 = {"l1d": 48 * KiB, "l2": 1 * MiB}
    for d in (64, 128):
        assert cpuflash.choose_tiles(d, cache=zen5) == cpuflash.TileConfig(384, 256)


def test_tiles_shrink_to_feed_every_thread():
    tiles = cpuflash.TileConfig(256, 64)
    assert tiling.split_for_threads(tiles, 4096, 8, 2) == tiles
    small = tiling.split_for_threads(tiles, 256, 1, 4)
    assert small.block_q == 24 and small.block_k == 64  # 11 items for 4 threads
    assert tiling.split_for_threads(cpuflash.TileConfig(384, 256), 1000, 1, 8).block_q == 48


def test_sysfs_reader(tmp_path):
    for index, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"),
                                                 (2, "Unified", "2048K"), (3, "Unified", "105M")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(f"{level}\n")
        (folder / "type").write_text(f"{kind}\n")
        (folder / "size").write_text(f"{size}\n")
    assert tiling._read_sysfs_caches(str(tmp_path)) == {
        "l1d": 48 * KiB, "l2": 2 * MiB, "l3": 105 * MiB}
    assert tiling._read_sysfs_caches(str(tmp_path / "missing")) == {}


def test_cpu_info_reports_the_machine():
    info = cpuflash.cpu_info()
    assert set(info["caches"]) == {"l1d", "l2", "l3"}
    assert all(size > 0 for size in info["caches"].values())
    assert info["cores"] >= 1 and info["threads"] >= 1
    assert isinstance(info["simd"], list) and isinstance(info["model"], str)


def test_tiles_are_clamped_to_the_call():
    assert tiling.clamp_tiles(cpuflash.TileConfig(10**12, 10**12), 100, 70) == \
        cpuflash.TileConfig(100, 96)
    tiles = cpuflash.TileConfig(64, 64)
    assert tiling.clamp_tiles(tiles, 1000, 1000) is tiles


@pytest.mark.parametrize("window", [(256, 0), (0, 0), (100, 7), (3, 300), (0, tiling.MAX_BAND)])
@pytest.mark.parametrize("block_q", [8, 64, 384])
def test_a_narrow_window_is_one_key_block_per_tile(window, block_q):
    band, align = tiling.band_tiles(cpuflash.TileConfig(block_q, 256), window)
    assert band.block_q == block_q and align == tiling.KEY_PANEL
    assert band.block_k % tiling.KEY_PANEL == 0
    left, right = window
    for diag0 in range(0, 2000, 7):  # the kernel's first key and end of a tile's band
        k_lo = max(0, diag0 - left) // align * align
        assert diag0 + block_q + right - k_lo <= band.block_k


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (0, -1), (tiling.MAX_BAND, 1)])
def test_other_windows_keep_their_blocks(window):
    tiles = cpuflash.TileConfig(384, 256)
    assert tiling.band_tiles(tiles, window) == (tiles, 256)


def test_backward_tiles():
    """Whole row groups and key panels (the kernels' facts that keep the bits independent of
    the thread count), shrunk to the call like the forward's."""
    tiles = tiling.backward_tiles(10**6, 10**6)
    assert (tiles.block_q, tiles.block_k) == (tiling.BACKWARD_BLOCK_Q, tiling.BACKWARD_BLOCK_K)
    assert tiles.block_q % tiling.BLOCK_Q_MULTIPLE == 0 and tiles.block_k % tiling.KEY_PANEL == 0
    assert tiling.backward_tiles(10, 40) == cpuflash.TileConfig(10, 64)
