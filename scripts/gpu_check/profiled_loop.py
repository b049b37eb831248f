"""GPU check: a large MLP traced by trace_step, each phase inside a torch.profiler range, the
profiler on for a window of steps; writes the profiler's chrome trace and the steps it covers.

The MLP is wide and the batch big so that kernels fill the device and the gaps between them are
small: TraceML's device span of a phase and the profiler's kernel time then describe the same
work. The ranges wrap exactly what TraceML times as a phase: the `.to()` copy (h2d), the model
call (forward), `backward()` and `optimizer.step()`.
"""
import argparse
import json
import os

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

import traceml

RANGES = ("h2d", "forward", "backward", "optimizer")
RANGE_PREFIX = "gpu_check."


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile-from", type=int, default=20, help="first profiled step (warm-up before)")
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pageable", action="store_true", help="the batch in pageable, not pinned, host memory")
    parser.add_argument("--out", required=True, help="folder for trace.json and profiled.json")
    args = parser.parse_args()

    torch.manual_seed(0)
    on_cuda = args.device.startswith("cuda")
    # TF32 tensor cores: fp32 matmuls at tensor-core speed keep the step short while still
    # dominated by large kernels.
    torch.set_float32_matmul_precision("high")
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers).to(args.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    host_batch = torch.randn(args.batch, args.width)
    if on_cuda and not args.pageable:
        host_batch = host_batch.pin_memory()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    profiler = profile(activities=activities)
    last_profiled = args.profile_from + args.profile_steps - 1
    for step in range(args.steps):
        if step == args.profile_from:
            profiler.start()
        with traceml.trace_step(model):
            with record_function(RANGE_PREFIX + "h2d"):
                inputs = host_batch.to(args.device, non_blocking=True)
            with record_function(RANGE_PREFIX + "forward"):
                outputs = model(inputs)
            loss = outputs.float().pow(2).mean()
            optimizer.zero_grad()
            with record_function(RANGE_PREFIX + "backward"):
                loss.backward()
            with record_function(RANGE_PREFIX + "optimizer"):
                optimizer.step()
        if step == last_profiled:
            profiler.stop()  # waits for the device: between steps, outside what is compared
    os.makedirs(args.out, exist_ok=True)
    profiler.export_chrome_trace(os.path.join(args.out, "trace.json"))
    with open(os.path.join(args.out, "profiled.json"), "w") as out:
        json.dump({"first_step": args.profile_from, "steps": args.profile_steps,
                   "ranges": [RANGE_PREFIX + name for name in RANGES],
                   "pinned": bool(on_cuda and not args.pageable),
                   "batch_bytes": host_batch.numel() * host_batch.element_size()}, out)
    print(f"trained {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
