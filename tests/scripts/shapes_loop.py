"""A loop in several of the shapes real loops take, for comparing the compiled timers with the
Python ones: a DataLoader with a short last batch and epochs (its StopIteration), an
evaluation under no_grad between steps, a step that raises inside forward, a closure-taking
optimizer, kwargs-only model calls, a manual SGD phase. Prints each step's counts as JSON."""
import json
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traceml
from traceml.probe import step as probe_step


class KeywordNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, features=None):
        return self.body(features)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(TensorDataset(torch.randn(21, 8), torch.randint(0, 2, (21,))), batch_size=4)

for epoch in range(2):  # 6 batches an epoch, the last of 1 sample
    for inputs, targets in loader:
        with traceml.trace_step(model):
            loss = nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():  # evaluation between steps
        for inputs, _ in loader:
            model(inputs)

try:  # a step whose forward raises: not a step
    with traceml.trace_step(model):
        model(torch.randn(3, 5))
except RuntimeError:
    pass

lbfgs = torch.optim.LBFGS(model.parameters(), max_iter=2)
inputs, targets = torch.randn(5, 8), torch.randint(0, 2, (5,))
for _ in range(2):
    with traceml.trace_step(model):
        def closure():
            lbfgs.zero_grad()
            closure_loss = nn.functional.cross_entropy(model(inputs), targets)
            closure_loss.backward()
            return closure_loss
        lbfgs.step(closure)

keyword_model = KeywordNet()
keyword_optimizer = torch.optim.Adam(keyword_model.parameters())
for _ in range(3):
    with traceml.trace_step(keyword_model):
        loss = keyword_model(features=torch.randn(7, 8)).sum()
        keyword_optimizer.zero_grad()
        loss.backward()
        keyword_optimizer.step()

for _ in range(3):  # manual SGD: no optimizer
    with traceml.trace_step(model):
        loss = model(torch.randn(6, 8)).sum()
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= 0.01 * parameter.grad

probe = probe_step._probe
probe.finish()
steps = [record for record in probe.sender.local_steps()]
print(json.dumps({
    "compiled": probe_step.fast_path is not None,
    "steps": [[r.step, r.samples, r.forward_calls, r.forward_ms > 0, r.backward_ms > 0, r.optimizer_ms > 0,
               r.input_wait_ms > 0] for r in steps],
    "eval_between_steps": sum(1 for r in steps if r.outside_ms > 0),
    "sums_ok": all(abs(r.input_wait_ms + r.outside_ms + r.h2d_ms + r.forward_ms + r.backward_ms + r.optimizer_ms
                       + r.untraced_ms - r.step_ms) < 0.05 for r in steps),
}))
sys.stdout.flush()
