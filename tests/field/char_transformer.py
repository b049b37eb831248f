"""A character-level transformer trained on a small text corpus, in the style of many first
language-model scripts: the corpus is encoded once into one tensor of character ids, a Dataset
slices (input, next-character) windows out of it, and a DataLoader with worker processes and
pinned memory shuffles them into batches. Each window is cheap to cut, so the workers have
little to do.

    python char_transformer.py --out DIR [--steps 300] [--workers 2] [--pin-memory]
                               [--batch-size 16] [--augment 0] [--read-ms 0] [--epochs 1] [--threads 1]

--augment N runs N passes of a per-character corruption (a pure-Python loop) over each
window: per-sample work the workers must do. --read-ms M makes each window wait M ms first, as
a read from a slow or remote disk would: work that needs no CPU.
"""
import argparse
import os
import random
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

WORDS = ("the of and to in is was that for on with as by at from his her they which be this "
         "river stone light window garden morning letter winter market silver harbour").split()


def make_corpus(characters, seed=7):
    """Sentences of common words: a stand-in for a downloaded text file."""
    rng = random.Random(seed)
    sentences, length = [], 0
    while length < characters:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + ". "
        sentences.append(sentence)
        length += len(sentence)
    return "".join(sentences)[:characters]


class CharWindows(Dataset):
    def __init__(self, ids, context, augment=0, read_ms=0.0):
        self.ids, self.context, self.augment, self.read_s = ids, context, augment, read_ms / 1000.0

    def __len__(self):
        return len(self.ids) - self.context - 1

    def __getitem__(self, index):
        if self.read_s:
            time.sleep(self.read_s)  # the window's bytes coming from a slow disk
        window = self.ids[index:index + self.context + 1]
        if self.augment:  # swap a few characters for their neighbours, one by one
            chars = window.tolist()
            rng = random.Random(index)
            for _ in range(self.augment):
                for position in range(1, len(chars) - 1):
                    if rng.random() < 0.02:
                        chars[position], chars[position + 1] = chars[position + 1], chars[position]
            window = torch.tensor(chars)
        return window[:-1], window[1:]


class CharTransformer(nn.Module):
    def __init__(self, vocab, context, width=64, depth=2, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, ids):
        x = self.embed(ids) + self.position[:ids.shape[1]]
        x = self.encoder(x, mask=self.causal[:ids.shape[1], :ids.shape[1]], is_causal=True)
        return self.head(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pin-memory", action="store_true")
    parser.add_argument("--persistent-workers", action="store_true")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--augment", type=int, default=0)
    parser.add_argument("--read-ms", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads: one, so that the loader's workers have the other cores")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    text = make_corpus(100_000)
    vocab = sorted(set(text))
    index_of = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index_of[c] for c in text], dtype=torch.long)
    dataset = CharWindows(ids, args.context, args.augment, args.read_ms)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        pin_memory=args.pin_memory, persistent_workers=args.persistent_workers and args.workers > 0,
                        drop_last=True, generator=torch.Generator().manual_seed(0))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = CharTransformer(len(vocab), args.context, width=args.width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    steps_per_epoch = args.steps // args.epochs

    updates, waited_s = 0, 0.0
    for epoch in range(args.epochs):
        batches = iter(loader)
        for _ in range(steps_per_epoch):
            started = time.perf_counter()
            inputs, targets = next(batches)
            waited_s += time.perf_counter() - started
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            updates += 1
            if updates % 100 == 0:
                print(f"epoch {epoch} step {updates} loss {loss.item():.3f}", flush=True)
        del batches
    print(f"data {waited_s * 1e3 / max(updates, 1):.2f} ms/batch")
    torch.save(model.state_dict(), os.path.join(args.out, "char_transformer.pt"))
    print(f"updates {updates}")


if __name__ == "__main__":
    main()
