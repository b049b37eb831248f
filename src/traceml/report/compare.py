"""`traceml compare BASE NEW`: did the change help? Phase by phase, with a verdict that a machine
whose speed drifts cannot fake, the change in diagnosis and what else differs between the runs;
with `--fail-on regression`, the decision a CI job exits on.

What drift can do, and what the verdict reads so that it cannot:
- A machine's speed wanders within a run (a neighbour starts, the clock throttles). Each run's
  steps are cut into stretches of time (BLOCKS) and the interval of the change in median step is
  bootstrapped over those stretches, not over single steps: a run that sped up or slowed down
  halfway gives a wide interval, not a confident one.
- Two processes running the same code differ by a few percent (memory layout, caches, clocks),
  which no interval over one run's steps can see. So a change counts only beyond
  ±EQUIVALENCE_MARGIN: IMPROVEMENT when the whole interval lies below -5%, REGRESSION when it
  lies above +5%, EQUIVALENT when it lies within ±5%, INCONCLUSIVE otherwise.
- A machine busier during one run than the other may account for a change: then no
  IMPROVEMENT or REGRESSION, but INCONCLUSIVE. From the collector's samples: other processes
  using c more cores during one run make it at most (1 + c) times slower (the training's share
  of the CPU shrinks no further, with one thread or more); where Linux says how long each
  rank's main thread waited, ready to run, for a CPU, that is the load's cost itself: waits
  that differ by W ms a step move the median by at most W ms. A change still beyond the margin
  once the busier side is granted that cost is the code's.
- Repeats measure run-to-run variance itself: BASE and NEW may each be a folder of runs of the
  same code, best made interleaved (base, new, new, base, ...), so that drift falls on both.
  The bootstrap then resamples runs and, within each, stretches; since a bootstrap over a
  handful of runs sees too little of their spread, the interval is at least Student's t on the
  runs' medians. A run slower from start to end than its side's others (DISTURBED_RUN_PACE) is
  the machine's, and is left out like a disturbed stretch.
"""
from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple, TypedDict, Union, cast

from traceml import rundir
from traceml.analysis.bootstrap import CONFIDENCE, interval, mean_difference_half_width
from traceml.records import ALL_PHASES, SystemSample

if TYPE_CHECKING:  # report.summary builds what this reads, and reads this module's runs
    from traceml.report.summary import FinalSummary, RunPart, Throughput

EQUIVALENCE_MARGIN = 0.05  # a change within 5% of the baseline either way does not count
RESAMPLES = 2000
BLOCKS = 10  # stretches of time a run's steps are cut into
MIN_BLOCK_STEPS = 3  # steps in each stretch, at the least
MIN_BLOCKS = 5  # stretches a run needs for an interval: 15 measured steps
DISTURBED_PACE = 1.5  # a stretch this much slower than the run's median stretch: the machine's
# Same for a whole run among repeats of the same code: their medians are steadier than a stretch's.
DISTURBED_RUN_PACE = 1.25
# Other processes' CPU differing by less is noise in the samples, not a busier machine.
LOAD_DIFFERENCE_CORES = 0.5

# The gate's default threshold: the same code, rerun one process after another on a quiet 2-core
# machine, came out up to 5% slower than its baseline, right on the verdicts' margin.
GATE_THRESHOLD = 0.10
# What `traceml compare --fail-on regression` exits with.
EXIT_PASS, EXIT_REGRESSION, EXIT_INCONCLUSIVE = 0, 1, 3


class Machine(TypedDict):
    """How busy each side's machine was, and what the load may have cost it."""

    other_cores_a: Optional[float]
    other_cores_b: Optional[float]
    cpu_wait_ms_a: Optional[float]
    cpu_wait_ms_b: Optional[float]
    repeats_a: int
    repeats_b: int
    stretches_left_out_a: int
    stretches_left_out_b: int
    repeats_left_out_a: int
    repeats_left_out_b: int
    busier: Optional[str]  # "A", "B"; None: neither, or not known
    slowdown_a: float  # the most the load may have slowed the side, as a factor
    slowdown_b: float
    cpu_wait_difference_ms: float


