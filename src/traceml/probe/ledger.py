"""The memory ledger, probe side: what holds this rank's memory (parameters, gradients,
optimizer state, activations saved for backward), read now and then and sent when it changed.

Readings are taken on the training thread, between steps, never on the sender's: autograd
replaces a parameter's .grad, and an optimizer its state, in C++ without holding the GIL, so a
tensor read from another thread meanwhile can be freed under it (and the process crash). A reading costs a walk over the parameters and the optimizers' state (attributes
and dict reads: an optimizer's state is read with .items(), never `state[p]`, which would add an
entry to the user's defaultdict), so it is taken at step starts at most every READING_INTERVAL_S
(the steps between pay nothing: probe.step's due-step check), at the end of each sampled step,
and as the process ends. The training thread also hands over what a plain step cannot show: the
optimizers it sees stepping on a sampled step (or while steps are being inferred), the gradients
as backward returns on a sampled step (a loop that sets them to None after each update shows
none between steps), and the activations a sampled step saved for backward (probe/layers.py).

Tensors that share storage count once: tied weights, views, a gradient that is a view of a
bucket. A sharded parameter (a DTensor under FSDP2) counts its local shard, and its full size
goes into unsharded_parameter_bytes (its gradient's and optimizer state's likewise); the most
held all-gathered at once comes from probe/sharded.py's GatherWatch. Under PEFT, parameters named lora_* or inside
modules_to_save are the adapters; each target module kind (q_proj, v_proj) gets its bytes.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, Dict, Hashable, Iterator, List, Optional, Protocol, Set, Tuple, TypedDict, TypeVar

from traceml.records import MemoryLedger, adapter_target

if TYPE_CHECKING:
    from torch import Tensor
    from torch.nn import Module
    from torch.optim import Optimizer

T = TypeVar("T")
StorageKey = Hashable  # the same for tensors that share storage (tensor_storage)

log = logging.getLogger("traceml")

READING_INTERVAL_S = 2.0  # between readings at step starts, at most as often as this
FIRST_READING_STEPS = (1, 2)  # after the first update (an optimizer's state is made then), and once more


class GatherPeaks(Protocol):
    """The most a sharded model held all-gathered at once, by phase (probe/sharded.GatherWatch)."""

    step: int  # the step the ledger reads at
    peak_bytes: Dict[str, Optional[int]]


class ParameterFigures(TypedDict):
    """The parameters' MemoryLedger fields."""

    trainable_bytes: int
    frozen_bytes: int
    trainable_dtypes: Dict[str, int]
    frozen_dtypes: Dict[str, int]
    parameters: int
    trainable_parameters: int
    unsharded_parameter_bytes: Optional[int]


