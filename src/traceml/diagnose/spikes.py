"""Slow steps: stall episodes, their period and their cause, warm-up transients, and the user's
planned work between steps (evaluation, checkpoint saves). Findings: STEP_SPIKES, EVAL_HEAVY,
CHECKPOINT_STALL.

A slow step is far above the median (robust z-score) and at least twice it. Consecutive slow
steps are one episode (a stall lasts as long as it lasts); a period needs at least three
episodes at the same gap of two steps or more. A few stalls far above the rest (an evaluation
that compiled, one long pause) are outliers: named apart, never the typical figure, and never
hiding the period of the others. Episodes early in the run that never come back are warm-up
(the allocator, optimizer state, caches): noted, never a finding. Steps TraceML slowed on
purpose (a deep-dive sample) are left out. When every phase grows in the slow steps, no single
part of the step is to blame: the machine stalled, and the system sampler says whether other
processes were using the CPU at the time.
"""
from __future__ import annotations

import statistics
from collections import Counter
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, TypedDict

import msgspec

from traceml.analysis.goodput import Goodput
from traceml.analysis.rollup import Window, WindowStep
from traceml.records import (ALL_PHASES, STEP_PHASES, Evidence, Finding, FindingKind, Severity, SystemSample,
                             warmup_stall_horizon)
from traceml.words import counted, duration, every, times

MIN_Z = 6.0  # robust z-score (median and MAD) a step must pass to be slow
MIN_RATIO = 2.0  # ... and it must take this many times the median step (a busy machine's
                 # jitter reaches 1.5x; the stalls worth naming are longer)
PART_MIN_EXCESS = 0.5  # a part of the step stalls when it grows by this share of the median step
SOMETIMES_PARTS = ("untraced", "outside", "input_wait", "gc")  # parts that stall on their own
MAJOR_SHARE = 0.25  # a slow step counts when its excess is at least this share of the largest's
MIN_REPEATS = 3  # episodes at one gap that make a period
MIN_GAP = 2  # steps between the starts of two episodes of a period
PERIODIC_SHARE = 0.6  # this share of the gaps between episodes equal: a period
WARN_COST_SHARE = 0.05  # stalls costing this share of the run's time: warn (below: info)
EXPLAINED_SHARE = 0.5  # a cause (one phase, planned work) that accounts for this much of the excess
MACHINE_GROWTH = 0.3  # every part of the step this much longer in the slow steps: the machine
MACHINE_PART_SHARE = 0.1  # ... every part that is at least this share of the median step
OTHER_CPU_CORES = 0.5  # other processes using this many cores: the CPU is contended
BIGGER_INPUT_RATIO = 1.5  # slow steps with this many times the usual samples or tokens: bigger inputs
EVAL_LINE = 0.15  # evaluation at this share of the run bounds it; below, it is noted
CHECKPOINT_LINE = 0.05  # checkpoint saves at this share of the run bound it
PLANNED_NOTE_SHARE = 0.01  # planned work below this share of the run is not worth a line
PLANNED_FLOOR_MS = 0.5  # a window holds an evaluation (a save) when it holds this much of one...
PLANNED_NOISE_SHARE = 0.1  # ... and this share of the median window that holds any: a median,
                           # which one evaluation ten times slower cannot inflate as it does the largest;
                           # or at least the median step: a stray batch fetched without gradients is a
                           # forward alone, less than a step, while on a busy machine one evaluation
                           # can take twelve times another's
PLANNED_ELSEWHERE_SHARE = 0.02  # planned work outside the windows counted (the warm-up steps):
                                # said when it is this share of all of it
OUTLIER_RATIO = 5.0  # a slow step, an evaluation or a save this many times the median one is an
                     # outlier: named apart and left out of the typical figure (a busy machine
                     # stretches short work two or three times; a first evaluation that loads its
                     # data or compiles takes ten)

