"""GPU check: a plain MLP loop traced by trace_step, shaped by flags for the memory, MFU, idle-gap
and NVML rows; writes what only the script can know (torch's own memory figures, its own step
rate) to --facts as JSON."""
import argparse
import json
import time

import torch
from torch import nn

import traceml


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=0.0, help="keep stepping at least this long")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bf16", action="store_true", help="the model call under bf16 autocast")
    parser.add_argument("--stall-ms", type=float, default=0.0, help="host sleep between steps (the GPU idles)")
    parser.add_argument("--rate-from", type=int, default=5, help="the script's own step rate from this step")
    parser.add_argument("--facts", default=None, help="write torch's memory figures and the step rate here")
    args = parser.parse_args()

    torch.manual_seed(0)
    on_cuda = args.device.startswith("cuda")
    torch.set_float32_matmul_precision("high")  # TF32: fp32 products on tensor cores
    # No biases: a step's FLOPs are then the matrix products alone, countable by hand.
    model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)]).to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    inputs = torch.randn(args.batch, args.width, device=args.device)
    started = time.perf_counter()
    rate_start = None
    step = 0
    while step < args.steps or time.perf_counter() - started < args.seconds:
        if step == args.rate_from:
            if on_cuda:
                torch.cuda.synchronize()  # the script's own timing, between steps
            rate_start = time.perf_counter()
        with traceml.trace_step(model):
            with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.bf16):
                outputs = model(inputs)
            loss = outputs.float().pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if args.stall_ms:
            time.sleep(args.stall_ms / 1000.0)  # the host busy elsewhere: the device waits
        step += 1
    facts = {"steps": step}
    if on_cuda:
        # Read after the last step with nothing allocated since: what TraceML's last step
        # record should hold (peak stats are reset at each step's start).
        facts.update(max_memory_allocated=torch.cuda.max_memory_allocated(),
                     memory_allocated=torch.cuda.memory_allocated(),
                     memory_reserved=torch.cuda.memory_reserved())
        torch.cuda.synchronize()
    if rate_start is not None:
        facts["steps_per_s"] = (step - args.rate_from) / (time.perf_counter() - rate_start)
    if args.facts:
        with open(args.facts, "w") as out:
            json.dump(facts, out)
    print(f"trained {step} steps", flush=True)


if __name__ == "__main__":
    main()
