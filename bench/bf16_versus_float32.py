"""bfloat16 against float32, side by side in one process (interleaved, best of N, same threads).

    python bench/bf16_versus_float32.py [--repeats 5] [--quick] [--backward]

For each shape: cpuflash on float32 inputs, cpuflash on bfloat16 inputs (AMX tiles on a CPU
that has them, the AVX512-BF16 dot products where they pay, else widened to float32: the line
`bfloat16:` of `python -m cpuflash info` says which), and torch's
`scaled_dot_product_attention` on bfloat16 tensors. Prints GFLOP/s (4 * B * H * visible pairs * D
per call) and the ratios. The bfloat16 output is checked against the float32 one first (a loose
bound: bfloat16 inputs and P).
With `--backward`, also cpuflash's backward (`attention_backward`) on float32 against bfloat16,
and the bfloat16 forward and backward against torch's (autograd through SDPA), at N/2 (its own
table).
"""

import argparse
import time

import ml_dtypes
import numpy as np

import cpuflash
from cpuflash import _amx, _simd

import runner  # bench/runner.py

# (B, H, N, D, causal)
CASES = [(1, 8, 4096, 128, False), (1, 8, 4096, 128, True), (1, 8, 4096, 64, False),
         (1, 8, 4096, 64, True)]
QUICK = [(1, 8, 1024, 128, False), (1, 8, 1024, 64, True)]


def calls(batch, heads, n, d, causal, rng):
    """The timed calls of one shape; the bfloat16 result checked against float32's."""
    import torch

    q32, k32, v32 = (rng.standard_normal((batch, heads, n, d), dtype=np.float32)
                     for _ in range(3))
    q16, k16, v16 = (x.astype(ml_dtypes.bfloat16) for x in (q32, k32, v32))
    w32 = [x.astype(np.float32) for x in (q16, k16, v16)]  # the bfloat16 numbers, in float32
    tq, tk, tv = (torch.from_numpy(x).to(torch.bfloat16) for x in w32)
    expected = cpuflash.attention(*w32, causal=causal)
    got = cpuflash.attention(q16, k16, v16, causal=causal).astype(np.float32)
    error = float(np.abs(got - expected).max())
    if error > 2e-2 * float(np.abs(expected).max()):
        raise SystemExit(f"bfloat16 differs from float32 by {error:.3g}")

    def sdpa():
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    return {"cpuflash float32": lambda: cpuflash.attention(q32, k32, v32, causal=causal),
            "cpuflash bfloat16": lambda: cpuflash.attention(q16, k16, v16, causal=causal),
            "torch bfloat16": sdpa}


def backward_calls(batch, heads, n, d, causal, rng):
    """The float32 and the bfloat16 backward of one shape, and the bfloat16 forward and
    backward of cpuflash and of torch (autograd through `scaled_dot_product_attention`)."""
    import torch
    x32 = [rng.standard_normal((batch, heads, n, d), dtype=np.float32) for _ in range(4)]
    x16 = [x.astype(ml_dtypes.bfloat16) for x in x32]
    timed = {}
    for name, (q, k, v, dout) in (("float32", x32), ("bfloat16", x16)):
        out, lse = cpuflash.attention(q, k, v, causal=causal, return_lse=True)
        timed[name] = (lambda q=q, k=k, v=v, dout=dout, out=out, lse=lse:
                       cpuflash.attention_backward(dout, q, k, v, out, lse, causal=causal))

    def ours_both(q=x16[0], k=x16[1], v=x16[2], dout=x16[3]):
        out, lse = cpuflash.attention(q, k, v, causal=causal, return_lse=True)
        return cpuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)

    tq, tk, tv = (torch.from_numpy(x).to(torch.bfloat16).requires_grad_() for x in x32[:3])
    tdout = torch.from_numpy(x32[3]).to(torch.bfloat16)

    def torch_both():
        for t in (tq, tk, tv):
            t.grad = None
        torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, is_causal=causal).backward(tdout)
        return tq.grad, tk.grad, tv.grad

    timed["bfloat16 both"] = ours_both
    timed["torch bfloat16 both"] = torch_both
    return timed


def best_of(timed, repeats):
    """Best seconds of each call over `repeats` interleaved rounds."""
    best = {name: float("inf") for name in timed}
    for _ in range(repeats):
        for name, call in timed.items():
            runner.settle(call, cheap=False)  # the other library's threads stop spinning
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="two small shapes")
    parser.add_argument("--backward", action="store_true", help="the backward too")
    args = parser.parse_args(argv)
    threads = runner.match_torch_threads()
    path = ("AMX tiles (%s)" % _amx.TILES if _amx.TILES is not None
            else "vdpbf16ps" if _simd.BF16_DOT else "widened to float32")
    print(f"{threads} threads, best of {args.repeats} interleaved rounds; cpuflash bfloat16: "
          f"{path}")
    print("| case | cpuflash fp32 GFLOP/s | cpuflash bf16 GFLOP/s | torch bf16 GFLOP/s "
          "| bf16 / fp32 | bf16 / torch bf16 |")
    print("| --- | --- | --- | --- | --- | --- |")
    rng = np.random.default_rng(0)
    for batch, heads, n, d, causal in QUICK if args.quick else CASES:
        timed = calls(batch, heads, n, d, causal, rng)
        best = best_of(timed, args.repeats)
        work = runner.flops(batch, heads, n, n, d, causal) / 1e9
        f32, b16, tb16 = (work / best[name] for name in timed)
        label = f"B{batch} H{heads} N{n} D{d}{' causal' if causal else ''}"
        print(f"| {label} | {f32:.0f} | {b16:.0f} | {tb16:.0f} | {b16 / f32:.2f}x "
              f"| {b16 / tb16:.2f}x |", flush=True)
    if not args.backward:
        return
    print("\n| backward | cpuflash fp32 s | cpuflash bf16 s | bf16 speed / fp32 "
          "| bf16 forward + backward: cpuflash s | torch s | cpuflash speed / torch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for batch, heads, n, d, causal in QUICK if args.quick else CASES:
        best = best_of(backward_calls(batch, heads, n // 2, d, causal, rng), args.repeats)
        label = f"B{batch} H{heads} N{n // 2} D{d}{' causal' if causal else ''}"
        ours, theirs = best["bfloat16 both"], best["torch bfloat16 both"]
        print(f"| {label} | {best['float32']:.3f} | {best['bfloat16']:.3f} "
              f"| {best['float32'] / best['bfloat16']:.2f}x | {ours:.3f} | {theirs:.3f} "
              f"| {theirs / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
