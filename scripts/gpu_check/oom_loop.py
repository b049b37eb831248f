"""GPU check: a loop whose model runs out of device memory inside a named layer at a given step,
for the post-mortem and for its traceback and exit code against plain python."""
import argparse
import contextlib
from collections import OrderedDict

import torch
from torch import nn


class BlowUp(nn.Module):
    """Asks for twice the device's memory once the given call comes: a real allocation failure."""

    def __init__(self, at_call):
        super().__init__()
        self.at_call, self.calls = at_call, 0

    def forward(self, x):
        self.calls += 1
        if self.calls < self.at_call:
            return x
        if x.is_cuda:
            capacity = torch.cuda.get_device_properties(x.device).total_memory
            return x + torch.empty(2 * capacity, dtype=torch.uint8, device=x.device)[:1]
        # The CPU has no device memory to exhaust: the dry run raises the error CUDA would.
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated on the CPU)")


class Net(nn.Module):
    def __init__(self, width, at_call):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.ReLU()),
                                     nn.Sequential(OrderedDict(linear=nn.Linear(width, width),
                                                               blow_up=BlowUp(at_call)))])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--oom-at", type=int, default=8, help="the step (from 0) that runs out of memory")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--without-traceml", action="store_true",
                        help="the same loop with TraceML never attached: the baseline traceback")
    args = parser.parse_args()

    # The same `with` line either way, so that the tracebacks can be compared line for line.
    if args.without_traceml:  # the baseline: TraceML never even imported
        step_block = lambda model: contextlib.nullcontext()  # noqa: E731
    else:
        import traceml

        step_block = traceml.trace_step

    torch.manual_seed(0)
    model = Net(args.width, args.oom_at + 1).to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs = torch.randn(64, args.width, device=args.device)
    for _ in range(args.steps):
        with step_block(model):
            loss = model(inputs).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    print(f"trained {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
