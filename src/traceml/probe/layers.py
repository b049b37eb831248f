"""Deep-dive: per-module forward and backward time and memory, measured on sampled steps.

On a sampled step, process-wide module hooks (installed for that step only, so other steps
pay nothing) time each module of the traced model: forward from its pre-hook to its hook;
backward over the autograd nodes the module's own forward made, from the first of them starting
to the last of them finishing. Those nodes are told by their sequence number (autograd numbers
nodes as it makes them; one made at the pre-hook marks where the module's begin), so a module
that returns its input unchanged (Dropout(p=0), an identity) has none and no backward, and a
module whose input also feeds another branch ends when its own nodes end, not when that input's
gradient is complete (which waits for every branch: the reason tensor hooks on inputs and
outputs over-count). A saved_tensors_hooks context around the model's forward attributes
every tensor saved for backward to the modules in flight (parameters excluded), which gives
exact activation memory per module. Figures are inclusive of child modules; leaves are
marked, and the share of the model's time its leaves account for is the coverage (the rest
runs in functional code or custom autograd functions inside parents).

The same hooks count a step's FLOPs from the shapes they see: the matrix products of Linear and
convolution modules, forward, and the input and weight gradients backward will compute (see
_count_flops). Nothing else runs inside the step to count them: torch's FlopCounterMode
decomposes some backward ops (silu's) into others, which changes the low bits of gradients,
and a checkpoint with them.

On CUDA the times come from pooled CUDA events, read later with query() when the next
sampled step begins: never a synchronize.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Type

from traceml.records import (CAPTURE_MEMORY, CAPTURE_REGRESSION, CAPTURE_SPIKE, MAX_WARMUP_STEPS, LayerCapture,
                             LayerReport, LayerStat, StepRecord)

if TYPE_CHECKING:
    from types import ModuleType

    from torch import Tensor
    from torch.autograd.graph import saved_tensors_hooks
    from torch.nn import Module
    from torch.utils.hooks import RemovableHandle

log = logging.getLogger("traceml")
_now_ns = time.perf_counter_ns

DEFAULT_EVERY_N_STEPS = 10
_ACCUMULATE_GRAD_NR = 2 ** 63  # autograd gives AccumulateGrad nodes UINT64_MAX
REPORT_EVERY_SAMPLES = 5  # send the cumulative figures after this many sampled steps
CALLS, FORWARD_NS, BACKWARD_NS, SAVED, OUTPUT, ALLOC_DELTA = range(6)
MAX_CAPTURES = 3  # automatic captures a run
CAPTURE_STEPS = 3  # steps each samples
BASELINE_STEP = 20  # sampling only to capture: the sample before starts here (after warm-up)
BASELINE_STEPS = 2


class LayerProbe:
    """Deep-dive state for one model in one training process."""

    def __init__(self, probe: Any, model: Module, every_n_steps: int = DEFAULT_EVERY_N_STEPS,
                 auto_capture: bool = True):
        """every_n_steps: sample every Nth step; 0 samples only to capture (auto_capture: when
        the probe sees a step go wrong, the next CAPTURE_STEPS steps are sampled, against a
        sample taken before: the regular samples, or BASELINE_STEPS steps from BASELINE_STEP)."""
        import torch

        self._torch = torch
        self.probe = probe
        self.every_n_steps = max(0, every_n_steps)
        self.watch = AnomalyWatch(wake=self._wake) if auto_capture else None
        self.captures_taken = 0
        self._capture: Optional[_Capture] = None  # the capture being sampled or resolved
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
        self._stack: List[List[Any]] = []  # the modules in flight, outermost first
        self._backward_spans: List[List[Any]] = []  # [module, start, end] per call of this step
        # Multiplying it makes one autograd node, whose sequence number says where a module's
        # forward begins (torch numbers nodes as it makes them, per thread).
        self._marker = torch.zeros((), requires_grad=True)
        self._handles: List[RemovableHandle] = []
        self._watched: List[Tuple[str, Any, int]] = []  # weakrefs to outputs and saved tensors
        self._watched_step = 0  # the sampled step they come from
        # Activations for the memory ledger: bytes saved for backward since the last backward
        # (what is alive at once), and this step's most.
        self._saved_since_backward = self._step_peak_saved = 0
        self.alive: Dict[str, int] = {}
        self._device_spans: List[Tuple[List[float], int, Any, Any]] = []  # CUDA: (row, slot, begin, end)
        # FLOPs: id(module) -> (FLOPs a forward element, whether the element is the input's
        # rather than the output's) for Linear and convolution modules; this step's sum, and
        # the regular samples' (their mean is a step's figure).
        self._flops_per_element = _matmul_modules(model, torch.nn)
        # Which backward pass runs now, -1 outside one (private, hence the fallback).
        self._graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
        self._step_flops = 0
        self._sampled_flops = 0
        self._said_paused = False  # deep-dive paused under torch.compile, said once
        self._graphs_at_start = _compiled_graphs()  # torch.compile compiling after this: pause

    def _wake(self) -> None:
        """The watch asked for a capture (sender thread): the next step calls begin_step."""
        self.probe.layers_due_step = 0

    # -- the step, called by the probe ------------------------------------------------------
    def begin_step(self, step_index: int) -> None:
        """Sample this step if it is due; then tell the probe the next step that needs this
        call (probe.layers_due_step), so that the steps in between pay nothing for deep-dive."""
        self._begin_step(step_index)
        probe = self.probe
        probe.layers_active = self.active  # a sampled step is slower by TraceML's doing: never a slow step
        probe.layers_due_step = self._next_due_step(step_index)
        # Written before the watch is read: a request the sender thread makes from now on
        # also wakes the probe (AnomalyWatch.wake), so none is missed between the two.
        if self.watch is not None and self.watch.request is not None:
            probe.layers_due_step = step_index + 1

    def _next_due_step(self, step_index: int) -> float:
        """The next step at which begin_step has work: checking what a sample left alive,
        reading device times, sending a capture, or sampling."""
        if self.active or self._capture is not None or self._device_spans:
            return step_index + 1
        due = [math.inf]
        if self._watched:
            due.append(self._watched_step + 2)
        if self.every_n_steps:
            due.append((step_index // self.every_n_steps + 1) * self.every_n_steps)
        elif self.watch is not None and step_index + 1 < BASELINE_STEP + BASELINE_STEPS:
            due.append(max(step_index + 1, BASELINE_STEP))
        return max(step_index + 1, min(due))

    def _begin_step(self, step_index: int) -> None:
        # Two steps on, the loop's own variables (`loss`, `outputs`) have moved on: what is
        # still alive then is kept on purpose or by a leak.
        if step_index >= self._watched_step + 2:
            self._check_alive()
        self._resolve_device_spans()
        if self._capture is not None and self._capture.steps_left == 0:
            self._send_capture()
        if (self.every_n_steps or self._capture is not None) and _compiled_graphs() != self._graphs_at_start:
            self._pause_for_compile()
            return
        if self._capture is None and self.watch is not None and self.watch.request is not None:
            self._start_capture()
        if self._capture is not None:
            if self._capture.steps_left == 0:
                return  # sampled, waiting for its device times
        elif self.every_n_steps:
            if step_index % self.every_n_steps or step_index == 0:
                return
        elif not (self.watch is not None and BASELINE_STEP <= step_index < BASELINE_STEP + BASELINE_STEPS
                  and _capturable()):
            return
        self._check_alive()  # an earlier sampled step's, if not checked yet
        self._watched_step = step_index
        hooks = self._torch.nn.modules.module
        self._handles = [hooks.register_module_forward_pre_hook(self._before_forward),
                         hooks.register_module_forward_hook(self._after_forward)]
        self.active = True

    def _pause_for_compile(self) -> None:
        """torch.compile has compiled in this process: global module hooks inside its graphs
        would break them and make them recompile, so per-layer sampling stops, said once. Step
        phases go on as before."""
        if self.every_n_steps and not self._said_paused:
            self._said_paused = True
            log.warning("traceml: deep-dive paused: torch.compile compiled the model, and per-layer "
                        "hooks inside its graphs would break them and make it recompile; step phases go on")
        self._capture = None

    def end_step(self) -> None:
        if not self.active:
            self.probe.layers_active = False
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.backward_done()
        self._stack.clear()
        self.active = False
        ledger = getattr(self.probe.sender, "ledger", None)
        if ledger is not None:
            ledger.note_activations(self._watched_step, self._step_peak_saved)
            reading = ledger.reading(self._watched_step + 1)
            if reading is not None:
                self.probe.sender.push(reading)
        self._saved_since_backward = self._step_peak_saved = 0
        self.probe.layers_active = False
        step_flops, self._step_flops = self._step_flops, 0
        if self._capture is not None:
            self._capture.steps_left -= 1
            return
        self.sampled_steps += 1
        self._sampled_flops += step_flops
        if self.every_n_steps and self.sampled_steps % REPORT_EVERY_SAMPLES == 0:
            self.report()

    # -- automatic capture ------------------------------------------------------------------
    def _start_capture(self) -> None:
        """A rule fired: sample the next steps into figures of their own, beside the ones so
        far (the sample before)."""
        reason, detail, step = self.watch.request  # type: ignore[union-attr, misc]  # called when the watch asked
        self.watch.request = None  # type: ignore[union-attr]  # called when the watch asked
        if self.captures_taken >= MAX_CAPTURES or not self.sampled_steps or not _capturable():
            return
        self.captures_taken += 1
        self._capture = _Capture(reason, detail, step, self._layer_stats(self.stats, self.alive),
                                 self.sampled_steps, self.stats)
        self.stats = {name: [0, 0, 0, 0, 0, 0] for name in self.kinds}

    def _send_capture(self, finishing: bool = False) -> None:
        """Once its device times are in (or the run ends): send the capture, and go back to the
        figures so far."""
        capture = self._capture
        rows = {id(row) for row in self.stats.values()}
        if not finishing and any(id(span[0]) in rows for span in self._device_spans):
            return
        self._capture = None
        captured, self.stats = self.stats, capture.stats_before  # type: ignore[union-attr]  # called while a capture runs
        sampled = CAPTURE_STEPS - capture.steps_left  # type: ignore[union-attr]  # called while a capture runs
        if sampled:
            self.probe.sender.push(LayerCapture(
                rank=self.probe.rank, step=capture.step, reason=capture.reason, detail=capture.detail,  # type: ignore[union-attr]  # called while a capture runs
                before_steps=capture.before_steps, after_steps=sampled, before=capture.before,  # type: ignore[union-attr]  # called while a capture runs
                after=self._layer_stats(captured, {})))

    def finish(self) -> None:
        """At the end of the run: a capture still open is sent with the steps it has, and the
        figures so far."""
        self._resolve_device_spans()
        if self._capture is not None:
            self._send_capture(finishing=True)
        self.report()

    @property
    def flops_per_step(self) -> int:
        """The regular samples' mean FLOPs a step (0 before the first)."""
        return self._sampled_flops // self.sampled_steps if self.sampled_steps else 0

    def saved_tensors_context(self) -> saved_tensors_hooks:
        """The context the model's forward runs in on a sampled step (see TimedForward)."""
        return self._torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def current_layer(self) -> Optional[str]:
        return self._stack[-1][0] if self._stack else None

    # -- forward ------------------------------------------------------------------------------
    def _before_forward(self, module: Module, args: Tuple[object, ...]) -> None:
        entered_ns = _now_ns()
        name = self.names.get(id(module))
        if name is None:
            return
        first_node = (self._marker * 1.0).grad_fn._sequence_nr() + 1 if self._torch.is_grad_enabled() else None  # type: ignore[union-attr]  # a grad-enabled product has a grad_fn
        timeline = self.probe.timeline
        allocated = self.probe.device_memory.read()[0] if self.probe.device_memory is not None else None
        start: Any = timeline.record() if timeline is not None else _now_ns()
        if timeline is None:
            self._charge(start - entered_ns)
        # [module, first node, start, storages saved, allocated, TraceML's own ns inside it]
        self._stack.append([name, first_node, start, set(), allocated, 0])

    def _after_forward(self, module: Module, args: Tuple[object, ...], output: object) -> None:
        ended_ns = _now_ns()
        name = self.names.get(id(module))
        if name is None or not self._stack or self._stack[-1][0] != name:
            return
        _, first_node, start, _, allocated, own_ns = self._stack.pop()
        stats = self.stats[name]
        stats[CALLS] += 1
        timeline = self.probe.timeline
        if timeline is not None:
            self._device_spans.append((stats, FORWARD_NS, start, timeline.record()))
            if allocated is not None:
                stats[ALLOC_DELTA] += self.probe.device_memory.read()[0] - allocated
        else:
            stats[FORWARD_NS] += ended_ns - start - own_ns
        outputs = _tensors(output, self._torch.Tensor)
        for tensor in outputs:
            size = tensor.numel() * tensor.element_size()
            stats[OUTPUT] += size
            self._watch(name, tensor, size)
        if first_node is not None:
            self._time_backward(name, first_node, outputs)
        flops = self._flops_per_element.get(id(module))
        if flops is not None and outputs:
            self._count_flops(module, args, outputs[0], flops, first_node is not None)
        if timeline is None:
            self._charge(_now_ns() - ended_ns)

    def _count_flops(self, module: Module, args: Tuple[object, ...], output: Tensor, flops: Tuple[int, bool],
                     grad_enabled: bool) -> None:
        """A Linear's or convolution's call: its product forward, and the ones backward will
        compute for the gradients that need one (its input's, its weight's). A forward run
        inside backward (activation checkpointing's recompute) has no backward of its own."""
        per_element, of_input = flops
        first = args[0] if args and isinstance(args[0], self._torch.Tensor) else None
        if of_input and first is None:
            return
        forward = per_element * (first.numel() if of_input else output.numel())  # type: ignore[union-attr]  # an input or an output is there to count
        products = 1
        if grad_enabled and self._graph_task_id() == -1:
            weight = getattr(module, "weight", None)
            products += bool(first is None or first.requires_grad)  # no tensor input: assume it does
            products += bool(weight is not None and weight.requires_grad)
        self._step_flops += forward * products

    def _charge(self, own_ns: int) -> None:
        """TraceML's own time (its hooks, counting saved tensors) spent inside the modules in
        flight: not theirs, so left out of their forward time."""
        for entry in self._stack:
            entry[5] += own_ns

    def _time_backward(self, name: str, first_node: int, outputs: List[Any]) -> None:
        """Hook the nodes this call made: the ones its outputs come from start its backward,
        the ones that lead out of it (to its inputs, parameters, or nothing) end it. The hooks
        live on the graph's nodes, which go with the graph."""
        def made_here(node: Any) -> bool:
            # AccumulateGrad (a parameter's) is numbered past every other node.
            return node is not None and first_node <= node._sequence_nr() < _ACCUMULATE_GRAD_NR

        heads = [t.grad_fn for t in outputs if made_here(t.grad_fn)]
        if not heads:
            return  # its output is its input, or needs no gradient: no backward of its own
        span: List[Any] = [name, None, None]
        self._backward_spans.append(span)
        seen = set()
        todo = list(heads)
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            inner = [n for n, _ in node.next_functions if made_here(n)]
            if inner:
                todo.extend(inner)
            else:
                node.register_hook(lambda grad_inputs, grad_outputs, span=span: self._backward_end(span))
        for node in set(heads):
            node.register_prehook(lambda grad_outputs, span=span: self._backward_start(span))

    def _pack(self, tensor: Tensor) -> Tensor:
        """Every tensor saved for backward counts for each module in flight, once per call."""
        entered_ns = _now_ns()
        try:
            storage = tensor.data_ptr()
        except Exception:  # a tensor without storage (sparse, nested): not counted
            return tensor
        if storage in self._param_pointers or not self._stack:
            return tensor
        size = tensor.numel() * tensor.element_size()
        if storage not in self._stack[0][3]:  # new to the outermost call: alive until backward
            self._saved_since_backward += size
            self._step_peak_saved = max(self._step_peak_saved, self._saved_since_backward)
        for name, _, _, seen, _, _ in self._stack:
            if storage not in seen:
                seen.add(storage)
                self.stats[name][SAVED] += size
        self._watch(self._stack[-1][0], tensor, size)
        self._charge(_now_ns() - entered_ns)
        return tensor

    def _watch(self, name: str, tensor: Tensor, size: int) -> None:
        """Keep a weak reference: if the tensor outlives its step, something leaks it."""
        try:
            self._watched.append((name, weakref.ref(tensor), size))
        except TypeError:
            pass

    # -- backward -----------------------------------------------------------------------------
    def _backward_start(self, span: List[Any]) -> None:
        if span[1] is None:
            timeline = self.probe.timeline
            span[1] = timeline.record() if timeline is not None else _now_ns()

    def _backward_end(self, span: List[Any]) -> None:
        timeline = self.probe.timeline
        if timeline is None:
            span[2] = _now_ns()
            return
        if span[2] is not None:
            timeline.release(span[2])
        span[2] = timeline.record()

    def backward_done(self) -> None:
        """Backward has returned: count each call's span from its first node starting to its
        last node finishing."""
        timeline = self.probe.timeline
        for name, start, end in self._backward_spans:
            if start is not None and end is not None:
                if timeline is not None:
                    self._device_spans.append((self.stats[name], BACKWARD_NS, start, end))
                else:
                    self.stats[name][BACKWARD_NS] += max(0, end - start)
            elif timeline is not None:
                for event in (start, end):
                    if event is not None:
                        timeline.release(event)
        self._backward_spans = []  # a call whose backward did not run by now never will
        self._saved_since_backward = 0  # backward freed them
        ledger = getattr(self.probe.sender, "ledger", None)
        if self.active and ledger is not None:
            ledger.note_gradients()

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
        for row, slot, begin, end in self._device_spans:
            if begin.query() and end.query():
                row[slot] += int(begin.elapsed_time(end) * 1e6)
                self.probe.timeline.release(begin)
                self.probe.timeline.release(end)
            else:
                pending.append((row, slot, begin, end))
        self._device_spans = pending

    def _layer_stats(self, stats: Dict[str, List[float]], alive: Dict[str, int]) -> List[LayerStat]:
        on_device = self.probe.device_memory is not None
        return [LayerStat(name=name, kind=self.kinds[name], leaf=name in self.leaves,
                          calls=int(s[CALLS]), forward_ms=s[FORWARD_NS] / 1e6,
                          backward_ms=s[BACKWARD_NS] / 1e6, saved_bytes=int(s[SAVED]),
                          output_bytes=int(s[OUTPUT]),
                          allocated_delta_bytes=int(s[ALLOC_DELTA]) if on_device else None,
                          alive_bytes=alive.get(name, 0))
                for name, s in stats.items() if s[CALLS]]

    def report(self) -> None:
        """Send the cumulative figures so far (the collector keeps the latest per rank); none
        when sampling only to capture."""
        if not self.sampled_steps or not self.every_n_steps:
            return
        def coverage(slot: int) -> float:
            """The share of the model's time its leaves account for."""
            root = self.stats[self.root][slot]
            leaves = sum(self.stats[name][slot] for name in self.leaves if name != self.root)
            return min(1.0, leaves / root) if root else 0.0

        self.probe.sender.push(LayerReport(
            rank=self.probe.rank, sampled_steps=self.sampled_steps, every_n_steps=self.every_n_steps,
            forward_coverage=coverage(FORWARD_NS), backward_coverage=coverage(BACKWARD_NS),
            layers=self._layer_stats(self.stats, self.alive), flops_per_step=self.flops_per_step or None))


