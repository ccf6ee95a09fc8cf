"""What the score modifiers cost in cpuflash (float32), next to the plain case they modify.

* ALiBi and softcap against plain causal attention: B=1, H=8, N=4096, D=128.
* A sliding window (256, 0) over N=16384: the cost per visible pair is what to compare with the
  plain causal line, since the window leaves only 257 keys per query. Wider windows (1024 and
  4096 keys) and plain causal attention at the same N=16384 show how the cost per pair depends
  on the window: a short row pays its query read, softmax and output over fewer pairs.
* An additive bias of shape (1, 1, N, N) and a boolean mask of shape (N, N) (lower triangular,
  so it hides what `causal` hides) against plain and causal attention at N=2048.

GFLOP/s count visible pairs only (``4 * B * H * visible pairs * D``), and
``ns_per_visible_pair`` is recorded as well. Each configuration is first checked against the
float64 reference on the same arguments at a reduced length (dense references of N=16384 would
take gigabytes), then run once untimed at full size, then timed.
"""

import os

import numpy as np
import pytest

import cpuflash

import runner  # bench/runner.py

# Toy shapes for a CI smoke run. Read here, not imported from conftest: tests/ has a conftest
# module of the same name.
SMALL = os.environ.get("CPUFLASH_BENCH_SMALL") == "1"

HEADS, HEAD_DIM = (2, 32) if SMALL else (8, 128)
N_MODIFIERS = 256 if SMALL else 4096
N_WINDOW, WINDOW = (512, (32, 0)) if SMALL else (16384, (256, 0))
WIDER_WINDOWS = (128, 256) if SMALL else (1024, 4096)
N_ARRAYS = 192 if SMALL else 2048
# Length of the correctness check: large enough for several tiles, small enough for a dense
# float64 reference.
N_CHECK = 384


def _alibi_slopes(heads):
    # the ALiBi paper's geometric slopes, 2^(-8 h / H)
    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)


def _tril(n):
    return np.tril(np.ones((n, n), dtype=bool))


# name -> (N, options builder taking N). Arrays are built per length so the check can use the
# same options at N_CHECK.
FEATURES = {
    "causal": (N_MODIFIERS, lambda n: dict(causal=True)),
    "causal-alibi": (N_MODIFIERS, lambda n: dict(causal=True,
                                                 alibi_slopes=_alibi_slopes(HEADS))),
    "causal-softcap": (N_MODIFIERS, lambda n: dict(causal=True, softcap=30.0)),
    "window": (N_WINDOW, lambda n: dict(window=WINDOW)),
    **{f"window-{left}": (N_WINDOW, lambda n, left=left: dict(window=(left, 0)))
       for left in WIDER_WINDOWS},
    f"causal-N{N_WINDOW}": (N_WINDOW, lambda n: dict(causal=True)),
    "plain-N{}".format(N_ARRAYS): (N_ARRAYS, lambda n: dict()),
    "causal-N{}".format(N_ARRAYS): (N_ARRAYS, lambda n: dict(causal=True)),
    "bias": (N_ARRAYS, lambda n: dict(
        bias=np.random.default_rng(7).standard_normal((1, 1, n, n), dtype=np.float32))),
    "mask-tril": (N_ARRAYS, lambda n: dict(mask=_tril(n))),
}


def _visible_pairs(n, options):
    if options.get("mask") is not None:
        rule = np.ones((n, n), dtype=bool)  # the mask alone decides here
        return int(np.count_nonzero(rule & options["mask"]))
    return runner.visible_pairs(n, n, options.get("causal", False), options.get("window"))


@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature(timed, feature):
    n, make_options = FEATURES[feature]

    # -- correctness first, on a length a dense reference can afford
    n_check = min(n, N_CHECK)
    check_case = dict(B=1, Hq=HEADS, Hk=HEADS, Nq=n_check, Nk=n_check, D=HEAD_DIM, causal=False)
    q, k, v = runner.random_inputs(check_case, seed=1)
    check_options = make_options(n_check)
    out = cpuflash.attention(q, k, v, **check_options)
    ok, error, limit = runner.check_against_reference(out, q, k, v, **check_options)
    assert ok, f"{feature}: max error {error:.3g} > {limit:.3g}"

    # -- then the full size
    case = dict(check_case, Nq=n, Nk=n)
    q, k, v = runner.random_inputs(case)
    options = make_options(n)
    pairs = _visible_pairs(n, options)
    timed(lambda: cpuflash.attention(q, k, v, **options), 4 * HEADS * pairs * HEAD_DIM,
          visible_pairs=HEADS * pairs)
