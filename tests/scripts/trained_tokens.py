"""Next-token training in the three shapes its batches take, each printing how many tokens a step
trains on (the positions its loss counts), to compare with TraceML's tokens per step:
  hf        a Hugging Face causal LM given labels=input_ids, which it shifts inside; with
            --padded, rows padded at the end, their labels -100 and an attention_mask
  xy        nanoGPT's x, y = chunk[:, :-1], chunk[:, 1:]; model(x, y): two views of one chunk
  chunk     a decoder given the whole (batch, length + 1) chunk, slicing it inside and
            returning (logits, loss)
It never imports traceml (zero-code mode).

    python trained_tokens.py --shape hf|xy|chunk [--padded] [--steps 12]
"""
import argparse

import torch
from torch import nn
from torch.nn import functional as F

BATCH, LENGTH, VOCAB, WIDTH = 4, 32, 64, 32


class Decoder(nn.Module):
    """A one-layer next-token model: forward(idx, targets) or forward(chunk)."""

    def __init__(self, slices=False):
        super().__init__()
        self.slices = slices
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx, targets=None):
        if self.slices:  # the whole chunk: the inputs and their next tokens
            idx, targets = idx[:, :-1], idx[:, 1:]
        logits = self.head(self.mix(self.embed(idx))[0])
        return logits, F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def hugging_face_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=WIDTH, n_layer=1, n_head=2)
    return GPT2LMHeadModel(config)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=("hf", "xy", "chunk"), required=True)
    parser.add_argument("--padded", action="store_true", help="hf: rows padded at the end")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = hugging_face_model() if args.shape == "hf" else Decoder(slices=args.shape == "chunk")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stream = torch.randint(0, VOCAB, (args.steps, BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(1))
    # Row r keeps 12 + 5r tokens; the rest is padding, left out of the loss (-100).
    lengths = torch.tensor([12 + 5 * row for row in range(BATCH)])
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    trained = []
    for step in range(args.steps):
        chunk = stream[step]
        if args.shape == "hf":
            input_ids = chunk[:, :LENGTH]
            if args.padded:
                labels = input_ids.masked_fill(mask == 0, -100)
                loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            else:
                loss = model(input_ids=input_ids, labels=input_ids).loss
                labels = input_ids
            trained.append(int((labels[:, 1:] != -100).sum()))  # the model shifts: position 0 predicts nothing
        elif args.shape == "xy":
            x, y = chunk[:, :-1], chunk[:, 1:]
            _, loss = model(x, y)
            trained.append(y.numel())
        else:
            _, loss = model(chunk)
            trained.append(chunk[:, 1:].numel())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    print(f"trained tokens a step {sorted(set(trained))}")
    print(f"updates {args.steps}")


if __name__ == "__main__":
    main()
