"""DeepSeek's MLA decoding in absorbed form on cpuflash, checked against transformers' own layer.

A small random DeepSeek V3 attention layer (transformers' `DeepseekV3Attention`, float32, eager
attention) prefills a prompt the normal way. What MLA caches per token is one latent row shared
by every head: `c_kv` (kv_lora_rank columns, after its RMSNorm) and the roped `k_pe`
(qk_rope_head_dim), 128 + 16 = 144 columns here, 512 + 64 = 576 in DeepSeek V3. The next token is
then decoded without expanding that cache into per-head keys and values:

* each head's q_nope is absorbed through its W_UK (the key half of `kv_b_proj`) and put next to
  its roped q_pe, so its scores against the latent rows are the layer's scores;
* `cpuflash.attention_with_kvcache(q, latent_cache, None, k=new_row, value_dim=kv_lora_rank)`
  attends all heads to the one latent "kv head", whose first kv_lora_rank columns are the values;
* each head's W_UV (the value half of `kv_b_proj`) and `o_proj` finish the layer.

The result must match the layer's own decoding step (which expands K and V for every cached
token). The same step over 16 keys chosen by a top-k indexer (`key_indices`, DeepSeek V3.2's
sparse attention) must match a dense softmax that masks every other key. Last, the absorbed step
at DeepSeek V3's size (128 heads, 4096 rows of 512 + 64) is timed against torch's three lines;
those timings are printed, not checked. Runs offline: the weights are random.

    python examples/deepseek_mla_decode.py           # the timing best of 20
    python examples/deepseek_mla_decode.py --small   # best of 3, used by the tests
"""

import argparse
import time

import numba
import numpy as np
import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3

import cpuflash

PROMPT, TOPK = 50, 16
CONFIG = dict(hidden_size=256, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=64,
              kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
              num_hidden_layers=1, vocab_size=64, max_position_embeddings=163840,
              # DeepSeek V3's YaRN: its mscale makes the softmax scale differ from
              # 1/sqrt(qk_head_dim), so the example has to pass the layer's own
              rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                                   original_max_position_embeddings=4096, beta_fast=32.0,
                                   beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))


def random_layer():
    """A DeepseekV3Attention with random weights (its RMSNorm gains too) and its rotary."""
    config = transformers.DeepseekV3Config(**CONFIG, attn_implementation="eager")
    torch.manual_seed(0)
    layer = modeling_deepseek_v3.DeepseekV3Attention(config, layer_idx=0).eval()
    for norm in (layer.q_a_layernorm, layer.kv_a_layernorm):
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    return layer, modeling_deepseek_v3.DeepseekV3RotaryEmbedding(config)


def projections(layer, hidden, position_embeddings):
    """What `DeepseekV3Attention.forward` computes before it expands K and V, for `hidden`
    (1, n, hidden_size): q_nope (H, n, nope), the roped q_pe (H, n, rope) and the latent rows
    (n, kv_lora_rank + rope) that its cache keeps."""
    n, heads = hidden.shape[1], layer.num_heads
    if layer.q_lora_rank is None:
        q = layer.q_proj(hidden)
    else:
        q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(hidden)))
    q = q.view(1, n, heads, layer.qk_head_dim).transpose(1, 2)
    q_nope, q_pe = q.split([layer.qk_nope_head_dim, layer.qk_rope_head_dim], dim=-1)
    c_kv, k_pe = layer.kv_a_proj_with_mqa(hidden).split(
        [layer.kv_lora_rank, layer.qk_rope_head_dim], dim=-1)
    c_kv = layer.kv_a_layernorm(c_kv)
    # the layer's rope, interleaved pairs or halves as its config says
    rope = (modeling_deepseek_v3.apply_rotary_pos_emb_interleave if layer.config.rope_interleave
            else modeling_deepseek_v3.apply_rotary_pos_emb)
    q_pe, k_pe = rope(q_pe, k_pe.view(1, 1, n, -1), *position_embeddings)
    return q_nope[0], q_pe[0], torch.cat([c_kv[0], k_pe[0, 0]], dim=-1)


