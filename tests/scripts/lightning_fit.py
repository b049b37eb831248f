"""A small Lightning fit with validation, traced by TraceMLCallback (either namespace)."""
import argparse
import importlib
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Rows(Dataset):
    def __init__(self, count, sleep_ms=0.0):
        self.inputs = torch.randn(count, 16)
        self.sleep_ms = sleep_ms

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        if self.sleep_ms:
            time.sleep(self.sleep_ms / 1000.0)
        return self.inputs[index], self.inputs[index, :1]


parser = argparse.ArgumentParser()
parser.add_argument("--namespace", choices=("lightning", "pytorch_lightning"), default="lightning")
parser.add_argument("--steps", type=int, default=80)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--val-every", type=int, default=20, help="validate every N training batches")
parser.add_argument("--val-sample-ms", type=float, default=2.0, help="a slow validation Dataset")
parser.add_argument("--untraced", action="store_true", help="no TraceMLCallback")
parser.add_argument("--shard", action="store_true",
                    help="FSDP2 on 2 ranks: ModelParallelStrategy, each Linear under fully_shard (FSDPStrategy is FSDP1, GPU only)")
parser.add_argument("--save", help="torch.save the model (and its state_dict) here once fit")
args = parser.parse_args()
# The namespace is chosen on the command line, and the module's class must be importable by
# name (torch.save pickles it): both decided here, at the top.
pl = importlib.import_module("lightning.pytorch" if args.namespace == "lightning" else "pytorch_lightning")


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, inputs):
        return self.net(inputs)

    def configure_model(self):
        if not args.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return nn.functional.mse_loss(self(inputs), targets)

    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        self.log("val_loss", nn.functional.mse_loss(self(inputs), targets))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main():
    callbacks = []
    if not args.untraced:
        from traceml.integrations import lightning as traceml_lightning

        traceml_lightning.init()
        callbacks.append(traceml_lightning.TraceMLCallback())
    torch.manual_seed(0)
    sharding = {}
    if args.shard:
        sharding = dict(devices=2, strategy=pl.strategies.ModelParallelStrategy(data_parallel_size=2,
                                                                               tensor_parallel_size=1))
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", logger=False, **(sharding or dict(devices=1)),
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accumulate_grad_batches=args.accumulate,
                         val_check_interval=args.val_every, limit_val_batches=4,
                         num_sanity_val_steps=1, callbacks=callbacks)
    model = Regressor()
    trainer.fit(model, DataLoader(Rows(100_000), batch_size=8),
                DataLoader(Rows(256, args.val_sample_ms), batch_size=8))
    print("fit", trainer.global_step, "optimizer steps")
    if args.save:
        os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
        torch.save(model.state_dict(), args.save)
        torch.save(model, args.save + ".module")


if __name__ == "__main__":
    main()
