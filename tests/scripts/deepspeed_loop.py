"""DeepSpeed ZeRO on 2 gloo ranks (DS_ACCELERATOR=cpu): an MLP under deepspeed.initialize with its
own AdamW, engine.backward and engine.step, micro-batches accumulated by the engine; traced by
trace_step or by zero-code mode, with one rank slowed between steps on request."""
import argparse
import contextlib
import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

# DeepSpeed's CPU accelerator compiles a shared-memory all-reduce (a minute of g++ on a machine
# that has not built it yet) when its process group starts, after probing every op with the
# compiler. Only inference's all-reduce calls it; ZeRO training with torch's AdamW uses no op.
deepspeed.ops.__compatible_ops__ = {}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2))
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--zero-code", action="store_true", help="no trace_step: traceml run finds the steps")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--sleep-ms", type=float, default=0.0, help="between steps, on the slow rank")
    parser.add_argument("--local_rank", type=int, default=0)  # deepspeed's launcher passes it
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": args.accumulate,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": args.stage}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = engine.global_rank
    if not args.zero_code:
        import traceml
    generator = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        with traceml.trace_step(engine) if not args.zero_code else contextlib.nullcontext():
            for _ in range(args.accumulate):
                inputs = torch.randn(8, 32, generator=generator)
                loss = engine(inputs).pow(2).mean()
                engine.backward(loss)
                engine.step()  # updates at the accumulation boundary only
        if rank == args.slow_rank and args.sleep_ms:
            time.sleep(args.sleep_ms / 1000.0)
    print(f"rank {rank} trained {engine.global_steps} optimizer steps", flush=True)


if __name__ == "__main__":
    main()
