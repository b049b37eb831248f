"""A word-level LSTM language model trained the classic way: a corpus batchified into columns,
truncated backpropagation through time (the hidden state detached between chunks),
clip_grad_norm_, parameters updated by hand (no torch.optim unless --use-optimizer), the
whole model saved with torch.save(model) when validation improves and loaded back for the
test under torch.serialization.safe_globals.

    python lstm_bptt.py --out DIR [--epochs 2] [--use-optimizer] [--tied]
"""
import argparse
import math
import os
import time

import torch
from torch import nn


class RNNModel(nn.Module):
    def __init__(self, vocab, width, layers, dropout=0.2, tied=False):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, layers, dropout=dropout)
        self.decoder = nn.Linear(width, vocab)
        if tied:
            self.decoder.weight = self.encoder.weight
        self.vocab, self.width, self.layers = vocab, width, layers
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens, hidden):
        embedded = self.drop(self.encoder(tokens))
        output, hidden = self.rnn(embedded, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.vocab)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, batch):
        weight = next(self.parameters())
        return (weight.new_zeros(self.layers, batch, self.width),
                weight.new_zeros(self.layers, batch, self.width))


def batchify(data, columns):
    rows = data.size(0) // columns
    return data[:rows * columns].view(columns, -1).t().contiguous()


def repackage_hidden(hidden):
    """Cut the graph at the chunk boundary: truncated BPTT."""
    if isinstance(hidden, torch.Tensor):
        return hidden.detach()
    return tuple(repackage_hidden(h) for h in hidden)


def get_chunk(source, i, bptt):
    length = min(bptt, len(source) - 1 - i)
    return source[i:i + length], source[i + 1:i + 1 + length].reshape(-1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--bptt", type=int, default=12)
    parser.add_argument("--lr", type=float, default=5.0)
    parser.add_argument("--clip", type=float, default=0.25)
    parser.add_argument("--use-optimizer", action="store_true")
    parser.add_argument("--tied", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(1111)

    vocab = 200
    corpus = torch.randint(0, vocab, (6000,), generator=torch.Generator().manual_seed(7))
    train_data = batchify(corpus[:4800], 10)
    val_data = batchify(corpus[4800:5400], 5)
    test_data = batchify(corpus[5400:], 5)

    model = RNNModel(vocab, 32, 2, tied=args.tied)
    criterion = nn.NLLLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr) if args.use_optimizer else None
    updates = 0

    def evaluate(source):
        model.eval()
        total = 0.0
        hidden = model.init_hidden(source.size(1))
        with torch.no_grad():
            for i in range(0, source.size(0) - 1, args.bptt):
                data, targets = get_chunk(source, i, args.bptt)
                output, hidden = model(data, hidden)
                hidden = repackage_hidden(hidden)
                total += len(data) * criterion(output, targets).item()
        return total / (len(source) - 1)

    def train():
        nonlocal updates
        model.train()
        total_loss, started = 0.0, time.time()
        hidden = model.init_hidden(train_data.size(1))
        for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
            data, targets = get_chunk(train_data, i, args.bptt)
            model.zero_grad()
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            if optimizer is not None:
                optimizer.step()
            else:
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-args.lr)
            updates += 1
            total_loss += loss.item()
            if batch % 10 == 9:
                elapsed_ms = (time.time() - started) * 1000 / 10
                print(f"| batch {batch + 1:3d} | ms/batch {elapsed_ms:5.2f} | loss {total_loss / 10:5.2f} "
                      f"| ppl {math.exp(total_loss / 10):8.2f}")
                total_loss, started = 0.0, time.time()

    best = None
    path = os.path.join(args.out, "model.pt")
    for epoch in range(1, args.epochs + 1):
        train()
        val_loss = evaluate(val_data)
        print(f"| end of epoch {epoch} | valid loss {val_loss:5.2f} | valid ppl {math.exp(val_loss):8.2f}")
        if best is None or val_loss < best:
            with open(path, "wb") as f:
                torch.save(model, f)
            best = val_loss
        else:
            args.lr /= 4.0

    with open(path, "rb") as f:
        with torch.serialization.safe_globals([RNNModel, nn.Dropout, nn.Embedding, nn.LSTM, nn.Linear]):
            model = torch.load(f)
        model.rnn.flatten_parameters()
    test_loss = evaluate(test_data)
    print(f"| end of training | test loss {test_loss:5.2f} | test ppl {math.exp(test_loss):8.2f}")
    print(f"updates {updates}")


if __name__ == "__main__":
    main()
