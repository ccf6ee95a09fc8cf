"""A tiny causal language model written for flash-attn, the way models using it are written.

Nothing here knows about cpuflash: test_flash_attn.py imports this module with
``sys.modules["flash_attn"]`` pointing at `cpuflash.flash_attn`, trains a step and decodes with
the KV cache, and compares with the same weights run through torch's SDPA (``use_flash=False``,
the fallback such models keep for machines without flash-attn).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from flash_attn import flash_attn_func, flash_attn_with_kvcache


def rotary_tables(max_len, head_dim, base=10000.0, dtype=torch.float32):
    """cos and sin, (max_len, head_dim / 2), as flash-attn's RotaryEmbedding builds them."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x, cos, sin):
    """GPT-NeoX rotary (non-interleaved) on x (B, N, H, D) at positions 0..N-1."""
    c, s = cos[:x.shape[1], None, :], sin[:x.shape[1], None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, use_flash=True):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.use_flash = use_flash

    def project(self, x):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.n_heads, self.head_dim)
        k, v = self.wkv(x).view(b, n, 2, self.n_kv_heads, self.head_dim).unbind(2)
        return q, k, v

    def forward(self, x, cos, sin):
        q, k, v = self.project(x)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.use_flash:
            out = flash_attn_func(q, k, v, causal=True)
        else:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=True,
                                                 enable_gqa=True).transpose(1, 2)
        return self.wo(out.reshape(x.shape))

    def step(self, x, k_cache, v_cache, cache_seqlens, cos, sin):
        """Tokens x (B, n, dim) at positions cache_seqlens..: rotary, cache write and attention
        in one flash-attn call."""
        q, k, v = self.project(x)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                      cache_seqlens=cache_seqlens, causal=True,
                                      rotary_interleaved=False)
        return self.wo(out.reshape(x.shape))


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, use_flash=True):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads, n_kv_heads, use_flash)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))

    def step(self, x, cache, cache_seqlens, cos, sin):
        x = x + self.attn.step(self.norm1(x), *cache, cache_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, dim=64, n_heads=4, n_kv_heads=2, n_layers=2, max_len=64,
                 use_flash=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, n_kv_heads, use_flash)
                                    for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        cos, sin = rotary_tables(max_len, dim // n_heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos.to(x.dtype), self.sin.to(x.dtype))
        return self.head(x)

    @torch.no_grad()
    def generate(self, prompt, n_new):
        """Greedy decoding with a KV cache per layer: the prompt in one call, then a token a
        step. Returns the tokens and the logits each step produced."""
        batch, n_prompt = prompt.shape
        attn = self.blocks[0].attn
        dtype = self.head.weight.dtype
        caches = [tuple(torch.zeros(batch, n_prompt + n_new, attn.n_kv_heads, attn.head_dim,
                                    dtype=dtype) for _ in range(2)) for _ in self.blocks]
        cache_seqlens = torch.zeros(batch, dtype=torch.int32)
        tokens, logits = prompt, []
        step_in = prompt
        for _ in range(n_new):
            x = self.embed(step_in)
            for block, cache in zip(self.blocks, caches):
                x = block.step(x, cache, cache_seqlens, self.cos.to(dtype), self.sin.to(dtype))
            step_logits = self.head(x)
            logits.append(step_logits)
            cache_seqlens += step_in.shape[1]
            step_in = step_logits[:, -1:].argmax(-1)
            tokens = torch.cat((tokens, step_in), dim=1)
        return tokens, torch.cat(logits, dim=1)