ACTIONS = {
    "outside": ("A periodic task between steps (logging, metrics, a sync) stalls training: "
                "make it asynchronous or run it less often."),
    "untraced": ("Work inside the step that runs only sometimes (metrics, a .item() sync, a "
                 "synchronous save) stalls it: move it out of the step, make it asynchronous, "
                 "or run it less often."),
    "input_wait": ("The DataLoader stalls now and then (a worker restarting each epoch, a slow "
                   "shard, an uneven file): use persistent_workers=True, a larger "
                   "prefetch_factor, and look for unusually slow samples."),
    "gc": ("Full garbage collections stall the step: gc.freeze() after setup, or collect "
           "explicitly every N steps at a moment of your choosing."),
}
DEFAULT_ACTION = ("Some steps do much more {phase} work than others: look for inputs that vary "
                  "in size (bucket by length) or work that happens only every few steps.")
BIGGER_INPUT_ACTION = ("Some batches are much larger than the rest (variable-length samples, a "
                       "last or merged batch, a sampler that groups): bucket samples by length, cap "
                       "the batch's tokens, or drop_last=True, so every step does similar work.")
MACHINE_ACTION = ("Something else on this machine competes with the training (another job, "
                  "data preparation, a backup): run it elsewhere or at another time, give the "
                  "training dedicated cores (taskset, the scheduler's CPU binding), and set "
                  "OMP_NUM_THREADS to the cores it really has.")
EVAL_ACTION = ("Evaluation is the run's plan, not a fault; if it costs too much: evaluate less "
               "often or on fewer batches, under torch.inference_mode() with a larger batch, or "
               "asynchronously on a copy of the weights.")
CHECKPOINT_ACTION = ("Save asynchronously (torch.distributed.checkpoint.async_save, or copy the "
                     "state to host memory and write it from a thread), save less often, and save "
                     "only what resuming needs.")


class WarmupTransient(TypedDict):
    """Slow early steps that never came back (the summary's steps.warmup_transients)."""

    first_step: int
    steps: int
    excess_ms: float


class Episode(msgspec.Struct):
    """Consecutive slow steps: one stall."""

    first_step: int
    steps: int
    excess_ms: float  # over the median step, summed
    peak_excess_ms: float  # the slowest step's