class LedgerWatch:
    """The models and optimizers of one training process, and the ledger last sent for them."""

    def __init__(self, rank: int, clock: Callable[[], float] = time.time):
        self.rank = rank
        self._clock = clock
        # Weak references, in the order they were handed over (optimizers are named in it).
        self._models: List[weakref.ref[Module]] = []
        self._optimizers: List[weakref.ref[Optimizer]] = []
        # Gradients come and go (zero_grad(set_to_none=True)); each parameter keeps the size of
        # the last one seen, which backward makes again at every step: id(parameter) -> (a
        # weak reference to it, its gradient's bytes). Keyed by id: a tensor's == is
        # elementwise, so tensors cannot key a WeakKeyDictionary. A gradient gone now counts
        # by its size alone: its storage's address may be another gradient's by now.
        self._gradients: Dict[int, Tuple[weakref.ref[Tensor], Tuple[int, StorageKey], int]] = {}
        # Each pass that notes gradients is a generation: gradients noted in one pass were alive
        # together, so those that shared a storage then (FSDP's reduce-scatter output, a DDP
        # bucket) count once when gone; one address seen in two passes may be two storages.
        self._noting = 0
        self.activation_bytes: Optional[int] = None
        self.activation_step: Optional[int] = None
        self._last_sent: Optional[MemoryLedger] = None
        self._watched = 0  # models and optimizers handed over so far, freed ones included
        self._paced_from: Optional[Tuple[int, float]] = None  # (step, time) of the last reading at a step start
        self._reading = threading.Lock()  # the last reading is compared and replaced in one go
        self._gathers: Optional[GatherPeaks] = None  # a sharded model's (probe/sharded.GatherWatch)
        self._sharded_by = ""

    # -- the training thread hands these over ------------------------------------------------
    def watch_model(self, model: Module) -> None:
        self._watch(self._models, model)

    def _watch(self, watched: List[weakref.ref[T]], thing: T) -> None:
        if not any(ref() is thing for ref in watched):
            watched.append(weakref.ref(thing))
            self._watched += 1

    def watch_optimizer(self, optimizer: Optimizer) -> None:
        """An optimizer seen stepping: its state is read from now on (a trainer's wrapper,
        Accelerate's AcceleratedOptimizer say, is read through the optimizer it wraps)."""
        inner = getattr(optimizer, "optimizer", None)
        self._watch(self._optimizers, inner if inner is not None and hasattr(inner, "state") else optimizer)

    def watch_sharding(self, watch: GatherPeaks, sharded_by: str) -> None:
        """A sharded model (by FSDP2, FSDP1, DeepSpeed ZeRO: `sharded_by`) and its all-gathers:
        each step a reading starts is watched for their peak."""
        self._gathers, self._sharded_by = watch, sharded_by

    def note_gradients(self) -> None:
        """Backward has returned on a sampled step: every gradient is there now."""
        self._noting += 1
        for _, parameter in self._parameters():
            self._note_gradient(parameter)

    def note_activations(self, step: int, saved_bytes: int) -> None:
        """A sampled step's activations: the most its forward calls saved for backward at once."""
        self.activation_bytes, self.activation_step = saved_bytes, step

    # -- readings ----------------------------------------------------------------------------
    def at_step_start(self, step: int, now_s: float) -> Tuple[Optional[MemoryLedger], float]:
        """A due step has started (training thread): the reading, when it moved, and the next
        step due: the first readings at FIRST_READING_STEPS, then one READING_INTERVAL_S on at
        the pace the steps have been going."""
        reading = self.reading(step)
        if self._gathers is not None:
            self._gathers.step = step
        later = [s for s in FIRST_READING_STEPS if s > step]
        if later:
            next_step: float = later[0]
        elif self._paced_from is None:
            next_step = step + 1
        else:
            since_step, since_s = self._paced_from
            per_step_s = max(1e-6, (now_s - since_s) / max(1, step - since_step))
            next_step = step + max(1, math.ceil(READING_INTERVAL_S / per_step_s))
        self._paced_from = (step, now_s)
        return reading, next_step

    def reading(self, step: int, final: bool = False) -> Optional[MemoryLedger]:
        """The ledger now, when it differs from the one last sent (None: nothing moved, or
        nothing to read yet). step: the last step ended. final: the process is ending, and a
        model or optimizer the training freed (a loop inside a function has returned) leaves
        the last reading standing: that is what held the memory while it trained."""
        with self._reading:
            alive = len(self._alive(self._models)) + len(self._alive(self._optimizers))
            if not alive or (final and self._last_sent is not None and alive < self._watched):
                return None
            ledger = self._read(step)
            if self._last_sent is not None and _figures(self._last_sent) == _figures(ledger):
                return None
            self._last_sent = ledger
            return ledger

    @staticmethod
    def _alive(watched: List[weakref.ref[T]]) -> List[T]:
        return [thing for thing in (ref() for ref in watched) if thing is not None]

    def _parameters(self) -> Iterator[Tuple[str, Tensor]]:
        """(name, parameter) of every watched model, then the optimizers' parameters no model
        holds ("" for a name); each parameter once."""
        seen = set()
        for model in self._alive(self._models):
            for name, parameter in model.named_parameters():
                if id(parameter) not in seen:
                    seen.add(id(parameter))
                    yield name, parameter
        for optimizer in self._alive(self._optimizers):
            for group in list(optimizer.param_groups):
                for parameter in list(group["params"]):
                    if id(parameter) not in seen:
                        seen.add(id(parameter))
                        yield "", parameter

    def _note_gradient(self, parameter: Tensor) -> None:
        grad = parameter.grad
        if grad is not None:
            key, size = tensor_storage(grad)
            self._gradients[id(parameter)] = (weakref.ref(parameter), (self._noting, key), size)

    def _read(self, step: int) -> MemoryLedger:
        counted: Set[StorageKey] = set()  # storages already in some part
        adapter = _Adapters()
        self._noting += 1
        parameters = list(self._parameters())
        figures = self._read_parameters(parameters, counted, adapter)
        gradient_bytes, unsharded_gradients = self._read_gradients(counted, adapter)
        optimizer_bytes, unsharded_optimizers = self._read_optimizers(counted, adapter)
        sharded = figures["unsharded_parameter_bytes"] is not None
        gathers = self._gathers
        peaks = gathers.peak_bytes if gathers is not None else {}
        kind, rank = self._adapter_config(parameters) if adapter.parameter_bytes else ("", None)
        return MemoryLedger(
            rank=self.rank, step=step, unix_s=self._clock(), **figures,
            gradient_bytes=gradient_bytes, optimizer_state_bytes=optimizer_bytes,
            activation_bytes=self.activation_bytes, activation_step=self.activation_step,
            adapter=kind, adapter_rank=rank, adapter_parameters=adapter.elements,
            adapter_parameter_bytes=adapter.parameter_bytes, adapter_gradient_bytes=adapter.gradient_bytes,
            adapter_optimizer_bytes=adapter.optimizer_bytes, adapter_targets=adapter.targets,
            unsharded_gradient_bytes=unsharded_gradients if sharded else None,
            unsharded_optimizer_bytes=unsharded_optimizers if sharded else None,
            gathered_forward_peak_bytes=peaks.get("forward"), gathered_backward_peak_bytes=peaks.get("backward"),
            sharded_by=self._sharded_by, **(_mesh(parameters) if sharded else {}))

    def _read_parameters(self, parameters: List[Tuple[str, Tensor]], counted: Set[StorageKey],
                         adapter: "_Adapters") -> ParameterFigures:
        """The parameters' MemoryLedger fields; each one's gradient noted as it is seen."""
        dtypes: Dict[bool, Dict[str, int]] = {True: {}, False: {}}  # by requires_grad
        elements = trainable_elements = unsharded = 0
        sharded = False
        for name, parameter in parameters:
            key, size = tensor_storage(parameter)
            sharded = sharded or getattr(parameter, "_local_tensor", None) is not None
            unsharded += parameter.numel() * parameter.element_size()
            elements += parameter.numel()
            if parameter.requires_grad:
                trainable_elements += parameter.numel()
            if key not in counted:
                counted.add(key)
                mine = dtypes[bool(parameter.requires_grad)]
                dtype = str(parameter.dtype).replace("torch.", "")
                mine[dtype] = mine.get(dtype, 0) + size
                adapter.take(name, parameter, size)
            self._note_gradient(parameter)
        return {"trainable_bytes": sum(dtypes[True].values()), "frozen_bytes": sum(dtypes[False].values()),
                "trainable_dtypes": dtypes[True], "frozen_dtypes": dtypes[False], "parameters": elements,
                "trainable_parameters": trainable_elements,
                "unsharded_parameter_bytes": unsharded if sharded else None}

    def _read_gradients(self, counted: Set[StorageKey], adapter: "_Adapters") -> Tuple[int, int]:
        """The trainable parameters' gradients, each at the size it last had, and at the size
        they have unsharded (a sharded gradient, a DTensor, gives its full size)."""
        gradient_bytes = unsharded_bytes = 0
        gone_counted: Set[Tuple[int, StorageKey]] = set()  # storages of gradients gone now, as they were when seen
        for parameter_id, (ref, seen_key, size) in list(self._gradients.items()):
            parameter = ref()
            if parameter is None:  # its model is gone
                del self._gradients[parameter_id]
                continue
            if not parameter.requires_grad:
                continue
            grad = parameter.grad
            # One storage can hold several gradients (FSDP's reduce-scatter output): its bytes
            # count once, while each sharded gradient adds its own full size unsharded.
            if grad is not None:
                key, size = tensor_storage(grad)
                shared = key in counted
                counted.add(key)
            else:
                shared = seen_key in gone_counted
                gone_counted.add(seen_key)
            unsharded_bytes += _unsharded_size(parameter, 0 if shared else size)
            if shared:
                continue
            gradient_bytes += size
            if parameter_id in adapter.ids:
                adapter.gradient_bytes += size
        return gradient_bytes, unsharded_bytes

    def _read_optimizers(self, counted: Set[StorageKey], adapter: "_Adapters") -> Tuple[Dict[str, int], int]:
        """Each optimizer's state tensors, by optimizer, and all of them at their unsharded size."""
        optimizer_bytes: Dict[str, int] = {}
        unsharded_bytes = 0
        for optimizer in self._alive(self._optimizers):
            name = _optimizer_name(optimizer, optimizer_bytes)
            held = 0
            for parameter, state in list(optimizer.state.items()):
                for value in list(state.values()) if isinstance(state, dict) else ():
                    if _is_tensor(value):
                        key, size = tensor_storage(value)
                        if key not in counted:
                            counted.add(key)
                            held += size
                            unsharded_bytes += _unsharded_size(value, size)
                            if id(parameter) in adapter.ids:
                                adapter.optimizer_bytes += size
            optimizer_bytes[name] = held
        return optimizer_bytes, unsharded_bytes

    def _adapter_config(self, parameters: List[Tuple[str, Tensor]]) -> Tuple[str, Optional[int]]:
        """("LoRA", r) from a PEFT model's config, or from a lora_A weight's rows without one."""
        for model in self._alive(self._models):
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
        self.ids: Set[int] = set()  # id() of the adapter parameters, for their gradients and state

    def take(self, name: str, parameter: Tensor, size: int) -> None:
        """Count the parameter if it is an adapter's."""
        target = adapter_target(name)
        if target is None:
            return
        self.ids.add(id(parameter))
        self.parameter_bytes += size
        self.elements += parameter.numel()
        self.targets[target] = self.targets.get(target, 0) + size


