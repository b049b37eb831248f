"""The one record schema shared by probe, collector, store and views (record_types.py says
where each record type is kept, wire.py how records travel).

A field is only ever appended to a record, with a default: field order is part of the wire
version, and the store reads a field added after a run was written as its default.
"""

from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import msgspec

try:
    from enum import StrEnum as StrEnum  # re-exported: the one StrEnum for every Python
except ImportError:  # Python before 3.11: the same, by hand
    from enum import Enum

    class StrEnum(str, Enum):  # type: ignore[no-redef]
        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return str.__format__(str(self.value), spec)


class Phase(StrEnum):
    """The phases of a step, in the order a step lives them: the one list of phase names (a
    member is its name as a string, so JSON, the store's columns and the card hold plain text)."""

    INPUT_WAIT = "input_wait"
    OUTSIDE = "outside"
    H2D = "h2d"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    UNTRACED = "untraced"
    GC = "gc"  # garbage-collector pauses overlap the phases above: reported beside them, never added


ALL_PHASES = tuple(Phase)
STEP_PHASES = ALL_PHASES[:-1]  # they add up to a step's wall time
OVERLAPPING_PHASES = (Phase.GC,)
# The model's own work; its share decides COMPUTE_BOUND.
COMPUTE_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
# The phases the probe times itself (on the device, under CUDA), in the order of its step layout.
TIMED_PHASES = (Phase.H2D,) + COMPUTE_PHASES
# The order a timeline lays a step's phases out in: the probe measures how long each phase
# took, not when inside the step; the window after the step is input wait, then the rest.
TIMELINE_ORDER = TIMED_PHASES + (Phase.UNTRACED, Phase.INPUT_WAIT, Phase.OUTSIDE)


class Beside(StrEnum):
    """Where a rank's pulse finds its training thread when it is in no Phase (RankPulse.phase)."""

    IN_STEP = "in step"  # its own code inside a step, in no timed phase
    EVALUATION = "evaluation"
    CHECKPOINT = "checkpoint"
    COMPILE = "compile"


PLANNED_WORK = (Beside.EVALUATION, Beside.CHECKPOINT, Beside.COMPILE)  # beside the steps on purpose

# The warm-up rule, one for the probe, the rollup and the rules: a run's first steps (the
# allocator growing, autotuning, DataLoader workers starting) are not the run.
MAX_WARMUP_STEPS = 5  # figures start after a tenth of the steps, at most this many
WARMUP_STALL_STEPS = 20  # a stall that starts this early among the measured steps (or in their
WARMUP_STALL_SHARE = 0.1  # first tenth, when longer) and never comes back is warm-up, not a finding