class Stalls:
    """The slow steps of a window, grouped into episodes, with what they have in common.

    Computed once per window (diagnose builds it) and read by the rules that a periodic cause
    explains, so one cause gives one finding.
    """

    def __init__(self, window: Window, system: Sequence[SystemSample] = ()):
        # Steps TraceML slowed on purpose, and steps torch.compile compiled in, are left out:
        # a compilation is told by RECOMPILATION, never as a stall.
        steps = [s for s in window.steps if not s.instrumented and not s.compile_ms]
        self.total_ms = window.total_ms
        self.median_ms = statistics.median(s.step_ms for s in steps) if steps else 0.0
        self.episodes: List[Episode] = []
        self.warmup: List[Episode] = []
        self.slow: List[WindowStep] = []
        self.outliers: List[WindowStep] = []  # slow steps far slower than the typical one
        self._regular: List[WindowStep] = []  # the other slow steps: the typical figures' own
        self._normal: List[WindowStep] = []  # the steps in no stall
        self.usual_ms: Dict[str, float] = {}  # each figure's median in the steps in no stall
        self.period: Optional[int] = None
        self.growth_ms: Dict[str, float] = {}
        self.phase = ""  # the phase that grows most in the slow steps
        self.machine_wide = False
        self.other_cpu_cores: Optional[float] = None
        self.input_ratio: Optional[float] = None  # the slow steps' samples (or tokens) over the usual
        self.input_measure = "samples"
        if len(steps) < 10:
            return
        # Stalls of the whole step first; when they have no period, a part of the step that
        # stalls on its own period (a sync every 10th step) is found in that part's figures,
        # which a busy machine's jitter in the compute phases does not drown.
        found = _stall_episodes(steps, [s.step_ms for s in steps], (MIN_RATIO - 1.0) * self.median_ms)
        if found is None or _period([e.first_step for e in found.episodes]) is None:
            by_part = [_stall_episodes(steps, [getattr(s, f"{part}_ms") for s in steps],
                                       PART_MIN_EXCESS * self.median_ms) for part in SOMETIMES_PARTS]
            # Steps that carry bigger inputs are marked by them, however much the rest jitter.
            by_part.append(_bigger_input_episodes(steps, self.median_ms))
            periodic = [f for f in by_part if f is not None and _period([e.first_step for e in f.episodes])]
            if periodic:
                found = max(periodic, key=lambda f: sum(e.excess_ms for e in f.episodes))
        if found is None:
            return
        self.episodes, self.warmup = found.episodes, found.warmup
        if not self.episodes:
            return
        in_episode = {e.first_step + i for e in self.episodes for i in range(e.steps)}
        stalled = {e.first_step + i for e in found.episodes + found.minor + found.warmup
                   for i in range(e.steps)}
        self.slow = [s for s in steps if s.step in in_episode]
        _, outliers = _typical([s.step_ms - self.median_ms for s in self.slow])
        self.outliers = [self.slow[i] for i in outliers]
        self._regular = [s for i, s in enumerate(self.slow) if i not in outliers]
        normal = self._normal = [s for s in steps if s.step not in stalled]
        self.usual_ms = {name: statistics.median(getattr(s, f"{name}_ms") for s in normal) if normal else 0.0
                         for name in ALL_PHASES}
        # How much longer each part is in the typical slow step (the mean of all but the
        # outliers, which tell their own): so many slow steps times it, and the outliers, are the cost.
        self.growth_ms = {name: statistics.fmean(getattr(s, f"{name}_ms") for s in self._regular) - usual
                          for name, usual in self.usual_ms.items()}
        self.phase = max(ALL_PHASES, key=lambda name: self.growth_ms[name])
        self.other_cpu_cores = _other_cpu_cores(system, self.slow)
        self.period = self._loops_own_period()
        self.input_ratio, self.input_measure = _input_ratio(self.slow, normal)
        self.machine_wide = self._machine_wide()

    def _loops_own_period(self) -> Optional[int]:
        """The episodes' period, unless the scheduler may have made it. Other processes taking
        turns with the training on the CPU stall it at a rhythm of their own, and a few time
        slices lost by steps of a steady pace fall on a period by chance (every 17 steps, 4 ms
        each, 1% of the run, beside a busy loop). Stalls that cheap are then told as irregular
        ones are: not at all."""
        period = _period([e.first_step for e in self.episodes])
        if period is not None and self.contended and self.cost_share < WARN_COST_SHARE:
            return None
        return period

    @property
    def cost_ms(self) -> float:
        """The slow steps' time over the median step (a part's stall counts the whole step it slowed)."""
        return sum(s.step_ms - self.median_ms for s in self.slow)

    @property
    def cost_share(self) -> float:
        return self.cost_ms / self.total_ms if self.total_ms else 0.0

    @property
    def excess_ms(self) -> float:
        """How much longer the typical slow step (outliers aside) is than the median step."""
        return statistics.fmean(s.step_ms for s in self._regular) - self.median_ms if self._regular else 0.0

    def phase_excess_ms(self, phase: str, steps: Optional[List[WindowStep]] = None) -> List[float]:
        """Each slow step's time in this phase over its usual time (or these steps')."""
        usual_ms = self.usual_ms[phase]
        return [getattr(s, f"{phase}_ms") - usual_ms for s in (self.slow if steps is None else steps)]

    def phase_cost_share(self, phase: str) -> float:
        """The share of the run's time this phase takes over its usual in the slow steps."""
        return sum(self.phase_excess_ms(phase)) / self.total_ms if self.total_ms else 0.0

    def explained_by(self, *names: str) -> bool:
        """Whether these phases account for the slow steps' excess."""
        if not self.slow:
            return False

        def together(step: WindowStep) -> float:
            return float(sum(getattr(step, f"{name}_ms") for name in names))

        growth = statistics.fmean(map(together, self._regular)) - (
            statistics.median(map(together, self._normal)) if self._normal else 0.0)
        return growth >= EXPLAINED_SHARE * self.excess_ms

    def when(self) -> str:
        """How often: "every 20 steps", or how many times."""
        if self.period:
            return every(self.period, "step")
        longest = max(e.steps for e in self.episodes)
        if len(self.episodes) == 1:
            return "once" + (f", {longest} steps in a row" if longest > 1 else "")
        in_a_row = f", the longest {longest} steps in a row" if longest > 1 else ""
        return f"{times(len(self.episodes))}, irregularly{in_a_row}"

    def evidence(self) -> Evidence:
        return {"episodes": len(self.episodes), "slow_steps": len(self.slow),
                "period_steps": self.period, "phase": self.phase,
                "phase_growth_ms": round(self.growth_ms.get(self.phase, 0.0), 3),
                "spike_median_ms": round(self.median_ms + self.excess_ms, 3),
                "step_median_ms": round(self.median_ms, 3),
                "first_spike_step": self.episodes[0].first_step if self.episodes else None,
                "longest_episode_steps": max((e.steps for e in self.episodes), default=0),
                "outliers": [{"step": s.step, "ms": round(s.step_ms, 3)} for s in self.outliers],
                "cost_ms": round(self.cost_ms, 3), "steps_total_ms": round(self.total_ms, 3)}

    def warmup_note(self) -> List[WarmupTransient]:
        """The warm-up transients, for the summary: slow early steps that did not come back."""
        return [{"first_step": e.first_step, "steps": e.steps, "excess_ms": round(e.excess_ms, 3)}
                for e in self.warmup]

    @property
    def bigger_inputs(self) -> bool:
        """The slow steps carry more samples or tokens than the usual ones: more work, not a stall."""
        return self.input_ratio is not None and self.input_ratio >= BIGGER_INPUT_RATIO

    def _machine_wide(self) -> bool:
        """Every part of the step that counts slowed at once (a stall of one cause grows one
        part), or, while other processes took the CPU, stalls that no part explains or that come
        at no period (a descheduled process stalls in whichever phase it was in). Never when the
        slow steps carry bigger inputs: their work grows every phase."""
        if self.bigger_inputs:
            return False
        usual = self.usual_ms
        parts = [name for name in STEP_PHASES if usual[name] >= MACHINE_PART_SHARE * self.median_ms]
        if parts and all(self.growth_ms[name] >= MACHINE_GROWTH * usual[name] for name in parts):
            return True
        return (self.period is None or not self.explained_by(self.phase)) and self.contended

    @property
    def contended(self) -> bool:
        """Other processes used at least OTHER_CPU_CORES while the slow steps ran."""
        return self.other_cpu_cores is not None and self.other_cpu_cores >= OTHER_CPU_CORES


