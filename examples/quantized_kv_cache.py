"""Generation with an 8-bit KV cache in transformers: `cpuflash.transformers.QuantizedKVCache`.

The model runs on cpuflash's attention ("cpufa"); its keys and values are stored as int8 (or
float8_e4m3) rows with one float32 scale per (token, head), and every decoding step's attention
reads the 8-bit rows in place. The same prompt is then generated with transformers' float cache:
the script prints both continuations, how many tokens agree, and the bytes each cache holds.

    python examples/quantized_kv_cache.py --model HuggingFaceTB/SmolLM2-135M-Instruct
    python examples/quantized_kv_cache.py --dtype float8_e4m3 --model <path or hub name>
    python examples/quantized_kv_cache.py --small   # a small random model, used by the tests
"""

import argparse
import inspect
import time

import torch
import transformers

import cpuflash.transformers


def load(name, small):
    """(model, tokenizer or None): a checkpoint, or a small random Llama for `--small`."""
    if small:
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                          num_hidden_layers=2, num_attention_heads=8,
                                          num_key_value_heads=2, head_dim=16)
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config).eval(), None
    tokenizer = transformers.AutoTokenizer.from_pretrained(name)
    return transformers.AutoModelForCausalLM.from_pretrained(name).eval(), tokenizer


def generate(model, ids, cache, tokens):
    # transformers 5.x names the cache argument `cache` (`past_key_values` before)
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    extra = {} if cache is None else {keyword: cache}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, do_sample=False, max_new_tokens=tokens,
                             min_new_tokens=tokens, pad_token_id=0, **extra)
    return out[0, ids.shape[1]:], time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="int8", choices=["int8", "float8_e4m3"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--small", action="store_true", help="a small random model, 8 tokens")
    args = parser.parse_args()

    model, tokenizer = load(args.model, args.small)
    model.set_attn_implementation(cpuflash.transformers.register())
    tokens = 8 if args.small else args.tokens
    if tokenizer is None:
        ids = torch.randint(0, model.config.vocab_size, (1, 24),
                            generator=torch.Generator().manual_seed(1))
    else:
        prompt = "The three most useful things to know about the sea are"
        ids = tokenizer(prompt, return_tensors="pt").input_ids

    cache = cpuflash.transformers.QuantizedKVCache(model.config, args.dtype)
    quantized, seconds_q = generate(model, ids, cache, tokens)
    floats, seconds_f = generate(model, ids, None, tokens)

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    float32_bytes = (2 * 4 * config.num_hidden_layers * config.num_key_value_heads
                     * cache.get_seq_length() * head_dim)
    show = tokenizer.decode if tokenizer is not None else (lambda t: t.tolist())
    print(f"{args.dtype} cache: {show(quantized)!r}  ({seconds_q:.2f} s)")
    print(f"float cache: {show(floats)!r}  ({seconds_f:.2f} s)")
    agree = int((quantized == floats).sum())
    print(f"{agree} of {tokens} generated tokens agree; the {args.dtype} cache holds "
          f"{cache.nbytes / 1e6:.2f} MB, {cache.nbytes / float32_bytes:.2f}x a float32 cache "
          f"of {cache.get_seq_length()} tokens")


if __name__ == "__main__":
    main()
