"""The probe's process-level API: trace_step, infer_steps, trace_model_instance and detach set
up the process's one StepProbe (step._probe) with its patches, model hooks and sender, and
take TraceML out of the training after an internal fault.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, List, Optional, Protocol, Tuple, TypedDict, TypeVar, cast

from traceml.probe import step
from traceml.probe.patches import Patches
from traceml.probe.patches.first_call import FirstModelCall, owner_of, trainable
from traceml.probe.step_state import _now_ns
from traceml.probe.step import StepProbe
from traceml.probe.syncs import HostSyncSampler
from traceml.rendezvous import rank_env, ENV_AUTO_CAPTURE, ENV_DEEP, ENV_DEEP_EVERY, ENV_TOKEN
from traceml.records import STEPS_FROM_OPTIMIZER, STEPS_FROM_TRACE_STEP, CodeSample, RankHello

if TYPE_CHECKING:
    from types import ModuleType

    from torch import device
    from torch.nn import Module
    from torch.optim import Optimizer
    from torch.utils.hooks import RemovableHandle

    from traceml.probe.code_sites import StartupSampler
    from traceml.probe.memory import DeviceMemory

log = logging.getLogger("traceml")


_NO_TRACE = contextlib.nullcontext()  # what trace_step returns once TraceML has disabled itself
M = TypeVar("M", bound="Module")  # a model handed in, and handed back
_trace_step: Any = None
first_call = FirstModelCall()  # the process's wait for a first module call (zero-code, inferred steps)
patches: Optional[Patches] = None  # the probe's patches, while attached
_hooked_models: "weakref.WeakKeyDictionary[Module, List[RemovableHandle]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_disabled = False
# The model trace_step was last called with, once set up (a weakref, or _no_model): the same
# model again returns the probe at once. Cleared by detach and _disable.
_ready_for: Any = None
_explicit_steps_seen = False  # a trace_step was used: steps are never inferred in this process
_create_options: dict = {}  # how infer_steps wants the probe made: web_port, run_name, profile_memory
first_call_ns = 0  # set by traceml.trace_step before it imports this module


def _disable(where: str) -> None:
    """After an internal fault: take the patches out and stay out of the training's way."""
    global _disabled, _ready_for
    _disabled = True
    _ready_for = None
    log.warning("traceml: disabled after an internal error in %s; training continues untraced",
                where, exc_info=True)
    try:
        detach()
    except Exception:
        log.debug("traceml: could not take the patches out", exc_info=True)


def trace_step(model: Any = None) -> Any:
    """Trace one optimizer step: `with traceml.trace_step(model): ...`."""
    global _ready_for
    ready = _ready_for
    if ready is not None and ready() is model:  # every step after the first: nothing to set up
        return _trace_step
    if _disabled:
        return _NO_TRACE
    if (_trace_step is None or _trace_step.auto_steps
            or (model is not None and model not in _hooked_models)):
        try:
            _setup(model)
            _note_explicit_steps()
        except Exception:
            _disable("setup")
            return _NO_TRACE
    try:  # a weak reference: the model is the user's to free
        _ready_for = weakref.ref(model) if model is not None else _no_model
    except TypeError:  # not weakly referable: this model takes the checks above each step
        _ready_for = None
    return _trace_step


def _no_model() -> None:
    """What _ready_for returns when trace_step was last set up without a model."""
    return None


def _note_explicit_steps() -> None:
    global _explicit_steps_seen
    _explicit_steps_seen = True
    probe = step._probe
    if probe is not None and probe.auto_steps:
        probe.stop_inferring_steps()


def _setup(model: Optional[Module]) -> None:
    global _trace_step, patches
    setup_started_ns = first_call_ns or _now_ns()
    with _lock:
        if step._probe is None:
            step._probe = _create_probe(model)
            step._probe.setup_started_ns = setup_started_ns  # type: ignore[misc]  # probe.step: typed when the StepProbe split lands
        if _trace_step is None:  # first use, or after detach()
            patches = Patches(step._probe, first_call)
            patches.install()
            _trace_step = step._probe
        if model is not None and model not in _hooked_models:
            _hook(model)


def _hook(model: Module) -> None:
    """Time this model's forward (and, under `traceml run --deep`, deep-dive on it)."""
    probe = step._probe
    if patches is None:  # detached meanwhile
        return
    _hooked_models[model] = patches.hook_model(model)
    ledger = getattr(probe.sender, "ledger", None)  # type: ignore[union-attr]  # probe.step: typed when the StepProbe split lands
    if ledger is not None:
        ledger.watch_model(model)
    if probe.layers is None and (os.environ.get(ENV_DEEP) or _auto_capture()):  # type: ignore[union-attr]  # probe.step: typed when the StepProbe split lands
        from traceml.probe.layers import DEFAULT_EVERY_N_STEPS, LayerProbe

        # traceml run --deep samples every Nth step; otherwise steps are sampled only to
        # capture what grew when a rule fires.
        every = int(os.environ.get(ENV_DEEP_EVERY) or DEFAULT_EVERY_N_STEPS) if os.environ.get(ENV_DEEP) else 0
        probe.layers = LayerProbe(probe, model, every_n_steps=every, auto_capture=_auto_capture())  # type: ignore[union-attr]  # probe.step: typed when the StepProbe split lands