def step_spikes(stalls: Stalls) -> Optional[Finding]:
    """Slow steps that no share-based finding or planned work explains (diagnose decides)."""
    if not stalls.episodes:
        return None
    cost = stalls.cost_share
    if stalls.period is None and cost < WARN_COST_SHARE:
        return None  # a few irregular hiccups that cost little: noise, not a finding
    slow_ms = stalls.median_ms + stalls.excess_ms
    one = len(stalls.slow) == 1
    they, them, cost_verb = ("it", "it", "costs") if one else ("they", "them", "cost")
    outliers = [(s.step, s.step_ms) for s in stalls.outliers]
    slow_steps = (f"{counted(len(stalls.slow), 'step')} "
                  + (f"are slow: {_some_of_about(len(stalls.slow), slow_ms, outliers, 1)}," if outliers else
                     f"take{'s' if one else ' about'} {slow_ms:.1f} ms")
                  + f" against a median of {stalls.median_ms:.1f} ms")
    cost_words = (f"{they} {cost_verb} {duration(stalls.cost_ms)} over the median step, {cost:.1%} of the "
                  f"{duration(stalls.total_ms)} of measured steps")
    evidence = {**stalls.evidence(), "share": round(cost, 4), "machine_wide": stalls.machine_wide,
                "input_ratio": None if stalls.input_ratio is None else round(stalls.input_ratio, 2),
                "other_cpu_cores": None if stalls.other_cpu_cores is None else round(stalls.other_cpu_cores, 2)}
    if stalls.machine_wide:
        busy = (f"; other processes used {stalls.other_cpu_cores:.1f} CPU cores meanwhile"
                if stalls.contended else "")
        summary = (f"the machine stalls the training {stalls.when()}: {slow_steps}, every phase "
                   f"slower at once{busy}; {cost_words}")
        action = MACHINE_ACTION
    else:
        phase = stalls.phase
        inputs = (f"; {they} carr{'ies' if one else 'y'} {stalls.input_ratio:.1f}x the usual step's "
                  f"{stalls.input_measure}" if stalls.bigger_inputs else "")
        summary = (f"{slow_steps}, {stalls.when()}; {phase.replace('_', ' ')} grows by "
                   f"{stalls.growth_ms[phase]:.1f} ms in {them}{inputs}; {cost_words}")
        action = (BIGGER_INPUT_ACTION if stalls.bigger_inputs
                  else ACTIONS.get(phase, DEFAULT_ACTION.format(phase=phase)))
    return Finding(kind=FindingKind.STEP_SPIKES, severity=Severity.WARN if cost >= WARN_COST_SHARE else Severity.INFO,
                   summary=summary, action=action, evidence=evidence)


