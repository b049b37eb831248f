"""Inferred steps (the Trace API, no trace_step) in several shapes, for comparing the compiled
timers with the Python ones: gradient accumulation over a DataLoader, spans (nested, and one
left by an exception), scalars of every kind (float, int, bool, a 0-dim tensor, a value too
large for a float, keywords), a GAN's two optimizers taking turns, evaluation between steps,
and a second traced region with a new optimizer. Prints each step's counts as JSON; spans and
scalars go to the run's store."""
import json
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traceml
from traceml.probe import step as probe_step

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
loader = DataLoader(TensorDataset(torch.randn(40, 8), torch.randint(0, 2, (40,))), batch_size=4)
tracer = traceml.Trace()

with tracer.trace("shapes"):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = iter(loader)
    for index in range(5):  # two micro-batches per update
        with tracer.span("update"):
            for _ in range(2):
                inputs, targets = next(batches)
                with tracer.span("compute"):
                    loss = nn.functional.cross_entropy(model(inputs), targets) / 2
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        tracer.log_scalar("loss", loss * 2)  # a 0-dim tensor
        tracer.log_scalar("lr", 0.01)
        tracer.log_scalar("index", index)
        tracer.log_scalar("flag", index % 2 == 0)
        tracer.log_scalar("huge", 10 ** 400)  # no float holds it: not logged, never raised
        tracer.log_scalar(name="keyword", value=float(index))
        try:
            with tracer.span("failing"):
                raise ValueError("the span's block raised")
        except ValueError:
            pass
    with torch.no_grad():  # evaluation between steps
        for inputs, _ in loader:
            model(inputs)

    # A GAN: the discriminator's update, then the generator's, each step.
    generator, discriminator = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 1))
    generator_optimizer = torch.optim.Adam(generator.parameters(), lr=1e-3)
    discriminator_optimizer = torch.optim.Adam(discriminator.parameters(), lr=1e-3)
    for _ in range(5):
        fake = generator(torch.randn(6, 4))
        discriminator_loss = discriminator(fake.detach()).mean() - discriminator(torch.randn(6, 8)).mean()
        discriminator_optimizer.zero_grad()
        discriminator_loss.backward()
        discriminator_optimizer.step()
        generator_loss = -discriminator(fake).mean()
        generator_optimizer.zero_grad()
        generator_loss.backward()
        generator_optimizer.step()
        tracer.log_scalar("generator_loss", generator_loss.item())

with tracer.trace("finetune"):  # a second region: a new optimizer ends its steps
    finetune_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for inputs, targets in loader:
        with tracer.span("compute"):
            loss = nn.functional.cross_entropy(model(inputs), targets)
        finetune_optimizer.zero_grad()
        loss.backward()
        finetune_optimizer.step()
        tracer.log_scalar("loss", loss.item())

probe = probe_step._probe
steps = probe.sender.local_steps()
print(json.dumps({
    "compiled": probe_step.fast_path is not None,
    "steps": [[r.step, r.samples, r.forward_calls, r.forward_ms > 0, r.backward_ms > 0, r.optimizer_ms > 0]
              for r in steps],
    "sums_ok": all(abs(r.input_wait_ms + r.outside_ms + r.h2d_ms + r.forward_ms + r.backward_ms + r.optimizer_ms
                       + r.untraced_ms - r.step_ms) < 0.05 for r in steps),
}))
sys.stdout.flush()
