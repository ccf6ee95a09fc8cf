"""What `jax.pure_callback` costs on the CPU against cpuflash's FFI target, for large operands.

Both run a callback that does nothing with one float32 operand and returns one result of the
same size (untouched). The difference between them is the copying around the callback; the
addresses show whether the callback sees XLA's own buffer.

    taskset -c 1 python bench/jax_callback_copies.py [--mib 16 256] [--repeat 5]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from cpuflash import _jax_ffi


def best_of(function, x, repeat):
    jax.block_until_ready(function(x))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(function(x))
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    seen = {}

    def callback(x):
        x = np.asarray(x)
        seen["callback"] = x.__array_interface__["data"][0]
        return np.empty(x.shape, x.dtype)

    def job(options, operands, results):
        seen["ffi"] = operands[0].__array_interface__["data"][0]

    print(f"{'MiB':>5} {'pure_callback ms':>17} {'FFI ms':>8}  the callback sees XLA's buffer")
    for mib in args.mib:
        x = jnp.ones((mib * 2 ** 18,), jnp.float32)
        kind = jax.ShapeDtypeStruct(x.shape, x.dtype)
        via_callback = jax.jit(lambda x: jax.pure_callback(callback, kind, x))
        via_ffi = jax.jit(lambda x: _jax_ffi.call(job, (), [x], (kind,))[0])
        t_callback = best_of(via_callback, x, args.repeat)
        t_ffi = best_of(via_ffi, x, args.repeat)
        own = x.unsafe_buffer_pointer()
        print(f"{mib:5d} {1e3 * t_callback:17.2f} {1e3 * t_ffi:8.3f}  pure_callback: "
              f"{seen['callback'] == own}, FFI: {seen['ffi'] == own}")


if __name__ == "__main__":
    main()