def periodic(finding: Finding, stalls: Stalls, what: str, phase: str) -> Finding:
    """A share-based finding whose time comes from the stalls: told once, by its cause and period
    ("every 20 steps, untraced work inside the step takes 104 ms in 5 steps against a median step of
    8.0 ms: 520 ms, 60.0% of the 867 ms of measured steps, 66.0% with its time in the other steps").
    The stalls' own share first (their count times the typical figure, and the outliers named apart);
    the finding's, when it reads otherwise, after it: the same work in the other steps as well."""
    share = finding.evidence["share"]
    stall_share = stalls.phase_cost_share(phase)
    stall_ms = stall_share * stalls.total_ms
    outliers_ms = stalls.phase_excess_ms(phase, stalls.outliers)
    outliers = [(s.step, ms) for s, ms in zip(stalls.outliers, outliers_ms)]
    count, growth_ms = len(stalls.slow), stalls.growth_ms[phase]
    takes = (f"more in {counted(count, 'step')}: {_some_of_about(count, growth_ms, outliers, 0)},"
             if outliers else f"{growth_ms:.0f} ms in {counted(count, 'step')}")
    rest = f", {share:.1%} with its time in the other steps" if f"{share:.1%}" != f"{stall_share:.1%}" else ""
    summary = (f"{stalls.when()}, {what} takes {takes} against a median step of {stalls.median_ms:.1f} ms: "
               f"{duration(stall_ms)}, {stall_share:.1%} of the {duration(stalls.total_ms)} of measured steps{rest}")
    evidence = {**finding.evidence, **stalls.evidence(), "share": share, "stall_share": round(stall_share, 4),
                "periodic": True, "stall_ms": round(stall_ms, 3),
                "outliers": [{"step": step, "ms": round(ms, 3)} for step, ms in outliers]}
    return Finding(kind=finding.kind, severity=finding.severity, summary=summary,
                   action=ACTIONS.get(phase, finding.action), rank=finding.rank, evidence=evidence)


