"""Train a tiny character-level causal transformer in torch with cpuflash attention.

The same model is trained twice from the same seed on the same batches, a step of each in turn:
once with ``cpuflash.torch.scaled_dot_product_attention`` and once with torch's own
``torch.nn.functional.scaled_dot_product_attention``. Exact attention in both, so the two loss
curves must agree (within float32 rounding, which grows slowly over the steps); the script checks
that and prints steps per second for both (warm steps only: the first steps, which compile
kernels, are not timed). Exits 0 with a message without torch.

    python examples/train_tiny_transformer.py            # a few hundred steps
    python examples/train_tiny_transformer.py --small    # used by the tests
"""

import argparse
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None

TEXT = """\
It is a truth universally acknowledged, that a single man in possession of a good fortune,
must be in want of a wife. However little known the feelings or views of such a man may be on
his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding
families, that he is considered the rightful property of some one or other of their daughters.
"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is let
at last?" Mr. Bennet replied that he had not. "But it is," returned she; "for Mrs. Long has just
been here, and she told me all about it." Mr. Bennet made no answer. "Do you not want to know
who has taken it?" cried his wife impatiently. "You want to tell me, and I have no objection to
hearing it." This was invitation enough.
"""

WARMUP = 3  # steps left out of the timing (kernel compilation, allocator warm-up)


def build_model(vocab, dim, heads, layers, context):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
            self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                           torch.nn.Linear(4 * dim, dim))

        def forward(self, x, sdpa):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, heads, dim // heads).unbind(2)
            y = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, n, dim))
            return x + self.mlp(self.norm2(x))

    class TinyTransformer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            self.position = torch.nn.Parameter(0.02 * torch.randn(context, dim))
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
            self.norm, self.head = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab)

        def forward(self, tokens, sdpa):
            x = self.embed(tokens) + self.position[:tokens.shape[1]]
            for block in self.blocks:
                x = block(x, sdpa)
            return self.head(self.norm(x))

    return TinyTransformer()


def training(sdpa, data, vocab, args, batches):
    """One step at a time (a generator): each step's loss and seconds for one attention
    implementation."""
    torch.manual_seed(0)  # the same initial weights for both runs
    model = build_model(vocab, args.dim, args.heads, args.layers, args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for starts in batches:
        start_time = time.perf_counter()
        x = torch.stack([data[s:s + args.context] for s in starts])
        y = torch.stack([data[s + 1:s + args.context + 1] for s in starts])
        loss = F.cross_entropy(model(x, sdpa).reshape(-1, vocab), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        yield loss.item(), time.perf_counter() - start_time


def train_side_by_side(implementations, data, vocab, args, batches):
    """Train one model per implementation, a step of each in turn (so that a busy moment of a
    shared machine slows both alike); per implementation, the losses and warm steps/s."""
    runs = [training(sdpa, data, vocab, args, batches) for sdpa in implementations]
    losses, seconds = [[] for _ in runs], [0.0 for _ in runs]
    for step in range(len(batches)):
        for i, run in enumerate(runs):
            loss, took = next(run)
            losses[i].append(loss)
            if step >= WARMUP:
                seconds[i] += took
    return [(lost, (len(batches) - WARMUP) / spent) for lost, spent in zip(losses, seconds)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="few steps, tiny model (for CI)")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    if torch is None:
        print("torch is not installed: nothing to show (pip install torch)")
        return
    import cpuflash.torch

    args.steps = args.steps or (30 if args.small else 300)
    args.dim, args.heads, args.layers, args.context, args.batch = (
        (32, 2, 1, 32, 8) if args.small else (64, 4, 2, 64, 16))
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT])
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(len(data) - args.context - 1, (args.batch,), generator=generator)
               for _ in range(args.steps)]

    print(f"{args.steps} steps, batch {args.batch} x {args.context} characters, "
          f"{args.layers} layers of {args.heads} heads x {args.dim // args.heads}")
    (ours, ours_speed), (theirs, theirs_speed) = train_side_by_side(
        [cpuflash.torch.scaled_dot_product_attention, F.scaled_dot_product_attention], data,
        len(chars), args, batches)

    print(f"{'step':>6} {'cpuflash':>10} {'torch SDPA':>11} {'difference':>11}")
    every = max(1, args.steps // 10)
    for step in list(range(0, args.steps, every)) + [args.steps - 1]:
        print(f"{step:>6} {ours[step]:>10.4f} {theirs[step]:>11.4f} "
              f"{ours[step] - theirs[step]:>+11.2e}")
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    print(f"largest loss difference over all steps: {worst:.2e}")
    print(f"steps/s (warm): cpuflash {ours_speed:.1f}, torch SDPA {theirs_speed:.1f}")
    learned = ours[-1] < 0.8 * ours[0]
    # float32 rounding differs between the two attention kernels and grows along the steps
    ok = worst <= 1e-2 * max(1.0, theirs[0]) and learned
    print(f"loss fell from {ours[0]:.3f} to {ours[-1]:.3f}: {'yes' if learned else 'NO'}")
    if not ok:
        raise SystemExit("FAILED")
    print("OK")


if __name__ == "__main__":
    main()