class _SeriesFigures(TypedDict):
    median_a_ms: float
    median_b_ms: float
    delta_ms: float
    delta_share: Optional[float]  # of A's median (None: A's is zero)
    ci_ms: Optional[List[float]]  # [low, high] of the change (None: no per-step data)
    ci_share: Optional[List[float]]
    steps_a: int
    steps_b: int
    margin_ms: float
    verdict: str  # IMPROVEMENT, REGRESSION, EQUIVALENT, INCONCLUSIVE
    reason: str


class SeriesComparison(_SeriesFigures, total=False):
    """One phase's (or the step's) change from A to B."""

    run_to_run_ms: float  # with repeats: Student's t half-width on the runs' medians
    share_a: float  # a phase's share of A's step
    share_b: float


class DiagnosisChange(TypedDict):
    primary_a: Optional[str]
    primary_b: Optional[str]
    gone: List[str]  # finding kinds A had and B has not
    new: List[str]


class EnvironmentRow(TypedDict):
    field: str
    a: Union[str, int, float, None]
    b: Union[str, int, float, None]
    differs: bool


class _Compared(TypedDict):
    a: str
    b: str
    verdict: str
    reason: str
    confidence: float
    equivalence_margin: float
    machine: Machine
    step: SeriesComparison
    phases: Dict[str, SeriesComparison]
    diagnosis: DiagnosisChange
    environment: List[EnvironmentRow]


class GateDecision(TypedDict):
    phase: str
    threshold: float
    verdict: str
    decision: str  # "pass", "fail", "inconclusive"
    exit_code: int
    reason: str


class Comparison(_Compared, total=False):
    """`traceml compare`'s result (--json writes it as it is)."""

    gate: GateDecision  # with --fail-on regression