def _matmul_modules(model: Module, nn: ModuleType) -> Dict[int, Tuple[int, bool]]:
    """id(module) -> (FLOPs a forward element, whether of its input) for each Linear and
    convolution in the model: 2 a multiply-add of the product, the bias add not counted (as
    torch.utils.flop_counter counts them). A Linear's output element takes in_features of them;
    a convolution's, in_channels/groups x the kernel's size; a transposed convolution's input
    element, out_channels/groups x the kernel's size."""
    conv, transposed = nn.modules.conv._ConvNd, nn.modules.conv._ConvTransposeNd
    found = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            found[id(module)] = (2 * module.in_features, False)
        elif isinstance(module, transposed):
            found[id(module)] = (2 * (module.out_channels // module.groups) * math.prod(module.kernel_size), True)
        elif isinstance(module, conv):
            found[id(module)] = (2 * (module.in_channels // module.groups) * math.prod(module.kernel_size), False)
    return found


def _unpack(tensor: Tensor) -> Tensor:
    return tensor


def _tensors(value: object, tensor_type: Type[Tensor]) -> List[Tensor]:
    """The tensors a module returned: itself, or those in its list, tuple or dict."""
    values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, tensor_type)]


class _Capture:
    """A capture in progress: why it fired, the figures before, and the steps still to sample."""

    def __init__(self, reason: str, detail: str, step: int, before: List[LayerStat], before_steps: int,
                 stats_before: Dict[str, List[float]]):
        self.reason, self.detail, self.step = reason, detail, step
        self.before, self.before_steps = before, before_steps
        self.stats_before = stats_before  # the regular figures, back once the capture is sent
        self.steps_left = CAPTURE_STEPS


class AnomalyWatch:
    """The rules that ask for a capture, over this rank's closed steps (on the sender's thread,
    off the training's): one step far slower than the run's baseline, the recent steps' median
    well above it, or memory held at a step's end jumping. The next step takes `request`."""

    # The baseline is frozen for the rest of the run, so it starts well clear of the warm-up
    # (records.warmup_steps): at twice the most steps the summary leaves out.
    BASELINE_FROM_STEP = 2 * MAX_WARMUP_STEPS
    BASELINE_COUNT = 50  # steps whose median is the baseline
    SPIKE_RATIO = 3.0  # not the STEP_SPIKES rule's slow step, on purpose (docs/deep-dive.md, "Capture on anomaly")
    REGRESSION_RATIO = 1.3
    REGRESSION_WINDOW = 20  # steps whose median is compared with the baseline, every as many
    MEMORY_JUMP_SHARE = 0.10  # of the memory held the step before...
    MEMORY_JUMP_MIN_BYTES = 64 * 2 ** 20  # ... and at least this much
    QUIET_STEPS = 50  # after a request, none of its kind for this many steps (a stray spike
                      # does not keep a slowdown right after it from being captured)

    def __init__(self, wake: Callable[[], None] = lambda: None) -> None:
        self.request: Optional[Tuple[str, str, int]] = None  # (reason, detail, step)
        self.wake = wake  # called after a request is made, so the training thread takes it
        self.baseline_ms: Optional[float] = None
        self._first: List[float] = []
        self._recent: List[float] = []
        self._held_bytes: Optional[int] = None
        self._quiet_until: Dict[str, int] = {}

    def observe(self, record: StepRecord) -> None:
        if record.instrumented or record.step < self.BASELINE_FROM_STEP:
            return
        held = record.device_allocated_bytes if record.device_allocated_bytes is not None else record.host_rss_bytes
        before, self._held_bytes = self._held_bytes, held
        if self.baseline_ms is None:
            self._first.append(record.step_ms)
            if len(self._first) == self.BASELINE_COUNT:
                self.baseline_ms = statistics.median(self._first)
            return
        fired = []
        if record.step_ms >= self.SPIKE_RATIO * self.baseline_ms:
            fired.append((CAPTURE_SPIKE, f"step {record.step} took {record.step_ms:.1f} ms against a "
                                         f"baseline of {self.baseline_ms:.1f} ms"))
        self._recent.append(record.step_ms)
        if len(self._recent) == self.REGRESSION_WINDOW:
            recent_ms, self._recent = statistics.median(self._recent), []
            if recent_ms >= self.REGRESSION_RATIO * self.baseline_ms:
                fired.append((CAPTURE_REGRESSION, f"the median of steps {record.step - self.REGRESSION_WINDOW + 1}"
                                                  f"-{record.step} is {recent_ms:.1f} ms against a baseline "
                                                  f"of {self.baseline_ms:.1f} ms"))
        if (held is not None and before is not None
                and held - before >= max(self.MEMORY_JUMP_MIN_BYTES, self.MEMORY_JUMP_SHARE * before)):
            fired.append((CAPTURE_MEMORY, f"memory held at step {record.step}'s end jumped by "
                                          f"{(held - before) / 2 ** 20:.0f} MiB to {held / 2 ** 20:.0f} MiB"))
        for reason, detail in fired:
            if self.request is None and record.step >= self._quiet_until.get(reason, 0):
                self.request = (reason, detail, record.step)
                self._quiet_until[reason] = record.step + self.QUIET_STEPS
                self.wake()


def _compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process (0 when dynamo is not loaded;
    -1 when its counters cannot be read, which counts as compiled)."""
    import sys

    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is None:
        return 0
    try:
        return int(dynamo.counters["stats"]["unique_graphs"])
    except Exception:
        return -1


def _capturable() -> bool:
    """Whether sampling uninvited does no harm: not once torch.compile has compiled something
    in this process (global module hooks appearing would make it recompile)."""
    return _compiled_graphs() == 0
