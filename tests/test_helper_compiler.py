"""The helpers' pipeline (`cpuflash._jit.HelperCompiler`) compiles without SSA form, where a
variable has one type in the whole function. Under Numba's own pipeline a variable can hold a
float32 on one line and a float64 on the next; without SSA form both lines would compute in
float64, which is other arithmetic than the code says. So every helper must give each of its
variables one type: this types every helper that the kernels' chains compile (three general
builds, and the code generated around a user's functions) again, with SSA form, and finds the
variables that get more than one there.
"""

import pytest

from helpers import clean_env, explain, last_json_line, run_python

CHECK = """
    import collections, gc, json

    import numpy as np
    from numba import types
    from numba.core import compiler
    from numba.core.registry import CPUDispatcher

    import cpuflash as cf
    from cpuflash import _jit

    # the general builds of the three kernels (their chains hold the plain builds' helpers),
    # with a modifier and the sinks' branches; decoding from an int8 cache
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 40, 64)).astype(np.float32)
    options = dict(softcap=5.0, sinks=np.zeros(2, np.float32))
    out, lse = cf.attention(q, q, q, return_lse=True, **options)
    cf.attention_backward(out, q, q, q, out, lse, **options)
    cache = cf.quantize_kv(q, "int8")
    cf.attention_with_kvcache(q[:, :, :1], cache, cache, softcap=5.0)
    # and the code generated around the user's functions (`kernels/_user.py`)
    table = rng.standard_normal((2, 128)).astype(np.float32)

    def relative(score, b, h, q_idx, kv_idx, table):
        return score + table[h, q_idx - kv_idx + 64]

    def relative_grad(dscore, score, b, h, q_idx, kv_idx, table, dtable):
        dtable[h, q_idx - kv_idx + 64] += dscore
        return dscore

    doc = np.repeat(np.arange(4), 10)[None].astype(np.int32)

    def same_doc(b, h, q_idx, kv_idx, doc):
        return doc[b, q_idx] == doc[b, kv_idx] and kv_idx <= q_idx

    mask = cf.block_mask(same_doc, 1, 1, 40, 40, args=(doc,))
    user = dict(score_mod=relative, score_args=(table,), block_mask=mask)
    out, lse = cf.flex_attention(q, q, q, return_lse=True, **user)
    cf.flex_attention_backward(out, q, q, q, out, lse, score_mod_grad=relative_grad, **user)
    cf.attention_with_kvcache(q[:, :, :1], q, q, score_mod=relative, score_args=(table,))

    checked, unstable = 0, set()
    for helper in [f for f in gc.get_objects() if isinstance(f, CPUDispatcher)]:
        if helper._compiler.pipeline_class is not _jit.HelperCompiler:
            continue
        for signature in list(helper.overloads):
            flags = compiler.Flags()  # the helper's options, with SSA form (the default)
            helper.targetdescr.options.parse_as_flags(flags, helper.targetoptions)
            flags.no_compile = True  # typed and lowered, not turned into machine code
            typed = compiler.compile_extra(helper.typingctx, helper.targetctx, helper.py_func,
                                           signature, None, flags, {})
            found = collections.defaultdict(set)  # variable -> its types (SSA: x, x.1, ...)
            for name, kind in typed.type_annotation.typemap.items():
                # (arg.x: the argument x as passed, a variable of its own)
                variable = name if name.startswith("arg.") else name.split(".")[0]
                # ($: Numba's temporaries; _: values nobody reads; a literal constant has the
                # same value as its plain type)
                if not variable.startswith("$") and variable != "_":
                    found[variable].add(str(types.unliteral(kind)))
            checked += 1
            unstable |= {f"{helper.py_func.__qualname__}: {variable} {sorted(kinds)}"
                         for variable, kinds in found.items() if len(kinds) > 1}
    print(json.dumps(dict(checked=checked, unstable=sorted(unstable))))
"""


@pytest.mark.slow
def test_every_variable_of_a_helper_has_one_type(tmp_path):
    result = run_python(CHECK,
                        env=clean_env(NUMBA_CACHE_DIR=str(tmp_path), CPUFLASH_QUIET="1"),
                        timeout=600)
    assert result.returncode == 0, explain(result)
    report = last_json_line(result)
    assert report["checked"] > 200, report  # the helpers compiled (an empty cache: not loaded)
    assert report["unstable"] == [], report["unstable"]