def tensor_storage(tensor: Tensor) -> Tuple[StorageKey, int]:
    """(a key that is the same for tensors sharing storage, the storage's bytes). A sharded
    tensor (DTensor) is its local shard. The key is the storage's address alone: devices'
    memory and the host's never share addresses in one process (CUDA's unified addressing)."""
    local = getattr(tensor, "_local_tensor", None)
    if local is not None:
        tensor = local
    try:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer:
            return pointer, int(storage.nbytes())
    except Exception:  # no storage of its own (a meta or wrapper tensor): its own size
        pass
    return ("object", id(tensor)), tensor.numel() * tensor.element_size()


def _unsharded_size(tensor: Tensor, local_bytes: int) -> int:
    """A sharded tensor's (a DTensor's) bytes unsharded: its full shape's; another's own bytes.
    A gradient's is its parameter's full shape at the gradient's bytes per element."""
    if getattr(tensor, "_local_tensor", None) is None:
        return local_bytes
    grad = getattr(tensor, "grad", None)
    element_size = grad.element_size() if grad is not None else tensor.element_size()
    return int(tensor.numel()) * element_size


def _mesh(parameters: List[Tuple[str, Tensor]]) -> Dict[str, Dict[str, int]]:
    """The first DTensor parameter's DeviceMesh: {"mesh_dims": name -> size, "mesh_coordinate":
    name -> this rank's index}; a dimension without a name is "dim0", "dim1", ... ({} if unread)."""
    for _, parameter in parameters:
        mesh = getattr(parameter, "device_mesh", None)
        if mesh is None or getattr(parameter, "_local_tensor", None) is None:
            continue
        try:
            sizes = [int(size) for size in mesh.mesh.shape]
            names = list(mesh.mesh_dim_names or [f"dim{index}" for index in range(len(sizes))])
            coordinate = mesh.get_coordinate() or []
            return {"mesh_dims": dict(zip(names, sizes)),
                    "mesh_coordinate": {name: int(index) for name, index in zip(names, coordinate)}}
        except Exception:  # a mesh of another torch's making: no mesh figures
            log.debug("traceml: the DeviceMesh is not read", exc_info=True)
            return {}
    return {}


def _is_tensor(value: object) -> bool:
    return hasattr(value, "untyped_storage") and hasattr(value, "element_size")


def _optimizer_name(optimizer: Optimizer, taken: Dict[str, int]) -> str:
    """The optimizer's class ("AdamW"), numbered when several share it ("AdamW 2")."""
    base = type(optimizer).__name__
    name, number = base, 1
    while name in taken:
        number += 1
        name = f"{base} {number}"
    return name


def _figures(ledger: MemoryLedger) -> Tuple[object, ...]:
    """The figures a reading is sent for when one of them moves (its step and time aside)."""
    return (ledger.trainable_bytes, ledger.frozen_bytes, ledger.gradient_bytes, ledger.optimizer_state_bytes,
            ledger.activation_bytes, ledger.adapter_parameter_bytes, ledger.adapter_gradient_bytes,
            ledger.adapter_optimizer_bytes, ledger.unsharded_parameter_bytes, ledger.gathered_forward_peak_bytes,
            ledger.gathered_backward_peak_bytes, ledger.sharded_by)
