"""Accelerate's FSDP path on the CPU: Accelerate 1.16 turns an FSDP plugin into FSDP only on
accelerators (on the CPU it quietly runs DDP), so the scripts that test Accelerate's and HF
Trainer's FSDP set the distributed type themselves once the Accelerator is built."""
import accelerate
from accelerate.utils import DistributedType


def let_accelerate_shard_on_cpu():
    built = accelerate.Accelerator.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        built(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.state.distributed_type == DistributedType.MULTI_CPU:
            self.state.distributed_type = DistributedType.FSDP
            self.state.fsdp_plugin = fsdp_plugin

    accelerate.Accelerator.__init__ = init