def _auto_capture() -> bool:
    return os.environ.get(ENV_AUTO_CAPTURE, "1") != "0"


def hook_inferred_model(model: Module) -> None:
    """Steps inferred: time this model, found at its first call (patches.first_call)."""
    with _lock:
        if step._probe is not None and model not in _hooked_models:
            _hook(model)


def _time_the_model_of(optimizer: Optimizer) -> bool:
    """At an optimizer's first step: when traced models do not hold all its parameters (the
    first module called was another one: a GAN's discriminator, say, for the generator's
    optimizer, or an encoder beside its decoder), the next module called that holds the others
    is timed as forward too. True when such a module is now awaited."""
    try:
        untraced = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
        for model in list(_hooked_models):
            untraced.difference_update(id(parameter) for parameter in model.parameters())
        if not untraced:
            return False
        first_call.arm(hook_inferred_model, wanted=owner_of(untraced))
        return True
    except Exception:  # inside the user's optimizer.step(): a fault costs this model's forward only
        log.debug("traceml: the model of an optimizer is not timed", exc_info=True)
        return False


def infer_steps(web_port: Optional[int] = None, run_name: Optional[str] = None,
                profile_memory: bool = True, steps_from: str = STEPS_FROM_OPTIMIZER,
                device_of: Optional[Module] = None, model: Optional[Module] = None) -> Optional[StepProbe]:
    """Trace without trace_step: each step ends at optimizer.step() (the Trace API, zero-code
    mode, the trainer integrations; steps_from says which, for the card).

    Rank 0 not under `traceml run` starts the run's collector, serving the web dashboard on
    web_port when given. model: the model to time, when the caller knows it (a trainer does);
    otherwise it is found at the first optimizer step. device_of: a module whose parameters
    say the device. An explicit trace_step, before or after, decides steps instead.
    """
    if _disabled:
        return None
    try:
        with _lock:
            if step._probe is None:
                _create_options.update(web_port=web_port, run_name=run_name, steps_from=steps_from,
                                       profile_memory=profile_memory, device_of=device_of)
        _setup(model)
        with _lock:
            probe = step._probe
            if probe is not None and not _explicit_steps_seen:
                probe.set_steps_from(steps_from)
                if not probe.auto_steps:
                    probe.auto_steps = True  # type: ignore[misc]  # probe.step: typed when the StepProbe split lands
                    if not _hooked_models:  # the model is the first one called with parameters to train
                        first_call.arm(hook_inferred_model, wanted=trainable)
        return probe
    except Exception:
        _disable("step inference setup")
        return None


def trace_model_instance(model: M, every_n_steps: Optional[int] = None) -> M:
    """Deep-dive on this model: per-module forward and backward time and memory, measured on
    every Nth step traced by trace_step (every_n_steps, default 10). Returns the model."""
    if _disabled:
        return model
    try:
        _setup(model)
        from traceml.probe.layers import DEFAULT_EVERY_N_STEPS, LayerProbe

        every = every_n_steps or int(os.environ.get(ENV_DEEP_EVERY) or DEFAULT_EVERY_N_STEPS)
        probe = step._probe
        if probe is not None and (probe.layers is None or probe.layers.names.get(id(model)) is None
                                  or not probe.layers.every_n_steps):
            probe.layers = LayerProbe(probe, model, every_n_steps=every, auto_capture=_auto_capture())
    except Exception:
        _disable("deep-dive setup")
    return model


def detach() -> None:
    """Take every patch and model hook back out, leaving torch as it was; the probe stays.

    The last step's window closes at its end. The next trace_step attaches everything again.
    """
    global _trace_step, _ready_for, patches
    _ready_for = None

    with _lock:
        if step._probe is None:
            return
        try:
            step._probe.finish()
            step._probe.reset_inferred_steps()
        finally:
            if patches is not None:
                patches.remove()  # the first-call wait with them
            patches = None
        for handles in _hooked_models.values():
            for handle in handles:
                handle.remove()
        _hooked_models.clear()
        _trace_step = None


