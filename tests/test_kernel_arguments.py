"""The kernels are called through their compiled entry points, which check an argument's dtype
but not an array's number of dimensions (`cpuflash._jit._entry_point`). This runs every route
to a kernel once more with every argument's whole type checked against the kernel's signature
first (`_jit._type_checked`): a route that hands a kernel an array of the wrong shape fails
here."""

import pytest

from helpers import REPO_DIR, explain, run_python

EVERY_ROUTE = """
    import numpy as np, numba, cpuflash
    from cpuflash import _combine, _jit, reference
    from cpuflash.kernels import backward, decode, fa1, forward, quantize

    assert _jit.CHECK_ARGUMENTS
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 37, 24)).astype(np.float32)
    k = rng.standard_normal((2, 2, 41, 24)).astype(np.float32)
    v = rng.standard_normal((2, 2, 41, 16)).astype(np.float32)

    # -- forward and backward, batched, packed, half precision
    out, lse = cpuflash.attention(q, k, v, causal=True, alibi_slopes=np.ones(4), sinks=np.ones(4),
                                  return_lse=True)
    cpuflash.attention_backward(out, q, k, v, out, lse, causal=True, alibi_slopes=np.ones(4),
                                sinks=np.ones(4))
    cpuflash.attention_backward(out, q, k, v, out, lse, causal=True)  # (the plain kernels)
    cpuflash.attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16))
    cu = np.array([0, 20, 37], dtype=np.int32)
    cpuflash.attention_varlen(q[0].swapaxes(0, 1), q[0].swapaxes(0, 1), q[0].swapaxes(0, 1),
                              cu, cu, causal=True)
    reference.attention_fa1(q, q, q, causal=True)

    # -- decoding: one query row, a paged cache, a quantized cache, split keys merged
    cpuflash.attention(q[:, :, :1], k, v)
    pages = rng.standard_normal((6, 2, 16, 24)).astype(np.float32)
    table = np.arange(6).reshape(2, 3)
    cpuflash.attention_with_kvcache(q[:, :, :1], pages, pages, cache_seqlens=np.array([40, 9]),
                                     block_table=table)
    long = rng.standard_normal((2, 2, 600, 24)).astype(np.float32)
    cpuflash.attention_with_kvcache(q[:, :, :1], long, long, num_splits=3)
    kq, vq = cpuflash.quantize_kv(k), cpuflash.quantize_kv(v)
    cpuflash.attention_with_kvcache(q[:, :, :1], kq, vq, cache_seqlens=30)
    cpuflash.attention_with_kvcache(q[:, :, :1], kq, vq, cache_seqlens=30, softcap=20.0)

    # -- your own functions, with the gradients of their arguments
    def bias(score, b, h, q_idx, kv_idx, table):
        return score + table[h]

    def bias_grad(dscore, score, b, h, q_idx, kv_idx, table, dtable):
        dtable[h] += dscore

    table = np.zeros(4, dtype=np.float32)
    out, lse = cpuflash.flex_attention(q, k, v, score_mod=bias, score_args=(table,),
                                       return_lse=True)
    cpuflash.flex_attention_backward(out, q, k, v, out, lse, score_mod=bias, score_args=(table,),
                                     score_mod_grad=bias_grad)

    kernels = (forward.fa2_forward, forward.fa2_forward_plain, backward.fa2_backward,
               backward.fa2_backward_plain, backward.score_arg_grads, decode.decode,
               decode.decode_plain, fa1.fa1_forward, _combine._merge_kernel, quantize.int8_rows)
    print("not called", [kernel._pyfunc.__name__ for kernel in kernels if not kernel._calls])
    print("checked", all(getattr(c, "checks_types", False)
                         for kernel in kernels for c in kernel._calls.values()))
"""


@pytest.mark.slow
def test_every_route_hands_its_kernel_the_signatures_types():
    import os

    env = dict(os.environ, CPUFLASH_CHECK_KERNEL_ARGUMENTS="1", CPUFLASH_QUIET="1")
    result = run_python(EVERY_ROUTE, env=env, cwd=str(REPO_DIR), timeout=1200)
    assert result.returncode == 0, explain(result)
    assert "not called []" in result.stdout and "checked True" in result.stdout, explain(result)
