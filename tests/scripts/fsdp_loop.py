"""A sharded training loop on 2 gloo ranks (CPU): FSDP2's fully_shard on every block (or FSDP1
around the model, which torch 2.13 runs only with an accelerator), with one rank slowed in its
compute or between steps, or every collective made slow on every rank, on request."""
import argparse
import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

import traceml


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, hidden):
        return hidden + self.down(torch.relu(self.up(hidden)))


class Net(nn.Module):
    def __init__(self, width, blocks, busy_ms):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 4)
        self.busy_s = busy_ms / 1000.0
        self.spin = torch.randn(96, 96)

    def forward(self, hidden):
        if self.busy_s:  # real extra compute on this rank, not a sleep
            # A fixed amount of work: busy_s of this thread's own CPU time, which a busy
            # machine stretches as it would a real model's, not busy_s of the wall clock.
            deadline = time.thread_time() + self.busy_s
            while time.thread_time() < deadline:
                self.spin = torch.tanh(self.spin @ self.spin)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def shard(model, how):
    if how == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        return FullyShardedDataParallel(model, use_orig_params=True)
    from torch.distributed.fsdp import fully_shard
    mesh = None
    if how == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def slow_collectives(delay_ms, calls):
    """Every rank's collectives take delay_ms longer: a slow network, the same on every rank.
    calls: a one-item list, counting them."""
    for name in ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
                 "all_reduce"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def slowed(*args, __original=original, **kwargs):
            calls[0] += 1
            time.sleep(delay_ms / 1000.0)
            return __original(*args, **kwargs)
        setattr(dist, name, slowed)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--shard", choices=("fsdp2", "hsdp", "fsdp1"), default="fsdp2",
                        help="hsdp: FSDP2 on a 2-D mesh, replicated across the ranks and sharded within each")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--busy-ms", type=float, default=0.0, help="extra forward compute, on the slow rank")
    parser.add_argument("--sleep-ms", type=float, default=0.0, help="between steps, on the slow rank")
    parser.add_argument("--slow-comm-ms", type=float, default=0.0, help="added to every collective, every rank")
    parser.add_argument("--zero-code", action="store_true", help="no trace_step: traceml run finds the steps")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    slow = rank == args.slow_rank
    torch.manual_seed(0)
    model = shard(Net(args.width, args.blocks, args.busy_ms if slow else 0.0), args.shard)
    collective_calls = [0]
    if args.slow_comm_ms:
        slow_collectives(args.slow_comm_ms, collective_calls)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        batches = [(torch.randn(args.batch_size, args.width, generator=generator),
                    torch.randint(0, 4, (args.batch_size,), generator=generator)) for _ in range(args.accumulate)]
        with (traceml.trace_step(model) if not args.zero_code else contextlib.nullcontext()):
            for index, (inputs, targets) in enumerate(batches):
                if args.shard != "fsdp1" and args.accumulate > 1:
                    model.set_requires_gradient_sync(index == args.accumulate - 1)
                loss = nn.functional.cross_entropy(model(inputs), targets) / args.accumulate
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if slow and args.sleep_ms:  # its own business between steps: logging, a metric
            time.sleep(args.sleep_ms / 1000.0)
    print(f"rank {rank} trained {args.steps} steps", flush=True)
    if args.slow_comm_ms:
        print(f"rank {rank} slowed collectives a step: {collective_calls[0] / args.steps:g}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