def _create_probe(model: Optional[Module]) -> StepProbe:
    import torch

    from traceml.probe.memory import DeviceMemory, HostRss
    from traceml.probe.patches.dynamo import compiling
    from traceml.probe.sender import Sender
    from traceml.probe.thread_cpu import ThreadCpu

    device = _model_device(torch, model if model is not None else _create_options.get("device_of"))
    timeline = device_memory = None
    profile_memory = _create_options.get("profile_memory", True)
    if device.type == "cuda":
        from traceml.probe.clock import DeviceTimeline

        timeline = DeviceTimeline(lambda: torch.cuda.Event(enable_timing=True))
        device_memory = DeviceMemory(torch, device, counting=profile_memory)
    host_rss = HostRss() if profile_memory else None
    thread_cpu = ThreadCpu.of_this_thread()  # made on the training thread: its counts

    def probe_for(sender: Sender) -> StepProbe:
        """The step probe feeding this sender: made by the sender once it is built."""
        syncs = None if timeline is None else HostSyncSampler(rank_env()[0], sender.push, is_compiling=compiling())
        return StepProbe(sender, timeline=timeline, device_memory=device_memory, host_rss=host_rss,
                         on_fault=_disable, time_the_model_of=_time_the_model_of,
                         stop_awaiting_models=first_call.disarm, grad_enabled=torch.is_grad_enabled, syncs=syncs)

    startup, startup_sites = _startup_so_far()
    # Made where the training runs: its thread is the one whose stack a stall reports.
    sender = Sender(_hello(torch, device, device_memory, startup), timeline=timeline, host_rss=host_rss, thread_cpu=thread_cpu,
                    feed_of=probe_for, training_thread=threading.get_ident(), web_port=_create_options.get("web_port"),
                    run_name=_create_options.get("run_name"), evaluating=_evaluating)
    probe = cast(StepProbe, sender.feed)  # what probe_for made
    for record in startup_sites:
        sender.push(record)
    sender.start()
    atexit.register(_at_exit)
    return probe


def _evaluating() -> bool:
    """Whether the training thread is in an evaluation region the patches found (read by the
    sender thread's stall pulse and code sampler)."""
    return patches is not None and patches.evaluation.evaluating()


def _model_device(torch: ModuleType, model: Optional[Module]) -> device:
    if model is not None:
        with contextlib.suppress(StopIteration, AttributeError, TypeError):
            return next(model.parameters()).device
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _hello(torch: ModuleType, device: device, device_memory: Optional[DeviceMemory], startup: StartupFields) -> RankHello:
    rank, local_rank, world_size, node_rank = rank_env()
    return RankHello(
        rank=rank, local_rank=local_rank, world_size=world_size, node_rank=node_rank, host=socket.gethostname(),
        pid=os.getpid(), device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        device_capacity_bytes=device_memory.capacity_bytes if device_memory is not None else None,
        torch_version=str(torch.__version__),
        argv=[os.path.abspath(sys.argv[0])] + sys.argv[1:] if sys.argv and sys.argv[0] else list(sys.argv),
        started_at_unix_s=_process_start_unix_s(), token=os.environ.get(ENV_TOKEN, ""),
        steps_from=_create_options.get("steps_from", STEPS_FROM_TRACE_STEP), **startup)


class ImportTimer(Protocol):
    """zero_code's timer of the script's imports: stop() says what it timed, as the hello's fields."""

    def stop(self) -> StartupFields: ...


import_timer: Optional[ImportTimer] = None  # zero_code's, of the script's imports, under `traceml run`
startup_sampler: Optional[StartupSampler] = None  # and its sampler of the script's start (probe/code_sites.py)


class StartupFields(TypedDict, total=False):
    """The hello's fields on the script's start, where `traceml run` measured them."""

    imports_ms: Optional[float]
    slowest_import: str
    modules_imported: int


def _startup_so_far() -> Tuple[StartupFields, List[CodeSample]]:
    """The script's import time and modules loaded until now, as the hello's fields, and where
    its start was sampled, as CodeSamples, when `traceml run` measured them (both then stop)."""
    global import_timer, startup_sampler
    timer, import_timer = import_timer, None
    sampler, startup_sampler = startup_sampler, None
    fields: StartupFields = timer.stop() if timer is not None else {}
    sites: List[CodeSample] = []
    if sampler is not None:
        sites, fields["modules_imported"] = sampler.stop(rank_env()[0])
    return fields, sites


def _process_start_unix_s() -> float:
    """When this process started. On Linux from its age on the boot clock (to 10 ms): the
    start psutil gives adds the boot time, which /proc rounds to the second."""
    with contextlib.suppress(Exception):
        with open("/proc/self/stat", "rb") as stat, open("/proc/uptime", "rb") as uptime:
            started_ticks = int(stat.read().rsplit(b")", 1)[1].split()[19])
            age_s = float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age_s)
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:
        return time.time()


def _at_exit() -> None:
    probe = step._probe
    if probe is None:
        return
    try:
        probe.finish()
    except Exception:  # the last step is lost; what came before it still goes out below
        log.debug("traceml: could not close the last step", exc_info=True)
    try:
        # Neither sys.exit nor an uncaught exception was seen: the interpreter ends normally.
        probe.goodbye(exit_code=0 if probe.exit_code is None else probe.exit_code)
    except Exception:
        log.warning("traceml: could not flush telemetry at exit", exc_info=True)
