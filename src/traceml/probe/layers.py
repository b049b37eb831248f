"""Deep-dive: per-module forward and backward time and memory, measured on sampled steps.

On a sampled step, process-wide module hooks (installed for that step only, so other steps
pay nothing) time each module of the traced model: forward from its pre-hook to its hook,
backward from the moment the gradient of its output arrives to the moment the gradient of
its input is produced. A saved_tensors_hooks context around the model's forward attributes
every tensor saved for backward to the modules in flight (parameters excluded), which gives
exact activation memory per module. Figures are inclusive of child modules; leaves are
marked, and the share of the model's time its leaves account for is the coverage (the rest
runs in functional code or custom autograd functions inside parents).

On CUDA the times come from pooled CUDA events, read later with query() when the next
sampled step begins: never a synchronize.
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

from traceml.records import LayerReport, LayerStat

log = logging.getLogger("traceml")
_now_ns = time.perf_counter_ns

DEFAULT_EVERY_N_STEPS = 10
REPORT_EVERY_SAMPLES = 5  # send the cumulative figures after this many sampled steps
CALLS, FORWARD_NS, BACKWARD_NS, SAVED, OUTPUT, ALLOC_DELTA = range(6)


class LayerProbe:
    """Deep-dive state for one model in one training process."""

    def __init__(self, probe: Any, model: Any, every_n_steps: int = DEFAULT_EVERY_N_STEPS):
        import torch

        self._torch = torch
        self.probe = probe
        self.every_n_steps = max(1, every_n_steps)
        self.names: Dict[int, str] = {}
        self.kinds: Dict[str, str] = {}
        self.leaves = set()
        for name, module in model.named_modules():
            name = name or type(module).__name__
            self.names[id(module)] = name
            self.kinds[name] = type(module).__name__
            if next(module.children(), None) is None:
                self.leaves.add(name)
        self.root = self.names[id(model)]
        # A saved weight is the parameter or a view of it (weight.t()) starting where it does.
        self._param_pointers = {p.data_ptr() for p in model.parameters()}
        self.stats: Dict[str, List[float]] = {name: [0, 0, 0, 0, 0, 0] for name in self.kinds}
        self.sampled_steps = 0
        self.active = False
        self._stack: List[Tuple[str, int, Any, set, Optional[int]]] = []
        self._calls = itertools.count()
        self._backward_open: Dict[int, Tuple[str, Any]] = {}  # call -> (module, start)
        self._handles: List[Any] = []
        self._watched: List[Tuple[str, Any, int]] = []  # weakrefs to outputs and saved tensors
        self._watched_step = 0  # the sampled step they come from
        self.alive: Dict[str, int] = {}
        self._device_spans: List[Tuple[str, int, Any, Any]] = []  # CUDA: (name, slot, begin, end)
        # FLOPs of one whole step, counted once by torch's FlopCounterMode (it slows the step it
        # watches): on the step after the first sampled one, so no layer timing sees it.
        self.flops_per_step: Optional[int] = None
        self._flop_step = self.every_n_steps + 1
        self._flop_counter: Any = None

    # -- the step, called by the probe ------------------------------------------------------
    def begin_step(self, step_index: int) -> None:
        # Two steps on, the loop's own variables (`loss`, `outputs`) have moved on: what is
        # still alive then is kept on purpose or by a leak.
        if step_index >= self._watched_step + 2:
            self._check_alive()
        self._resolve_device_spans()
        if step_index == self._flop_step and self.flops_per_step is None:
            self._count_flops()
        if step_index % self.every_n_steps or step_index == 0:
            return
        self._check_alive()  # an earlier sampled step's, if not checked yet
        self._watched_step = step_index
        hooks = self._torch.nn.modules.module
        self._handles = [hooks.register_module_forward_pre_hook(self._before_forward),
                         hooks.register_module_forward_hook(self._after_forward)]
        self.active = True

    def end_step(self) -> None:
        if self._flop_counter is not None:
            counter, self._flop_counter = self._flop_counter, None
            try:
                counter.__exit__(None, None, None)
                self.flops_per_step = int(counter.get_total_flops())
            except Exception:
                log.debug("traceml: FLOPs not counted", exc_info=True)
        if not self.active:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.backward_done()
        self._stack.clear()
        self.active = False
        self.sampled_steps += 1
        if self.sampled_steps % REPORT_EVERY_SAMPLES == 0:
            self.report()

    def _count_flops(self) -> None:
        try:
            from torch.utils.flop_counter import FlopCounterMode

            counter = FlopCounterMode(display=False)
            counter.__enter__()
            self._flop_counter = counter
        except Exception:  # an old torch, or a mode already active: no MFU, nothing else lost
            log.debug("traceml: FLOPs not counted", exc_info=True)
            self.flops_per_step = 0

    @property
    def instrumenting(self) -> bool:
        """Whether this step runs with deep-dive hooks or the FLOP counter: slower by TraceML's
        doing, so never read as a slow step of the user's."""
        return self.active or self._flop_counter is not None

    def saved_tensors_context(self) -> Any:
        """The context the model's forward runs in on a sampled step (see TimedForward)."""
        return self._torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def current_layer(self) -> Optional[str]:
        return self._stack[-1][0] if self._stack else None

    # -- forward ------------------------------------------------------------------------------
    def _before_forward(self, module: Any, args: tuple) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        call = next(self._calls)
        timeline = self.probe.timeline
        start: Any = timeline.record() if timeline is not None else _now_ns()
        allocated = self.probe.device_memory.read()[0] if self.probe.device_memory is not None else None
        self._stack.append((name, call, start, set(), allocated))
        grad_input = _graph_tensor(args, self._torch.Tensor)
        if grad_input is not None:  # its gradient arrives when this module's backward is done
            grad_input.register_hook(lambda grad, call=call: self._backward_end(call))

    def _after_forward(self, module: Any, args: tuple, output: Any) -> None:
        name = self.names.get(id(module))
        if name is None or not self._stack or self._stack[-1][0] != name:
            return
        _, call, start, _, allocated = self._stack.pop()
        stats = self.stats[name]
        stats[CALLS] += 1
        timeline = self.probe.timeline
        if timeline is not None:
            self._device_spans.append((name, FORWARD_NS, start, timeline.record()))
            if allocated is not None:
                stats[ALLOC_DELTA] += self.probe.device_memory.read()[0] - allocated
        else:
            stats[FORWARD_NS] += _now_ns() - start
        tensor_type = self._torch.Tensor
        for tensor in _tensors(output, tensor_type):
            size = tensor.numel() * tensor.element_size()
            stats[OUTPUT] += size
            self._watch(name, tensor, size)
        grad_output = _graph_tensor((output,), tensor_type)
        if grad_output is not None:  # its gradient arriving starts this module's backward
            grad_output.register_hook(lambda grad, call=call, name=name: self._backward_start(call, name))

    def _pack(self, tensor: Any) -> Any:
        """Every tensor saved for backward counts for each module in flight, once per call."""
        try:
            storage = tensor.data_ptr()
        except Exception:  # a tensor without storage (sparse, nested): not counted
            return tensor
        if storage in self._param_pointers or not self._stack:
            return tensor
        size = tensor.numel() * tensor.element_size()
        for name, _, _, seen, _ in self._stack:
            if storage not in seen:
                seen.add(storage)
                self.stats[name][SAVED] += size
        self._watch(self._stack[-1][0], tensor, size)
        return tensor

    def _watch(self, name: str, tensor: Any, size: int) -> None:
        """Keep a weak reference: if the tensor outlives its step, something leaks it."""
        try:
            self._watched.append((name, weakref.ref(tensor), size))
        except TypeError:
            pass

    # -- backward -----------------------------------------------------------------------------
    def _backward_start(self, call: int, name: str) -> None:
        timeline = self.probe.timeline
        self._backward_open[call] = (name, timeline.record() if timeline is not None else _now_ns())

    def _backward_end(self, call: int) -> None:
        opened = self._backward_open.pop(call, None)
        if opened is not None:
            self._close_backward(opened)

    def backward_done(self) -> None:
        """Backward has returned: modules whose input needs no gradient end here."""
        for opened in self._backward_open.values():
            self._close_backward(opened)
        self._backward_open.clear()

    def _close_backward(self, opened: Tuple[str, Any]) -> None:
        name, start = opened
        timeline = self.probe.timeline
        if timeline is not None:
            self._device_spans.append((name, BACKWARD_NS, start, timeline.record()))
        else:
            self.stats[name][BACKWARD_NS] += _now_ns() - start

    # -- bookkeeping ----------------------------------------------------------------------------
    def _check_alive(self) -> None:
        """Outputs and saved tensors of the last sampled step still alive now: what a leak
        keeps, by module."""
        if not self._watched:
            return
        alive: Dict[str, int] = {}
        for name, ref, size in self._watched:
            if ref() is not None:
                alive[name] = alive.get(name, 0) + size
        self.alive = alive
        self._watched = []

    def _resolve_device_spans(self) -> None:
        pending = []
        for name, slot, begin, end in self._device_spans:
            if begin.query() and end.query():
                self.stats[name][slot] += int(begin.elapsed_time(end) * 1e6)
                self.probe.timeline.release(begin)
                self.probe.timeline.release(end)
            else:
                pending.append((name, slot, begin, end))
        self._device_spans = pending

    def report(self) -> None:
        """Send the cumulative figures so far (the collector keeps the latest per rank)."""
        if not self.sampled_steps:
            return
        root = self.stats[self.root]
        leaf_forward = sum(self.stats[name][FORWARD_NS] for name in self.leaves if name != self.root)
        leaf_backward = sum(self.stats[name][BACKWARD_NS] for name in self.leaves if name != self.root)
        on_device = self.probe.device_memory is not None
        layers = [LayerStat(name=name, kind=self.kinds[name], leaf=name in self.leaves,
                            calls=int(s[CALLS]), forward_ms=s[FORWARD_NS] / 1e6,
                            backward_ms=s[BACKWARD_NS] / 1e6, saved_bytes=int(s[SAVED]),
                            output_bytes=int(s[OUTPUT]),
                            allocated_delta_bytes=int(s[ALLOC_DELTA]) if on_device else None,
                            alive_bytes=self.alive.get(name, 0))
                  for name, s in self.stats.items() if s[CALLS]]
        self.probe.sender.push(LayerReport(
            rank=self.probe.rank, sampled_steps=self.sampled_steps, every_n_steps=self.every_n_steps,
            forward_coverage=min(1.0, leaf_forward / root[FORWARD_NS]) if root[FORWARD_NS] else 0.0,
            backward_coverage=min(1.0, leaf_backward / root[BACKWARD_NS]) if root[BACKWARD_NS] else 0.0,
            layers=layers, flops_per_step=self.flops_per_step or None))


def _unpack(tensor: Any) -> Any:
    return tensor


def _tensors(value: Any, tensor_type: type) -> List[Any]:
    if isinstance(value, tensor_type):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, tensor_type)]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, tensor_type)]
    return []


def _graph_tensor(values: tuple, tensor_type: type) -> Optional[Any]:
    """The first tensor made inside the autograd graph (it has a grad_fn): a hook on it goes
    when the graph does. Never a leaf: that is the user's own tensor (a parameter, an input
    with requires_grad), and a hook left on it would stay there, and travel with it."""
    for value in values:
        for tensor in _tensors(value, tensor_type):
            if tensor.grad_fn is not None:
                return tensor
    return None