class ComparedRun:
    """One side of a comparison: a run, or repeats of the same code (a folder of run
    directories). Each repeat's steps per phase, in the order they ran, and how busy the machine
    was meanwhile: the cores other processes used (the median of the collector's samples), and
    how long a rank's main thread waited, ready, for a CPU in a step (None where not known)."""

    def __init__(self, label: str, summary: FinalSummary, repeats: List[Dict[str, List[float]]],
                 other_cores: Optional[float] = None, cpu_wait_ms: Optional[float] = None):
        self.label, self.summary, self.repeats = label, summary, repeats
        self.other_cores, self.cpu_wait_ms = other_cores, cpu_wait_ms
        # Each repeat's steady stretches, found once on its step times and read for every phase.
        self._steady: List[List[Tuple[int, int]]] = []
        self._left_out = 0
        for repeat in repeats:
            bounds = _stretch_bounds(len(repeat.get("step", [])))
            keep = _steady_stretches([statistics.median(repeat["step"][lo:hi]) for lo, hi in bounds])
            self._steady.append([stretch for stretch, kept in zip(bounds, keep) if kept])
            self._left_out += len(bounds) - len(self._steady[-1])
        # The repeats compared: all but those the machine disturbed as a whole (_steady_repeats).
        self._compared = list(range(len(repeats)))
        if all(self._steady):
            medians = [self._median_of(index, "step") for index in self._compared]
            self._compared = [index for index, kept in zip(self._compared, _steady_repeats(medians)) if kept]

    def _steady_values(self, index: int, name: str) -> List[float]:
        """One repeat's values of a phase (or the step) in its steady stretches."""
        values = self.repeats[index].get(name, [])
        return [value for lo, hi in self._steady[index] for value in values[lo:hi]]

    def _median_of(self, index: int, name: str) -> float:
        """One repeat's median over its steady stretches."""
        return float(statistics.median(self._steady_values(index, name)))

    @property
    def steps(self) -> Dict[str, List[float]]:
        """Every repeat's steps per phase, one after the other."""
        pooled: Dict[str, List[float]] = {}
        for repeat in self.repeats:
            for name, values in repeat.items():
                pooled.setdefault(name, []).extend(values)
        return pooled

    def stretch_medians(self, name: str) -> List[List[float]]:
        """Each repeat's medians of its steady stretches (see _steady_stretches); an empty list
        for a repeat too short to cut into MIN_BLOCKS stretches."""
        return [[statistics.median(self.repeats[index].get(name, [])[lo:hi]) for lo, hi in self._steady[index]]
                for index in self._compared]

    def repeat_medians(self, name: str) -> List[float]:
        """Each compared repeat's median over its steady stretches; an empty list when a repeat
        is too short to cut into stretches."""
        return [self._median_of(index, name) for index in self._compared] if all(self._steady) else []

    def disturbed_stretches(self) -> int:
        """How many stretches, over every repeat, the comparison leaves out as the machine's."""
        return self._left_out

    def disturbed_repeats(self) -> int:
        """How many whole repeats the comparison leaves out as the machine's."""
        return len(self.repeats) - len(self._compared)

    def median_ms(self, name: str) -> float:
        """The median over the steady stretches' steps; the card's median without per-step data."""
        values = [value for index in self._compared for value in self._steady_values(index, name)]
        return float(statistics.median(values)) if values else self.summary["phases"][name]["median_ms"]

    @classmethod
    def load(cls, path: Path) -> "ComparedRun":
        """A run directory, a final_summary.json (with its store beside it when there is one), or a
        folder of run directories: repeats of the same code."""
        if not path.exists():
            raise FileNotFoundError(f"no such run: {path}")
        if path.is_dir() and not (path / rundir.STORE_NAME).is_file() and not (path / rundir.SUMMARY_JSON).is_file():
            runs = sorted(child for child in path.iterdir()
                          if (child / rundir.STORE_NAME).is_file() or (child / rundir.SUMMARY_JSON).is_file())
            if not runs:
                raise FileNotFoundError(f"{path} holds no run: no {rundir.SUMMARY_JSON} or "
                                        f"{rundir.STORE_NAME} in it or in its folders")
            loaded = [cls._load_one(run) for run in runs]
            return cls(str(path), loaded[0].summary, [run.repeats[0] for run in loaded],
                       _median([run.other_cores for run in loaded]),
                       _median([run.cpu_wait_ms for run in loaded]))
        return cls._load_one(path)

    @classmethod
    def _load_one(cls, path: Path) -> "ComparedRun":
        run_dir = path if path.is_dir() else path.parent
        summary_path = path if path.is_file() else run_dir / rundir.SUMMARY_JSON
        store_path = run_dir / rundir.STORE_NAME
        steps: Dict[str, List[float]] = {}
        summary: Optional[FinalSummary] = None
        other_cores = cpu_wait_ms = None
        if summary_path.is_file():
            summary = cast("FinalSummary", json.loads(summary_path.read_text()))
        if store_path.is_file():
            from traceml.collector.store import Store
            from traceml.report.summary import RunData, RunFacts, build_summary

            store = Store(str(store_path), readonly=True)
            try:
                data = RunData(store)
                if summary is None:
                    summary = build_summary(data, RunFacts.from_store(store))
                steps = {name: [getattr(s, f"{name}_ms") or 0.0 for s in data.window.steps]
                         for name in ("step",) + ALL_PHASES}
                other_cores = _other_cores(data.samples)
                cpu_wait_ms = _cpu_wait_ms(data.samples, summary["throughput"].get("steps_per_s"),
                                           summary["run"].get("world_size") or 1)
            finally:
                store.close()
        if summary is None:
            raise FileNotFoundError(f"{path}: no {rundir.SUMMARY_JSON} or {rundir.STORE_NAME} there")
        return cls(str(path), summary, [steps], other_cores, cpu_wait_ms)


def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    known = [value for value in values if value is not None]
    return round(statistics.median(known), 2) if known else None


def _other_cores(samples: Sequence[SystemSample]) -> Optional[float]:
    """The cores that processes other than the training used during the run."""
    return _median([max(0.0, sample.other_cores()) for sample in samples if sample.cpu_count])


def _cpu_wait_ms(samples: Sequence[SystemSample], steps_per_s: Optional[float], ranks: int) -> Optional[float]:
    """How long a rank's main thread, which drives its steps, waited ready for a CPU in a step."""
    waits = [sample.training_cpu_wait_percent for sample in samples if sample.training_cpu_wait_percent is not None]
    if not waits or not steps_per_s:
        return None
    return round(statistics.fmean(waits) / ranks / 100.0 * 1000.0 / steps_per_s, 3)