def planned_work(window: Window, goodput: Optional[Goodput] = None) -> List[Finding]:
    """Evaluation and checkpoint saves ("evaluated 5 times: 4 of about 36 ms, one of 402 ms at
    step 500, and 402 ms elsewhere: 948 ms, 3.2% of the 29.4 s run"): a note, unless more than
    their line of the run (goodput's, else the window's steps and their planned work). Each
    window that holds some counts once, and each one after the last step; the typical one times
    its count, the outliers and what the windows counted missed (the warm-up) add up to the total."""
    found = []
    after_last_step = goodput.after_last_step if goodput is not None else {}
    run_ms = (goodput.wall_s * 1e3 if goodput is not None
              else window.total_ms + sum(s.eval_ms + s.checkpoint_ms for s in window.steps))
    window_median_ms = statistics.median(s.step_ms for s in window.steps) if window.steps else 0.0
    for kind, name, part, line, verb, action in (
            (FindingKind.EVAL_HEAVY, "eval", "evaluation", EVAL_LINE, "evaluated", EVAL_ACTION),
            (FindingKind.CHECKPOINT_STALL, "checkpoint", "checkpoint", CHECKPOINT_LINE, "saved a checkpoint",
             CHECKPOINT_ACTION)):
        figure = f"{name}_ms"
        in_steps = [(s.step, getattr(s, figure)) for s in window.steps]
        total_ms = goodput.seconds(part) * 1e3 if goodput is not None else sum(ms for _, ms in in_steps)
        share = total_ms / run_ms if run_ms else 0.0
        after = after_last_step.get(part, {})
        after_count = max(1, int(after.get("count", 0)))  # a run stored before they were counted: one
        after_each_ms = after.get("ms", 0.0) / after_count
        occurrences = _occurrences(in_steps + [(None, after_each_ms)] * after_count, window_median_ms)
        if share < PLANNED_NOTE_SHARE or not occurrences:
            continue
        durations_ms = [ms for _, ms in occurrences]
        each_ms, outlier_indexes = _typical(durations_ms)
        outliers = [occurrences[i] for i in outlier_indexes]
        period = _period([step for step, _ in occurrences if step is not None])  # outliers in it
        after_ms = sum(ms for step, ms in occurrences if step is None)
        after_count = sum(step is None for step, _ in occurrences)
        if len(occurrences) == 1:
            when, amounts = ["after the last step" if after_ms else f"at step {occurrences[0][0]}"], f"{each_ms:.0f} ms"
        else:
            last = "the last" if after_count == 1 else f"the last {after_count}"
            when = ([every(period, "step")] if period else []) + (
                [f"{last} after the last step"] if after_ms and (None, after_each_ms) not in outliers else [])
            amounts = (_some_of_about(len(occurrences), each_ms, outliers, 0) if outliers
                       else f"about {each_ms:.0f} ms each")
        elsewhere_ms = max(0.0, total_ms - sum(durations_ms))
        if elsewhere_ms >= PLANNED_ELSEWHERE_SHARE * total_ms:
            amounts += f", and {elsewhere_ms:.0f} ms elsewhere"
        elif len(occurrences) == 1:
            amounts = ""  # the total says it
        severity = Severity.CRIT if share >= 2 * line else Severity.WARN if share >= line else Severity.INFO
        found.append(Finding(
            kind=kind, severity=severity,
            summary=(f"{verb} {times(len(occurrences))}" + (f" ({', '.join(when)})" if when else "")
                     + (f": {amounts}" if amounts else "") + f": {duration(total_ms)}, {share:.1%} of the "
                     f"{duration(run_ms)} run"),
            action=action,
            evidence={"share": round(share, 4), "count": len(occurrences), "each_ms": round(each_ms, 3),
                      "period_steps": period, "outliers": [{"step": step, "ms": round(ms, 3)} for step, ms in outliers],
                      "first_step": occurrences[0][0], "after_last_step_ms": round(after_ms, 3),
                      "after_last_step_count": after_count, "elsewhere_ms": round(elsewhere_ms, 3),
                      "total_ms": round(total_ms, 3), "run_ms": round(run_ms, 3), "line": line}))
    return found


