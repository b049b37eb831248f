"""The memory ledger, probe side: what holds this rank's memory (parameters, gradients,
optimizer state, activations saved for backward), read off the training thread and sent when it
changes.

The sender thread reads the watched models' parameters and gradients and the watched
optimizers' state every few seconds (ROUNDS_PER_READING) and sends a MemoryLedger when a figure
moved. Reading costs the training nothing: parameters and their gradients are attributes, an
optimizer's state a dict read with .get() and .values() (never `state[p]`, which would add an
entry to the user's defaultdict). The training thread only hands over what the sender cannot
find on its own, on steps it already slows on purpose: the optimizers it sees stepping on a
sampled step (or while steps are being inferred), the gradients as backward returns on a
sampled step (a loop that sets them to None after each update shows none to the sender), and
the activations a sampled step saved for backward (probe/layers.py counts them); that step's end
then takes a reading itself, while everything it read is still alive (a loop inside a function
frees its optimizer when it returns, and a short run may end before the sender's next reading).

Tensors that share storage count once: tied weights, views, a gradient that is a view of a
bucket. A sharded parameter (a DTensor under FSDP2) counts its local shard, and its full size
goes into unsharded_parameter_bytes. Under PEFT, parameters named lora_* or inside
modules_to_save are the adapters; each target module kind (q_proj, v_proj) gets its bytes.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

from traceml.records import MemoryLedger, adapter_target

log = logging.getLogger("traceml")

ROUNDS_PER_READING = 20  # sender rounds (FLUSH_INTERVAL_S / ROUNDS_PER_FLUSH each) between readings: 2 s


class LedgerWatch:
    """The models and optimizers of one training process, and the ledger last sent for them."""

    def __init__(self, rank: int, clock: Any = time.time):
        self.rank = rank
        self._clock = clock
        self._models: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        # Gradients come and go (zero_grad(set_to_none=True)); each parameter keeps the size of
        # the last one seen, which backward makes again at every step: id(parameter) -> (a
        # weak reference to it, its gradient's bytes). Keyed by id: a tensor's == is
        # elementwise, so tensors cannot key a WeakKeyDictionary. A gradient gone now counts
        # by its size alone: its storage's address may be another gradient's by now.
        self._gradients: Dict[int, Tuple[Any, int]] = {}
        self.activation_bytes: Optional[int] = None
        self.activation_step: Optional[int] = None
        self._last_sent: Optional[MemoryLedger] = None
        self._watched = 0  # models and optimizers handed over so far, freed ones included
        self._reading = threading.Lock()  # the sender reads, and a sampled step's end (training thread)

    # -- the training thread hands these over ------------------------------------------------
    def watch_model(self, model: Any) -> None:
        if model not in self._models:
            self._models.add(model)
            self._watched += 1

    def watch_optimizer(self, optimizer: Any) -> None:
        """An optimizer seen stepping: its state is read from now on (a trainer's wrapper,
        Accelerate's AcceleratedOptimizer say, is read through the optimizer it wraps)."""
        inner = getattr(optimizer, "optimizer", None)
        optimizer = inner if inner is not None and hasattr(inner, "state") else optimizer
        if optimizer not in self._optimizers:
            self._optimizers.add(optimizer)
            self._watched += 1

    def note_gradients(self) -> None:
        """Backward has returned on a sampled step: every gradient is there now."""
        for _, parameter in self._parameters():
            self._note_gradient(parameter)

    def note_activations(self, step: int, saved_bytes: int) -> None:
        """A sampled step's activations: the most its forward calls saved for backward at once."""
        self.activation_bytes, self.activation_step = saved_bytes, step

    # -- the sender thread reads -------------------------------------------------------------
    def reading(self, step: int, final: bool = False) -> Optional[MemoryLedger]:
        """The ledger now, when it differs from the one last sent (None: nothing moved, or
        nothing to read yet). step: the last step ended. final: the process is ending, and a
        model or optimizer the training freed (a loop inside a function has returned) leaves
        the last reading standing: that is what held the memory while it trained."""
        with self._reading:
            alive = len(self._models) + len(self._optimizers)
            if not alive or (final and self._last_sent is not None and alive < self._watched):
                return None
            ledger = self._read(step)
            last = self._last_sent
            if last is not None and _same_figures(last, ledger):
                return None
            self._last_sent = ledger
            return ledger

    def _parameters(self) -> Iterator[Tuple[str, Any]]:
        """(name, parameter) of every watched model, then the optimizers' parameters no model
        holds ("" for a name); each parameter once."""
        seen = set()
        for model in list(self._models):
            for name, parameter in model.named_parameters():
                if id(parameter) not in seen:
                    seen.add(id(parameter))
                    yield name, parameter
        for optimizer in list(self._optimizers):
            for group in list(optimizer.param_groups):
                for parameter in list(group["params"]):
                    if id(parameter) not in seen:
                        seen.add(id(parameter))
                        yield "", parameter

    def _note_gradient(self, parameter: Any) -> None:
        grad = parameter.grad
        if grad is not None:
            self._gradients[id(parameter)] = (weakref.ref(parameter), _storage(grad)[1])

    def _read(self, step: int) -> MemoryLedger:
        counted = set()  # storages already in some part
        trainable_dtypes: Dict[str, int] = {}
        frozen_dtypes: Dict[str, int] = {}
        elements = trainable_elements = 0
        unsharded = 0
        sharded = False
        adapter = _Adapters()
        adapter_ids = set()
        gradient_bytes = 0
        parameters = list(self._parameters())
        for name, parameter in parameters:
            key, size = _storage(parameter)
            full = parameter.numel() * parameter.element_size()
            if getattr(parameter, "_local_tensor", None) is not None:
                sharded = True
            unsharded += full
            elements += parameter.numel()
            if parameter.requires_grad:
                trainable_elements += parameter.numel()
            if key not in counted:
                counted.add(key)
                dtypes = trainable_dtypes if parameter.requires_grad else frozen_dtypes
                dtype = str(parameter.dtype).replace("torch.", "")
                dtypes[dtype] = dtypes.get(dtype, 0) + size
                if adapter.take(name, parameter, size):
                    adapter_ids.add(id(parameter))
            self._note_gradient(parameter)
        for parameter_id, (ref, size) in list(self._gradients.items()):
            parameter = ref()
            if parameter is None:  # its model is gone
                del self._gradients[parameter_id]
                continue
            grad = parameter.grad
            key = _storage(grad)[0] if grad is not None else None
            if parameter.requires_grad and (key is None or key not in counted):
                if key is not None:
                    counted.add(key)
                gradient_bytes += size
                if id(parameter) in adapter_ids:
                    adapter.gradient_bytes += size
        optimizer_bytes: Dict[str, int] = {}
        for optimizer in list(self._optimizers):
            name = _optimizer_name(optimizer, optimizer_bytes)
            held = 0
            for parameter, state in list(optimizer.state.items()):
                for value in list(state.values()) if isinstance(state, dict) else ():
                    if _is_tensor(value):
                        key, size = _storage(value)
                        if key not in counted:
                            counted.add(key)
                            held += size
                            if id(parameter) in adapter_ids:
                                adapter.optimizer_bytes += size
            optimizer_bytes[name] = held
        kind, rank = self._adapter_config(parameters) if adapter.parameter_bytes else ("", None)
        return MemoryLedger(
            rank=self.rank, step=step, unix_s=self._clock(),
            trainable_bytes=sum(trainable_dtypes.values()), frozen_bytes=sum(frozen_dtypes.values()),
            trainable_dtypes=trainable_dtypes, frozen_dtypes=frozen_dtypes,
            parameters=elements, trainable_parameters=trainable_elements,
            gradient_bytes=gradient_bytes, optimizer_state_bytes=optimizer_bytes,
            activation_bytes=self.activation_bytes, activation_step=self.activation_step,
            adapter=kind, adapter_rank=rank, adapter_parameters=adapter.elements,
            adapter_parameter_bytes=adapter.parameter_bytes, adapter_gradient_bytes=adapter.gradient_bytes,
            adapter_optimizer_bytes=adapter.optimizer_bytes, adapter_targets=adapter.targets,
            unsharded_parameter_bytes=unsharded if sharded else None)

    def _adapter_config(self, parameters: List[Tuple[str, Any]]) -> Tuple[str, Optional[int]]:
        """("LoRA", r) from a PEFT model's config, or from a lora_A weight's rows without one."""
        for model in list(self._models):
            configs = getattr(model, "peft_config", None)
            if isinstance(configs, dict) and configs:
                config = next(iter(configs.values()))
                kind = str(getattr(getattr(config, "peft_type", None), "value", "") or "adapter")
                return ("LoRA" if kind.upper() == "LORA" else kind), getattr(config, "r", None)
        for name, parameter in parameters:
            if ".lora_A." in name and parameter.dim() == 2:
                return "LoRA", int(parameter.shape[0])
        return "adapter", None


class _Adapters:
    """The adapter group's figures as a reading goes through the parameters."""

    def __init__(self) -> None:
        self.parameter_bytes = self.gradient_bytes = self.optimizer_bytes = self.elements = 0
        self.targets: Dict[str, int] = {}

    def take(self, name: str, parameter: Any, size: int) -> bool:
        """Count the parameter if it is an adapter's; True when it is."""
        target = adapter_target(name)
        if target is None:
            return False
        self.parameter_bytes += size
        self.elements += parameter.numel()
        self.targets[target] = self.targets.get(target, 0) + size
        return True


def _storage(tensor: Any) -> Tuple[Any, int]:
    """(a key that is the same for tensors sharing storage, the storage's bytes). A sharded
    tensor (DTensor) is its local shard."""
    local = getattr(tensor, "_local_tensor", None)
    if local is not None:
        tensor = local
    try:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer:
            return (str(tensor.device), pointer), int(storage.nbytes())
    except Exception:  # no storage of its own (a meta or wrapper tensor): its own size
        pass
    return id(tensor), tensor.numel() * tensor.element_size()


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "untyped_storage") and hasattr(value, "element_size")


def _optimizer_name(optimizer: Any, taken: Dict[str, int]) -> str:
    """The optimizer's class ("AdamW"), numbered when several share it ("AdamW 2")."""
    base = type(optimizer).__name__
    name, number = base, 1
    while name in taken:
        number += 1
        name = f"{base} {number}"
    return name


def _same_figures(a: MemoryLedger, b: MemoryLedger) -> bool:
    """Whether two readings hold the same figures (their step and time aside)."""
    return (a.trainable_bytes, a.frozen_bytes, a.gradient_bytes, a.optimizer_state_bytes, a.activation_bytes,
            a.adapter_parameter_bytes, a.adapter_gradient_bytes, a.adapter_optimizer_bytes,
            a.unsharded_parameter_bytes) == (
        b.trainable_bytes, b.frozen_bytes, b.gradient_bytes, b.optimizer_state_bytes, b.activation_bytes,
        b.adapter_parameter_bytes, b.adapter_gradient_bytes, b.adapter_optimizer_bytes,
        b.unsharded_parameter_bytes)
