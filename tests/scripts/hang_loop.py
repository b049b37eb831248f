"""A small loop that averages its gradients by hand with all_reduce (on the default group or a
group of its own), or under DDP (gloo, or one process), for the hang locator: at one step a rank can stall in its own code (after backward,
before forward, in a layer's forward or in its optimizer's step), its DataLoader worker can
hang, every rank can evaluate for a while, or a rank can be killed; and, as planned work that
is no hang, a checkpoint save to a slow disk and a compilation mid-run."""
import argparse
import contextlib
import io
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import traceml


class Rows(Dataset):
    def __init__(self, hang_at):
        self.hang_at = hang_at

    def __len__(self):
        return 100_000

    def __getitem__(self, index):
        if index == self.hang_at:  # a worker stuck on one sample: a lost file handle, a dead mount
            parent = os.getppid()
            while os.getppid() == parent:  # ... that still ends with the training process
                time.sleep(0.2)
        return torch.randn(16), torch.randn(1)


def load_shard(seconds):
    """The rank's own slow work inside a step: the line the hang finding should name."""
    time.sleep(seconds)


class ShardLoader(nn.Module):
    """A layer whose forward stalls for `stall_s` when set: a forward that never returns."""

    stall_s = 0.0

    def forward(self, inputs):
        if self.stall_s:
            load_shard(self.stall_s)
        return inputs


class ShardedSGD(torch.optim.SGD):
    """SGD whose step stalls for `stall_s` when set: the rank's own code inside the optimizer."""

    stall_s = 0.0

    def step(self, closure=None):
        if self.stall_s:
            load_shard(self.stall_s)
        return super().step(closure)


class SlowDisk(io.BytesIO):
    """A checkpoint's destination that takes `seconds` to accept the first write: a network
    file system at a bad moment."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def write(self, data):
        if self.seconds:
            time.sleep(self.seconds)
            self.seconds = 0
        return super().write(data)


def slow_compiler(seconds):
    """A torch.compile backend that takes `seconds` to compile (inductor's time on a large model,
    made certain here), then runs the graph as traced."""
    def compile_graph(graph_module, example_inputs):
        time.sleep(seconds)
        return graph_module.forward
    return compile_graph


def evaluate(model, seconds):
    deadline = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < deadline:
            model(torch.randn(64, 16))
            time.sleep(0.05)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--at", type=int, default=20, help="the step where it happens")
    parser.add_argument("--stall-rank", type=int, default=-1)
    parser.add_argument("--stall-s", type=float, default=3600.0)
    parser.add_argument("--stall-in", default="after-backward",
                        choices=("after-backward", "before-forward", "forward", "optimizer"))
    parser.add_argument("--ddp", action="store_true", help="DDP averages the gradients, not the loop")
    parser.add_argument("--grads-on-subgroup", action="store_true",
                        help="the loop averages its gradients on a group of its own, as on a mesh dimension's")
    parser.add_argument("--hang-worker-rank", type=int, default=-1, help="this rank's DataLoader worker hangs")
    parser.add_argument("--eval-s", type=float, default=0.0, help="every rank evaluates this long at --eval-at")
    parser.add_argument("--eval-at", type=int, default=None, help="the step before which it evaluates (--at)")
    parser.add_argument("--kill-rank", type=int, default=-1, help="this rank SIGKILLs itself mid-step at --at")
    parser.add_argument("--save-at", type=int, default=-1, help="save a checkpoint to a slow disk after this step")
    parser.add_argument("--save-s", type=float, default=8.0)
    parser.add_argument("--compile-at", type=int, default=-1, help="torch.compile the model at this step")
    parser.add_argument("--compile-s", type=float, default=8.0, help="how long its compiler takes")
    parser.add_argument("--zero-code", action="store_true")
    args = parser.parse_args()

    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    grads_group = dist.new_group(list(range(dist.get_world_size()))) if args.grads_on_subgroup else None
    torch.manual_seed(0)
    shard_loader = ShardLoader()
    model = nn.Sequential(nn.Linear(16, 32), shard_loader, nn.ReLU(), nn.Linear(32, 1))
    if args.ddp and distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = ShardedSGD(model.parameters(), lr=0.01)
    hang_at = args.at * 8 if rank == args.hang_worker_rank else -1
    loader = iter(DataLoader(Rows(hang_at), batch_size=8, num_workers=1 if args.hang_worker_rank >= 0 else 0))
    for step in range(args.steps):
        if step == (args.at if args.eval_at is None else args.eval_at) and args.eval_s:
            evaluate(model, args.eval_s)
        if step == args.save_at:
            torch.save(model.state_dict(), SlowDisk(args.save_s))
        if step == args.compile_at:
            model = torch.compile(model, backend=slow_compiler(args.compile_s))
        stalls = step == args.at and rank == args.stall_rank
        shard_loader.stall_s = optimizer.stall_s = 0.0
        if stalls and args.stall_in in ("forward", "optimizer"):
            (shard_loader if args.stall_in == "forward" else optimizer).stall_s = args.stall_s
        with (traceml.trace_step(model) if not args.zero_code else contextlib.nullcontext()):
            inputs, targets = next(loader)
            if stalls and args.stall_in == "before-forward":
                load_shard(args.stall_s)
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            if stalls and args.stall_in == "after-backward":
                load_shard(args.stall_s)
            if step == args.at and rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if distributed and not args.ddp:
                for parameter in model.parameters():
                    dist.all_reduce(parameter.grad, group=grads_group)
            optimizer.step()
            optimizer.zero_grad()
        time.sleep(0.01)
    print(f"rank {rank} trained {args.steps} steps", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