def absorbed_weights(layer):
    """W_UK (H, nope, kv_lora_rank) and W_UV (H, v, kv_lora_rank): `kv_b_proj` maps a latent to
    each head's [k_nope | v], so its weight is (H * (nope + v), kv_lora_rank)."""
    weight = layer.kv_b_proj.weight.view(layer.num_heads, -1, layer.kv_lora_rank)
    return weight[:, :layer.qk_nope_head_dim], weight[:, layer.qk_nope_head_dim:]


def output(layer, w_uv, latent_out):
    """The layer's output (hidden_size,) from the attention's output in latent space (1, H, 1,
    kv_lora_rank): each head's values are W_UV times its weighted sum of latents."""
    per_head = torch.as_tensor(latent_out)[0] @ w_uv.transpose(1, 2)  # (H, 1, v)
    return layer.o_proj(per_head.transpose(0, 1).reshape(1, -1))[0]


def check(what, got, expected, limit=1e-4):
    """Print max |got - expected| / max |expected|; fail at `limit` or above."""
    got, expected = (np.asarray(x, dtype=np.float64) for x in (got, expected))
    err = float(np.abs(got - expected).max() / np.abs(expected).max())
    print(f"  {what}: max abs error {err:.1e} (relative to max |expected|)")
    if not err < limit:
        raise SystemExit(f"FAILED: {what} ({err:.1e} >= {limit:.0e})")
    return err


