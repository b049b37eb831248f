"""TraceML's object API: a dashboard, named spans and logged scalars, without trace_step.

    python examples/seed_api.py      # then open the dashboard URL it prints

Each optimizer.step() ends a step; the spans show in the dashboard's timeline and breakdown.
"""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traceml

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

torch.manual_seed(0)
features = torch.randn(2048, 64)
labels = (features[:, :8].sum(dim=1) > 0).long()
loader = DataLoader(TensorDataset(features, labels), batch_size=32, shuffle=True)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 2)).to(device)
loss_fn = nn.CrossEntropyLoss()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

tracer = traceml.Trace(port=8080, profile_memory=True)
with tracer.trace("training_loop"):
    for epoch in range(args.epochs):
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            with tracer.span("forward_pass"):
                loss = loss_fn(model(inputs), targets)
            with tracer.span("backward_pass"):
                optimizer.zero_grad()
                loss.backward()
            optimizer.step()
            tracer.log_scalar("train_loss", loss)
    print(f"final loss {loss.item():.4f}")
