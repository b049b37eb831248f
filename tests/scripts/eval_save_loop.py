"""A training loop that evaluates every N steps and saves a checkpoint every M steps, then runs a
final evaluation and a final save, timing its own evaluation, saves, steps and wall time to
compare with TraceML's. Zero-code by default; --trace-step wraps each step itself.

--epochs E takes the shape of Hugging Face's run_clm_no_trainer.py instead: E epochs, each
ending with an evaluation (model.eval(), then torch.no_grad() around each batch's forward, the
losses gathered between) and Accelerate's save_state (the model by safetensors, the optimizer
by torch.save); the last epoch's come after the last step, and a final save of the model by
Accelerate's save_model follows."""
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
    parser.add_argument("--epochs", type=int, default=0, help="run_clm_no_trainer's shape, --steps in all")
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
    spent = {"eval_s": 0.0, "save_s": 0.0, "evaluations": 0, "saves": 0, "eval_ms": [], "save_ms": []}
    step_ms = []

    def timed(name, work):
        started = time.perf_counter()
        result = work()
        elapsed_s = time.perf_counter() - started
        spent[f"{name}_s"] += elapsed_s
        spent[f"{name}_ms"].append(round(elapsed_s * 1e3, 3))
        spent["evaluations" if name == "eval" else "saves"] += 1
        return result

    def evaluate():
        model.eval()
        with torch.no_grad():
            correct = sum((model(inputs).argmax(1) == targets).sum().item() for inputs, targets in held_out)
        model.train()
        return correct

    def evaluate_each_batch():  # run_clm_no_trainer's
        model.eval()
        losses = []
        for inputs, targets in held_out:
            with torch.no_grad():
                outputs = model(inputs)
            losses.append(nn.functional.cross_entropy(outputs, targets).repeat(len(inputs)))
        model.train()
        return torch.cat(losses).mean().exp().item()

    def save(step):
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "padding": padding,
                    "step": step}, f"checkpoint-{step % 2}.pt")

    if args.epochs:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        model.register_buffer("padding", padding)  # a checkpoint of a realistic size
        model, optimizer = accelerator.prepare(model, optimizer)

    def train_step(inputs, targets):
        loss = nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def iterations():
        """Each step's batch, timed by the script from its fetch to its update's end."""
        for epoch in range(max(1, args.epochs)):
            batches = iter(train)
            while True:
                started = time.perf_counter()
                batch = next(batches, None)
                if batch is None:
                    break
                yield batch
                step_ms.append((time.perf_counter() - started) * 1e3)
            if args.epochs:
                timed("eval", evaluate_each_batch)
                timed("save", lambda: accelerator.save_state(f"epoch-{epoch % 2}"))

    if args.epochs:
        train = DataLoader(SyntheticDataset(args.steps * 16 // args.epochs, 32, 0.0), batch_size=16)
    for step, (inputs, targets) in enumerate(iterations()):
        if args.trace_step:
            with traceml.trace_step(model):
                train_step(inputs, targets)
        else:
            train_step(inputs, targets)
        if not args.epochs and (step + 1) % args.eval_every == 0:
            timed("eval", evaluate)
        if not args.epochs and (step + 1) % args.save_every == 0:
            timed("save", lambda: save(step))
    if args.epochs:
        timed("save", lambda: accelerator.save_model(model, "final"))  # the final save_pretrained
    else:
        timed("eval", evaluate)  # the final evaluation and save, after the last step
        timed("save", lambda: save(args.steps))
    step_ms.sort()
    spent.update(step_median_ms=step_ms[len(step_ms) // 2], step_mean_ms=sum(step_ms) / len(step_ms),
                 step_p90_ms=step_ms[int(0.9 * (len(step_ms) - 1))])
    spent["wall_s"] = seconds_since_process_start()
    print("MEASURED " + json.dumps(spent), flush=True)


if __name__ == "__main__":
    main()