def best_of(functions, repeats):
    """Best seconds of each function, timed interleaved so that load from elsewhere hits both."""
    best = [float("inf")] * len(functions)
    for _ in range(repeats):
        for i, fn in enumerate(functions):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def time_absorbed_step(repeats, heads=128, rank=512, rope=64, rows=4096):
    """cpuflash's absorbed step against torch's three lines at DeepSeek V3's size."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, heads, 1, rank + rope), dtype=np.float32)
    latent = rng.standard_normal((1, 1, rows, rank + rope), dtype=np.float32)
    scale = (128 + 64) ** -0.5  # DeepSeek V3's qk_head_dim
    tq, tlatent = torch.from_numpy(q)[0, :, 0], torch.from_numpy(latent)[0, 0]

    def ours():
        return cpuflash.attention_with_kvcache(q, latent, None, value_dim=rank, scale=scale)

    def three_lines():
        scores = tq @ tlatent.T * scale
        return torch.softmax(scores, dim=-1) @ tlatent[:, :rank]

    # checked before it is timed (the first calls also compile or load the kernels)
    check(f"{heads} heads over {rows} latent rows, against torch's three lines",
          ours()[0, :, 0], three_lines())
    t_ours, t_torch = best_of([ours, three_lines], repeats)
    print(f"  absorbed step, {heads} heads over {rows} latent rows of {rank} + {rope}, best of "
          f"{repeats}: cpuflash {t_ours * 1e3:.2f} ms ({numba.get_num_threads()} threads), "
          f"torch's three lines {t_torch * 1e3:.2f} ms ({torch.get_num_threads()} threads): "
          f"{t_torch / t_ours:.2f}x")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer timing repeats (for CI)")
    args = parser.parse_args(argv)
    layer, rotary = random_layer()
    heads, rank = layer.num_heads, layer.kv_lora_rank
    hidden = torch.randn(1, PROMPT + 1, layer.hidden_size)
    prompt, token = hidden[:, :PROMPT], hidden[:, PROMPT:]
    print(f"DeepSeek V3 attention layer: {heads} heads, latent {rank} + "
          f"{layer.qk_rope_head_dim}, softmax scale {layer.scaling:.4f} (YaRN's mscale "
          f"included), prompt {PROMPT} tokens")

    with torch.inference_mode():
        # -- prefill the layer's own way: expanded K and V, causal, into transformers' cache
        cache = transformers.DynamicCache()
        causal = torch.full((PROMPT, PROMPT), -torch.inf).triu(1)[None, None]
        layer(prompt, rotary(prompt, torch.arange(PROMPT)[None]), causal, cache=cache)
        # what the layer cached per token: c_kv after its norm (1, 1, n, rank), roped k_pe
        held = cache.layers[0]
        latent_cache = np.zeros((1, 1, PROMPT + 8, held.keys.shape[-1] + held.values.shape[-1]),
                                np.float32)  # (B, one latent "kv head", room, rank + rope)
        latent_cache[0, 0, :PROMPT] = torch.cat([held.keys, held.values], dim=-1)[0, 0]

        # -- the reference: the layer's own decoding step for the next token over its cache
        token_rope = rotary(token, torch.tensor([[PROMPT]]))
        expected = layer(token, token_rope, None, cache=cache)[0][0, 0]

        # -- the absorbed step: q = [q_nope W_UK | q_pe] against the latent rows
        q_nope, q_pe, new_row = projections(layer, token, token_rope)
        w_uk, w_uv = absorbed_weights(layer)
        q = torch.cat([q_nope @ w_uk, q_pe], dim=-1)[None].numpy()  # (1, H, 1, rank + rope)
        filled = np.array([PROMPT], np.int32)  # rows in the cache; the caller advances it
        latent_out = cpuflash.attention_with_kvcache(
            q, latent_cache, None, k=new_row[None, None].numpy(), cache_seqlens=filled,
            value_dim=rank, scale=layer.scaling)
        print("absorbed decoding step (cpuflash over the latent cache):")
        check("the token's latent row written into the cache, against the layer's cache",
              latent_cache[0, 0, PROMPT], torch.cat([held.keys, held.values], dim=-1)[0, 0, -1])
        check("the layer's output, against its own step (K and V expanded)",
              output(layer, w_uv, latent_out), expected)

        # -- the same step over the TOPK keys an indexer picks (DeepSeek V3.2): here the keys
        # with the highest absorbed scores summed over the heads, in position order; -1 fills
        # the slots of a cache with fewer rows than TOPK
        keys = latent_cache[0, 0, :PROMPT + 1]
        scores = q[0, :, 0].astype(np.float64) @ keys.T * layer.scaling  # (H, rows)
        top = np.sort(np.argsort(-scores.sum(axis=0))[:TOPK])
        key_indices = np.full((1, 1, TOPK), -1, np.int32)  # (B, Nq, topk)
        key_indices[0, 0, :len(top)] = top
        # (the same new row again at the same position: rewriting it changes nothing)
        sparse_out = cpuflash.attention_with_kvcache(
            q, latent_cache, None, k=new_row[None, None].numpy(), cache_seqlens=filled,
            value_dim=rank, scale=layer.scaling, key_indices=key_indices)
        # the dense reference, float64: a softmax over every row with the others masked
        masked = np.full_like(scores, -np.inf, dtype=np.float64)
        masked[:, top] = scores[:, top]
        weights = np.exp(masked - masked.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        reference = (weights @ keys[:, :rank].astype(np.float64))[None, :, None]
        print(f"top-{TOPK} of {PROMPT + 1} keys (key_indices):")
        check("the latent output, against a dense softmax masking the other keys",
              sparse_out, reference)
        # random weights spread the softmax: the keys left out still carry weight, so the
        # sparse output is not the dense one (a trained model's indexer loses little)
        dense = np.exp(scores - scores.max(axis=1, keepdims=True))
        mass = (dense[:, top].sum(axis=1) / dense.sum(axis=1)).mean()
        print(f"  (these {TOPK} keys hold {100 * mass:.0f}% of the dense softmax's weight, "
              f"averaged over the heads)")

        print("timing (informational):")
        time_absorbed_step(3 if args.small else 20)
    print("OK")


if __name__ == "__main__":
    main()
