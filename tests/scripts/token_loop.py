"""A tiny token model fed padded batches (input_ids and attention_mask), traced with trace_step."""
import argparse

import torch
from torch import nn

import traceml

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
args = parser.parse_args()

BATCH, LENGTH, VOCAB = 8, 32, 100


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids, attention_mask):
        hidden = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        return self.head(hidden)


model = TinyLM()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
# Row r of every batch keeps 8 + (3r mod 24) tokens: the rest is padding.
lengths = torch.tensor([8 + (3 * row) % 24 for row in range(BATCH)])
mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
for step in range(args.steps):
    with traceml.trace_step(model):
        input_ids = torch.randint(0, VOCAB, (BATCH, LENGTH)) * mask
        logits = model(input_ids=input_ids, attention_mask=mask)
        loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), input_ids.view(-1), reduction="none")
        loss = (loss * mask.view(-1)).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
print("real tokens a step", int(mask.sum()), "of", BATCH * LENGTH)
