"""The benchmark runner (``bench/runner.py``) and the command line: FLOP counting, report
writers, CLI runs.

Nothing here asserts a timing: speed is measured in ``bench/`` and by ``python -m cpuflash bench``.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from cpuflash.__main__ import bench_runner

runner = bench_runner()  # bench/runner.py of this repository

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None


def brute_force_pairs(n_q, n_k, causal=False, window=None):
    """Visible (query, key) pairs by testing every pair against the rules of the API contract."""
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    count = 0
    for i in range(n_q):
        diagonal = i + n_k - n_q
        for j in range(n_k):
            if left >= 0 and j < diagonal - left:
                continue
            if right >= 0 and j > diagonal + right:
                continue
            count += 1
    return count


SHAPES = [(0, 5), (5, 0), (1, 1), (1, 7), (7, 1), (5, 5), (3, 8), (8, 3), (13, 29), (29, 13)]
WINDOWS = [None, (0, 0), (2, 0), (0, 3), (-1, 2), (3, -1), (1, 1), (50, 50), (-1, -1)]


@pytest.mark.parametrize("n_q,n_k", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_visible_pairs_match_brute_force(n_q, n_k, causal, window):
    assert runner.visible_pairs(n_q, n_k, causal, window) == \
        brute_force_pairs(n_q, n_k, causal, window)


def test_visible_pairs_match_the_reference_mask(rng):
    """The count agrees with the keys the reference actually lets through (via its output)."""
    from cpuflash.reference import attention_reference

    n_q, n_k = 9, 14
    q = np.zeros((n_q, 4))
    k = np.zeros((n_k, 4))
    # v = identity: out[i, j] = softmax weight of key j for query i, nonzero exactly if visible
    v = np.eye(n_k)
    for causal, window in [(True, None), (False, (3, 1)), (True, (2, 5))]:
        out = attention_reference(q, k, v, causal=causal, window=window)
        assert np.count_nonzero(out) == runner.visible_pairs(n_q, n_k, causal, window)


def test_flops_counts_bottom_right_causal():
    # square causal: the lower triangle with its diagonal
    assert runner.flops(1, 1, 4, 4, 1, causal=True) == 4 * (4 * 5 // 2)
    # Nq < Nk: query i sees i + Nk - Nq + 1 keys (a prefill chunk after a cache)
    assert runner.flops(2, 3, 2, 5, 8, causal=True) == 4 * 2 * 3 * (4 + 5) * 8
    # Nq > Nk: the first Nq - Nk queries see nothing
    assert runner.flops(1, 1, 5, 2, 1, causal=True) == 4 * (0 + 0 + 0 + 1 + 2)
    assert runner.flops(1, 8, 1024, 1024, 128) == 4 * 8 * 1024 * 1024 * 128


def test_cases_cover_the_targets():
    full = runner.cases(quick=False)
    shapes = {tuple(case[key] for key in ("B", "Hq", "Hk", "Nq", "Nk", "D", "causal"))
              for case in full}
    for n in (1024, 2048, 4096):
        assert (1, 8, 8, n, n, 128, False) in shapes
        assert (1, 8, 8, n, n, 128, True) in shapes
    assert (1, 32, 8, 2048, 2048, 128, True) in shapes
    assert (1, 16, 16, 256, 4096, 128, True) in shapes
    assert len(runner.cases(quick=True)) < len(full)


def test_case_labels():
    gqa = {"B": 1, "Hq": 32, "Hk": 8, "Nq": 2048, "Nk": 2048, "D": 128, "causal": True}
    chunk = {"B": 1, "Hq": 16, "Hk": 16, "Nq": 256, "Nk": 4096, "D": 128, "causal": False}
    assert runner.case_label(gqa) == "B1 H32/8 N2048 D128 causal"
    assert runner.case_label(chunk) == "B1 H16 Nq256 Nk4096 D128"


def test_naive_is_skipped_when_its_scores_are_too_big():
    small = {"B": 1, "Hq": 8, "Hk": 8, "Nq": 4096, "Nk": 4096, "D": 128, "causal": False}
    huge = dict(small, Nq=16384, Nk=16384)
    assert runner.skip_reason("naive", small) is None
    assert "GiB" in runner.skip_reason("naive", huge)
    with pytest.raises(ValueError, match="unknown implementation 'nope'"):
        runner.skip_reason("nope", small)


@pytest.mark.parametrize("name", ["cpuflash", "fa1", "naive", "torch"])
def test_prepared_implementations_agree_with_the_reference(name):
    """Each competitor computes the same thing, bottom-right causal and GQA included."""
    case = {"B": 2, "Hq": 4, "Hk": 2, "Nq": 5, "Nk": 19, "D": 16, "causal": True}
    if runner.skip_reason(name, case):
        pytest.skip(runner.skip_reason(name, case))
    q, k, v = runner.random_inputs(case, seed=3)
    out = runner.prepare(name, q, k, v, case)()
    assert out.shape == (2, 4, 5, 16)
    heads = [(b, h) for b in range(2) for h in range(4)]
    ok, error, limit = runner.check_against_reference(out, q, k, v, causal=True, heads=heads)
    assert ok, f"{name}: max error {error:.3g} > {limit:.3g}"


def test_check_against_reference_catches_a_wrong_result():
    case = {"B": 1, "Hq": 2, "Hk": 2, "Nq": 8, "Nk": 8, "D": 8, "causal": True}
    q, k, v = runner.random_inputs(case)
    not_causal = runner.prepare("naive", q, k, v, dict(case, causal=False))()
    ok, error, limit = runner.check_against_reference(not_causal, q, k, v, causal=True)
    assert not ok and error > limit


def test_measure_reports_every_implementation():
    case = {"B": 1, "Hq": 2, "Hk": 1, "Nq": 24, "Nk": 40, "D": 16, "causal": True}
    record = runner.measure(case, ["cpuflash", "naive", "torch"], repeats=1)
    assert record["flops"] == runner.case_flops(case)
    assert list(record["results"]) == ["cpuflash", "naive", "torch"]
    expected = {"cpuflash": "ok", "naive": "ok", "torch": "ok" if HAS_TORCH else "skipped"}
    for name, result in record["results"].items():
        assert result["status"] == expected[name], (name, result)
        if result["status"] == "ok":
            assert result["seconds"] > 0 and result["gflops"] > 0
            assert result["max_error"] <= result["error_limit"]
        else:
            assert result["reason"] == "torch is not installed"


def fake_report():
    """A report as `runner.run` returns it, with made-up numbers."""
    def ok(gflops):
        return {"status": "ok", "seconds": 1.0 / gflops, "gflops": gflops, "max_error": 1e-7,
                "error_limit": 1e-5, "calls_per_sample": 1, "reason": None}

    def record(n, causal, results):
        case = {"B": 1, "Hq": 8, "Hk": 8, "Nq": n, "Nk": n, "D": 128, "causal": causal}
        return {"case": case, "label": runner.case_label(case),
                "flops": runner.case_flops(case), "results": results}

    skipped = {"status": "skipped", "seconds": None, "gflops": None, "max_error": None,
               "error_limit": None, "calls_per_sample": None, "reason": "torch is not installed"}
    wrong = {"status": "wrong", "seconds": None, "gflops": None, "max_error": 0.5,
             "error_limit": 1e-5, "calls_per_sample": None,
             "reason": "max error 0.5 > allowed 1e-05"}
    return {
        "date": "2026-01-01T00:00:00+00:00",
        "machine": {"model": "Test CPU", "caches": {"l1d": 49152}, "simd": ["avx2"]},
        "versions": {"numba": "0.68.1"},
        "threads": {"numba": 2, "threading_layer": "tbb", "torch": 2},
        "implementations": ["cpuflash", "torch", "fa1"],
        "repeats": 3,
        "sgemm": {"backend": "torch.matmul", "size": 4096, "seconds": 0.5, "gflops": 250.0,
                  "gflops_runs": [250.0, 240.0]},
        "cases": [
            # a numpy float, as a real run may leave: the JSON writer must convert it
            record(1024, False, {"cpuflash": ok(200.0), "torch": ok(160.0),
                                 "fa1": ok(np.float64(100.0))}),
            record(2048, False, {"cpuflash": ok(210.0), "torch": skipped, "fa1": ok(110.0)}),
            record(2048, True, {"cpuflash": ok(180.0), "torch": ok(150.0), "fa1": wrong}),
        ],
    }


def test_markdown_table_from_a_fake_report():
    text = runner.markdown_table(fake_report())
    lines = text.splitlines()
    assert lines[0] == ("| case | cpuflash GFLOP/s | torch GFLOP/s | fa1 GFLOP/s | "
                        "cpuflash/torch | % of sgemm |")
    assert lines[2] == "| B1 H8 N1024 D128 | 200.0 | 160.0 | 100.0 | 1.25x | 80% |"
    assert lines[3] == "| B1 H8 N2048 D128 | 210.0 | - | 110.0 | - | 84% |"
    assert lines[4] == "| B1 H8 N2048 D128 causal | 180.0 | 150.0 | WRONG | 1.20x | 72% |"
    assert "sgemm ceiling: 250.0 GFLOP/s (torch.matmul, 4096^3 float32)" in text
    assert "B1 H8 N2048 D128: torch skipped (torch is not installed)" in text
    assert "B1 H8 N2048 D128 causal: fa1 wrong (max error 0.5 > allowed 1e-05)" in text
    text.encode("ascii")


def test_a_ceiling_below_a_competitor_is_reported_unreliable_without_a_share():
    """A busy moment while sgemm ran once printed "141% of sgemm": no share above 100% may be
    printed as if it were measured."""
    report = fake_report()
    report["sgemm"]["gflops"] = 190.0  # below cpuflash's 200 and 210
    usable, note = runner.sgemm_ceiling(report)
    assert usable is None
    assert note.startswith("cpuflash reached 210.0 GFLOP/s on B1 H8 N2048 D128, more than sgemm")
    text = runner.markdown_table(report)
    lines = text.splitlines()
    assert lines[0] == "| case | cpuflash GFLOP/s | torch GFLOP/s | fa1 GFLOP/s | cpuflash/torch |"
    assert lines[2] == "| B1 H8 N1024 D128 | 200.0 | 160.0 | 100.0 | 1.25x |"
    assert "% of sgemm |" not in text and not re.search(r"\d%", text)
    assert "The sgemm ceiling is unreliable: cpuflash reached 210.0 GFLOP/s" in text
    assert "machine was busy while sgemm was measured" in text
    report["sgemm"]["openblas_coretype"] = "Haswell"  # as run() records the environment
    assert "slow on this CPU, OPENBLAS_CORETYPE=Haswell is set)" in runner.sgemm_ceiling(
        report)[1]
    # any competitor above it makes it no ceiling, not only cpuflash
    report = fake_report()
    report["cases"][0]["results"]["fa1"]["gflops"] = 260.0
    assert runner.sgemm_ceiling(report)[0] is None
    assert "fa1 reached 260.0 GFLOP/s" in runner.markdown_table(report)
    # equal is still a ceiling
    report = fake_report()
    report["sgemm"]["gflops"] = 210.0
    assert runner.sgemm_ceiling(report) == (report["sgemm"], None)
    assert "| 100% |" in runner.markdown_table(report)


class FakeTiming:
    """Stands in for `runner._settled_sample`: no call is timed, each sample takes what a
    machine doing `idle_gflops` would, `busy_factor` times longer while `busy(role, case)`."""

    def __init__(self, monkeypatch, busy, idle_gflops, busy_factor=4.0):
        self.busy, self.idle_gflops, self.busy_factor = busy, idle_gflops, busy_factor
        self.case, self.log, self.ceilings = None, [], []
        real_prepare, real_ceiling = runner.prepare, runner.SgemmCeiling
        timing = self

        def tagged_prepare(name, q, k, v, case):
            fn = real_prepare(name, q, k, v, case)

            def call():
                return fn()

            call.tag = (name, runner.case_flops(case))
            timing.case = runner.case_label(case)
            return call

        class RecordedCeiling(real_ceiling):
            def __init__(self, size):
                super().__init__(size)
                timing.ceilings.append(self)

        monkeypatch.setattr(runner, "prepare", tagged_prepare)
        monkeypatch.setattr(runner, "SgemmCeiling", RecordedCeiling)
        monkeypatch.setattr(runner, "_settled_sample", self.sample)

    def sample(self, fn, number, call_seconds):
        if hasattr(fn, "tag"):
            role, work = fn.tag
        else:
            role, work = "sgemm", 2 * self.ceilings[-1].size ** 3
        self.log.append((role, self.case))
        slow = self.busy_factor if self.busy(role, self.case) else 1.0
        return slow * work / (self.idle_gflops[role] * 1e9)


RUN_CASES = [{"B": 1, "Hq": 2, "Hk": 1, "Nq": 16, "Nk": 24, "D": 8, "causal": False},
             {"B": 1, "Hq": 2, "Hk": 1, "Nq": 16, "Nk": 24, "D": 8, "causal": True}]
IDLE = {"cpuflash": 80.0, "naive": 10.0, "sgemm": 100.0}


def test_run_samples_the_ceiling_between_the_rounds(monkeypatch):
    """A neighbour's burst during the first case and the sgemm before it: the ceiling's samples
    between the later rounds still find the machine idle (sampled only before the cases, it
    would come out at a quarter, and cpuflash at 320% of it)."""
    first = runner.case_label(RUN_CASES[0])
    timing = FakeTiming(monkeypatch, lambda role, case: case in (None, first), IDLE)
    steps = []
    report = runner.run(RUN_CASES, ["cpuflash", "naive"], repeats=3, sgemm_size=16,
                           progress=steps.append)
    assert steps[-1] is None and len(steps) - 1 == runner.run_steps(RUN_CASES)
    candidates = len(timing.ceilings[0].candidates)
    # each candidate once before the cases; then every round of every case ends with sgemm
    assert [role for role, _ in timing.log[:candidates]] == ["sgemm"] * candidates
    for case in RUN_CASES:
        roles = [role for role, label in timing.log[candidates:]
                 if label == runner.case_label(case)]
        assert roles[:2] == ["cpuflash", "naive"]  # the untimed first calls
        assert roles[2:] == ["cpuflash", "naive", "sgemm"] * 3
    sgemm = report["sgemm"]
    assert sgemm["gflops"] == pytest.approx(100.0)
    assert sgemm["reliable"] is True and sgemm["note"] is None
    assert len(sgemm["gflops_runs"]) == (candidates + 2 * 3) // candidates  # taken in turn
    assert min(sgemm["gflops_runs"]) == pytest.approx(25.0)  # the busy ones are in there
    slowed, idle = (record["results"]["cpuflash"]["gflops"] for record in report["cases"])
    assert (slowed, idle) == (pytest.approx(20.0), pytest.approx(80.0))
    text = runner.markdown_table(report)
    assert "| 20% |" in text and "| 80% |" in text


def test_run_reports_a_ceiling_that_was_always_measured_busy(monkeypatch):
    """When every sgemm sample is slowed down and the competitors are not, the ceiling comes
    out below cpuflash: the report says so, and gives no share."""
    FakeTiming(monkeypatch, lambda role, case: role == "sgemm", IDLE)
    report = runner.run(RUN_CASES, ["cpuflash", "naive"], repeats=2, sgemm_size=16)
    assert report["sgemm"]["gflops"] == pytest.approx(25.0)
    assert report["sgemm"]["reliable"] is False
    assert "cpuflash reached 80.0 GFLOP/s" in report["sgemm"]["note"]
    text = runner.markdown_table(report)
    assert "% of sgemm |" not in text and not re.search(r"\d%", text)
    assert "The sgemm ceiling is unreliable" in text


def test_json_and_markdown_files(tmp_path):
    report = fake_report()
    report["cases"][0]["results"]["cpuflash"]["max_error"] = float("inf")
    runner.write_json(report, tmp_path / "bench.json")
    loaded = json.loads((tmp_path / "bench.json").read_text())
    assert loaded["machine"]["model"] == "Test CPU"
    assert loaded["threads"]["numba"] == 2
    assert loaded["cases"][0]["results"]["fa1"]["gflops"] == 100.0
    assert loaded["cases"][0]["results"]["cpuflash"]["max_error"] == "inf"
    runner.write_markdown(report, tmp_path / "bench.md")
    assert "| B1 H8 N1024 D128 | 200.0 |" in (tmp_path / "bench.md").read_text()


def test_plot_is_written_exactly_when_matplotlib_is_there(tmp_path):
    written, message = runner.write_plot(fake_report(), tmp_path / "bench.png")
    assert written == HAS_MATPLOTLIB, message
    if HAS_MATPLOTLIB:
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in message
        assert not (tmp_path / "bench.png").exists()


def test_machine_record_is_json_ready():
    record = runner.machine_record()
    assert {"date", "machine", "versions", "threads"} <= set(record)
    assert record["threads"]["numba"] >= 1
    json.dumps(record)


def run_cli(*args, timeout=600):
    # The timeout only guards against a hang; nothing here depends on how long a run takes.
    # PYTHONIOENCODING=ascii: a non-ASCII character in the output fails the run
    return subprocess.run([sys.executable, "-m", "cpuflash", *args], capture_output=True,
                          text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONIOENCODING="ascii"))


def test_cli_info_prints_caches_tiles_and_jit_cache():
    done = run_cli("info")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    import cpuflash

    caches = cpuflash.cpu_info()["caches"]
    assert f"L1d {caches['l1d'] // 1024} KiB" in out
    for label in ("CPU:", "AVX2:", "AVX-512:", "AMX:", "caches:", "threads:", "threading:",
                  "JIT cache:", "numba ", "llvmlite ", "numpy "):
        assert label in out
    for head_dim in (64, 128, 256):
        tiles = cpuflash.choose_tiles(head_dim)
        assert f"D={head_dim:<4d} block_q={tiles.block_q:<4d} block_k={tiles.block_k:<4d}" in out


def test_jit_cache_location_follows_numba_cache_dir(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c",
         "from cpuflash.__main__ import jit_cache_location; print(*jit_cache_location(), sep='|')"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path)))
    assert done.returncode == 0, done.stderr
    path, how = done.stdout.strip().split("|")
    assert path.startswith(str(tmp_path)) and how.startswith("NUMBA_CACHE_DIR")


def test_jit_cache_location_default_is_next_to_the_kernels():
    from cpuflash.__main__ import jit_cache_location
    import cpuflash.kernels

    if os.environ.get("NUMBA_CACHE_DIR"):
        pytest.skip("NUMBA_CACHE_DIR is set")
    path, how = jit_cache_location()
    kernels = os.path.dirname(cpuflash.kernels.__file__)
    if os.access(kernels, os.W_OK):
        assert path == os.path.join(kernels, "__pycache__")
        assert "__pycache__" in how
    else:
        assert "user-wide" in how


def test_cli_bench_quick_end_to_end(tmp_path):
    done = run_cli("bench", "--quick", "--out", str(tmp_path), "--repeats", "1")
    assert done.returncode == 0, done.stderr
    assert "| case | cpuflash GFLOP/s |" in done.stdout
    report = json.loads((tmp_path / "bench.json").read_text())
    assert len(report["cases"]) == len(runner.cases(quick=True))
    for record in report["cases"]:
        assert record["results"]["cpuflash"]["status"] == "ok"
    assert (tmp_path / "bench.md").exists()
    assert (tmp_path / "bench.png").exists() == HAS_MATPLOTLIB
    assert ("plot skipped" in done.stdout) != HAS_MATPLOTLIB
    assert not re.search(r"\b(1\d\d|[2-9]\d\d)%", done.stdout), "a share of sgemm above 100%"


def test_cli_without_the_repository(tmp_path):
    """Installed without its repository (``pip install .``), `info` works and `bench` says in
    one line where the benchmark lives, with exit status 2 and no traceback."""
    import shutil

    import cpuflash

    shutil.copytree(os.path.dirname(cpuflash.__file__), tmp_path / "site" / "cpuflash",
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, PYTHONIOENCODING="ascii")
    env.pop("NUMBA_CACHE_DIR", None)  # so the kernel cache sits next to the copy's kernels

    def run(*args):
        return subprocess.run([sys.executable, "-m", "cpuflash", *args], capture_output=True,
                              text=True, timeout=300, env=env, cwd=tmp_path)

    where = run("info")
    assert where.returncode == 0, where.stderr
    assert str(tmp_path / "site" / "cpuflash") in where.stdout  # the copy ran, not the clone
    done = run("bench", "--quick")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert "bench/ folder of cpuflash's repository" in done.stderr


def test_cli_rejects_bad_arguments():
    done = run_cli("bench", "--repeats", "0")
    assert done.returncode == 2 and "must be >= 1" in done.stderr
    assert run_cli().returncode == 2


def test_measure_survives_a_competitor_that_raises(monkeypatch):
    def broken(name, q, k, v, case):
        if name == "fa1":
            def raise_error():
                raise RuntimeError("boom")
            return raise_error
        return original(name, q, k, v, case)

    original = runner.prepare
    monkeypatch.setattr(runner, "prepare", broken)
    case = {"B": 1, "Hq": 1, "Hk": 1, "Nq": 16, "Nk": 16, "D": 8, "causal": False}
    record = runner.measure(case, ["cpuflash", "fa1"], repeats=1)
    assert record["results"]["fa1"]["status"] == "error"
    assert record["results"]["fa1"]["reason"] == "RuntimeError: boom"
    assert record["results"]["cpuflash"]["status"] == "ok"
    report = {"implementations": ["cpuflash", "fa1"], "cases": [record], "repeats": 1}
    assert "| ERROR |" in runner.markdown_table(report)


def _report(llvm_cpu, simd, ratios):
    """A report of one case per ratio (cpuflash's GFLOP/s over torch's), on a made-up CPU."""
    ok = {"status": "ok"}
    return {"machine": {"llvm_cpu": llvm_cpu, "simd": simd},
            "cases": [{"results": {"cpuflash": dict(ok, gflops=100.0 * r),
                                   "torch": dict(ok, gflops=100.0)}} for r in ratios]}


@pytest.mark.parametrize("llvm_cpu, simd, expected", [
    ("znver3", ["avx2", "fma"], "Zen 3"),
    ("znver5", ["avx2", "avx512f"], "Zen 5"),
    ("sapphirerapids", ["avx512f", "amx-tile"], "AMX"),
    ("skylake-avx512", ["avx512f"], None),
])
def test_bench_names_the_cpu_class(llvm_cpu, simd, expected):
    found = runner.cpu_class({"llvm_cpu": llvm_cpu, "simd": simd})
    assert (found is None) == (expected is None)
    if expected is not None:
        assert expected in found[0]
    line = runner.expectation(_report(llvm_cpu, simd, [0.9, 1.3]))
    assert "this run: cpuflash at 0.90-1.30x torch SDPA" in line
    assert ("has no figures for this CPU" in line) == (expected is None)
    if expected is not None:  # the figures are the README's, row and column
        low, high = found[1]
        with open(runner.README, encoding="utf-8") as f:
            row = next(line for line in f if line.startswith(f"| {found[0]} |"))
        assert row.split("|")[2].strip() == f"{low:.2f}-{high:.2f}x"
        assert f"measured {low:.2f}-{high:.2f}x" in line
