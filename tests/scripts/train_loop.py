"""A real, tiny CPU training loop the tests run under TraceML, shaped by its flags."""
import argparse
import gc
import json
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

import traceml
from synthetic_data import SyntheticDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--load-ms", type=float, default=0.0, help="per-sample sleep in the Dataset")
    parser.add_argument("--no-loader", action="store_true", help="batches built by hand, no DataLoader")
    parser.add_argument("--outside-ms", type=float, default=0.0, help="sleep between steps")
    parser.add_argument("--close-stdout-at", type=int, default=-1, help="the script closes its stdout")
    parser.add_argument("--crash-at", type=int, default=-1, help="raise inside this step")
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--timestamps", help="write the loop's own step start times here")
    parser.add_argument("--step-ends", help="write the loop's own times at the end of each step here")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU checks")
    parser.add_argument("--keep-graph", action="store_true",
                        help="the classic leak: keep each step's loss tensor and outputs in a list")
    parser.add_argument("--retain-graph", action="store_true",
                        help="backward(retain_graph=True): a kept graph keeps its saved activations too")
    parser.add_argument("--gc-heap", type=int, default=0,
                        help="build this many Python objects, then gc.collect() in every step")
    parser.add_argument("--save-every", type=int, default=0,
                        help="a synchronous checkpoint save inside every Nth step")
    parser.add_argument("--save-mb", type=float, default=32.0)
    parser.add_argument("--save-between", action="store_true", help="save after the step, not inside it")
    parser.add_argument("--stall-every", type=int, default=0,
                        help="every Nth step waits --stall-ms inside the step (a metric's sync)")
    parser.add_argument("--stall-ms", type=float, default=100.0)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--long-batch-every", type=int, default=0,
                        help="every Nth batch is 8 times larger (inputs that vary in size)")
    parser.add_argument("--print-summary", action="store_true", help="print traceml.summary() at the end")
    parser.add_argument("--read-loss", action="store_true",
                        help="read the loss on the host every step, as logging often does (a host sync on CUDA)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.features, args.width), nn.ReLU(),
                          nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, 10)).to(args.device)
    optimizer = (torch.optim.Adam(model.parameters(), lr=1e-3) if args.optimizer == "adam"
                 else torch.optim.SGD(model.parameters(), lr=0.01))
    dataset = SyntheticDataset(args.steps * args.batch_size, args.features, args.load_ms)
    if args.no_loader:
        def batch(index):
            size = args.batch_size
            if args.long_batch_every and index % args.long_batch_every == args.long_batch_every - 1:
                size *= 8  # an unusually long input: eight times the work
            rows = [(index * args.batch_size + row) % len(dataset) for row in range(size)]
            return dataset.inputs[rows], dataset.targets[rows]

        batches = (batch(index) for index in range(args.steps))
    else:
        batches = DataLoader(dataset, batch_size=args.batch_size)

    kept, heap = [], [[index] for index in range(args.gc_heap)]
    checkpoint = torch.zeros(int(args.save_mb * 2 ** 20 / 4))
    starts, ends = [], []
    for step, (inputs, targets) in enumerate(batches):
        starts.append(time.perf_counter())
        if step == args.close_stdout_at:
            print("closing stdout", flush=True)
            sys.stdout.close()
        with traceml.trace_step(model):
            if args.device != "cpu":
                inputs = inputs.to(args.device, non_blocking=True)
                targets = targets.to(args.device, non_blocking=True)
            if step == args.crash_at:
                raise RuntimeError(f"boom at step {step}")
            outputs = model(inputs)
            loss = nn.functional.cross_entropy(outputs, targets)
            optimizer.zero_grad()
            loss.backward(retain_graph=args.retain_graph)
            optimizer.step()
            if args.read_loss:
                logged_loss = loss.item()  # READ LOSS
            if args.keep_graph:
                kept.append((loss, outputs))  # keeps each step's graph and activations alive
            if args.gc_heap:
                gc.collect()
            if args.stall_every and step % args.stall_every == args.stall_every - 1:
                time.sleep(args.stall_ms / 1000.0)  # a metric's sync, say, every so often
            if args.save_every and not args.save_between and step % args.save_every == args.save_every - 1:
                torch.save({"model": model.state_dict(), "extra": checkpoint},
                           f"checkpoint-{step % 2}.pt")
        ends.append(time.perf_counter())
        if args.save_every and args.save_between and step % args.save_every == args.save_every - 1:
            torch.save({"model": model.state_dict(), "extra": checkpoint}, f"checkpoint-{step % 2}.pt")
        if args.outside_ms:
            time.sleep(args.outside_ms / 1000.0)
    if not sys.stdout.closed:
        print(f"trained {len(starts)} steps", flush=True)
    if args.print_summary:  # traceml.summary(), as a user logs it to a tracker
        print("SUMMARY " + json.dumps(traceml.summary()), flush=True)
    del kept, heap  # alive until here on purpose: the leak, and the objects gc walks
    if args.timestamps:
        with open(args.timestamps, "w") as out:
            json.dump(starts, out)
    if args.step_ends:
        with open(args.step_ends, "w") as out:
            json.dump(ends, out)
    sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
