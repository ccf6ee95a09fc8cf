"""Forward speed of cpuflash against FA-1, naive numpy and torch SDPA (float32).

Shapes: B=1, H=8, D=128, square N = 1024, 2048, 4096, causal and not (toy shapes with
``CPUFLASH_BENCH_SMALL=1``). Every implementation's first result is checked against the float64
reference before it is timed. Compare rows of one shape by their ``gflops`` extra info, or run
``python -m cpuflash bench`` for the interleaved side-by-side table.
"""

import os

import pytest

import runner  # bench/runner.py

# Toy shapes for a CI smoke run. Read here, not imported from conftest: tests/ has a conftest
# module of the same name.
SMALL = os.environ.get("CPUFLASH_BENCH_SMALL") == "1"


def _shapes():
    if SMALL:
        sizes, heads, head_dim = (64, 129), 2, 32
    else:
        sizes, heads, head_dim = (1024, 2048, 4096), 8, 128
    return [dict(B=1, Hq=heads, Hk=heads, Nq=n, Nk=n, D=head_dim, causal=causal)
            for n in sizes for causal in (False, True)]


SHAPES = _shapes()


@pytest.mark.parametrize("implementation", runner.IMPLEMENTATIONS)
@pytest.mark.parametrize("case", SHAPES, ids=[runner.case_label(c).replace(" ", "-")
                                              for c in SHAPES])
def test_forward(timed, case, implementation):
    reason = runner.skip_reason(implementation, case)
    if reason is not None:
        pytest.skip(reason)
    q, k, v = runner.random_inputs(case)
    fn = runner.prepare(implementation, q, k, v, case)

    def check(out):
        ok, error, limit = runner.check_against_reference(out, q, k, v, causal=case["causal"])
        assert ok, f"{implementation} is wrong: max error {error:.3g} > {limit:.3g}"

    timed(fn, runner.case_flops(case), check=check)
