"""Code written for flash-attn, run on the CPU by changing its import to cpuflash.flash_attn.

The attention layer below is written as flash-attn users write it: ``flash_attn_func`` with
``causal=True`` for training, ``flash_attn_with_kvcache`` for decoding (the rotary embedding and
the cache write done by the call). The only change for the CPU is the import, made here the way
code that must run on both does it (use flash-attn where it is installed, cpuflash otherwise).
A library you cannot edit can be pointed at cpuflash before it is imported::

    import sys, cpuflash.flash_attn
    sys.modules["flash_attn"] = cpuflash.flash_attn

The script checks itself against the same layer computed with torch's SDPA: the training
output and every gradient, and each decoded step against the full forward over the sequence.
Exits 0 with a message without torch.

    python examples/flash_attn_swap.py
    python examples/flash_attn_swap.py --small   # used by the tests
"""

import argparse
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("torch is not installed: nothing to show (pip install torch)")
    raise SystemExit(0)

try:  # a GPU with flash-attn installed
    from flash_attn import flash_attn_func, flash_attn_with_kvcache
except ImportError:  # the CPU: the same functions from cpuflash
    from cpuflash.flash_attn import flash_attn_func, flash_attn_with_kvcache


def rotary(x, cos, sin, start=0):
    """GPT-NeoX rotary embedding of x (B, N, H, D) at positions start, start + 1, ..."""
    c, s = cos[start:start + x.shape[1], None], sin[start:start + x.shape[1], None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


class Attention(torch.nn.Module):
    """Causal grouped-query self-attention with rotary embeddings, written for flash-attn."""

    def __init__(self, dim, heads, kv_heads, max_len):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wqkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        angles = torch.outer(torch.arange(max_len).double(),
                             10000.0 ** (-torch.arange(0, self.head_dim, 2).double()
                                         / self.head_dim))
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def qkv(self, x):
        q, k, v = self.wqkv(x).split([self.heads * self.head_dim,
                                      self.kv_heads * self.head_dim,
                                      self.kv_heads * self.head_dim], dim=-1)
        b, n, _ = x.shape
        return (q.view(b, n, self.heads, -1), k.view(b, n, self.kv_heads, -1),
                v.view(b, n, self.kv_heads, -1))

    def forward(self, x, use_sdpa=False):
        q, k, v = self.qkv(x)
        q, k = rotary(q, self.cos, self.sin), rotary(k, self.cos, self.sin)
        if use_sdpa:  # the reference: torch's SDPA in (B, H, N, D)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=True,
                                                 enable_gqa=True).transpose(1, 2)
        else:
            out = flash_attn_func(q, k, v, causal=True)
        return self.wo(out.flatten(2))

    def decode_step(self, x, k_cache, v_cache, cache_seqlens):
        q, k, v = self.qkv(x)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=self.cos,
                                      rotary_sin=self.sin, cache_seqlens=cache_seqlens,
                                      causal=True, rotary_interleaved=False)
        return self.wo(out.flatten(2))


def check_training(layer, x):
    """flash_attn_func's output and gradients against SDPA's."""
    results = []
    for use_sdpa in (False, True):
        layer.zero_grad()
        leaf = x.detach().clone().requires_grad_()
        out = layer(leaf, use_sdpa=use_sdpa)
        out.square().mean().backward()
        results.append([out.detach(), leaf.grad] + [p.grad.clone() for p in layer.parameters()])
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*results))
    print(f"training: output and {len(results[0]) - 1} gradients vs SDPA, "
          f"max relative difference {worst:.1e}")
    return worst < 1e-4


@torch.no_grad()
def check_decoding(layer, x, n_prompt):
    """A prompt in one flash_attn_with_kvcache call, then one token a step, against SDPA over
    the whole sequence (each position sees the same keys either way)."""
    batch, n, _ = x.shape
    k_cache = torch.zeros(batch, n, layer.kv_heads, layer.head_dim)
    v_cache = torch.zeros_like(k_cache)
    cache_seqlens = torch.zeros(batch, dtype=torch.int32)
    start = time.perf_counter()
    outs = [layer.decode_step(x[:, :n_prompt], k_cache, v_cache, cache_seqlens)]
    cache_seqlens += n_prompt
    for i in range(n_prompt, n):
        outs.append(layer.decode_step(x[:, i:i + 1], k_cache, v_cache, cache_seqlens))
        cache_seqlens += 1
    seconds = time.perf_counter() - start
    full = layer(x, use_sdpa=True)
    worst = float((torch.cat(outs, dim=1) - full).abs().max() / full.abs().max())
    print(f"decoding: prompt of {n_prompt} + {n - n_prompt} steps with the KV cache in "
          f"{seconds * 1e3:.0f} ms, max relative difference vs SDPA {worst:.1e}")
    return worst < 1e-4


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes (for CI)")
    args = parser.parse_args(argv)
    batch, n, dim = (2, 48, 128) if args.small else (4, 512, 512)
    torch.manual_seed(0)
    layer = Attention(dim, heads=8, kv_heads=2, max_len=n)
    x = torch.randn(batch, n, dim)
    print(f"flash_attn_func from {flash_attn_func.__module__}")
    ok = check_training(layer, x)
    ok &= check_decoding(layer, x, n_prompt=n // 2)
    if not ok:
        raise SystemExit("FAILED")
    print("OK")


if __name__ == "__main__":
    main()