def _occurrences(windows: Sequence[Tuple[Optional[int], float]],
                 step_median_ms: float) -> List[Tuple[Optional[int], float]]:
    """The windows (step, ms; None: after the last step) that held an evaluation (or a save):
    over an absolute floor, and over a share of the median window that held any or as long as
    the median step (see PLANNED_NOISE_SHARE)."""
    held = [(step, ms) for step, ms in windows if ms >= PLANNED_FLOOR_MS]
    if not held:
        return []
    line_ms = min(PLANNED_NOISE_SHARE * statistics.median(ms for _, ms in held), step_median_ms)
    return [(step, ms) for step, ms in held if ms >= max(line_ms, PLANNED_FLOOR_MS)]


def _typical(values: Sequence[float]) -> Tuple[float, List[int]]:
    """The typical value of some occurrences and the outliers' indexes: those OUTLIER_RATIO times
    the median or more (fewer than half, always). The typical value is the mean of the others,
    so that their count times it, and the outliers, add up to the whole."""
    if not values:
        return 0.0, []
    median = statistics.median(values)
    outliers = [i for i, value in enumerate(values) if median > 0 and value >= OUTLIER_RATIO * median]
    return statistics.fmean(v for i, v in enumerate(values) if i not in outliers), outliers


def _some_of_about(count: int, typical_ms: float, outliers: Sequence[Tuple[Optional[int], float]],
                   digits: int) -> str:
    """"4 of about 36 ms, one of 402 ms at step 500": the typical ones and each outlier (step, ms;
    step None: after the last step), so that the parts of a total can be added up."""
    told = [f"{ms:.{digits}f} ms " + ("after the last step" if step is None else f"at step {step}")
            for step, ms in sorted(outliers, key=lambda outlier: (outlier[0] is None, outlier[0] or 0))]
    said = f"{count - len(told)} of about {typical_ms:.{digits}f} ms"
    if len(told) == 1:
        return f"{said}, one of {told[0]}"
    return f"{said}, {len(told)} of {', '.join(told[:-1])} and {told[-1]}" if told else said


def _outlier_words(values_ms: Sequence[float], digits: int = 0) -> str:
    """" (one of them 1200 ms)", " (2 of them: 1200 and 1500 ms)", " (5 of them, 800 to 1500 ms)"."""
    values = sorted(values_ms)
    if not values:
        return ""
    if len(values) == 1:
        return f" (one of them {values[0]:.{digits}f} ms)"
    if len(values) == 2:
        return f" (2 of them: {values[0]:.{digits}f} and {values[1]:.{digits}f} ms)"
    return f" ({len(values)} of them, {values[0]:.{digits}f} to {values[-1]:.{digits}f} ms)"


class _Found(NamedTuple):
    episodes: List[Episode]  # the stalls that matter
    minor: List[Episode]  # hiccups much smaller than the largest stall
    warmup: List[Episode]  # early stalls that never came back


def _stall_episodes(steps: List[WindowStep], values_ms: List[float], min_excess_ms: float) -> Optional[_Found]:
    """The episodes of slow values (far above their median by a robust z-score, and by at
    least min_excess_ms), or None when no value is slow."""
    median = statistics.median(values_ms)
    mad = statistics.median(abs(v - median) for v in values_ms) or max(median, 1e-3) * 0.01
    episodes = _episodes([(step.step, value - median) for step, value in zip(steps, values_ms)
                          if 0.6745 * (value - median) / mad > MIN_Z and value - median > min_excess_ms])
    horizon = warmup_stall_horizon(steps[0].step, len(steps))
    early = [e for e in episodes if e.first_step < horizon]
    later = [e for e in episodes if e.first_step >= horizon]
    warmup: List[Episode] = []
    if early and not any(e.peak_excess_ms >= MAJOR_SHARE * max(x.peak_excess_ms for x in early)
                         for e in later):
        warmup, episodes = early, later
    if not episodes:
        return None if not warmup else _Found([], [], warmup)
    # Short steps have jittery hiccups too: the stalls that matter are those of the same order
    # as the largest one; smaller ones would blur the period. But a few outliers (OUTLIER_RATIO
    # times the next largest, fewer than a period's repeats) must not hide the period of the
    # others: measured against the largest of the others, when that finds a period.
    def period_above(reference: float) -> Optional[int]:
        return _period([e.first_step for e in episodes if e.peak_excess_ms >= MAJOR_SHARE * reference])

    peaks = sorted((e.peak_excess_ms for e in episodes), reverse=True)
    reference = peaks[0]
    if period_above(reference) is None:
        for above, below in zip(peaks[:MIN_REPEATS - 1], peaks[1:MIN_REPEATS]):
            if above >= OUTLIER_RATIO * below and period_above(below):
                reference = below
                break
    return _Found([e for e in episodes if e.peak_excess_ms >= MAJOR_SHARE * reference],
                  [e for e in episodes if e.peak_excess_ms < MAJOR_SHARE * reference], warmup)


