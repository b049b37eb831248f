"""A loop traced with the Trace API only (no trace_step): steps inferred from optimizer.step()."""
import argparse
import contextlib
import json
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import traceml


class SlowDataset(Dataset):
    def __init__(self, load_ms):
        self.load_ms = load_ms

    def __len__(self):
        return 100_000

    def __getitem__(self, index):
        if self.load_ms:
            time.sleep(self.load_ms / 1000.0)
        return torch.randn(32), torch.randn(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--load-ms", type=float, default=0.0)
    parser.add_argument("--explicit", action="store_true", help="also wrap each step in trace_step")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--regions", type=int, default=1,
                        help="traced regions one after another (pretraining, then fine-tuning), "
                             "each with a new optimizer")
    parser.add_argument("--nap-ms", type=float, default=0.0,
                        help="a span 'nap' around a sleep of this many ms, in some steps")
    parser.add_argument("--nap-every", type=int, default=1, help="the nap runs in every N-th step")
    parser.add_argument("--truth", default=None,
                        help="write the nap's own perf_counter time in each step here (JSON)")
    args = parser.parse_args()

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(args.device)
    loss_fn = nn.MSELoss()  # a module without parameters, called at top level: not the model
    batches = iter(DataLoader(SlowDataset(args.load_ms), batch_size=8))
    tracer = traceml.Trace(port=args.port)
    nap_ms = {}  # step -> the nap's time as the script measured it
    for region in range(args.regions):
        # A new optimizer each region, as fine-tuning after pretraining makes one.
        optimizer = (torch.optim.SGD(model.parameters(), lr=0.01) if region % 2 == 0
                     else torch.optim.AdamW(model.parameters(), lr=1e-4))
        with tracer.trace("api_loop" if region == 0 else f"api_loop_{region}"):
            for step in range(args.steps):
                block = traceml.trace_step(model) if args.explicit else contextlib.nullcontext()
                with block:
                    for _ in range(args.accumulate):
                        inputs, targets = (t.to(args.device) for t in next(batches))
                        with tracer.span("compute"):
                            loss = loss_fn(model(inputs), targets) / args.accumulate
                            loss.backward()
                    if args.nap_ms and step % args.nap_every == 0:
                        with tracer.span("nap"):
                            started = time.perf_counter()
                            time.sleep(args.nap_ms / 1000.0)
                            nap_ms[step] = (time.perf_counter() - started) * 1000.0
                    optimizer.step()
                    optimizer.zero_grad()
                tracer.log_scalar("loss", loss * args.accumulate)  # a 0-dim tensor
                tracer.log_scalar("lr", optimizer.param_groups[0]["lr"])  # a float
    if args.truth:
        with open(args.truth, "w") as out:
            json.dump({"nap_ms": nap_ms}, out)


if __name__ == "__main__":
    main()
