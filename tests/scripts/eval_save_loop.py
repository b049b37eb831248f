"""A training loop that evaluates every N steps and saves a checkpoint every M steps, then runs a
final evaluation and a final save, timing its own evaluation, saves and wall time to compare
with TraceML's goodput. Zero-code by default; --trace-step wraps each step itself."""
import argparse
import json
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

from synthetic_data import SyntheticDataset


def seconds_since_process_start() -> float:
    with open("/proc/self/stat", "rb") as stat, open("/proc/uptime", "rb") as uptime:
        started_ticks = int(stat.read().rsplit(b")", 1)[1].split()[19])
        return float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-batches", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=15)
    parser.add_argument("--save-mb", type=float, default=24.0)
    parser.add_argument("--trace-step", action="store_true")
    parser.add_argument("--setup-s", type=float, default=0.0, help="time to set up before training")
    args = parser.parse_args()
    time.sleep(args.setup_s)  # opening a dataset, say, before the first step
    if args.trace_step:
        import traceml

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train = DataLoader(SyntheticDataset(args.steps * 16, 32, 0.0), batch_size=16)
    held_out = DataLoader(SyntheticDataset(args.eval_batches * 8, 32, 2.0), batch_size=8)
    padding = torch.zeros(int(args.save_mb * 2 ** 20 / 4))  # a checkpoint of a realistic size
    spent = {"eval_s": 0.0, "save_s": 0.0, "evaluations": 0, "saves": 0}

    def evaluate():
        started = time.perf_counter()
        model.eval()
        with torch.no_grad():
            correct = sum((model(inputs).argmax(1) == targets).sum().item() for inputs, targets in held_out)
        model.train()
        spent["eval_s"] += time.perf_counter() - started
        spent["evaluations"] += 1
        return correct

    def save(step):
        started = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "padding": padding,
                    "step": step}, f"checkpoint-{step % 2}.pt")
        spent["save_s"] += time.perf_counter() - started
        spent["saves"] += 1

    for step, (inputs, targets) in enumerate(train):
        if args.trace_step:
            with traceml.trace_step(model):
                loss = nn.functional.cross_entropy(model(inputs), targets)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        else:
            loss = nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if (step + 1) % args.eval_every == 0:
            evaluate()
        if (step + 1) % args.save_every == 0:
            save(step)
    evaluate()  # the final evaluation and save, after the last step
    save(args.steps)
    spent["wall_s"] = seconds_since_process_start()
    print("MEASURED " + json.dumps(spent), flush=True)


if __name__ == "__main__":
    main()
