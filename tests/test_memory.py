"""Long sequences: correct at N = 65536, and extra memory O(N), never O(N^2).

The peak memory is measured in a fresh interpreter, so the pytest process's own allocations do
not blur it.
"""

import sys

import numpy as np
import pytest

import cpuflash

from accuracy import assert_close_to_reference
from helpers import explain, last_json_line, run_python


@pytest.mark.slow
def test_long_causal_sequence(rng):
    """N = 65536, one head, D = 64 (about 550 GFLOP, a few seconds on 2 cores): checked on its
    last rows, which bottom-right alignment makes a small (8 x 65536) reference problem."""
    n, d = 65536, 64
    q, k, v = (rng.standard_normal((1, 1, n, d), dtype=np.float32) for _ in range(3))
    out, lse = cpuflash.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (1, 1, n, d) and np.isfinite(out).all() and np.isfinite(lse).all()
    assert_close_to_reference(out[:, :, -8:], q[:, :, -8:], k, v, lse=lse[:, :, -8:],
                              causal=True)
    # the first rows see few keys: row 0 sees only key 0
    np.testing.assert_allclose(out[0, 0, 0], v[0, 0, 0], rtol=1e-6)


MEMORY_SCRIPT = """
    import json, resource, sys
    import numpy as np
    import cpuflash

    n, d, heads = 16384, 128, int(sys.argv[1])
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, heads, n, d), dtype=np.float32) for _ in range(3))
    tiny = np.ones((1, 1, 4, d), np.float32)
    cpuflash.attention(tiny, tiny, tiny, causal=True)  # compile or load the kernel first
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = cpuflash.attention(q, k, v, causal=True)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(dict(before_kib=before, after_kib=after, out_bytes=out.nbytes,
                          finite=bool(np.isfinite(out).all()))))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss is KiB on Linux")
@pytest.mark.parametrize("heads", [1, 4])
def test_peak_memory_is_the_output_and_a_little_more(heads):
    result = run_python(MEMORY_SCRIPT, heads, timeout=300)
    assert result.returncode == 0, explain(result)
    m = last_json_line(result)
    assert m["finite"]
    increase = (m["after_kib"] - m["before_kib"]) * 1024
    allowed = m["out_bytes"] + 64 * 2**20
    assert increase <= allowed, (
        f"peak RSS grew by {increase / 2**20:.1f} MiB during the call (before "
        f"{m['before_kib'] / 1024:.1f} MiB, after {m['after_kib'] / 1024:.1f} MiB); allowed: "
        f"output {m['out_bytes'] / 2**20:.1f} MiB + 64 MiB")