def warmup_steps(step_count: int) -> int:
    """The steps left out at the start of a run of step_count steps (numbered from 0)."""
    return min(MAX_WARMUP_STEPS, step_count // 10)


def warmup_stall_horizon(first_step: int, measured_steps: int) -> int:
    """The step before which a stall that never comes back counts as warm-up."""
    return first_step + max(WARMUP_STALL_STEPS, int(WARMUP_STALL_SHARE * measured_steps))


# How a rank's steps were found (RankHello's and RankEnd's steps_from); integrations name themselves.
STEPS_FROM_TRACE_STEP = "trace_step"
STEPS_FROM_OPTIMIZER = "optimizer.step() (inferred)"
STEPS_FROM_BACKWARD = "backward() (inferred)"


class RankHello(msgspec.Struct, tag="hello", array_like=True):
    """Sent once per training process when it first connects: who it is and what it runs on."""

    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    host: str
    pid: int
    device: str  # "cpu", "cuda:0", ...
    device_name: str
    device_capacity_bytes: Optional[int]
    torch_version: str
    argv: List[str]
    started_at_unix_s: float  # when the process started
    # The run's shared secret when the collector listens beyond loopback; the collector drops
    # a connection whose hello lacks it, and never stores it.
    token: str = ""
    steps_from: str = ""  # how steps are found: one of STEPS_FROM_*, or a trainer integration
    # Startup, for goodput (it runs from started_at_unix_s, the process's start, to the first
    # step): the time the script spent in its import statements before its first step, as
    # measured under `traceml run` (None: not measured).
    imports_ms: Optional[float] = None
    slowest_import: str = ""  # the top-level module whose import took longest
    modules_imported: int = 0  # the modules the script loaded meanwhile (measured as imports_ms)


class StepRecord(msgspec.Struct, tag="step", array_like=True, gc=False):
    """One optimizer step of one rank.

    The window runs from the end of the previous step to the end of this one. The planned work
    in it (eval_ms, checkpoint_ms) is beside the step, never in step_ms: the seven STEP_PHASES
    add up to step_ms, and step_ms, eval_ms and checkpoint_ms to the window.
    Device-timed phases (CUDA events) are marked by device_timed; gc_ms overlaps the rest.
    Scalars only, so not tracked by the garbage collector (gc=False): thousands of these
    pass through the probe's buffer and must not make the user's collections slower.
    """

    rank: int
    step: int
    start_unix_s: float
    step_ms: float
    input_wait_ms: float
    outside_ms: float
    h2d_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    untraced_ms: float
    gc_ms: float
    gc_collections: int
    forward_calls: int
    samples: int  # batch dimension of the first tensor given to the model, summed over calls
    device_timed: bool = False
    gpu_idle_ms: Optional[float] = None  # device timeline gap before this step's first event
    device_allocated_bytes: Optional[int] = None  # at step end
    device_peak_bytes: Optional[int] = None  # peak during the step (stats reset at step start)
    device_reserved_bytes: Optional[int] = None
    host_rss_bytes: Optional[int] = None  # rate-limited: the latest reading at step end
    # The step's wait for collectives, within its phases (not added to them). Under DDP: the
    # part of backward from this rank's last gradient bucket being ready to backward's end.
    # Under FSDP on the CPU: the time blocked in its all-gathers and reduce-scatters, in forward,
    # backward and the optimizer's step (probe/sharded.py). None where it is not measured.
    comm_wait_ms: Optional[float] = None
    gc_max_pause_ms: float = 0.0  # the longest single collection in the window
    gc_full_collections: int = 0  # generation-2 collections: the ones that walk every object
    gc_gen0_ms: float = 0.0  # gc_ms, by the generation collected
    gc_gen1_ms: float = 0.0
    gc_gen2_ms: float = 0.0
    tokens: int = 0  # token inputs (an integer 2-D first input or input_ids): positions trained, padding in
    real_tokens: Optional[int] = None  # of them, those trained: labels not -100, or mask kept (None: neither)
    # The user's planned work in the window, beside the step (out of outside_ms between steps,
    # out of untraced_ms inside one): evaluation (probe/patches/evaluation.py) and the DataLoader waits
    # between steps with gradients off; time inside the saves (probe/patches/saves.py).
    eval_ms: float = 0.0
    checkpoint_ms: float = 0.0
    instrumented: bool = False  # TraceML slowed this step on purpose (a deep-dive sample)
    # Overlapping too: torch.compile compiling (first compilations and recompilations) in the
    # window, wherever it happened (forward, the lazy backward compile, evaluation).
    compile_ms: float = 0.0
    # Of comm_wait_ms, the parts in forward (FSDP's all-gathers) and in the optimizer's step: the rest is backward's.
    forward_comm_wait_ms: float = 0.0
    optimizer_comm_wait_ms: float = 0.0
    # The training thread's wait for a CPU in the window: ready to run while other threads held
    # the cores (probe/thread_cpu.py: read every 20 ms, spread evenly; None where not known).
    cpu_wait_ms: Optional[float] = None
    # ... and its time on a CPU: what it did, however long the machine kept it waiting.
    on_cpu_ms: Optional[float] = None


class RolledStep(msgspec.Struct):
    """One step across all ranks that reported it: per-phase medians, and the slowest rank.
    Made by the rollup (analysis.rollup.roll_up) and kept in the store's `rolled` table."""

    step: int
    ranks: int
    start_unix_s: float
    step_ms: float
    worst_rank: int
    worst_step_ms: float
    input_wait_ms: float
    outside_ms: float
    h2d_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    untraced_ms: float
    gc_ms: float
    gc_collections: float
    gc_max_pause_ms: float  # the longest pause on any rank
    gc_gen2_ms: float  # of gc_ms, full collections
    samples: int  # summed over ranks: the global batch
    device_timed: bool
    gpu_idle_ms: Optional[float]
    device_allocated_bytes: Optional[int]  # the largest rank's
    device_peak_bytes: Optional[int]
    device_reserved_bytes: Optional[int]
    host_rss_bytes: Optional[int]
    tokens: int = 0  # summed over ranks, padding included
    real_tokens: Optional[int] = None  # summed over the ranks that counted them (labels, a mask)
    eval_ms: float = 0.0  # beside step_ms, never in it: evaluation and checkpoint saves in the window
    checkpoint_ms: float = 0.0
    instrumented: bool = False  # TraceML slowed it on purpose on some rank (a deep-dive sample)
    compile_ms: float = 0.0  # overlapping: torch.compile compiling in the window
    # As StepRecord's: the median rank's collective wait (None unless every rank measured it), of it forward's.
    comm_wait_ms: Optional[float] = None
    forward_comm_wait_ms: float = 0.0


def window_end_unix_s(step: Union[StepRecord, RolledStep]) -> float:
    """Where a step's window ends: its start, its step and the planned work beside it."""
    return step.start_unix_s + (step.step_ms + step.eval_ms + step.checkpoint_ms) / 1e3


class OomRecord(msgspec.Struct, tag="oom", array_like=True):
    """A step that raised an out-of-memory error: where it was and how full memory was."""

    rank: int
    step: int
    phase: str  # the phase in flight: forward, backward, optimizer, h2d, untraced
    layer: Optional[str]  # the module in flight, under deep-dive
    message: str
    allocated_bytes: Optional[int] = None
    reserved_bytes: Optional[int] = None
    peak_bytes: Optional[int] = None
    host_rss_bytes: Optional[int] = None
    largest_layers: List[Tuple[str, int]] = []  # (module, saved bytes), under deep-dive


class LayerStat(msgspec.Struct, array_like=True, gc=False):
    """One module's deep-dive figures, summed over the sampled steps (inclusive of children)."""

    name: str
    kind: str  # the module's class
    leaf: bool  # no child modules: its time and memory are its own
    calls: int
    forward_ms: float
    backward_ms: float
    saved_bytes: int  # tensors saved for backward (parameters excluded)
    output_bytes: int
    allocated_delta_bytes: Optional[int] = None  # on CUDA: allocated after minus before
    alive_bytes: int = 0  # its saved tensors and outputs of the last sampled step still alive after it


class LayerReport(msgspec.Struct, tag="layers", array_like=True):
    """A rank's deep-dive so far: cumulative per-module figures over sampled_steps steps."""

    rank: int
    sampled_steps: int
    every_n_steps: int
    forward_coverage: float  # leaf modules' share of the model's forward time
    backward_coverage: float
    layers: List[LayerStat]
    flops_per_step: Optional[int] = None  # Linear and conv products a step, mean of the samples


class LayerCapture(msgspec.Struct, tag="capture", array_like=True):
    """Deep-dive taken on its own when the probe saw a step go wrong: each module's figures in
    the steps sampled right after (after, summed over after_steps) and in the sample taken
    before (before, summed over before_steps)."""

    rank: int
    step: int  # the step that fired the rule
    reason: str  # CAPTURE_SPIKE, CAPTURE_REGRESSION or CAPTURE_MEMORY
    detail: str  # the numbers that fired it
    before_steps: int
    after_steps: int
    before: List[LayerStat]
    after: List[LayerStat]


CAPTURE_SPIKE = "spike"  # one step far slower than the run's baseline
CAPTURE_REGRESSION = "regression"  # the recent steps' median well above the baseline
CAPTURE_MEMORY = "memory"  # memory held at a step's end jumped


class GpuSample(msgspec.Struct):
    index: int
    utilization_percent: float
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_c: Optional[float] = None
    power_w: Optional[float] = None


class SystemSample(msgspec.Struct, tag="system", array_like=True):
    """One reading of the node by the collector's sampler."""

    unix_s: float
    cpu_percent: float  # whole machine
    ram_used_bytes: int
    ram_total_bytes: int
    training_cpu_percent: float  # the training processes, 100 = one core
    training_rss_bytes: int
    gpus: List[GpuSample] = []
    cpu_count: int = 0  # logical CPUs: cpu_percent's 100 is all of them (0: not known)
    # Time the training ranks' main threads were ready to run but waited for a CPU, 100 = one
    # core's worth (Linux's schedstat): what a busy machine took from the steps, which those
    # threads drive (TraceML's own threads' waits are not the steps'). None: not known.
    training_cpu_wait_percent: Optional[float] = None

    def other_cores(self) -> float:
        """The cores processes other than the training used (negative within a reading's noise;
        meaningless where cpu_count is not known)."""
        return self.cpu_percent / 100.0 * self.cpu_count - self.training_cpu_percent / 100.0


class RankEnd(msgspec.Struct, tag="end", array_like=True):
    """Sent by a training process as it exits: what it sent, what it had to drop, how it ended."""

    rank: int
    exit_code: Optional[int]
    records_sent: int
    records_dropped: int
    steps_from: str = ""  # how steps were found in the end (an explicit trace_step may win late)
    # After the last step's window (which ends where that step ended): when the process ended,
    # and the evaluation and checkpoint saves it ran meanwhile (a final eval, a final save).
    ended_unix_s: Optional[float] = None
    tail_eval_ms: float = 0.0
    tail_checkpoint_ms: float = 0.0
    tail_evaluations: int = 0  # how many
    tail_saves: int = 0


class SpanRecord(msgspec.Struct, tag="span", array_like=True, gc=False):
    """A user span (`tracer.span(name)`) in one step of one rank: its calls summed.

    Spans overlap the phases (like gc): they are shown beside the breakdown, never added to it.
    """

    rank: int
    step: int
    name: str
    start_unix_s: float  # the first call's start
    duration_ms: float  # summed over the calls
    count: int


class ScalarRecord(msgspec.Struct, tag="scalar", array_like=True, gc=False):
    """A value the user logged (`tracer.log_scalar(name, value)`) at a step: a loss, a learning rate."""

    rank: int
    step: int
    name: str
    value: float


class CompileRecord(msgspec.Struct, tag="compile", array_like=True):
    """One compilation by torch.compile (dynamo) of one rank, as torch reported it."""

    rank: int
    step: int  # the step whose window it fell in; -1: before the first step
    start_unix_s: float
    duration_ms: float
    compile_id: str  # torch's "frame/attempt": attempt 0 is a frame's first compilation
    # What torch compiled: "dynamo" (a frame, forward), "lazy_backward" (its backward, at the
    # first backward), "triton_autotuning", "cudagraph_recording".
    trigger: str
    code: str = ""  # the compiled function: name (file:line)
    recompile_reason: str = ""  # the guard that failed (attempt > 0), in torch's words
    graph_breaks: int = 0  # graph breaks torch counted since the previous record
    graph_break_reasons: List[str] = []

    @property
    def recompiled(self) -> bool:
        """A recompilation: a frame's attempt after its first (its guards failed)."""
        return not self.compile_id.endswith("/0")


class SyncSite(msgspec.Struct, array_like=True, gc=False):
    """One line of code that made the host wait for the device, over a sample of steps."""

    site: str  # "train.py:57": the first frame outside torch and TraceML (the user's line)
    code: str  # that line's source, stripped ("loss.item()"); "" when it cannot be read
    call: str  # what synchronized: "Tensor.item", "Tensor.__bool__", "torch.cuda.synchronize", ...
    calls: int  # over the sample's steps
    wait_ms: float  # host time inside those calls, summed: mostly waiting for the device


class HostSyncSample(msgspec.Struct, tag="sync", array_like=True):
    """The host syncs one rank's process made during a sample of consecutive steps (on CUDA
    only: elsewhere the host never waits for a device). Every sample is sent, one without
    syncs too: `steps` is the denominator of the sites' per-step figures."""

    rank: int
    first_step: int
    steps: int
    sites: List[SyncSite] = []


class LoaderSample(msgspec.Struct, tag="loader", array_like=True, gc=False):
    """One training DataLoader iterator of one rank, as its configuration says and as its
    sender saw it work: cumulative figures since it was first seen, sent about once a second
    while it hands batches over. An iterator is one epoch's (or, with persistent_workers, the
    run's); `loader` numbers them in the order the rank made them."""

    rank: int
    loader: int
    unix_s: float
    num_workers: int
    pin_memory: bool  # batches pinned: pin_memory=True with an accelerator to pin for
    persistent_workers: bool
    prefetch_factor: Optional[int]  # None without workers
    batch_size: Optional[int]  # None when the loader does not batch (batch_size=None, a batch sampler of its own)
    usable_cores: int  # CPUs this process may run on (its affinity)
    batches: int  # handed over so far
    worker_cpu_s: float = 0.0  # its worker processes' CPU time so far (user + system)
    # Of the sender's readings (every 20 ms) of the batches made and waiting to be taken: how
    # many, and in how many at least one was waiting (without workers: none are read).
    ready_readings: int = 0
    ready_readings_with_a_batch: int = 0
    # Of its workers' main threads (where the Dataset runs), the time spent ready to run but
    # waiting for a CPU (Linux's schedstat; 0 where it is not known): the cores were taken.
    worker_cpu_wait_s: float = 0.0
    # Its next() calls' time on a thread other than the training's, which iterates it ahead into
    # a buffer (a prefetcher: MONAI's ThreadDataLoader): what that thread spends to get each
    # batch. 0: iterated on the training thread.
    thread_next_s: float = 0.0


class CodeSite(msgspec.Struct, array_like=True, gc=False):
    """A function (at its line sampled most) or a top-level statement the training thread was sampled in."""
    file: str
    line: int
    function: str  # "<module>": a top-level statement
    seconds: float  # the time its samples stand for: each, the time since the sampler's round before
    importing_s: float = 0.0  # of it, inside a module import (startup)
    statement: int = 0  # startup: the script's top-level line it ran under (0: the site is that line)


class CodeSample(msgspec.Struct, tag="code", array_like=True):
    """Where a rank's training thread was in one part (probe/code_sites.CODE_PARTS): cumulative."""
    rank: int
    part: str
    samples: int
    seconds: float  # the time they stand for: the sites' denominator
    sites: List[CodeSite] = []  # the most time first


class MemoryLedger(msgspec.Struct, tag="ledger", array_like=True):
    """What holds one rank's memory, as its sender read it (probe/ledger.py): sent when a
    figure moves. Bytes count each storage once (tied weights, views); a sharded parameter
    counts its local shard. What else memory holds (the rest, the allocator's cache) is the
    step records' figures minus these (analysis/ledger.py)."""

    rank: int
    step: int  # the last step ended when it was read
    unix_s: float
    trainable_bytes: int  # parameters with requires_grad
    frozen_bytes: int
    trainable_dtypes: Dict[str, int]  # bytes by dtype ("float32", "bfloat16", "uint8" for 4-bit)
    frozen_dtypes: Dict[str, int]
    parameters: int  # elements, trainable and frozen (a sharded one's full size)
    trainable_parameters: int
    gradient_bytes: int  # of trainable parameters, the last gradient each had
    optimizer_state_bytes: Dict[str, int]  # by optimizer ("AdamW", "SGD 2"): its state's tensors
    # Saved for backward at the peak of the latest sampled step (None: no step sampled yet).
    activation_bytes: Optional[int] = None
    activation_step: Optional[int] = None
    # Adapters (PEFT: lora_* parameters, modules_to_save): a part of the parameters above, with
    # their gradients and optimizer state, and their parameter bytes by target module kind.
    adapter: str = ""  # "LoRA"; "" without adapters
    adapter_rank: Optional[int] = None  # LoRA's r
    adapter_parameters: int = 0  # elements
    adapter_parameter_bytes: int = 0
    adapter_gradient_bytes: int = 0
    adapter_optimizer_bytes: int = 0
    adapter_targets: Dict[str, int] = {}  # "q_proj" -> bytes
    # Sharded parameters (FSDP): what they would take unsharded; None when none is sharded.
    unsharded_parameter_bytes: Optional[int] = None
    # ... and their gradients and optimizer state unsharded (None: none is sharded).
    unsharded_gradient_bytes: Optional[int] = None
    unsharded_optimizer_bytes: Optional[int] = None
    # FSDP2: the most parameter bytes held all-gathered at once on a watched step, in forward
    # and in backward (probe/sharded.py; None: not seen, or no all-gather in that phase).
    gathered_forward_peak_bytes: Optional[int] = None
    gathered_backward_peak_bytes: Optional[int] = None
    # The DeviceMesh the sharded parameters live on: its dimensions' names and sizes, and this
    # rank's coordinate on each (empty: no DTensor parameter).
    mesh_dims: Dict[str, int] = {}
    mesh_coordinate: Dict[str, int] = {}
    # What shards the model: "FSDP2", "FSDP1", "DeepSpeed ZeRO-2" ("": nothing, or DDP).
    sharded_by: str = ""


def adapter_target(name: str) -> Optional[str]:
    """For the ledger's adapter group: the target module kind an adapter parameter belongs to ("q_proj" for
    `...self_attn.q_proj.lora_A.default.weight`, "lm_head" for `lm_head.modules_to_save.default.weight`),
    or None when the parameter is no adapter's."""
    if "lora_" not in name and "modules_to_save" not in name:  # most parameters: no split
        return None
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.startswith("lora_") or part == "modules_to_save":
            return parts[index - 1] if index else part
    return None


PULSE_AFTER_S = 5.0  # a rank this long without ending a step starts sending pulses
PULSE_EVERY_S = 5.0


class RankPulse(msgspec.Struct, tag="pulse", array_like=True):
    """Where a rank's training thread is while it ends no step (probe/pulse.py): sent by the
    sender thread once the rank has gone PULSE_AFTER_S without ending a step, then every
    PULSE_EVERY_S while that lasts. The collector's hang watch reads it (diagnose/hangs.py)."""

    rank: int
    unix_s: float
    steps_ended: int  # the steps this rank has ended so far
    since_progress_s: float  # since it last ended a step (or since its probe started)
    phase: str  # what the training thread is in: a timed Phase, Phase.OUTSIDE (between steps) or a Beside
    # The user's frames of the training thread's stack, innermost first: (file, line, function);
    # not the standard library's, an installed package's or TraceML's.
    stack: List[Tuple[str, int, str]] = []
    innermost: str = ""  # the innermost frame of all, "file.py:12 function": the call it waits in
    waiting_in: str = ""  # "all_reduce" (a torch.distributed collective), "DataLoader", or ""
    pid: int = 0
    # The collectives this rank has issued on its default process group so far (its sequence
    # number; -1: not distributed, or unread): a rank one short of the others skipped one.
    collectives_issued: int = -1
    # In a DataLoader wait: the worker whose batch is awaited, its pid and its state as the
    # kernel gives it ("sleeping", "running", "disk wait", "gone"); -1, 0, "" otherwise.
    loader_worker: int = -1
    loader_worker_pid: int = 0
    loader_worker_state: str = ""
    # The same count on each other process group the rank belongs to (a DeviceMesh dimension's,
    # a new_group's), by the group's label ("ranks 0, 2"): the same label on every member.
    subgroup_collectives: Dict[str, int] = {}
    # The label of the group the collective it waits in was issued on ("world": the default
    # group); "" when it waits in none, or the call does not say.
    waiting_group: str = ""


class FindingKind(StrEnum):
    """What a Finding is about: the one list of kinds (docs/phases-and-verdicts.md says what each means).
    A member is its own name as a string, so the JSON, the store and /metrics hold plain text."""

    INSUFFICIENT_DATA = "INSUFFICIENT_DATA"
    INPUT_BOUND = "INPUT_BOUND"
    H2D_BOUND = "H2D_BOUND"
    UNTRACED_WORK = "UNTRACED_WORK"
    GC_PRESSURE = "GC_PRESSURE"
    COMPUTE_BOUND = "COMPUTE_BOUND"
    STEP_SPIKES = "STEP_SPIKES"
    EVAL_HEAVY = "EVAL_HEAVY"
    CHECKPOINT_STALL = "CHECKPOINT_STALL"
    RECOMPILATION = "RECOMPILATION"
    SLOW_STARTUP = "SLOW_STARTUP"
    HOST_SYNC = "HOST_SYNC"
    MEMORY_CREEP = "MEMORY_CREEP"
    MEMORY_PRESSURE = "MEMORY_PRESSURE"
    INPUT_STRAGGLER = "INPUT_STRAGGLER"
    COMPUTE_STRAGGLER = "COMPUTE_STRAGGLER"
    STRAGGLER = "STRAGGLER"
    COMM_BOUND = "COMM_BOUND"
    HANG = "HANG"
    RANK_LOST = "RANK_LOST"


# The kinds that name one rank as the others' wait.
STRAGGLER_KINDS = frozenset((FindingKind.INPUT_STRAGGLER, FindingKind.COMPUTE_STRAGGLER, FindingKind.STRAGGLER))


class Severity(StrEnum):
    """How bad a Finding is; ALERT_SEVERITIES are the ones worth telling someone about."""

    INFO = "info"
    WARN = "warn"
    CRIT = "crit"


ALERT_SEVERITIES = frozenset((Severity.WARN, Severity.CRIT))


# An evidence figure: a number, a word, or a short list (a launcher's stopped ranks, a spike's steps).
EvidenceFigure = Union[float, int, str, None, Sequence[Union[int, str, Mapping[str, Union[float, int, None]]]]]
Evidence = Dict[str, EvidenceFigure]


class Finding(msgspec.Struct, omit_defaults=False):
    """One diagnosis: what is wrong, by how much, and the next thing to try."""

    # A FindingKind and a Severity, as text: a run with kinds a later TraceML added still reads.
    kind: str
    severity: str
    summary: str
    action: str
    rank: Optional[int] = None
    evidence: Evidence = {}

    def figure(self, key: str) -> float:
        """An evidence figure as a number (0.0 where it is missing or no number)."""
        value = self.evidence.get(key)
        return float(value) if isinstance(value, (int, float)) else 0.0