def compare(a: ComparedRun, b: ComparedRun, seed: int = 0) -> Comparison:
    rng = random.Random(seed)
    machine: Machine = {"other_cores_a": a.other_cores, "other_cores_b": b.other_cores,
                        "cpu_wait_ms_a": a.cpu_wait_ms, "cpu_wait_ms_b": b.cpu_wait_ms,
                        "repeats_a": len(a.repeats), "repeats_b": len(b.repeats),
                        "stretches_left_out_a": a.disturbed_stretches(),
                        "stretches_left_out_b": b.disturbed_stretches(),
                        "repeats_left_out_a": a.disturbed_repeats(), "repeats_left_out_b": b.disturbed_repeats(),
                        "busier": _busier(a.other_cores, b.other_cores),
                        # What the load may have cost: the waits for a CPU where they were measured
                        # (the cost itself), else the bound that other processes' cores put on it.
                        "slowdown_a": 1.0, "slowdown_b": 1.0, "cpu_wait_difference_ms": 0.0}
    if a.cpu_wait_ms is not None and b.cpu_wait_ms is not None:
        machine["cpu_wait_difference_ms"] = abs(a.cpu_wait_ms - b.cpu_wait_ms)
    elif a.other_cores is not None and b.other_cores is not None:
        slowdown = 1.0 + abs(a.other_cores - b.other_cores)
        if machine["busier"] == "A":
            machine["slowdown_a"] = slowdown
        elif machine["busier"] == "B":
            machine["slowdown_b"] = slowdown
    step = _compare_series(a, b, "step", rng, machine)
    # A phase's change counts only beyond 5% of the step as well: a phase of 0.1 ms in a 10 ms
    # step may double from one run to the next without anything a user would want to know.
    step_margin_ms = EQUIVALENCE_MARGIN * step["median_a_ms"]
    phases: Dict[str, SeriesComparison] = {name: _compare_series(a, b, name, rng, machine, step_margin_ms)
                                           for name in ALL_PHASES}
    for name in ALL_PHASES:
        phases[name]["share_a"] = a.summary["phases"][name]["share"]
        phases[name]["share_b"] = b.summary["phases"][name]["share"]
    return {"a": a.label, "b": b.label, "verdict": step["verdict"], "reason": step["reason"],
            "confidence": CONFIDENCE, "equivalence_margin": EQUIVALENCE_MARGIN, "machine": machine,
            "step": step, "phases": phases, "diagnosis": _diagnosis(a.summary, b.summary),
            "environment": _environment(a.summary, b.summary)}


def _busier(cores_a: Optional[float], cores_b: Optional[float]) -> Optional[str]:
    """Which side ran while other processes used more cores ("A", "B"), or None when neither
    did (or it is not known)."""
    if cores_a is None or cores_b is None or abs(cores_a - cores_b) < LOAD_DIFFERENCE_CORES:
        return None
    return "B" if cores_b > cores_a else "A"


def _compare_series(a: ComparedRun, b: ComparedRun, name: str, rng: random.Random,
                    machine: Machine, least_margin_ms: float = 0.0) -> SeriesComparison:
    """Medians, their difference, its interval over stretches of time (and repeats), in ms and
    relative to A (None when A's median is zero or per-step data is missing), and the verdict:
    a change counts beyond ±EQUIVALENCE_MARGIN of A's median, and beyond least_margin_ms."""
    median_a, median_b = a.median_ms(name), b.median_ms(name)
    # margin_ms, verdict and reason are set below, once the interval is known.
    result: SeriesComparison = {"median_a_ms": median_a, "median_b_ms": median_b,  # type: ignore[typeddict-item]
                                "delta_ms": median_b - median_a,
                                "delta_share": (median_b - median_a) / median_a if median_a else None,
                                "ci_ms": None, "ci_share": None,
                                "steps_a": len(a.steps.get(name, [])), "steps_b": len(b.steps.get(name, []))}
    blocks_a, blocks_b = a.stretch_medians(name), b.stretch_medians(name)
    if all(blocks_a) and all(blocks_b):
        low, high = interval(sorted(_resampled_median(blocks_b, rng) - _resampled_median(blocks_a, rng)
                                    for _ in range(RESAMPLES)))
        # Repeats: a bootstrap over a handful of runs is too narrow for the variance between
        # them, so the interval is at least Student's t on the runs' own medians.
        half_width = mean_difference_half_width(a.repeat_medians(name), b.repeat_medians(name))
        if half_width is not None:
            result["run_to_run_ms"] = half_width
            low, high = min(low, result["delta_ms"] - half_width), max(high, result["delta_ms"] + half_width)
        result["ci_ms"] = [low, high]
        if median_a:
            result["ci_share"] = [low / median_a, high / median_a]
    result["margin_ms"] = max(EQUIVALENCE_MARGIN * median_a, least_margin_ms)
    result["verdict"], result["reason"] = _verdict(result, machine)
    return result