def _episodes(slow: List[Tuple[int, float]]) -> List[Episode]:
    """Consecutive slow steps (step, excess over the median) grouped: one episode each run."""
    episodes: List[Episode] = []
    for step_number, excess in slow:
        if episodes and step_number == episodes[-1].first_step + episodes[-1].steps:
            episode = episodes[-1]
            episode.steps += 1
            episode.excess_ms += excess
            episode.peak_excess_ms = max(episode.peak_excess_ms, excess)
        else:
            episodes.append(Episode(first_step=step_number, steps=1, excess_ms=excess,
                                    peak_excess_ms=excess))
    return episodes


def _period(starts: List[int]) -> Optional[int]:
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    if len(gaps) < MIN_REPEATS - 1:
        return None
    gap, count = Counter(gaps).most_common(1)[0]
    return gap if gap >= MIN_GAP and count >= PERIODIC_SHARE * len(gaps) else None


def _usual_input(steps: List[WindowStep]) -> Tuple[Optional[str], float]:
    """What a step's input is counted in (tokens, or samples when tokens are not counted) and
    its median over these steps; (None, 0) when neither is."""
    for field in ("tokens", "samples"):
        usual = statistics.median(getattr(s, field) for s in steps) if steps else 0
        if usual > 0:
            return field, usual
    return None, 0.0


def _bigger_input_episodes(steps: List[WindowStep], median_ms: float) -> Optional[_Found]:
    """The steps carrying BIGGER_INPUT_RATIO times the usual tokens (or samples), when they are
    slower than the rest by at least the usual step."""
    field, usual = _usual_input(steps)
    if field is None:
        return None
    bigger = [s for s in steps if getattr(s, field) >= BIGGER_INPUT_RATIO * usual]
    if len(bigger) < MIN_REPEATS or statistics.median(s.step_ms for s in bigger) < MIN_RATIO * median_ms:
        return None
    episodes = _episodes([(s.step, s.step_ms - median_ms) for s in bigger])
    return _Found(episodes, [], [])


def _input_ratio(slow: List[WindowStep], normal: List[WindowStep]) -> Tuple[Optional[float], str]:
    """How many times the usual step's tokens (samples, when tokens are not counted) the slow
    steps carry, and which of the two."""
    field, usual = _usual_input(normal)
    if field is None:
        return None, "samples"
    return statistics.median(getattr(s, field) for s in slow) / usual, field


def _other_cpu_cores(system: Sequence[SystemSample], slow: List[WindowStep]) -> Optional[float]:
    """Cores that processes other than the training used while the slow steps ran (the samples
    within a second of them; all samples when none is that close), or None without samples."""
    known = [s for s in system if s.cpu_count]
    if not known:
        return None
    near = [s for s in known if any(abs(s.unix_s - step.start_unix_s) <= 1.0 for step in slow)]
    readings = [s.other_cores() for s in (near or known)]
    return max(0.0, statistics.median(readings))
