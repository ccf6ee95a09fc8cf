"""Token generation with a KV cache: a toy transformer (random weights) on cpuflash.

The prompt goes through `attention_with_kvcache` in one chunk (chunked prefill), then every new
token is one query row against the cache (decoding, split over the cores). At the end the whole
sequence is run again without a cache through the dense reference, and every generated token's
logits must agree.

    python examples/kv_cache_decode.py           # 4 layers, 16 heads (4 KV heads), D=64
    python examples/kv_cache_decode.py --small   # a few seconds, used by the tests
"""

import argparse
import os
import time

# The toy model's matmuls are tiny. OpenBLAS's threads would spin-wait after each one and take the
# cores from cpuflash's threads (13x slower generation measured here): see the README's FAQ.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import cpuflash  # noqa: E402
from cpuflash.reference import attention_reference  # noqa: E402


class ToyTransformer:
    """Pre-norm decoder layers with GQA attention and a ReLU MLP; weights are random."""

    def __init__(self, rng, vocab, layers, heads, kv_heads, head_dim):
        width = heads * head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

        def weight(*shape):
            return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

        self.embed = weight(vocab, width) * np.float32(np.sqrt(vocab))
        self.layers = [dict(wq=weight(width, width), wk=weight(width, kv_heads * head_dim),
                            wv=weight(width, kv_heads * head_dim), wo=weight(width, width),
                            w1=weight(width, 2 * width), w2=weight(2 * width, width))
                       for _ in range(layers)]
        self.unembed = weight(width, vocab)

    def forward(self, tokens, attend):
        """Logits for `tokens` (n,); `attend(layer, q, k, v)` does attention on
        (heads, n, head_dim) arrays and returns (heads, n, head_dim)."""
        x = self.embed[tokens]
        for index, layer in enumerate(self.layers):
            h = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6)
            q, k, v = (self.split(h @ layer[w], n)
                       for w, n in (("wq", self.heads), ("wk", self.kv_heads),
                                    ("wv", self.kv_heads)))
            x = x + self.merge(attend(index, q, k, v)) @ layer["wo"]
            h = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6)
            x = x + np.maximum(h @ layer["w1"], 0) @ layer["w2"]
        return x @ self.unembed

    def split(self, x, heads):  # (n, heads * head_dim) -> (heads, n, head_dim)
        return np.ascontiguousarray(x.reshape(len(x), heads, self.head_dim).transpose(1, 0, 2))

    @staticmethod
    def merge(x):  # (heads, n, head_dim) -> (n, heads * head_dim)
        return x.transpose(1, 0, 2).reshape(x.shape[1], -1)


def generate(model, prompt, new_tokens, n_max):
    """Prefill `prompt` into a fresh KV cache, then decode `new_tokens` greedily.

    Returns the tokens, the logits each decoding step chose from, and the seconds of the
    prefill and of the decoding.
    """
    shape = (len(model.layers), 1, model.kv_heads, n_max, model.head_dim)
    k_cache, v_cache = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    filled = np.zeros(1, np.int32)  # positions already in the cache (the caller advances it)

    def cached(layer, q, k, v):
        return cpuflash.attention_with_kvcache(
            q[None], k_cache[layer], v_cache[layer], k=k[None], v=v[None],
            cache_seqlens=filled)[0]

    tokens = list(prompt)
    start = time.perf_counter()
    logits = model.forward(np.array(tokens), cached)
    filled += len(prompt)
    prefill = time.perf_counter() - start
    step_logits = []
    start = time.perf_counter()
    for _ in range(new_tokens):
        step_logits.append(logits[-1])
        tokens.append(int(np.argmax(logits[-1])))
        logits = model.forward(np.array(tokens[-1:]), cached)
        filled += 1
    decode = time.perf_counter() - start
    return tokens, step_logits, prefill, decode


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes (for CI)")
    args = parser.parse_args(argv)
    layers, heads, kv_heads, head_dim, prompt_len, new_tokens = (
        (2, 4, 2, 32, 40, 8) if args.small else (4, 16, 4, 64, 512, 64))
    rng = np.random.default_rng(0)
    model = ToyTransformer(rng, 256, layers, heads, kv_heads, head_dim)
    prompt = rng.integers(0, 256, prompt_len)
    n_max = prompt_len + new_tokens

    # Warm-up: the first calls compile cpuflash's prefill and decoding kernels (or load them
    # from the on-disk cache) and start the thread pools, which can take longer than the whole
    # generation; timed, it would be reported as speed. So the same prefill and two decoding
    # steps run once first, untimed, on a scratch cache.
    start = time.perf_counter()
    generate(model, prompt, 2, n_max)
    warm_up = time.perf_counter() - start

    tokens, step_logits, prefill, decode = generate(model, prompt, new_tokens, n_max)
    print(f"toy transformer: {layers} layers, {heads} heads ({kv_heads} KV heads), D={head_dim}")
    print(f"  warm-up (first calls: kernels compiled or loaded from the cache) {warm_up:.2f} s")
    print(f"  then: prefill {prompt_len} tokens in {prefill * 1e3:.0f} ms; "
          f"generated {new_tokens} tokens at {new_tokens / decode:.1f} tokens/s")

    # the same sequence without a cache, attention by the dense reference
    dense = model.forward(np.array(tokens[:-1]), lambda layer, q, k, v: attention_reference(
        q, k, v, causal=True, dtype=np.float32))
    expected = dense[prompt_len - 1:]
    err = float(np.abs(np.array(step_logits) - expected).max())
    print(f"  max logit difference vs a dense recomputation: {err:.2e}")
    if not err <= 1e-3 * float(np.abs(expected).max()):
        raise SystemExit("FAILED: cached decoding disagrees with the dense reference")
    print("  OK")


if __name__ == "__main__":
    main()