def _stretch_bounds(count: int) -> List[Tuple[int, int]]:
    """A run's steps cut into up to BLOCKS consecutive stretches of at least MIN_BLOCK_STEPS;
    none for a run too short to cut into MIN_BLOCKS."""
    stretches = min(BLOCKS, count // MIN_BLOCK_STEPS)
    if stretches < MIN_BLOCKS:
        return []
    size = count / stretches
    return [(round(i * size), round((i + 1) * size)) for i in range(stretches)]


def _steady_stretches(step_medians: Sequence[float]) -> List[bool]:
    """Which stretches ran at the run's own pace. A change to the code slows every stretch; a
    stretch DISTURBED_PACE times slower than the run's median stretch is the machine's doing (a
    neighbour's burst), and is left out, as long as most stretches stay."""
    return _at_their_pace(step_medians, DISTURBED_PACE)


def _steady_repeats(repeat_medians: Sequence[float]) -> List[bool]:
    """Which repeats of the same code ran at its pace: one run DISTURBED_RUN_PACE times slower
    than the side's median run is the machine's doing (a neighbour busy for its whole length)."""
    return _at_their_pace(repeat_medians, DISTURBED_RUN_PACE)


def _at_their_pace(medians: Sequence[float], slower_by: float) -> List[bool]:
    """Which of the medians are within slower_by times their own median: all, unless most are."""
    if not medians:
        return []
    pace = statistics.median(medians)
    steady = [median <= slower_by * pace for median in medians]
    return steady if sum(steady) * 2 > len(steady) else [True] * len(steady)


def _resampled_median(repeats: List[List[float]], rng: random.Random) -> float:
    """One bootstrap draw: repeats drawn with replacement, stretches within each likewise."""
    pooled: List[float] = []
    for blocks in rng.choices(repeats, k=len(repeats)):
        pooled.extend(rng.choices(blocks, k=len(blocks)))
    return float(statistics.median(pooled))


def _verdict(series: SeriesComparison, machine: Machine) -> Tuple[str, str]:
    if series["ci_share"] is None or series["ci_ms"] is None:
        return "INCONCLUSIVE", (f"no interval: a summary file without its telemetry.sqlite, fewer than "
                                f"{MIN_BLOCKS * MIN_BLOCK_STEPS} measured steps, or a baseline median of 0")
    (low, high), (low_ms, high_ms) = series["ci_share"], series["ci_ms"]
    margin_ms, median_a = series["margin_ms"], series["median_a_ms"]
    text = f"{CONFIDENCE:.0%} interval of the change in median: {low:+.1%} to {high:+.1%}"
    margin = f"±{margin_ms / median_a:.0%}"
    if -margin_ms <= low_ms and high_ms <= margin_ms:
        return "EQUIVALENT", f"{text}: no change beyond {margin}"
    # The change left once the busier side is granted what the load may have cost it.
    waits_ms = machine["cpu_wait_difference_ms"]
    slower_by_ms = (median_a + low_ms) / machine["slowdown_b"] - median_a - waits_ms
    faster_by_ms = (median_a + high_ms) - median_a / machine["slowdown_a"] + waits_ms
    if slower_by_ms > margin_ms:
        return "REGRESSION", f"{text}: B is slower, by more than {margin} and the machine's load can hide"
    if faster_by_ms < -margin_ms:
        return "IMPROVEMENT", f"{text}: B is faster, by more than {margin} and the machine's load can hide"
    if low_ms > margin_ms or high_ms < -margin_ms:
        return "INCONCLUSIVE", f"{text}, but {load_text(machine)}: enough to account for it; rerun both side by side"
    return "INCONCLUSIVE", (f"{text}: it reaches past {margin}; run longer or repeat each side "
                            f"(a folder of runs), side by side on a quiet machine")


def load_text(machine: Machine) -> str:
    """What made one side's machine busier, in words."""
    said = []
    if machine["busier"] and not machine["cpu_wait_difference_ms"]:
        said.append(f"the machine was busier during {machine['busier']} (other processes used "
                    f"{machine['other_cores_a']:g} cores during A and {machine['other_cores_b']:g} during B)")
    if machine["cpu_wait_difference_ms"]:
        said.append(f"the training's waits for a CPU differ by {machine['cpu_wait_difference_ms']:.2f} ms a "
                    "step between the runs")
    return " and ".join(said) or "the machine's load"


def gate(result: Comparison, phase: str = "step", threshold: Optional[float] = None,
         inconclusive_ok: bool = False) -> GateDecision:
    """`--fail-on regression`: fail when the phase (or the step) is a REGRESSION and slower by
    more than the threshold; pass when its interval shows it cannot be slower by more than the
    threshold (EQUIVALENT and IMPROVEMENT included); otherwise the runs cannot tell."""
    threshold = GATE_THRESHOLD if threshold is None else threshold
    series = result["step"] if phase == "step" else result["phases"][phase]
    verdict, change, span = series["verdict"], series["delta_share"], series["ci_share"]
    what = "the median step" if phase == "step" else f"the median {phase}"
    if verdict == "REGRESSION" and change is not None and change > threshold:
        decision, code = "fail", EXIT_REGRESSION
        reason = f"{what} is {change:+.1%} slower: a regression beyond the {threshold:.0%} threshold"
    elif verdict in ("EQUIVALENT", "IMPROVEMENT"):
        decision, code = "pass", EXIT_PASS
        reason = f"{what}: {verdict}, no regression"
    elif span is not None and _granted_high_ms(series, result["machine"]) <= threshold * series["median_a_ms"]:
        decision, code = "pass", EXIT_PASS
        reason = f"{what} is at most {span[1]:+.1%} slower: within the {threshold:.0%} threshold"
    else:
        decision, code = "inconclusive", EXIT_INCONCLUSIVE
        reason = f"{what}: {series['reason']}"
    if code == EXIT_INCONCLUSIVE and inconclusive_ok:
        code = EXIT_PASS
    return {"phase": phase, "threshold": threshold, "verdict": verdict, "decision": decision,
            "exit_code": code, "reason": reason}


def _granted_high_ms(series: SeriesComparison, machine: Machine) -> float:
    """How much slower B may be at most, once A is granted what the load may have cost it."""
    median_a = series["median_a_ms"]
    return median_a + (series["ci_ms"] or [0.0, 0.0])[1] - median_a / machine["slowdown_a"] + machine["cpu_wait_difference_ms"]


def _diagnosis(a: FinalSummary, b: FinalSummary) -> DiagnosisChange:
    kinds_a = [f["kind"] for f in a.get("findings", [])]
    kinds_b = [f["kind"] for f in b.get("findings", [])]

    def primary(summary: FinalSummary) -> Optional[str]:
        finding = summary.get("primary_diagnosis")
        return finding["kind"] if finding else None

    return {"primary_a": primary(a), "primary_b": primary(b),
            "gone": [k for k in kinds_a if k not in kinds_b],
            "new": [k for k in kinds_b if k not in kinds_a]}


def _environment(a: FinalSummary, b: FinalSummary) -> List[EnvironmentRow]:
    """What differs besides the code's speed: every row is shown, the differing ones flagged."""
    def facts(summary: FinalSummary) -> Dict[str, Union[str, int, float, None]]:
        # .get throughout: a summary file of an older run may lack a section
        run = summary.get("run") or cast("RunPart", {})
        throughput = summary.get("throughput") or cast("Throughput", {})
        return {"argv": " ".join(run.get("argv") or []), "torch_version": run.get("torch_version"),
                "world_size": run.get("world_size"), "devices": ", ".join(run.get("devices") or []),
                "batch_size": throughput.get("samples_per_step")}
    fa, fb = facts(a), facts(b)
    return [{"field": name, "a": fa[name], "b": fb[name], "differs": fa[name] != fb[name]} for name in fa]


# -- the text ---------------------------------------------------------------------------------
