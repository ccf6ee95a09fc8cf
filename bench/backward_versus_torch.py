"""The backward against torch's CPU backward, side by side in one process (interleaved, best of N).

    python bench/backward_versus_torch.py [--repeats 5] [--quick]

For each shape (float32, the same threads for both libraries): cpuflash's forward
(`attention(..., return_lse=True)`), its backward (`attention_backward`), and torch's
`scaled_dot_product_attention` forward alone and forward + `.backward()`. Prints the backward's
time against its own forward's, and forward + backward against torch's. Both libraries' gradients
are checked against each other before anything is timed.
"""

import argparse
import time

import numpy as np
import torch

import cpuflash

import runner  # bench/runner.py

# (B, Hq, Hk, N, D, causal): the shapes of the backward's targets, SmolLM2-135M's heads
# (GQA 9/3: fewer kv heads than a many-core machine has threads), and an MQA group
CASES = [(1, 8, 8, 4096, 128, False), (1, 8, 8, 4096, 128, True), (1, 32, 8, 2048, 128, True),
         (4, 8, 8, 512, 64, False), (1, 9, 3, 2048, 64, True), (1, 32, 1, 2048, 128, True)]
QUICK = [(1, 8, 8, 1024, 128, False), (1, 8, 8, 1024, 128, True)]


def calls(batch, hq, hk, n, d, causal, rng):
    """The four timed calls of one shape, and a check that both gradients agree."""
    q = rng.standard_normal((batch, hq, n, d), dtype=np.float32)
    k, v = (rng.standard_normal((batch, hk, n, d), dtype=np.float32) for _ in range(2))
    dout = rng.standard_normal((batch, hq, n, d), dtype=np.float32)
    out, lse = cpuflash.attention(q, k, v, causal=causal, return_lse=True)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    tdout = torch.from_numpy(dout)
    gqa = hq != hk

    def torch_forward():
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(
                tq, tk, tv, is_causal=causal, enable_gqa=gqa)

    def torch_both():
        for t in (tq, tk, tv):
            t.grad = None
        torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, is_causal=causal, enable_gqa=gqa).backward(tdout)
        return tq.grad, tk.grad, tv.grad

    def backward():
        return cpuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)

    ours, theirs = backward(), torch_both()
    for name, a, b in zip(("dq", "dk", "dv"), ours, theirs):
        scale = float(np.abs(b.numpy()).max())
        error = float(np.abs(a - b.numpy()).max())
        if error > 1e-3 * scale:
            raise SystemExit(f"{name} differs from torch's: {error:.3g} (largest {scale:.3g})")
    return {"cpuflash forward": lambda: cpuflash.attention(q, k, v, causal=causal,
                                                           return_lse=True),
            "cpuflash backward": backward,
            "torch forward": torch_forward,
            "torch forward+backward": torch_both}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="two small shapes")
    args = parser.parse_args(argv)
    threads = runner.match_torch_threads()
    print(f"float32, {threads} threads, best of {args.repeats} interleaved rounds")
    print("| case | cpuflash bwd / fwd | torch bwd / fwd | fwd+bwd: torch / cpuflash "
          "| forward: torch / cpuflash |")
    print("| --- | --- | --- | --- | --- |")
    rng = np.random.default_rng(0)
    for batch, hq, hk, n, d, causal in QUICK if args.quick else CASES:
        timed = calls(batch, hq, hk, n, d, causal, rng)
        best = {name: float("inf") for name in timed}
        for _ in range(args.repeats):
            for name, call in timed.items():
                runner.settle(call, cheap=False)  # the other library's threads stop spinning
                start = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - start)
        ours = best["cpuflash forward"] + best["cpuflash backward"]
        torch_backward = best["torch forward+backward"] - best["torch forward"]
        heads = f"{hq}/{hk}" if hq != hk else f"{hq}"
        label = f"B{batch} H{heads} N{n} D{d}{' causal' if causal else ''}"
        print(f"| {label} | {best['cpuflash backward'] / best['cpuflash forward']:.2f} "
              f"| {torch_backward / best['torch forward']:.2f} "
              f"| {best['torch forward+backward'] / ours:.2f}x "
              f"| {best['torch forward'] / best['cpuflash forward']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
